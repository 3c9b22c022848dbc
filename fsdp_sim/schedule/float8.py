"""FSDP2 with torchao float8 weights: the float8 all-gather and the scales it is cast with.

With `Float8LinearConfig(enable_fsdp_float8_all_gather=True)` each Float8Linear's weight is a
`WeightWithDynamicFloat8CastTensor` (torchao `float8/fsdp_utils.py`). FSDP2 calls its
`fsdp_pre_all_gather` inside `foreach_all_gather`, on the all-gather copy-in stream: it casts this rank's
shard to float8 and returns that as the all-gather input, so the weight travels and is kept unsharded at one
byte per element (the other parameters as before); `fsdp_post_all_gather` wraps the gathered bytes as a
`Float8TrainingTensor` the Linear uses without casting again. The cast needs the weight's tensorwise amax:
- without `precompute_float8_dynamic_scale_for_fsdp`, `hp_tensor_to_float8_dynamic(..., reduce_amax=True)`
  computes each weight's local amax and all-reduces it (MAX) over the weight's mesh, one small collective per
  weight on the copy-in stream before the copy-in (a functional collective, waited for inline);
- with it (torchtitan calls it after every `optimizer.step()`), one `torch._foreach_norm(ord=inf)` over all
  float8 weights' shards and one all-reduce of their stacked amaxes, on the compute stream, once per step;
  the pre-all-gather then casts with the precomputed `_precomputed_scale`.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_sim.schedule.ops import Op
from fsdp_sim.schedule.param_dtypes import UnitBytes, casts, gathered_itemsize
from fsdp_sim.schedule.settings import FSDPSettings
from fsdp_sim.wrap import Unit

AMAX_BYTES = 4  # one fp32 amax per weight (torchao `tensor_to_amax`, `torch.max(torch.abs(x))` in fp32)
PRECOMPUTE_LAUNCHES = 4  # _foreach_norm, stack, clamp, the scales' reciprocal: precompute_float8_dynamic_scale_for_fsdp
FLOAT8_BYTES = 1  # e4m3


def _float8_params(u: Unit, s: FSDPSettings):
    return [p for p in u.params if p.name in s.float8_weights]


def float8_unit_bytes(u: Unit, s: FSDPSettings, ub: UnitBytes) -> UnitBytes:
    """`ub` with the unit's float8 weights all-gathered at one byte per element: their fsdp_pre_all_gather
    output (an fp8 copy of the shard, a temporary like the flat copy-in cast) replaces their bf16 cast."""
    if not s.float8_all_gather:
        return ub
    gathered, cast = ub.gathered, ub.cast
    for p in _float8_params(u, s):
        n = p.padded_shard_numel(s.shard_size)
        gathered -= n * (gathered_itemsize(p, s) - FLOAT8_BYTES)
        cast -= n * s.param_bytes if casts(p, s) else 0
        cast += n * FLOAT8_BYTES
    return replace(ub, gathered=gathered, cast=cast)


class Float8AllGather:
    """torchao's float8 all-gather as a part of the FSDP2 step (techniques.py): the amaxes its casts need.
    Reads the step's graph, settings and units; the copy-in stream and the shard group's name are passed in
    (fsdp2.py owns them)."""

    def __init__(self, step) -> None:
        self.step = step

    def float8_pre_all_gather(self, u: Unit, stream: str, group: str, waits: tuple) -> tuple:
        """Per-weight amax and its all-reduce before the copy-in, unless the scales were precomputed.
        Returns the events the copy-in waits on."""
        s, g = self.step.s, self.step.g
        params = _float8_params(u, s) if not s.float8_precompute_scale else []
        if not params:
            return waits
        shard_bytes = sum(p.padded_shard_numel(s.shard_size) for p in params) * s.storage_bytes
        last: Op = g.add("copy", stream, f"{u.name} float8 amax of {len(params)} weights", deps=waits,
                         hbm_bytes=shard_bytes, launches=len(params))
        for p in params:
            last = g.add("all_reduce", stream, f"{p.name} float8 amax all-reduce", group=group, comm_bytes=AMAX_BYTES)
        return (last,)

    def float8_precompute_scales(self, stream: str, group: str) -> None:
        """`precompute_float8_dynamic_scale_for_fsdp(model)` after the optimizer step: read every float8
        weight's shard once, all-reduce the stacked amaxes once."""
        s, g = self.step.s, self.step.g
        if not s.float8_precompute_scale:
            return
        params = [p for u in self.step.units for p in _float8_params(u, s)]
        if not params:
            return
        shard_bytes = sum(p.padded_shard_numel(s.shard_size) for p in params) * s.storage_bytes
        g.add("copy", stream, f"float8 amax of {len(params)} weights (_foreach_norm)", hbm_bytes=shard_bytes,
              launches=PRECOMPUTE_LAUNCHES)
        g.add("all_reduce", stream, "float8 amax all-reduce (precompute)", group=group, comm_bytes=AMAX_BYTES * len(params))
