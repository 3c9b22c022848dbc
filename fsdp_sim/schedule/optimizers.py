"""What one optimizer step costs on the sharded fp32 parameters, as torch 2.13's `torch/optim` runs it.

`step_cost` returns the state tensors per parameter, the step's transient bytes, its HBM traffic and its
kernel launches, for the three implementations `torch.optim` has:
- foreach (the default on CUDA): one `torch._foreach_*` op per line of `_multi_tensor_adam` /
  `_multi_tensor_sgd`, each a pass over every shard; Adam(W) allocates `exp_avg_sq_sqrt =
  torch._foreach_sqrt(exp_avg_sqs)`, one shard-sized list of temporaries. AdamW: mul_(params) (decoupled
  weight decay) 8 B per element, lerp_(exp_avg, grad) 12, mul_(exp_avg_sq) 8, addcmul_ 12, sqrt 8, div_ 8,
  add_(eps) 8, addcdiv_(params) 16: 8 passes, 80 B. Adam (weight_decay 0 by default) skips the first.
  SGD with momentum: mul_(bufs) 8, add_(bufs, grads) 12, add_(params, bufs) 12; without: add_(params,
  grads) 12. Each pass is one launch per `FOREACH_ELEMENTS_PER_LAUNCH` elements (multi_tensor_apply).
- for_loop (`foreach=False`, `_single_tensor_adam`): the same ops one parameter at a time, so one launch
  per op per parameter; `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` holds the sqrt
  and the quotient of one parameter at once: 2 x its shard at the peak.
- fused (`fused=True`, `_fused_adam(w)`): one kernel reads param, grad, exp_avg, exp_avg_sq and writes
  the three back (28 B per element), no temporaries. torch has fused SGD too, but FSDP2's sharded
  DTensor parameters cannot take it (issue 8's check), so it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZERS = ("adamw", "adam", "sgd")
IMPLEMENTATIONS = ("foreach", "for_loop", "fused")
# multi_tensor_apply: one launch covers at most depth_to_max_blocks chunks of kChunkSize elements:
# 2240 x 65536 in CUDA >= 13 builds (320 before), torch 2.13's ATen/native/cuda/MultiTensorApply.cuh
FOREACH_ELEMENTS_PER_LAUNCH = 2240 * 65536
# (bytes per element, count) of each pass, from the source lines the module docstring lists
_PASSES = {
    "adamw": (8, 12, 8, 12, 8, 8, 8, 16),
    "adam": (12, 8, 12, 8, 8, 8, 16),
    "sgd": (8, 12, 12),
    "sgd_plain": (12,),
}
FUSED_ADAM_BYTES = 4 * (4 + 3)  # read p, g, m, v; write p, m, v (fp32)


@dataclass(frozen=True, slots=True)
class StepCost:
    states: int  # fp32 state tensors per parameter
    temp_bytes: int  # the step's transient peak
    traffic_bytes: int  # HBM bytes read and written
    launches: int


def states_per_param(optimizer: str, momentum: bool) -> int:
    return {"adamw": 2, "adam": 2, "sgd": 1 if momentum else 0}[optimizer]


def step_cost(optimizer: str, impl: str, momentum: bool, shards: list[int]) -> StepCost:
    """The step over parameters whose local fp32 shards have `shards` elements each (fused Adam(W) only:
    the scenario refuses fused SGD)."""
    numel, largest = sum(shards), max(shards, default=0)
    states = states_per_param(optimizer, momentum)
    if impl == "fused":
        chunks = max(1, -(-numel // FOREACH_ELEMENTS_PER_LAUNCH))
        return StepCost(states, 0, FUSED_ADAM_BYTES * numel, chunks)
    passes = _PASSES["sgd" if momentum else "sgd_plain"] if optimizer == "sgd" else _PASSES[optimizer]
    traffic = sum(passes) * numel
    adam = optimizer in ("adam", "adamw")
    if impl == "foreach":
        launches = len(passes) * max(1, -(-numel // FOREACH_ELEMENTS_PER_LAUNCH))
        return StepCost(states, 4 * numel if adam else 0, traffic, launches)
    return StepCost(states, 2 * 4 * largest if adam else 0, traffic, len(passes) * len(shards))
