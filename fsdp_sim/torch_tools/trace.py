"""Trace a real `nn.Module` into a workload: one forward and backward on fake tensors, on the CPU.

`trace_module(model, example_inputs, loss_fn=..., block_types=..., dtype="bf16")` runs the model once
under `FakeTensorMode` (no weights, no GPU, no memory: every tensor is shape and dtype only), with its
floating parameters in `dtype` as FSDP2's `MixedPrecisionPolicy(param_dtype=...)` would unshard them,
and returns a `Workload` whose fields mean exactly what `fsdp_sim/workload/model.py` says.

Granularity. A workload module is a *unit*: a block (a module whose class is in `block_types`; by
default the classes of the children of the largest `nn.ModuleList`, e.g. the decoder layers) or a
leftover top-level child holding no block (embedding, final norm, output head). Containers that hold
blocks (`layers`, `transformer`, `h`) are opened. Work done between units (glue in a parent's
`forward`, such as `h + pos_embeddings(pos)`) belongs to the unit that ran last; work before the first
unit to the first. Parameters held by no executed unit go to the unit whose work first reads them.

What is measured, and how (the event log and its reading are in `recorder.py`):
- FLOPs: `torch.utils.flop_counter.FlopCounterMode`'s formulas; its running total is read each time the
  active unit or phase changes. Causal CPU flash attention counts half its square (the kernels skip
  the masked blocks, as the analytic builder assumes).
- Memory: a `TorchDispatchMode` sees every op and registers each new storage with a weakref callback,
  so allocations and frees form an ordered event log; `saved_tensors_hooks` say which storages autograd
  keeps and for which unit. Ownership is by allocation: a unit's `saved_bytes` are the storages its
  forward allocated that are still alive when it ends and are saved for backward (by it, or later by a
  skip connection), or held until the backward anyway (a cache); its `output_bytes` those passed on to
  the next unit (or the loss), plus any used later in the forward; `saves_input` is whether it saves
  the previous unit's output (when it saves only part of it, the larger part decides). Parameters and
  the batch are never activations. `fwd_temp_bytes` is the peak of the unit's own live storages during
  its forward minus what is alive at its end; `bwd_temp_bytes` the peak rise of all live memory
  during its backward over the level when it began (autograd nodes are tagged with the unit that
  created them; `torch._C._current_autograd_node()` says which runs): gradients made so far count,
  saved tensors autograd has already released are netted out. So `bwd_tail_bytes` (an analytic block's
  last moment above its end state, `workload/model.py`) stays 0: the measured peak holds every moment.
- `fwd_hbm_bytes`: bytes read and written by the forward's elementwise ops (every non-view op whose
  time does not come from FLOPs, as `hardware/costs.py` prices them; no fusion assumed; a gather reads
  only the rows it returns).
- Kernels: a few ops save other tensors on the CPU than on CUDA (RMSNorm, LayerNorm statistics,
  dropout masks, SDPA with dropout); by default they run as CUDA stand-ins (`cuda_kernels.py`).
- `kernels`: what each unit's forward dispatches, one kernel per op that is not a view or a bare
  allocation: GEMMs (mm / addmm / bmm / baddbmm / convolution, with m, n, k), SDPA (batch, heads, seq,
  head dim, causal), memory-bound ops with their bytes, and the backward's memory-bound ops added to
  the forward kernels that caused them (`recorder.py`), so a traced workload is priced as the analytic
  builders' are. Each kernel is named by the module path that ran it, below the unit (`attention.wq: mm`).
- Anything surprising (a module saving its own output, partly saved inputs, caches) is listed in
  `workload.meta["notes"]`.
"""

from __future__ import annotations

import gc
import inspect
from typing import Any, Callable

from fsdp_sim.errors import ScenarioError
from fsdp_sim.torch_tools.read_log import read_modules
from fsdp_sim.torch_tools.recorder import Recorder, flop_counter, modes
from fsdp_sim.workload.model import Param, Workload

__all__ = ["trace_module", "trace_factory", "find_units", "TORCH_DTYPES"]

#: fsdp-sim dtype names -> torch dtype attribute names
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_FROM_TORCH = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8",
               "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8"}


def _import_torch():
    try:
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
    except ImportError as exc:
        raise ImportError("fsdp_sim.torch_tools.trace needs PyTorch; install it with "
                          "`pip install -e '.[torch]' from a clone, or pip install torch==2.13.0`") from exc
    return torch


