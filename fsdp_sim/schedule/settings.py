"""What a runtime needs to know about the FSDP configuration, already validated and resolved."""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_sim.dtypes import itemsize

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1}  # fp32 tensors per parameter (exp_avg, exp_avg_sq | momentum)
# foreach optimizers allocate shard-sized temporaries inside step(): Adam(W) builds sqrt(exp_avg_sq)
# (torch/optim/adam.py _multi_tensor_adam); SGD with momentum updates in place.
OPTIMIZER_STEP_TEMPS = {"adamw": 1, "adam": 1, "sgd": 0}
# The foreach step's passes over the fp32 shards and its HBM traffic per element (torch 2.13
# optim/adam.py `_multi_tensor_adam`, non-capturable): AdamW's mul_(params) (decoupled weight decay, 8 B),
# lerp_(exp_avg, grad) 12, mul_(exp_avg_sq) 8, addcmul_ 12, sqrt 8, div_ 8, add_(eps) 8, addcdiv_(params) 16:
# 8 passes, 80 bytes; Adam (weight_decay 0 by default) skips the first. optim/sgd.py `_multi_tensor_sgd` with
# momentum: mul_(bufs) 8, add_(bufs, grads) 12, add_(params, bufs) 12.
# multi_tensor_apply (foreach optimizers): one launch covers at most depth_to_max_blocks chunks of
# kChunkSize elements: 2240 x 65536 in CUDA >= 13 builds (320 before), torch 2.13's
# ATen/native/cuda/MultiTensorApply.cuh
FOREACH_ELEMENTS_PER_LAUNCH = 2240 * 65536
OPTIMIZER_STEP_PASSES = {"adamw": 8, "adam": 7, "sgd": 3}
OPTIMIZER_STEP_TRAFFIC = {"adamw": 80, "adam": 72, "sgd": 32}


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPSettings:
    """A (replicate x shard) device mesh and the per-unit FSDP2 options.

    `shard_size` ranks hold one copy sharded; `replicate_size` copies exist (HSDP, or DDP-like when
    `shard_size` is 1). Parameters are stored in `storage_dtype`, unsharded and computed in
    `param_dtype`, reduced in `reduce_dtype`. `backward_prefetch=False` is
    `m.set_modules_to_backward_prefetch([m])` on every FSDP module m, the one FSDP2 call that turns
    the default prefetch off (an empty list keeps it, `_fsdp_state._pre_backward`): each unit
    all-gathers in its own pre-backward.
    `reshard_last_unit=False` keeps the last inner unit unsharded after forward (torchtitan's default
    policy: backward needs it first, right after the root). A step runs `grad_accumulation` micro-batches before the optimizer step; with
    `requires_gradient_sync=False` all but the last skip the reduce-scatter (FSDP2's
    `set_requires_gradient_sync(False)`) and keep unsharded gradients, in `reduce_dtype`, instead.
    """

    shard_size: int
    replicate_size: int = 1
    reshard_after_forward: bool = True
    param_dtype: str = "bf16"
    reduce_dtype: str = "fp32"
    storage_dtype: str = "fp32"
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    backward_prefetch: bool = True
    reshard_last_unit: bool = True
    grad_accumulation: int = 1
    requires_gradient_sync: bool = True

    param_bytes: int = field(init=False)
    reduce_bytes: int = field(init=False)
    storage_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        # element sizes, fixed once: the schedule asks for them on every op
        object.__setattr__(self, "param_bytes", itemsize(self.param_dtype, "fsdp.mixed_precision.param_dtype"))
        object.__setattr__(self, "reduce_bytes", itemsize(self.reduce_dtype, "fsdp.mixed_precision.reduce_dtype"))
        object.__setattr__(self, "storage_bytes", itemsize(self.storage_dtype))
