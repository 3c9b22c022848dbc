"""Referee harness for FSDP1: PyTorch's ``MemTracker`` on rank 0 of a ``FullyShardedDataParallel`` job, on CPU.

``run_fsdp1_mem_tracker(cfg, world_size=..., ...)`` builds the ReferenceTransformer inside a
``FakeTensorMode``, wraps every TransformerBlock and the root with ``FullyShardedDataParallel``
(``ModuleWrapPolicy``, i.e. ``transformer_auto_wrap_policy``) over a ``"fake"`` process group, runs
``iterations`` training steps (forward, fp32 cross-entropy, backward, foreach AdamW, ``zero_grad``) under
``torch.distributed._tools.mem_tracker.MemTracker`` and reports the peak of the tracked bytes from the
second step on (the first has no optimizer state). FSDP1's own Python runs unmodified: FlatParameter
padding, ``_mp_shard``, the padded unsharded flat parameter freed by ``resize_(0)`` (the tracker follows
``UntypedStorage.resize_``), the flat gradient, ``_saved_grad_shard``. FSDPMemTracker knows only FSDP2, so
the categories are MemTracker's (parameters, gradients, activations, temporaries, optimizer states); the
referee gates the peak. With ``use_orig_params=True`` the original parameters are views of the flat
parameter while a unit runs, and MemTracker's pre-forward hook asks each parameter of a module for a
post-accumulate-grad hook, which a view (a non-leaf) refuses ("post accumulate grad hooks cannot be
registered on non-leaf tensors"), as a frozen parameter refuses any gradient hook: the harness skips those
hooks for a module with such a parameter. They only label gradients; the tracked total (what the referee gates) is every allocation either way.

``prepare_model`` changes the model before wrapping (``lora_referee.prepare``: peft's adapters, frozen
parameters); ``wrap="peft"`` wraps with peft's ``fsdp_auto_wrap_policy`` (``_or_policy`` of a
``lambda_auto_wrap_policy`` over the leaf modules whose weight requires grad and the block policy).

It reuses the FSDP2 harness's helpers (``tracker_patches._import_torch``, the 512 B rounding patch).
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

from .tracker_patches import _import_torch, _patch_cuda_rounding

if TYPE_CHECKING:  # pragma: no cover
    from .reference_model import ReferenceConfig

__all__ = ["run_fsdp1_mem_tracker", "simulate_fsdp1_reference"]

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", None)


def simulate_fsdp1_reference(cfg: ReferenceConfig, *, world_size: int, batch: int, seq: int,
                             param_dtype: str | None = "bf16", reduce_dtype: str | None = "fp32",
                             activation_checkpointing: str = "none", model_keys: dict | None = None,
                             wrap: str = "transformer_auto_wrap_policy", **fsdp1) -> dict[str, Any]:
    """fsdp-sim's peak allocated bytes for the job `run_fsdp1_mem_tracker` tracks with the same arguments
    (`fsdp1`: sharding_strategy, backward_prefetch (None: "none"), forward_prefetch, limit_all_gathers,
    use_orig_params; `model_keys`: the scenario's `model.lora` / `model.frozen` keys for what
    `prepare_model` did). `param_dtype=None` is FSDP1's MixedPrecision(param_dtype=None): the storage dtype,
    `training.param_storage_dtype` (`fsdp1.storage_dtype`, fp32 by default)."""
    from fsdp_sim.scenario import parse_scenario
    from fsdp_sim.simulate import simulate

    from .referee import reference_scenario

    storage = fsdp1.pop("storage_dtype", "fp32")
    data = reference_scenario(cfg, world_size=world_size, batch=batch, seq=seq, param_dtype=param_dtype or storage,
                              reduce_dtype=reduce_dtype, activation_checkpointing=activation_checkpointing)
    mixed_precision = {k: v for k, v in data["fsdp"]["mixed_precision"].items() if k != "cast_forward_inputs"}
    if param_dtype is None:
        mixed_precision["param_dtype"] = None
    if storage != "fp32":
        data["training"]["param_storage_dtype"] = storage
    data["model"] |= model_keys or {}
    if "backward_prefetch" in fsdp1 and fsdp1["backward_prefetch"] is None:
        fsdp1["backward_prefetch"] = "none"
    data["fsdp"] = {"version": 1, "wrap": wrap, "mixed_precision": mixed_precision} | fsdp1
    peak = simulate(parse_scenario(data, name="referee-fsdp1")).peak()
    return {"peak_bytes": peak["allocated_bytes"], "phase": peak["phase"], "op": peak["op"],
            "by_category": peak["by_category"]}


def _make_tracker(record_timeline: bool):
    """A MemTracker that re-arms its peak at the start of the measured window and notes where it peaked."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Fsdp1Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # use_orig_params: a unit's parameters are views (non-leaves) while it runs, and a frozen
            # FlatParameter takes no gradient hook at all; see the module docstring
            hookable = all(p.is_leaf and p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks and hookable)

        def __init__(self) -> None:
            super().__init__()
            self.phase, self.window_active = "forward", False
            self.window_peak, self.window_snap, self.window_where = -1, {}, {}
            self.timeline: list[dict[str, Any]] = []
            self._record_timeline = record_timeline

        def _current(self) -> dict[str, int]:
            snap = next(iter(self._curr_mem_snap.values()), {})
            return {getattr(k, "value", str(k)): int(v) for k, v in snap.items()}

        def re_arm(self) -> None:
            self.window_active = True
            cur = self._current()
            self.window_peak, self.window_snap, self.window_where = cur.get("Total", 0), cur, {"phase": "window start"}

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            if not self.window_active:
                return
            cur = self._current()
            parents = sorted(p for p in self._mod_tracker.parents if p != "Global")
            where = {"phase": "optimizer" if self._in_opt else self.phase,
                     "module": max(parents, key=lambda p: (p.count("."), len(p))) if parents else "Global"}
            if cur["Total"] > self.window_peak:
                self.window_peak, self.window_snap, self.window_where = cur["Total"], cur, where
            if self._record_timeline:
                self.timeline.append({"where": where, **cur})

    return _Fsdp1Tracker