# ---- which modules are units ------------------------------------------------------------------
def _default_block_types(model) -> tuple[type, ...]:
    """The classes of the children of the ModuleList holding the most parameters (the layers)."""
    from torch import nn
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return ()
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return tuple(dict.fromkeys(type(c) for c in largest))


def find_units(model, block_types: tuple[type, ...] | None = None) -> list[tuple[str, Any, bool]]:
    """`(fqn, module, is_block)` for every unit, in module-tree order (execution order comes from running)."""
    from torch import nn
    blocks = _default_block_types(model) if block_types is None else tuple(block_types)

    def has_block(m) -> bool:
        return any(isinstance(c, blocks) for c in m.modules()) if blocks else False

    units: list[tuple[str, Any, bool]] = []

    def visit(prefix: str, mod) -> None:
        for name, child in mod.named_children():
            fqn = f"{prefix}.{name}" if prefix else name
            if blocks and isinstance(child, blocks):
                units.append((fqn, child, True))
            elif has_block(child) or isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                visit(fqn, child)  # a container: its children run, it does not
            else:
                units.append((fqn, child, False))

    visit("", model)
    if not units:  # a model without children is its own single unit
        units.append(("", model, False))
    return units


# ---- the trace ------------------------------------------------------------------------------------
def _dtype_name(torch_dtype, where: str) -> str:
    name = str(torch_dtype).removeprefix("torch.")
    if name not in _FROM_TORCH:
        raise ScenarioError(f"{where}: dtype {name} is not one of {sorted(set(_FROM_TORCH))}")
    return _FROM_TORCH[name]


def _loss_arity(loss_fn: Callable) -> int:
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return 2
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in sig.parameters.values() if p.kind in kinds and p.default is inspect.Parameter.empty)


