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
referee gates the peak. ``use_orig_params=True`` fails inside MemTracker (issue #7), so it is refused.

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
                             param_dtype: str = "bf16", reduce_dtype: str | None = "fp32", **fsdp1) -> dict[str, Any]:
    """fsdp-sim's peak allocated bytes for the job `run_fsdp1_mem_tracker` tracks with the same arguments
    (`fsdp1`: sharding_strategy, backward_prefetch (None: "none"), forward_prefetch, limit_all_gathers)."""
    from fsdp_sim.scenario import parse_scenario
    from fsdp_sim.simulate import simulate

    from .referee import reference_scenario

    data = reference_scenario(cfg, world_size=world_size, batch=batch, seq=seq, param_dtype=param_dtype,
                              reduce_dtype=reduce_dtype)
    mixed_precision = {k: v for k, v in data["fsdp"]["mixed_precision"].items() if k != "cast_forward_inputs"}
    if "backward_prefetch" in fsdp1 and fsdp1["backward_prefetch"] is None:
        fsdp1["backward_prefetch"] = "none"
    data["fsdp"] = {"version": 1, "wrap": "transformer_auto_wrap_policy", "mixed_precision": mixed_precision} | fsdp1
    peak = simulate(parse_scenario(data, name="referee-fsdp1")).peak()
    return {"peak_bytes": peak["allocated_bytes"], "phase": peak["phase"], "op": peak["op"],
            "by_category": peak["by_category"]}


def _make_tracker(record_timeline: bool):
    """A MemTracker that re-arms its peak at the start of the measured window and notes where it peaked."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Fsdp1Tracker(MemTracker):
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
                          emulate_cuda_rounding: bool = False, record_timeline: bool = False) -> dict[str, Any]:
    """Track FSDP1 on rank 0 of ``world_size`` (CPU, fake tensors, fake process group). The hybrid strategies
    take a (world_size / shard_size, shard_size) device mesh, built outside the fake mode.

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

    if use_orig_params:
        raise ValueError("use_orig_params=True fails inside MemTracker (FSDP1's views of the flat parameter)")
    if sharding_strategy not in STRATEGIES or backward_prefetch not in PREFETCH:
        raise ValueError(f"sharding_strategy in {STRATEGIES}, backward_prefetch in {PREFETCH}")
    if iterations < 2:
        raise ValueError("iterations must be >= 2 (the first iteration is not compared)")
    dtype_of = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}
    if param_dtype not in dtype_of or reduce_dtype not in dtype_of:
        raise ValueError(f"param_dtype / reduce_dtype must be 'fp32', 'bf16' or 'fp16', got {param_dtype!r} / {reduce_dtype!r}")
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    restores = [_patch_cuda_rounding()] if emulate_cuda_rounding else []
    gc_was_enabled = gc.isenabled()
    try:
        mesh = None
        if sharding_strategy in STRATEGIES[3:]:
            mesh = init_device_mesh("cpu", (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
        with FakeTensorMode():
            model = FSDP(ReferenceTransformer(cfg), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                         sharding_strategy=ShardingStrategy[sharding_strategy],
                         backward_prefetch=BackwardPrefetch[backward_prefetch] if backward_prefetch else None,
                         forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
                         mixed_precision=MixedPrecision(param_dtype=dtype_of[param_dtype],
                                                        reduce_dtype=dtype_of[reduce_dtype]),
                         use_orig_params=False, device_id=torch.device("cpu"), device_mesh=mesh)
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
