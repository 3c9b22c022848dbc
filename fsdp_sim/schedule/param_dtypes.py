"""The bytes of each parameter as FSDP2 stores, casts and all-gathers it when a unit mixes dtypes.

A unit may hold trainable parameters (in the scenario's storage dtype, the optimizer's master copy) beside
frozen ones stored in their own dtype (a bf16 base under fp32 LoRA adapters, a uint8 4-bit base). Torch
2.13's `_fully_shard` handles them per parameter:
- `FSDPParam.init_dtype_attrs` clamps the policy's `param_dtype` to None for a parameter already in it and
  for a non-floating one (a packed uint8 base is never cast); a frozen floating parameter in another dtype is
  cast like any other, up as well as down (`MixedPrecisionPolicy` does not look at `requires_grad`: a bf16
  base under `param_dtype=torch.float32` is gathered in fp32). A policy without a param_dtype
  (`fsdp.mixed_precision.param_dtype: null`) casts nothing.
- `_get_param_all_gather_inputs` copies the parameters that still have a `param_dtype` into one flat
  temporary of that dtype (`flat_foreach_copy_input`: the copy-in cast); the others are gathered as stored.
- `_get_all_gather_input_metadatas` gives the all-gather buffer the inputs' dtype, or uint8 when they differ
  (every input viewed as bytes), so the buffer is always the sum of the inputs' bytes times the group size.
- `FSDPParamGroup._init_mp_dtypes` asks a uniform dtype of the trainable parameters only, so a frozen
  parameter in its own dtype is allowed in any group.
The unsharded parameters are views of per-parameter storages in the all-gather input's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_sim.dtypes import itemsize
from fsdp_sim.schedule.settings import FSDPSettings
from fsdp_sim.workload.model import Param
from fsdp_sim.wrap import Unit

NON_FLOATING = ("uint8",)  # `orig_dtype.is_floating_point` is False: param_dtype is clamped to None


def stored_itemsize(p: Param, s: FSDPSettings) -> int:
    """Bytes per element of the sharded parameter: trainable ones in the storage dtype (the optimizer's
    copy), frozen ones in their own dtype (no master copy is kept for a parameter nothing updates)."""
    return s.storage_bytes if p.trainable else itemsize(p.dtype)


def casts(p: Param, s: FSDPSettings) -> bool:
    """Whether the all-gather copy-in casts `p` (its `FSDPParam.param_dtype` is not None)."""
    if p.dtype in NON_FLOATING or not s.cast_params:  # param_dtype=None: nothing is cast
        return False
    stored = s.storage_dtype if p.trainable else p.dtype
    return stored != s.param_dtype


def gathered_itemsize(p: Param, s: FSDPSettings) -> int:
    """Bytes per element of `p`'s all-gather input, output slice and unsharded storage."""
    return s.param_bytes if casts(p, s) else stored_itemsize(p, s)


@dataclass(frozen=True, slots=True)
class UnitBytes:
    """One unit's per-rank bytes: the sharded storages, the all-gather input (in the gathered dtypes) and
    the part of it the copy-in casts through the flat temporary."""

    sharded: int
    gathered: int
    cast: int


@dataclass(frozen=True, slots=True)
class UnitShards:
    """What a unit's hooks and the optimizer size from, per rank: its bytes, and each trainable parameter's
    dim-0 shard (padded to the largest chunk) in elements and as the local shape the optimizer's states
    are `zeros_like` of."""

    bytes: UnitBytes
    trainable: tuple[int, ...]
    trainable_shapes: tuple[tuple[int, ...], ...]


_UNIT_SHARDS: dict[tuple, UnitShards] = {}
_UNIT_SHARDS_LIMIT = 4096  # entries (a few per unit shape of each model and mesh a process sweeps), then start over


def unit_shards(u: Unit, s: FSDPSettings) -> UnitShards:
    """The unit's shard sizes, cached by what they are computed from: every point of a sweep rebuilds the
    same units, and a model's blocks are units of the same parameter shapes (Llama 3 70B's 80), so a cold
    build walks each parameter's shape and dtypes once per kind of unit, not once per unit (that walk per
    unit was a seventh of a cold build).

    The key is complete: the sizes read only each parameter's shape, dtype and whether it is trained (not
    its name), in order, the shard group's size, `storage_dtype` and `param_dtype` (`storage_bytes` and
    `param_bytes` are their item sizes) and whether the policy casts (`cast_params`)."""
    key = (tuple([(p.shape, p.dtype, p.trainable) for p in u.params]), s.shard_size, s.storage_dtype,
           s.param_dtype, s.cast_params)
    shards = _UNIT_SHARDS.get(key)
    if shards is None:
        if len(_UNIT_SHARDS) >= _UNIT_SHARDS_LIMIT:
            _UNIT_SHARDS.clear()
        shards = _UNIT_SHARDS[key] = _unit_shards(u, s)
    return shards


def unit_bytes(u: Unit, s: FSDPSettings) -> UnitBytes:
    return unit_shards(u, s).bytes


def _unit_shards(u: Unit, s: FSDPSettings) -> UnitShards:
    world = s.shard_size
    sharded = gathered = cast = 0
    for p in u.params:
        n = p.padded_shard_numel(world)
        sharded += n * stored_itemsize(p, s)
        gathered += n * gathered_itemsize(p, s)
        cast += n * s.param_bytes if casts(p, s) else 0
    trainable = [p for p in u.params if p.trainable]
    return UnitShards(UnitBytes(sharded, gathered, cast), tuple(p.padded_shard_numel(world) for p in trainable),
                      tuple((-(-p.shape[0] // world), *p.shape[1:]) if p.shape else () for p in trainable))
