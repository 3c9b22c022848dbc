"""What one optimizer step costs on the sharded parameters, as torch 2.13's `torch/optim` runs it.

The parameters, their gradients and the states (`torch.zeros_like(p)` in `_init_group`) share the
parameters' storage dtype: fp32 under FSDP2's mixed precision (the sharded parameters keep their
original dtype), bf16 for a model stored in bf16; every byte figure below is in elements of that dtype
(`itemsize` bytes each; the fp32 figures in brackets). `step_cost` returns the state tensors per
parameter, the step's transient bytes, its HBM traffic and its kernel launches, for the three
implementations `torch.optim` has:
- foreach (the default on CUDA): one `torch._foreach_*` op per line of `_multi_tensor_adam` /
  `_multi_tensor_sgd`, each a pass over every shard; Adam(W) allocates `exp_avg_sq_sqrt =
  torch._foreach_sqrt(device_exp_avg_sqs)`, one shard-sized list of temporaries in the states' dtype.
  AdamW: mul_(params) (decoupled weight decay) 2 tensor accesses per element [8 B], lerp_(exp_avg,
  grad) 3 [12], mul_(exp_avg_sq) 2 [8], addcmul_ 3 [12], sqrt 2 [8], div_ 2 [8], add_(eps) 2 [8],
  addcdiv_(params) 4 [16]: 8 passes, 20 accesses [80 B]. Adam (weight_decay 0 by default) skips the
  first. SGD with momentum: mul_(bufs) 2, add_(bufs, grads) 3, add_(params, bufs) 3; without:
  add_(params, grads) 3. Each pass is one launch per `FOREACH_ELEMENTS_PER_LAUNCH` elements
  (multi_tensor_apply).
- for_loop (`foreach=False`, `_single_tensor_adam`): the same ops one parameter at a time, so one launch
  per op per parameter; `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds the sqrt
  and the quotient of one parameter at once: 2 x its shard at the peak.
- fused (`fused=True`, `_fused_adam(w)`): one kernel reads param, grad, exp_avg, exp_avg_sq and writes
  the three back (7 accesses per element [28 B]), no temporaries. torch has fused SGD too, but FSDP2's sharded
  DTensor parameters cannot take it (issue 8's check), so it is refused.

Two optimizers keep other states than fp32 copies of the parameter (`state_bytes`):
- `adamw8bit`: torchao's `AdamW8bit` (`torchao/optim/adam.py`, `subclass_8bit.py`), the 8-bit Adam that
  runs on FSDP2 (it builds its states from `p.to_local()` and wraps them back in DTensors;
  bitsandbytes' `AdamW8bit` sizes them from the DTensor's global numel and fails there, bitsandbytes
  issue #1633). Each moment of a local shard with >= 4096 elements that 256 divides ("follow
  bitsandbytes, only quantize tensors >= 4096 values") is `OptimState8bit`: uint8 codes (1 B per
  element), one fp32 scale per block of 256, and its own 256-entry fp32 quantization map; any other
  shard keeps two `zeros_like` states. Each parameter is stepped by its own compiled `single_param_adam`
  (one graph: dequantize, both lerps, requantize, update), counted as one launch with no temporaries,
  reading p, g, both codes and writing p and both codes (3 parameter-dtype accesses and 4 B of codes per
  element [16 B]).
- `adafactor`: `torch.optim.Adafactor` keeps, for a parameter of >= 2 dimensions, a row factor
  `shape[:-1] + (1,)` and a column factor `shape[:-2] + (1, shape[-1])` of the second moment, and a full
  `variance` for a vector (`_adafactor.py:_init_group`). On FSDP2 it does not run: its `norm(dim=-2)`
  of a Shard(0) gradient is a `_NormPartial` DTensor and the in-place `square_()` on it raises ("in-place
  operations that require placement changes are not supported"; under fake tensors `.item()` fails
  first), so the scenario refuses it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import math

from fsdp_sim.errors import ScenarioError

OPTIMIZERS = ("adamw", "adam", "sgd", "adamw8bit", "adafactor")
IMPLEMENTATIONS = ("foreach", "for_loop", "fused")
# multi_tensor_apply: one launch covers at most depth_to_max_blocks chunks of kChunkSize elements:
# 2240 x 65536 in CUDA >= 13 builds (320 before), torch 2.13's ATen/native/cuda/MultiTensorApply.cuh
FOREACH_ELEMENTS_PER_LAUNCH = 2240 * 65536
# ... and at most this many tensors, by list depth (tensor lists per op: 1 for an in-place op on one list
# such as `_foreach_mul_` by a tensor, or a reduction such as `_foreach_norm`): DepthToMaxConfig<true>
# (32 KB kernel arguments), pytorch/pytorch 008356ca aten/src/ATen/native/cuda/MultiTensorApply.cuh
FOREACH_CHUNK_ELEMENTS, FOREACH_MAX_CHUNKS = 65536, 2240  # kChunkSize, depth_to_max_blocks
FOREACH_MAX_TENSORS = (770, 448, 336, 252, 210)  # depth_to_max_tensors[depth - 1]
# the tensors each pass reads and writes per element, from the source lines the module docstring lists
_PASSES = {
    "adamw": (2, 3, 2, 3, 2, 2, 2, 4),
    "adam": (3, 2, 3, 2, 2, 2, 4),
    "sgd": (2, 3, 3),
    "sgd_plain": (3,),
}
FUSED_ADAM_ACCESSES = 4 + 3  # read p, g, m, v; write p, m, v
# torchao AdamW8bit: block_size=256, quantized only at >= 4096 elements (`_AdamBase._new_buffer`); the
# dynamic quantization map is a 256-entry fp32 table per state tensor (`OptimState8bit.zeros`)
BLOCK_8BIT, MIN_8BIT_NUMEL, QMAP_BYTES = 256, 4096, 256 * 4
ADAM_8BIT_ACCESSES, ADAM_8BIT_CODE_BYTES = 3, 2 + 2  # read p, g, write p (their dtype); read, write both uint8 codes


@dataclass(frozen=True, slots=True)
class StepCost:
    states: int  # fp32 state tensors per parameter
    temp_bytes: int  # the step's transient peak
    traffic_bytes: int  # HBM bytes read and written
    launches: int
    temp_tensors: tuple[int, ...] = ()  # the transient peak as the tensors it is: the foreach list, one per tensor


def states_per_param(optimizer: str, momentum: bool) -> int:
    """fp32 (parameter-dtype) state tensors per parameter; the optimizers whose states are not copies of
    the parameter (`state_bytes`) are refused by a runtime that asks this."""
    if optimizer not in ("adamw", "adam", "sgd"):
        raise ScenarioError(f"training.optimizer: {optimizer}'s states are not modelled in this runtime yet "
                            "(adamw8bit: FSDP2 only)")
    return {"adamw": 2, "adam": 2, "sgd": 1 if momentum else 0}[optimizer]


def state_bytes(optimizer: str, momentum: bool, shapes, itemsize: int) -> int:
    """Bytes of optimizer state over local tensors of `shapes` stored `itemsize` bytes an element
    (remembered: every point of a sweep asks it again for each unit's shards)."""
    return _state_bytes(optimizer, momentum, tuple(shapes), itemsize)


@lru_cache(maxsize=4096)  # a bound on memory: a few entries per unit shape, optimizer and dtype a process sweeps
def _state_bytes(optimizer: str, momentum: bool, shapes: tuple[tuple[int, ...], ...], itemsize: int) -> int:
    if optimizer == "adamw8bit":
        total = 0
        for shape in shapes:
            n = math.prod(shape)
            quantized = n >= MIN_8BIT_NUMEL and n % BLOCK_8BIT == 0
            total += 2 * (n + n // BLOCK_8BIT * 4 + QMAP_BYTES if quantized else n * itemsize)
        return total
    if optimizer == "adafactor":
        return sum((math.prod(s[:-1]) + math.prod(s[:-2]) * s[-1] if len(s) >= 2 else math.prod(s)) * itemsize
                   for s in shapes)
    return states_per_param(optimizer, momentum) * sum(math.prod(s) for s in shapes) * itemsize


def step_cost(optimizer: str, impl: str, momentum: bool, shards: list[int], itemsize: int) -> StepCost:
    """The step over parameters whose local shards have `shards` elements each, stored `itemsize` bytes an
    element (fused Adam(W) only: the scenario refuses fused SGD)."""
    numel, largest = sum(shards), max(shards, default=0)
    if optimizer == "adamw8bit":
        quantized = sum(n for n in shards if n >= MIN_8BIT_NUMEL and n % BLOCK_8BIT == 0)
        traffic = ((ADAM_8BIT_ACCESSES * itemsize + ADAM_8BIT_CODE_BYTES) * quantized
                   + FUSED_ADAM_ACCESSES * itemsize * (numel - quantized))
        return StepCost(2, 0, traffic, len(shards))
    states = states_per_param(optimizer, momentum)
    if impl == "fused":
        chunks = max(1, -(-numel // FOREACH_ELEMENTS_PER_LAUNCH))
        return StepCost(states, 0, FUSED_ADAM_ACCESSES * itemsize * numel, chunks)
    passes = _PASSES["sgd" if momentum else "sgd_plain"] if optimizer == "sgd" else _PASSES[optimizer]
    traffic = sum(passes) * itemsize * numel
    adam = optimizer in ("adam", "adamw")
    if impl == "foreach":
        launches = len(passes) * max(1, -(-numel // FOREACH_ELEMENTS_PER_LAUNCH))
        temps = tuple(itemsize * n for n in shards if n) if adam else ()
        return StepCost(states, sum(temps), traffic, launches, temps)
    temps = (itemsize * largest,) * 2 if adam and largest else ()
    return StepCost(states, sum(temps), traffic, len(passes) * len(shards), temps)


def multi_tensor_apply_launches(numels, depth: int = 1) -> int:
    """Kernels `multi_tensor_apply<depth>` launches over tensors of `numels` elements, as its loop does: a
    block per chunk of `FOREACH_CHUNK_ELEMENTS`, a launch whenever the blocks fill or the tensors fill (at a
    tensor's last chunk), a last one for what remains; empty tensors are skipped."""
    max_tensors = FOREACH_MAX_TENSORS[depth - 1]
    launches = blocks = tensors = 0
    for n in numels:
        if not n:
            continue
        tensors += 1
        chunks = -(-n // FOREACH_CHUNK_ELEMENTS)
        # whole launches of full blocks within this tensor, then what is left of it in the open launch
        full, blocks = divmod(blocks + chunks, FOREACH_MAX_CHUNKS)
        if full:
            launches += full
            tensors = 1 if blocks else 0  # a tensor whose chunks remain opens the next launch
        if tensors == max_tensors:
            launches, blocks, tensors = launches + (blocks > 0), 0, 0
    return launches + (blocks > 0)


def check_optimizer(optimizer: str, version: int) -> None:
    """Refuse an optimizer that does not run on the runtime (see the module docstring)."""
    if optimizer == "adafactor" and version == 2:
        raise ScenarioError("training.optimizer: torch.optim.Adafactor does not run on FSDP2's DTensor parameters "
                            "(in-place square_() on the _NormPartial norm of a sharded gradient raises)")
    if optimizer == "adafactor" or (optimizer == "adamw8bit" and version == 1):
        runtime = "FSDP1's flat shards" if version == 1 else "single-GPU training"
        raise ScenarioError(f"training.optimizer: {optimizer}'s step over {runtime} is not modelled yet "
                            "(adamw8bit runs under fsdp.version 2 and none)")
