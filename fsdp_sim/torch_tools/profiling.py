"""Label a model's units in a PyTorch profiler trace, so `apply_profile_trace` can read their times.

    with profile_labels(model) as labels, torch.profiler.profile(...) as prof:
        for _ in range(steps):
            logits = model(tokens)
            loss = labels.loss(loss_fn)(logits, targets)
            loss.backward()
            prof.step()
    prof.export_chrome_trace("profile.json")

Every unit (the same units `trace_module` finds: blocks and the leftover top-level children) gets
`record_function` ranges named `fsdp_sim::<fqn>::forward` and `fsdp_sim::<fqn>::backward` (a second
call of a unit in one step is `<fqn>#2`, as in a traced workload). The backward range opens when the
first gradient w.r.t. the unit's outputs is ready and closes when the gradients w.r.t. all its inputs
and parameters are (multi-grad hooks: no identity autograd nodes are added, unlike module backward
hooks). On a GPU the ranges are CPU-side; `apply_profile_trace` sums the kernels launched inside them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from fsdp_sim.torch_tools.trace import _import_torch, find_units

__all__ = ["profile_labels", "LABEL_PREFIX"]

LABEL_PREFIX = "fsdp_sim"


class _Labels:
    def __init__(self, torch) -> None:
        self.torch = torch
        self.calls: dict[str, int] = {}
        self.open: dict[tuple[str, str, int], Any] = {}
        self.backward_seen = False  # a forward after a backward is the next step: call counts restart

    def name(self, fqn: str) -> str:
        self.calls[fqn] = self.calls.get(fqn, 0) + 1
        return fqn if self.calls[fqn] == 1 else f"{fqn}#{self.calls[fqn]}"

    def begin(self, name: str, phase: str, key: int) -> None:
        self.backward_seen |= phase == "backward"
        rf = self.torch.autograd.profiler.record_function(f"{LABEL_PREFIX}::{name}::{phase}")
        rf.__enter__()
        self.open[(name, phase, key)] = rf

    def end(self, name: str, phase: str, key: int) -> None:
        rf = self.open.pop((name, phase, key), None)
        if rf is not None:
            rf.__exit__(None, None, None)

    def backward_range(self, name: str, outputs: list, ends: list) -> None:
        """Open `name`'s backward range at its first output gradient, close it after the last input/param one."""
        from torch.autograd.graph import register_multi_grad_hook
        outputs = [t for t in outputs if t.requires_grad]
        ends = [t for t in ends if t.requires_grad]
        if not outputs or not ends:
            return
        key = id(outputs[0])
        register_multi_grad_hook(outputs, lambda _g: self.begin(name, "backward", key), mode="any")
        register_multi_grad_hook(ends, lambda _g: self.end(name, "backward", key), mode="all")

    def loss(self, loss_fn: Callable) -> Callable:
        """`loss_fn` with its forward and backward labelled as the workload's `loss` module."""
        from torch.utils._pytree import tree_leaves

        def labelled(*args, **kwargs):
            self.maybe_next_step()
            name = self.name("loss")
            self.begin(name, "forward", 0)
            try:
                out = loss_fn(*args, **kwargs)
            finally:
                self.end(name, "forward", 0)
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, self.torch.Tensor)]
            self.backward_range(name, [t for t in tree_leaves(out) if isinstance(t, self.torch.Tensor)], tensors)
            return out

        return labelled

    def maybe_next_step(self) -> None:
        if self.backward_seen:
            self.calls.clear()
            self.backward_seen = False


@contextlib.contextmanager
def profile_labels(model, *, block_types: tuple[type, ...] | None = None) -> Iterator[_Labels]:
    """Hooks that label each unit's forward and backward with `record_function` ranges while active."""
    torch = _import_torch()
    from torch.utils._pytree import tree_leaves

    labels = _Labels(torch)
    units = find_units(model, block_types)
    current: dict[int, str] = {}
    handles = []

    def tensors(obj) -> list:
        return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]

    for fqn, module, _ in units:
        def pre(mod, args, kwargs, fqn=fqn):
            labels.maybe_next_step()
            name = labels.name(fqn or type(mod).__name__.lower())
            current[id(mod)] = name
            labels.begin(name, "forward", 0)

        def post(mod, args, kwargs, output):
            name = current.pop(id(mod))
            labels.end(name, "forward", 0)
            labels.backward_range(name, tensors(output), tensors((args, kwargs)) + list(mod.parameters()))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        yield labels
    finally:
        for h in handles:
            h.remove()
        for name, phase, key in list(labels.open):
            labels.end(name, phase, key)