def trace_module(model, example_inputs: tuple, *, loss_fn: Callable | None = None,
                 targets: tuple | None = None, block_types: tuple[type, ...] | None = None,
                 dtype: str = "bf16", name: str | None = None, emulate_cuda: bool = True) -> Workload:
    """The workload of one training step's forward and backward of `model` on `example_inputs`.

    `example_inputs` are the positional arguments of `model(...)`: real, meta or fake tensors (only
    their shapes and dtypes are used) or other values passed through. `loss_fn(output, *targets)`
    becomes a `loss` module outside the model; without `targets`, a two-argument loss gets labels
    shaped like an integer first input (token ids), as a language model's are. Without `loss_fn` the
    backward starts from ones on every output that requires grad. The model is not modified.
    `emulate_cuda` runs `F.rms_norm`, `F.layer_norm`, `F.dropout` and SDPA with dropout as their CUDA
    kernels (what they save differs on the CPU). The model runs in training mode, as a training step does.
    """
    torch = _import_torch()
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_leaves, tree_map

    if dtype not in TORCH_DTYPES:
        raise ScenarioError(f"dtype: {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
    compute = getattr(torch, TORCH_DTYPES[dtype])
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    units = find_units(model, block_types)
    unit_index = {id(m): i for i, (_, m, _) in enumerate(units)}

    # canonical parameter names (the first fqn of each tensor, as in the state dict) and aliases
    canonical: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), fqn)
        aliases.setdefault(canonical[id(p)], []).append(fqn)
    originals = {canonical[id(p)]: p for _, p in model.named_parameters()}
    unit_params: list[list[str]] = []
    for _, m, _ in units:
        unit_params.append(list(dict.fromkeys(canonical[id(p)] for p in m.parameters())))
    params_meta = {n: Param(n, tuple(p.shape), _dtype_name(p.dtype, f"parameter {n}"), p.requires_grad)
                   for n, p in originals.items()}

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    counter = flop_counter(torch)
    rec = Recorder(torch, counter)

    def fake_like(t, cast: bool):
        dt = compute if cast and t.is_floating_point() else t.dtype
        with fake_mode:
            return torch.empty(tuple(t.shape), dtype=dt, device="cpu")

    with fake_mode:
        fake_params: dict[str, Any] = {}
        for n, p in originals.items():
            fp = torch.empty(tuple(p.shape), dtype=compute if p.is_floating_point() else p.dtype,
                             device="cpu", requires_grad=p.requires_grad)
            for alias in aliases[n]:
                fake_params[alias] = fp
        fake_buffers = {n: fake_like(b, cast=False) for n, b in model.named_buffers(remove_duplicate=False)}
    # floating inputs in the compute dtype, as fully_shard's MixedPrecisionPolicy(cast_forward_inputs=True)
    inputs = tree_map(lambda t: fake_like(t, cast=True) if isinstance(t, torch.Tensor) else t, example_inputs)
    if loss_fn is not None and targets is None:
        arity = _loss_arity(loss_fn)
        first = example_inputs[0] if example_inputs else None
        if arity <= 1:
            targets = ()
        elif isinstance(first, torch.Tensor) and not first.is_floating_point() and arity == 2:
            targets = (first,)
        else:
            raise ScenarioError("trace: loss_fn takes targets; pass targets=(...) (labels are guessed only "
                                "for a two-argument loss and integer token-id inputs)")
    targets = tree_map(lambda t: fake_like(t, cast=False) if isinstance(t, torch.Tensor) else t, targets or ())
    for n in originals:
        rec.param_sids[rec.sid(fake_params[n])] = n
    for t in tree_leaves((inputs, targets, fake_buffers)):
        if isinstance(t, torch.Tensor):
            rec.sid(t)

    calls: list[int] = [0] * len(units)

    def pre_hook(module, args, kwargs):
        i = unit_index[id(module)]
        calls[i] += 1
        fqn = units[i][0] or type(module).__name__.lower()
        label = fqn if calls[i] == 1 else f"{fqn}#{calls[i]}"
        rec.enter(i, label, [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)], prefix=units[i][0])

    # the running module path names the kernels (`attention.wq: mm`); registered first, so a unit's own
    # path is pushed before its pre-hook opens the segment
    def push(fqn: str):
        return lambda module, args: rec.path.append(fqn)  # None: the inputs stay

    def pop(module, args, output):
        rec.path.pop()  # returns None: the output stays

    handles = []
    for fqn, m in model.named_modules():
        if fqn:
            handles.append(m.register_forward_pre_hook(push(fqn)))
            handles.append(m.register_forward_hook(pop, always_call=True))
    handles += [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for _, m, _ in units]
    claim_mode, memory_mode = modes(torch, rec, emulate_cuda=emulate_cuda, flop_ops=counter.flop_registry)
    was_training = [(m, m.training) for m in model.modules()]
    gc_was_enabled = gc.isenabled()
    final: list = []
    param_grads: set[int] = set()
    try:
        model.train()
        gc.disable()  # frees happen when the last reference goes, in order, as on the device
        with fake_mode, counter, claim_mode, memory_mode, \
                torch.autograd.graph.saved_tensors_hooks(lambda t: (rec.on_pack(t), t)[1], lambda t: t):
            out = torch.func.functional_call(model, {**fake_params, **fake_buffers}, inputs, strict=False)
            if loss_fn is not None:
                rec.enter(None, "loss", [t for t in tree_leaves((out, targets)) if isinstance(t, torch.Tensor)])
                final = [loss_fn(out, *targets)]
                grads = None
            else:
                final = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
                rec.phase = "between"
                grads = [torch.ones_like(t) for t in final]
            if not final or not all(isinstance(t, torch.Tensor) and t.requires_grad for t in final):
                raise ScenarioError("trace: nothing to differentiate (no output requires grad; "
                                    "are all parameters frozen?)")
            rec.final = {rec.sid(t) for t in final}
            rec.phase = "backward"
            rec.switch(("backward", len(rec.segments) - 1))
            torch.autograd.backward(final, grads)
            rec.switch(rec.ctx)
            rec.phase = "done"
            param_grads = {rec.sid(fp.grad) for fp in fake_params.values() if fp.grad is not None}
            del out, final, grads
    except ScenarioError:
        raise
    except Exception as exc:  # the user's model failed under fake tensors
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ScenarioError(f"trace: the forward/backward of {type(model).__name__} failed under FakeTensorMode: "
                            f"{type(exc).__name__}: {msg}") from exc
    finally:
        for h in handles:
            h.remove()
        for m, flag in was_training:
            m.training = flag
        if gc_was_enabled:
            gc.enable()
    fake_params.clear()
    gc.collect()

    executed = {s.unit for s in rec.segments if s.unit is not None}
    modules, notes = read_modules(rec, units, unit_params, params_meta, param_grads, executed, loss_fn is not None)
    first = example_inputs[0] if example_inputs else None
    if isinstance(first, torch.Tensor):
        tokens = first.numel() if not first.is_floating_point() else (first.shape[0] if first.dim() else 1)
    else:
        tokens = 0
    input_bytes = sum(t.numel() * t.element_size() for t in tree_leaves((example_inputs, targets))
                      if isinstance(t, torch.Tensor))
    buffer_bytes = sum(b.numel() * b.element_size() for _, b in model.named_buffers())
    meta = {
        "source": "fsdp_sim.torch_tools.trace",
        "torch": torch.__version__.split("+")[0],
        "model_class": type(model).__name__,
        "block_types": sorted({type(m).__name__ for _, m, b in units if b}),
        "inputs": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tree_leaves(example_inputs)
                   if isinstance(t, torch.Tensor)],
        "buffer_bytes": buffer_bytes,
        "module_classes": {m.name: type(units[s.unit][1]).__name__ for m, s in zip(modules, rec.segments)
                           if s.unit is not None},
    }
    if notes:
        meta["notes"] = notes
    model_flops = sum(m.fwd_flops + m.bwd_flops for m in modules if m.in_model)
    return Workload(name=name or type(model).__name__, modules=tuple(modules), activation_dtype=dtype,
                    input_bytes=input_bytes, tokens=int(tokens), model_flops=float(model_flops), meta=meta)


