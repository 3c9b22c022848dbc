"""What FullyShardedDataParallel makes of a unit's parameters: one FlatParameter, checked as torch checks it.

`FlatParamHandle._init_flat_param_and_metadata` (torch/distributed/fsdp/_flat_param.py, torch 2.13) first
runs `_validate_tensors_to_flatten` over the unit's parameters in order and raises on the first of:
- "Cannot flatten integer dtype tensors" (the first tensor not floating: bitsandbytes' default uint8
  storage of a 4-bit base);
- "Must flatten tensors with uniform dtype" (a bf16 frozen base beside fp32 adapters);
- "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`" (a frozen base beside
  trained adapters).
With an `auto_wrap_policy`, `_wrap_utils._validate_frozen_params` says so first, for any unit that mixes
requires_grad: without use_orig_params "FSDP does not support wrapping such modules when
use_orig_params=False" (a ValueError), with it a warning that "the gradient memory usage will be higher
than expected ({total} numel instead of {nonfrozen} numel before sharding via reduce-scatter)".
`flat_params` refuses what torch refuses, in its order, naming the scenario key that is the way out. The
FlatParameter requires grad if any of its parameters does (`flat_param_requires_grad or
tensor.requires_grad`). With `use_orig_params` its parameters are laid out `_get_aligned_numel` apart (16
bytes of the unsharded dtype) and padded to a multiple of the world size.

What the handle then does with a mixed FlatParameter (`use_orig_params=True`):
- in forward, each original parameter is a view of the unsharded flat parameter (`_use_unsharded_views`),
  and a view of a tensor that requires grad requires grad: autograd computes the frozen weights' gradients
  too and the flat gradient covers the whole flat parameter, all of it reduce-scattered (`_reduce_grad`
  reduces `flat_param.grad`);
- after the step's backward, `_use_sharded_grad_views` gives `.grad` only to the parameters that require
  grad ("parameters with ``requires_grad=False`` have their gradients set to ``None``"), so the optimizer,
  which skips parameters without a gradient, keeps states for the trained ones: their elements in this
  rank's shard (`_ShardParamInfo.numel_in_shard`), one tensor each. The sharded flat gradient stays whole
  under those views until `zero_grad`.
A 4-bit base is the exception: bitsandbytes' `MatMul4Bit.backward` returns no gradient for it, so autograd
computes none (the split's backward fills zeros).

bitsandbytes' block scales (`QuantState`, the workload's `...weight.absmax`) are a module attribute, not a
parameter: FSDP never flattens them, and every rank keeps them whole on the GPU (`Linear4bit.quant_state`,
moved with `Params4bit.to`); `quant_state_bytes` sizes them.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import ScenarioError
from fsdp_sim.schedule.param_dtypes import NON_FLOATING
from fsdp_sim.schedule.settings import FSDPSettings
from fsdp_sim.workload.frozen import QUANT_STATE_SUFFIX, packed_weights
from fsdp_sim.workload.model import Param
from fsdp_sim.wrap import Unit

ALIGNMENT = 16  # bytes: _flat_param._get_aligned_numel (use_orig_params=True), "from TorchInductor"


@dataclass(frozen=True, slots=True)
class FlatParam:
    """One unit's FlatParameter: its dtype, whether it requires grad, its numel (aligned and padded), and
    each parameter's (start, numel, requires grad) in it."""

    dtype: str
    requires_grad: bool
    numel: int
    layout: tuple[tuple[int, int, bool], ...]

    def trained_shards(self, world: int) -> tuple[int, ...]:
        """The trained parameters' elements in one rank's shard (`numel_in_shard`), for the rank that holds
        the most of them: what the optimizer's states are `zeros_like` of with use_orig_params."""
        return _trained_shards(self.layout, self.numel, world)


