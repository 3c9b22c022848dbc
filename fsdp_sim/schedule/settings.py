"""What a runtime needs to know about the FSDP configuration, already validated and resolved."""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import ScenarioError


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPSettings:
    """A (replicate x shard) device mesh and the per-unit FSDP2 options, in `fully_shard`'s words.

    `shard_size` ranks hold one copy sharded; `replicate_size` copies exist (HSDP, or DDP-like when
    `shard_size` is 1). Parameters are stored in `storage_dtype`, unsharded and computed in
    `param_dtype`, reduced in `reduce_dtype`: None is `MixedPrecisionPolicy`'s default, the gradient's
    dtype (= `param_dtype`), resolved here once. `output_dtype` casts each unit's forward output
    (`_cast_output_dtype`), `unit_output_dtype` overrides it per unit (unit name, dtype);
    `cast_forward_inputs` casts a unit's floating inputs to `param_dtype`.

    `reshard_after_forward` is what the non-root units pass to `fully_shard`: True, False, or an int k
    (1 < k < shard_size, a divisor: ZeRO++ hpZ, `_get_post_forward_mesh_info`), which keeps 1/k of the
    unsharded parameters after forward and all-gathers inside groups of k in backward.
    `root_reshard_after_forward` is the root's: None (FSDP2's default) keeps the root unsharded after
    forward (`_lazy_init` clears `post_forward_mesh_info` only when `_auto_reshard_after_forward`); an
    explicit True (or k) is honoured. `reshard_last_unit=False` keeps the last inner unit unsharded
    after forward (torchtitan's former policy: backward needs it first, right after the root).

    `forward_prefetch` k >= 1 is `set_modules_to_forward_prefetch` on every FSDP module with the next k
    units in forward order (0: none, FSDP2's default). `backward_prefetch` k >= 1 is
    `set_modules_to_backward_prefetch` with the k units before it in post-forward order (1 behaves
    as FSDP2's default one-ahead prefetch); 0 (False) is `m.set_modules_to_backward_prefetch([m])`
    on every FSDP module m, the one FSDP2 call that turns the default prefetch off (an empty list
    keeps it, `_fsdp_state._pre_backward`): each unit all-gathers in its own pre-backward.

    A step runs `grad_accumulation` micro-batches before the optimizer step; in all but the last,
    `requires_gradient_sync=False` skips the reduce-scatter (`set_requires_gradient_sync(False)`) and
    keeps unsharded gradients, in `reduce_dtype`, instead; `requires_all_reduce=False` (HSDP) reduce-
    scatters but skips the all-reduce, accumulating the partial output (`set_requires_all_reduce`);
    `reshard_after_backward=False` keeps the unsharded parameters after backward, so the next
    micro-batch's forward all-gathers nothing (`set_reshard_after_backward`).
    """

    shard_size: int
    replicate_size: int = 1
    reshard_after_forward: bool | int = True
    root_reshard_after_forward: bool | int | None = None
    param_dtype: str = "bf16"
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    unit_output_dtype: tuple[tuple[str, str], ...] = ()
    cast_forward_inputs: bool = True
    storage_dtype: str = "fp32"
    cast_params: bool = True  # the policy has a param_dtype (False: param_dtype=None, `param_dtype` is the storage's)
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"  # foreach | for_loop | fused (torch.optim's foreach= / fused=)
    momentum: bool = True  # SGD only: a momentum buffer per parameter
    max_norm: float | None = 1.0  # clip_grad_norm_ before the step (schedule/clipping.py); None: no clipping
    activation_checkpointing: bool = False
    forward_prefetch: int = 0
    backward_prefetch: int = 1
    reshard_last_unit: bool = True
    grad_accumulation: int = 1
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True
    reshard_after_backward: bool = True
    # torchtitan's activation-checkpoint mode (none | full | selective_layer | selective_op) and, for
    # selective_layer, its selective_ac_option k; `activation_checkpointing` is True for `full` only
    ac_mode: str = "none"
    ac_every: int = 1
    offload_params: bool = False  # offload_policy=CPUOffloadPolicy(pin_memory=True): state in pinned host memory (offload.py)
    activation_offload: bool = False  # the model's forward under torch.autograd.graph.save_on_cpu(pin_memory=True)
    # FSDP1 (`version: 1`, FullyShardedDataParallel, schedule/fsdp1.py): its ShardingStrategy, BackwardPrefetch
    # (None: off), the rate limiter and use_orig_params; forward_prefetch is 0 or 1 there
    version: int = 2
    sharding_strategy: str = "FULL_SHARD"
    fsdp1_backward_prefetch: str | None = "BACKWARD_PRE"
    limit_all_gathers: bool = True
    use_orig_params: bool = False
    # tensor parallel (schedule/tp.py): ranks per TP group, the plan's sequence parallelism; the shard and
    # replicate groups above are then the data-parallel mesh's (world / tp ranks)
    tp: int = 1
    sequence_parallel: bool = False
    # torchao float8 training (schedule/float8.py): the float8 Linears' weights by name, FSDP's float8
    # all-gather (enable_fsdp_float8_all_gather) and precompute_float8_dynamic_scale_for_fsdp
    float8_weights: frozenset[str] = frozenset()
    float8_all_gather: bool = False
    float8_precompute_scale: bool = False

    param_bytes: int = field(init=False)
    reduce_bytes: int = field(init=False)
    storage_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if self.reduce_dtype is None:  # MixedPrecisionPolicy(reduce_dtype=None): the gradient's dtype
            object.__setattr__(self, "reduce_dtype", self.param_dtype)
        for key in ("reshard_after_forward", "root_reshard_after_forward"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, bool):
                object.__setattr__(self, key, post_forward_size(value, self.shard_size, f"fsdp.{key}"))
        for key in ("forward_prefetch", "backward_prefetch"):
            if int(getattr(self, key)) < 0:
                raise ScenarioError(f"fsdp.{key}: a prefetch depth must be >= 0, got {getattr(self, key)}")
            object.__setattr__(self, key, int(getattr(self, key)))
        # element sizes, fixed once: the schedule asks for them on every op
        object.__setattr__(self, "param_bytes", itemsize(self.param_dtype, "fsdp.mixed_precision.param_dtype"))
        object.__setattr__(self, "reduce_bytes", itemsize(self.reduce_dtype, "fsdp.mixed_precision.reduce_dtype"))
        object.__setattr__(self, "storage_bytes", itemsize(self.storage_dtype))
        for dtype in (self.output_dtype, *(d for _, d in self.unit_output_dtype)):
            if dtype is not None:
                itemsize(dtype, "fsdp.mixed_precision.output_dtype")

    def output_dtype_of(self, unit: str) -> str | None:
        """The `output_dtype` of the policy `unit` was sharded with (None: its output is not cast)."""
        return dict(self.unit_output_dtype).get(unit, self.output_dtype)

    @property
    def post_forward_sizes(self) -> tuple[int, ...]:
        """The hpZ group sizes in use: one process group of that many ranks each (backward all-gathers)."""
        return tuple(sorted({v for v in (self.reshard_after_forward, self.root_reshard_after_forward)
                             if v is not None and not isinstance(v, bool)}))


def post_forward_size(value: int, shard_size: int, key: str = "fsdp.reshard_after_forward") -> bool | int:
    """`reshard_after_forward` as an int, checked and normalised as `_fsdp_init._get_post_forward_mesh_info` does.

    It must divide the shard group's size; 1 means False (torch warns: no resharding), the shard
    group's size means True; anything between is the size of the post-forward (hpZ) group.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(f"{key}: expected true, false or a group size (int), got {value!r}")
    if value < 1 or value > shard_size or shard_size % value:
        raise ScenarioError(f"{key}: as an int it is the group size to reshard to after forward and must be a "
                            f"factor of the shard group size {shard_size}, not {value}")
    if value == 1:
        return False
    if value == shard_size:
        return True
    return value


# the data-parallel mesh's process groups (a replicate x shard mesh): where the runtimes' collectives run
SHARD_GROUP, REPLICATE_GROUP = "shard", "replicate"


def post_forward_group(size: int) -> str:
    """The name of the post-forward (hpZ) process group of `size` ranks: a DeviceMesh of its own."""
    return f"post_forward_{size}"