# ---- `fsdp-sim trace package.module:factory` ------------------------------------------------------
def _load_factory(spec: str) -> Callable:
    import importlib
    import os
    import sys

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise ScenarioError(f"trace: {spec!r} is not package.module:factory")
    sys.path.insert(0, os.getcwd())  # as `python -m` would: a factory in the working directory imports
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises at import
        raise ScenarioError(f"trace: cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(os.getcwd())
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ScenarioError(f"trace: {module_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ScenarioError(f"trace: {spec} is not callable")
    return obj


def _block_classes(model, names: list[str]) -> tuple[type, ...]:
    classes = {type(m).__name__: type(m) for m in model.modules()}
    for n in names:
        if n not in classes:
            raise ScenarioError(f"--block-type: {model.__class__.__name__} has no module of class {n!r} "
                                f"(it has {sorted(classes)[:12]})")
    return tuple(classes[n] for n in names)


def trace_factory(spec: str, *, batch: int | None = None, seq: int | None = None, dtype: str = "bf16",
                  block_types: list[str] | None = None, input_shape: tuple[int, ...] | None = None,
                  name: str | None = None) -> Workload:
    """What `fsdp-sim trace` runs: build the model `spec` names (on the meta device) and trace it.

    `spec` is `package.module:factory`; `factory()` returns an `nn.Module` or `(module, loss_fn)`. The
    input is token ids `randint(vocab, (batch, seq))` when the model's first parametrised module is an
    `nn.Embedding`; otherwise `input_shape` gives the one input's shape (in `dtype`).
    """
    try:
        torch = _import_torch()
    except ImportError:
        raise ScenarioError("trace: needs PyTorch; install it with pip install -e '.[torch]' from a clone, or pip install torch==2.13.0") from None
    from torch import nn

    factory = _load_factory(spec)
    try:
        with torch.device("meta"):  # shapes only: no weights are allocated
            made = factory()
    except Exception as exc:
        raise ScenarioError(f"trace: {spec}() failed: {type(exc).__name__}: {exc}") from None
    model, loss_fn = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, nn.Module) or (loss_fn is not None and not callable(loss_fn)):
        raise ScenarioError(f"trace: {spec}() must return an nn.Module or (nn.Module, loss_fn), "
                            f"got {type(made).__name__}")
    blocks = _block_classes(model, block_types) if block_types else None
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if input_shape is not None:
        if not input_shape or any(d <= 0 for d in input_shape):
            raise ScenarioError(f"--input-shape: {list(input_shape)} must be positive sizes")
        if isinstance(first, nn.Embedding):
            inputs = (torch.empty(tuple(input_shape), dtype=torch.long, device="meta"),)
        else:
            inputs = (torch.empty(tuple(input_shape), dtype=getattr(torch, TORCH_DTYPES.get(dtype, "float32")),
                                  device="meta"),)
    elif isinstance(first, nn.Embedding):
        if not batch or not seq or batch <= 0 or seq <= 0:
            raise ScenarioError("--batch and --seq: required, positive, for a model that starts with an nn.Embedding")
        inputs = (torch.empty((batch, seq), dtype=torch.long, device="meta"),)
    else:
        raise ScenarioError(f"--input-shape: required, {type(model).__name__} does not start with an nn.Embedding "
                            "(its input cannot be guessed as token ids)")
    return trace_module(model, inputs, loss_fn=loss_fn, block_types=blocks, dtype=dtype,
                        name=name or type(model).__name__)