def run_fsdp1_mem_tracker(cfg: ReferenceConfig, *, world_size: int, batch: int, seq: int,
                          sharding_strategy: str = "FULL_SHARD", backward_prefetch: str | None = "BACKWARD_PRE",
                          forward_prefetch: bool = False, limit_all_gathers: bool = True,
                          param_dtype: str = "bf16", reduce_dtype: str | None = "fp32",
                          use_orig_params: bool = False, shard_size: int | None = None, iterations: int = 2,
                          emulate_cuda_rounding: bool = False, record_timeline: bool = False,
                          activation_checkpointing: str = "none", prepare_model=None, wrap: str = "per_block",
                          storage_dtype: str = "fp32", rank: int = 0) -> dict[str, Any]:
    """Track FSDP1 on rank 0 of ``world_size`` (CPU, fake tensors, fake process group). The hybrid strategies
    take a (world_size / shard_size, shard_size) device mesh, built outside the fake mode. ``param_dtype=None``
    is ``MixedPrecision(param_dtype=None)``; ``storage_dtype`` the dtype the model is built in (the trained
    parameters'); ``activation_checkpointing="full"`` wraps each block in a non-reentrant checkpoint after
    FSDP, as fsdp_qlora's ``apply_activation_checkpointing`` does. ``rank`` is the rank tracked (0 by
    default): with use_orig_params the trained parameters a rank's shard holds differ from rank to rank.

    Returns ``peak_bytes`` (from the second step on), ``peak_by_category`` (MemTracker's categories at
    that moment), ``peak_where`` (phase and innermost module), ``first_iteration_peak_bytes`` and, with
    ``record_timeline``, the running snapshot after every tracked op of the window."""
    _import_torch()
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .reference_model import ReferenceTransformer, TransformerBlock, loss_fn

    if sharding_strategy not in STRATEGIES or backward_prefetch not in PREFETCH:
        raise ValueError(f"sharding_strategy in {STRATEGIES}, backward_prefetch in {PREFETCH}")
    if iterations < 2:
        raise ValueError("iterations must be >= 2 (the first iteration is not compared)")
    dtype_of = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}
    if param_dtype not in dtype_of or reduce_dtype not in dtype_of or storage_dtype not in dtype_of:
        raise ValueError(f"param_dtype / reduce_dtype must be 'fp32', 'bf16' or 'fp16', got {param_dtype!r} / {reduce_dtype!r}")
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    restores = [_patch_cuda_rounding()] if emulate_cuda_rounding else []
    gc_was_enabled = gc.isenabled()
    try:
        mesh = None
        if sharding_strategy in STRATEGIES[3:]:
            mesh = init_device_mesh("cpu", (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
        with FakeTensorMode():
            module = ReferenceTransformer(cfg)
            if prepare_model is not None:
                prepare_model(module)
            if storage_dtype != "fp32":  # the trained parameters (peft's adapters take their base's dtype)
                _cast_parameters(module, dtype_of[storage_dtype])
            policy = ModuleWrapPolicy({TransformerBlock}) if wrap == "per_block" else _peft_policy(TransformerBlock)
            model = FSDP(module, auto_wrap_policy=policy,
                         sharding_strategy=ShardingStrategy[sharding_strategy],
                         backward_prefetch=BackwardPrefetch[backward_prefetch] if backward_prefetch else None,
                         forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
                         mixed_precision=MixedPrecision(param_dtype=dtype_of[param_dtype],
                                                        reduce_dtype=dtype_of[reduce_dtype]),
                         use_orig_params=use_orig_params, device_id=torch.device("cpu"), device_mesh=mesh)
            if activation_checkpointing == "full":
                _checkpoint_blocks(model, TransformerBlock)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
            tokens = torch.randint(0, cfg.vocab, (batch, seq))
            labels = torch.randint(0, cfg.vocab, (batch, seq))
            tracker = _make_tracker(record_timeline)()
            tracker.track_external(model, optim)
            first = -1
            with tracker:
                tracker.re_arm()
                for it in range(iterations):
                    gc.disable()
                    tracker.phase = "forward"
                    logits = model(tokens)
                    tracker.phase = "loss"
                    loss = loss_fn(logits, labels)
                    del logits
                    tracker.phase = "backward"
                    loss.backward()
                    tracker.phase = "optimizer"
                    optim.step()
                    optim.zero_grad()
                    del loss
                    gc.enable()
                    gc.collect()
                    if it == 0:
                        first = tracker.window_peak
                        tracker.re_arm()
                    tracker.reset_mod_stats()
        result = {"peak_bytes": tracker.window_peak, "peak_by_category": tracker.window_snap,
                  "peak_where": tracker.window_where, "first_iteration_peak_bytes": first}
        if record_timeline:
            result["timeline"] = tracker.timeline
        return result
    finally:
        if gc_was_enabled:
            gc.enable()
        for restore in restores:
            restore()
        if dist.is_initialized():
            dist.destroy_process_group()


def _cast_parameters(model, dtype) -> None:
    """Every trained parameter as a new one in `dtype` (a tied one stays tied): `Module.to` swaps tensors, which the
    fake mode's weak references refuse."""
    from torch import nn

    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.requires_grad:  # a frozen one keeps the dtype `prepare` gave it
                continue
            if id(param) not in new:
                new[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            setattr(module, name, new[id(param)])


def _peft_policy(block_cls):
    """peft's `fsdp_auto_wrap_policy` (peft/utils/other.py) for the reference model: `_or_policy` of the lambda
    policy over leaf modules whose weight requires grad and the transformer-block policy."""
    import functools

    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

    def lambda_policy_fn(module) -> bool:
        return (len(list(module.named_children())) == 0 and getattr(module, "weight", None) is not None
                and module.weight.requires_grad)

    return functools.partial(_or_policy, policies=[
        functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda_policy_fn),
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block_cls})])


def _checkpoint_blocks(model, block_cls) -> None:
    """Each block in a non-reentrant `checkpoint_wrapper`, applied after FSDP wrapped the model (fsdp_qlora's
    `apply_activation_checkpointing(model, checkpoint_wrapper_fn=..., check_fn=isinstance block)`)."""
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             apply_activation_checkpointing,
                                                                             checkpoint_wrapper)

    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, block_cls))
