"""What a runtime needs to know about the FSDP configuration, already validated and resolved."""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_sim.dtypes import itemsize

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
    optimizer_impl: str = "foreach"  # foreach | for_loop | fused (torch.optim's foreach= / fused=)
    momentum: bool = True  # SGD only: a momentum buffer per parameter
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