@lru_cache(maxsize=4096)
def _trained_shards(layout: tuple[tuple[int, int, bool], ...], numel: int, world: int) -> tuple[int, ...]:
    """`FlatParam.trained_shards`, cached (every point of a sweep rebuilds the same units): the trained
    elements before each offset by bisection, so a rank's share costs log(parameters), not a pass over them."""
    starts = [start for start, _, _ in layout]
    before = [0]  # trained elements before each parameter's start
    for _, n, trained in layout:
        before.append(before[-1] + (n if trained else 0))

    def trained_below(x: int) -> int:
        i = bisect_right(starts, x) - 1
        if i < 0:
            return 0
        start, n, trained = layout[i]
        return before[i] + (min(x - start, n) if trained else 0)

    size = -(-numel // world)
    rank = max(range(world), key=lambda r: (trained_below((r + 1) * size) - trained_below(r * size), -r))
    lo, hi = rank * size, (rank + 1) * size
    return tuple(n for n in (min(hi, start + numel) - max(lo, start) for start, numel, trained in layout if trained)
                 if n > 0)


def flat_dtype(p: Param, s: FSDPSettings) -> str:
    """The dtype FSDP sees: a trained parameter in the storage dtype (the optimizer's copy), a frozen one in
    its own (a bf16 base, the uint8 or bf16 of a packed 4-bit one)."""
    return s.storage_dtype if p.trainable else p.dtype


def compute_dtype(dtype: str, s: FSDPSettings) -> str:
    """`_fwd_bwd_param_dtype`: MixedPrecision's param_dtype, else the FlatParameter's own (`_init_param_dtype`)."""
    return s.param_dtype if s.cast_params else dtype


def flattened(u: Unit) -> tuple[Param, ...]:
    """The parameters FSDP flattens, in the order it does (`named_modules`, then each module's own): all but
    bitsandbytes' scales, which are not parameters, and each LoRA adapter right after the Linear it sits
    beside (peft's `lora.Linear` registers `base_layer`, then `lora_A`, `lora_B`); the rest in the
    workload's order, the builders' module order."""
    params = [p for p in u.params if not p.name.endswith(QUANT_STATE_SUFFIX)]
    adapters: dict[str, list[Param]] = {}
    for p in params:
        if ".lora_" in p.name:
            adapters.setdefault(p.name.split(".lora_")[0], []).append(p)
    base = [p for p in params if ".lora_" not in p.name]
    out = []
    for i, p in enumerate(base):
        out.append(p)
        owner = p.name.rsplit(".", 1)[0]
        if i + 1 == len(base) or base[i + 1].name.rsplit(".", 1)[0] != owner:
            out += adapters.pop(owner, [])
    return tuple(out + [p for ps in adapters.values() for p in ps])


def quant_state_bytes(units: list[Unit]) -> int:
    """Bytes of the 4-bit bases' scales every rank keeps whole (`QuantState`, not a parameter)."""
    return sum(p.numel * itemsize(p.dtype) for u in all_units(units) for p in u.params
               if p.name.endswith(QUANT_STATE_SUFFIX))


def all_units(units: list[Unit]) -> list[Unit]:
    """Every FSDP instance: each unit, then the units nested in it (peft's adapters), in pre-forward order."""
    return [v for u in units for v in (u, *u.nested)]


def flat_params(units: list[Unit], s: FSDPSettings) -> dict[str, FlatParam]:
    """Each unit's FlatParameter by unit name (none for a unit without parameters); a unit torch cannot
    flatten is refused."""
    world = s.shard_size if s.shard_size > 1 and s.sharding_strategy != "NO_SHARD" else s.shard_size * s.replicate_size
    packed = packed_weights(p.name for u in all_units(units) for p in u.params)
    out = {}
    for u in all_units(units):
        params = flattened(u)
        if not params:
            continue
        dtype, requires_grad = _validate(u, params, s, packed)
        _check_packed_cast(u, params, dtype, s, packed)
        aligned = ALIGNMENT // itemsize(compute_dtype(dtype, s)) if s.use_orig_params else 0
        starts, total = flat_layout([p.numel for p in params], world, aligned)
        out[u.name] = FlatParam(dtype, requires_grad, total,
                                tuple((start, p.numel, p.trainable) for start, p in zip(starts, params)))
    return out


def flat_layout(numels: list[int], world: int, aligned_numel: int) -> tuple[list[int], int]:
    """Where each parameter starts in the FlatParameter, and its elements before sharding: the parameters in
    order, each starting at a multiple of `aligned_numel` and the total padded to a multiple of `world`
    (`_init_flat_param_and_metadata`, only with use_orig_params, where aligned_numel > 0); without
    alignment, one after the other."""
    total, starts = 0, []
    for n in numels:
        if aligned_numel and total % aligned_numel:
            total += aligned_numel - total % aligned_numel
        starts.append(total)
        total += n
    if aligned_numel and total % world:
        total += world - total % world
    return starts, total


def flat_param_numel(numels: list[int], world: int, aligned_numel: int) -> int:
    """Elements of a FlatParameter before sharding (`flat_layout`)."""
    return flat_layout(numels, world, aligned_numel)[1]


def _validate(u: Unit, params: tuple[Param, ...], s: FSDPSettings, packed: frozenset[str]) -> tuple[str, bool]:
    """`_validate_tensors_to_flatten` over the unit's parameters, in its order: (dtype, requires_grad)."""
    dtype, requires_grad, first = None, None, None
    for p in params:
        d = flat_dtype(p, s)
        if dtype is None and d in NON_FLOATING:
            raise ScenarioError(_integer(u, p, packed))
        if dtype is not None and d != dtype:
            raise ScenarioError(_mixed_dtypes(u, first, p, s, packed))
        if not s.use_orig_params and requires_grad is not None and p.trainable != requires_grad:
            raise ScenarioError(f"fsdp.use_orig_params: false, and unit {u.name} mixes the trained "
                                f"{_trained(first, p).name} and the frozen {_frozen(first, p).name}: FSDP1 flattens "
                                "those only with use_orig_params; use fsdp.wrap: peft or fsdp.use_orig_params: true")
        dtype, first = d, first or p
        requires_grad = bool(requires_grad) or p.trainable
    return dtype, bool(requires_grad)


def _trained(a: Param, b: Param) -> Param:
    return a if a.trainable else b


def _frozen(a: Param, b: Param) -> Param:
    return b if a.trainable else a


def _integer(u: Unit, p: Param, packed: frozenset[str]) -> str:
    if p.name in packed:
        return (f"model.lora.quant_storage: {p.dtype} packs the 4-bit base {p.name} in an integer tensor, which "
                "FSDP1 cannot flatten ('Cannot flatten integer dtype tensors'); use model.lora.quant_storage: bf16 "
                "(bnb_4bit_quant_storage), as fsdp_qlora does")
    return f"model: unit {u.name} holds the integer {p.name} ({p.dtype}), which FSDP1 cannot flatten"


def _mixed_dtypes(u: Unit, first: Param, p: Param, s: FSDPSettings, packed: frozenset[str]) -> str:
    a, b = flat_dtype(first, s), flat_dtype(p, s)
    if packed & {first.name, p.name} and "uint8" in (a, b):
        return _integer(u, first if first.name in packed else p, packed)
    if first.trainable == p.trainable:
        return (f"model: unit {u.name} mixes {first.name} ({a}) and {p.name} ({b}); a FlatParameter has one dtype")
    trained, frozen = _trained(first, p), _frozen(first, p)
    key = "model.lora.quant_storage" if frozen.name in packed else "model.frozen_dtype"
    return (f"{key}: unit {u.name} mixes the frozen {frozen.name} ({flat_dtype(frozen, s)}) and the trained "
            f"{trained.name} ({s.storage_dtype}); a FlatParameter has one dtype: use fsdp.wrap: peft or one dtype "
            "for both (training.param_storage_dtype)")


def _check_packed_cast(u: Unit, params: tuple[Param, ...], dtype: str, s: FSDPSettings, packed: frozenset[str]) -> None:
    """A base packed in a floating dtype must not be cast: MixedPrecision's `_mp_shard` would convert the
    codes' bits as numbers (fsdp_qlora's train.py: "The Linear4Bit quant_storage dtype should always match
    the FSDP param_dtype")."""
    if compute_dtype(dtype, s) != dtype and any(p.name in packed for p in params):
        raise ScenarioError(f"fsdp.mixed_precision.param_dtype: {s.param_dtype} would cast the 4-bit codes of unit "
                            f"{u.name}, packed in {dtype} (model.lora.quant_storage); set it to {dtype} or null "
                            "(quant_storage must match FSDP's param_dtype)")


def autograd_requires_grad(units: list[Unit], flats: dict[str, FlatParam], s: FSDPSettings) -> frozenset[str]:
    """The parameters autograd computes a gradient for: every view of a FlatParameter that requires grad
    (use_orig_params), but a packed 4-bit base (`MatMul4Bit.backward` returns none for it)."""
    packed = packed_weights(p.name for u in all_units(units) for p in u.params)
    return frozenset(p.name for u in all_units(units) if u.name in flats and flats[u.name].requires_grad
                     for p in flattened(u) if p.name not in packed)
