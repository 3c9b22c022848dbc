"""Gradient-norm clipping between the last gradient reduction and the optimizer step (`training.max_norm`).

torchtitan clips every step at `training.max_norm` 1.0 (`config/configs.py`, `trainer.py` `train_step`),
and so does Hugging Face's Trainer (`TrainingArguments.max_grad_norm` 1.0); `null` turns it off. What each
runtime runs, read beside torch 2.13's `torch/nn/utils/clip_grad.py` and torchtitan b5bcd76's
`distributed/utils.py` `clip_grad_norm_`:
- `foreach` (plain training, FSDP2; FSDP1 when no unit is sharded, where `FSDP.clip_grad_norm_` hands over
  to torch's): `torch._foreach_norm` over the local gradients (one read of each, one fp32 0-dim output
  per tensor), `torch.stack` + `linalg.vector_norm` of those, then `max_norm / (total + 1e-6)` clamped to 1
  and `torch._foreach_mul_(grads, coef)`, in place (a read and a write of each gradient, nothing
  allocated). torchtitan passes `foreach=True`, which FSDP2's DTensor gradients need (`_has_foreach_support`
  admits plain tensors only). On DTensors the norm is `_NormPartial` over every sharded mesh dimension and
  is made whole by one all-reduce of one fp32 scalar per such dimension: the shard group, and the TP group
  under tensor parallel; not the replicate group under HSDP, whose placement is already Replicate, nor a
  shard group of one (traced under a fake process group with torch 2.13: `CommDebugMode` counts 1, 1, 2
  and 0 all-reduces for FSDP, HSDP, FSDP + TP and a shard dimension of size 1).
- `FSDP.clip_grad_norm_` (FSDP1, some unit sharded; `fully_sharded_data_parallel.py`, `_get_grad_norm`):
  one `vector_norm(grad, dtype=float32)` per gradient, stack, vector_norm, `** 2`, `dist.all_reduce` over
  the unit's process group (the shard group, intra-node under HYBRID_SHARD), `** 0.5`, the coefficient,
  then per gradient `coef.to(grad.dtype)` (a cast unless the gradient is fp32) and `grad.mul_(coef)`.
- Under CPU offload the gradients are host tensors (offload.py): the norm and the multiply run on the
  CPU, priced as host-memory traffic like the CPU optimizer step (hardware/host_link.py). FSDP1 moves the
  local norm to the GPU for its NCCL all-reduce and back (`total_norm.cpu()`); FSDP2's DTensor all-reduce
  of a CPU tensor runs on the gloo half of torchtitan's `cuda:nccl,cpu:gloo` backend, which no source here
  measures: it is not priced.

Launches: foreach ops as `multi_tensor_apply` issues them (optimizers.py); the small ops one each, and the
CPU issue thread pays each launch as any other. The per-tensor Python and DTensor dispatch around them
(pytorch#133586: ~2,000 gradients take >18 ms of CPU against 1.3 ms of GPU) is not charged: the issue
thread's cost is per kernel launch (hardware/compute.py).
"""

from __future__ import annotations

from fsdp_sim.hardware.host_link import CPU
from fsdp_sim.schedule.offload import CPU_STREAM
from fsdp_sim.schedule.ops import Op
from fsdp_sim.schedule.optimizers import FOREACH_CHUNK_ELEMENTS, multi_tensor_apply_launches
from fsdp_sim.schedule.settings import SHARD_GROUP
from fsdp_sim.schedule.tp import TP_GROUP

COMPUTE = "compute"  # the current CUDA stream (autograd.py's)
DEFAULT_MAX_NORM = 1.0  # torchtitan `training.max_norm` (config/configs.py); HF `TrainingArguments.max_grad_norm`
NORM_BYTES = 4  # the norms are fp32: `_foreach_norm` outputs opmath, FSDP1 passes dtype=torch.float32
# `_foreach_tensor_norm_cuda_impl` (ATen/native/cuda/ForeachReduceOp.cu): `at::zeros` of the per-chunk
# partial sums (ntensors x max chunks) and of a 320-entry global buffer (two fills), the multi_tensor_apply
# launches, then one `lpnorm_cleanup` per MAX_TENSORS_PER_KERNEL tensors (3200 in CUDA >= 13 builds, 400
# before: ATen/native/cuda/foreach_reduce.cuh)
FOREACH_NORM_FILLS, FOREACH_NORM_GLOBAL_ENTRIES, NORM_CLEANUP_TENSORS = 2, 320, 3200
TOTAL_NORM_LAUNCHES = 2  # torch.stack (a cat) and linalg.vector_norm of the per-tensor norms (`_get_total_norm`)
# per partial mesh dimension, around the all-reduce: `x ** 2` before, the functional all-reduce's clone of
# its input, `** 0.5` after (DTensor `_NormPartial`, traced with torch.profiler under a fake process group)
NORM_PARTIAL_LAUNCHES = 3
# `max_norm / (total_norm + 1e-6)` (add; `__rdiv__` is `reciprocal() * other`, torch/_tensor.py) and clamp
CLIP_COEF_LAUNCHES = 4


def partial_groups(s) -> tuple[str, ...]:
    """The process groups the total norm is all-reduced over, one fp32 scalar each (module docstring)."""
    if s.version == 0:
        return ()
    groups = (SHARD_GROUP,) if s.shard_size > 1 and s.sharding_strategy != "NO_SHARD" else ()
    return groups + ((TP_GROUP,) if s.tp > 1 else ())


def clip_grad_norm(step, last: Op | None, stepped: list[int]) -> Op | None:
    """`clip_grad_norm_(params, max_norm)` after `last` (the last gradient reduction the step waits) on the
    gradients of the tensors the optimizer steps (`stepped`: their local elements, `optimizer_shards`): the
    ops of the runtime's implementation; returns the last of them for the optimizer step to follow (`last`
    itself when clipping is off)."""
    s = step.s
    if s.max_norm is None:
        return last
    shards = [n for n in stepped if n]  # the local gradients: one per tensor the optimizer steps
    if not shards:
        return last
    groups = partial_groups(s)
    if step.techniques.cpu_offload:
        return _on_host(step, last, shards, groups)
    if s.version == 1 and groups:
        return _fsdp1(step, last, shards, groups)
    return _foreach(step, last, shards, groups)


def _foreach(step, last: Op | None, shards: list[int], groups: tuple[str, ...]) -> Op:
    g = step.g
    grad_bytes = sum(shards) * step.s.storage_bytes
    n = len(shards)
    # `_foreach_norm`'s outputs (one 0-dim fp32 tensor per gradient) live until the stack; its per-chunk
    # partial sums only while it runs
    norms = g.alloc(COMPUTE, "clip_grad_norm_ per-gradient norms", "temporaries", n * NORM_BYTES, deps=(last,))
    partials = g.alloc(COMPUTE, "_foreach_norm partial sums", "temporaries", _partials_bytes(shards))
    g.add("compute", COMPUTE, f"clip_grad_norm_ _foreach_norm ({n} gradients)", deps=(last,),
          hbm_bytes=grad_bytes + n * NORM_BYTES, launches=foreach_norm_launches(shards))
    g.free(COMPUTE, partials)
    g.add("compute", COMPUTE, "clip_grad_norm_ total norm (stack, vector_norm)", hbm_bytes=3 * n * NORM_BYTES,
          launches=TOTAL_NORM_LAUNCHES)
    g.free(COMPUTE, norms)
    _norm_all_reduces(g, "clip_grad_norm_", groups)
    g.add("compute", COMPUTE, "clip_grad_norm_ clip coefficient", hbm_bytes=0,
          launches=CLIP_COEF_LAUNCHES + NORM_PARTIAL_LAUNCHES * len(groups))
    return g.add("compute", COMPUTE, f"clip_grad_norm_ _foreach_mul_ ({n} gradients)", hbm_bytes=2 * grad_bytes,
                 launches=multi_tensor_apply_launches(shards))


def _fsdp1(step, last: Op | None, shards: list[int], groups: tuple[str, ...]) -> Op:
    """`FSDP.clip_grad_norm_` with some unit sharded: a norm and a multiply launched per gradient."""
    g, s = step.g, step.s
    grad_bytes = sum(shards) * s.storage_bytes
    n = len(shards)
    g.add("compute", COMPUTE, f"FSDP.clip_grad_norm_ vector_norm per gradient ({n})", deps=(last,),
          hbm_bytes=grad_bytes + n * NORM_BYTES, launches=n)
    # `total_norm ** norm_type` before `dist.all_reduce` (in place: no clone), `** (1 / norm_type)` after
    g.add("compute", COMPUTE, "FSDP.clip_grad_norm_ total norm (stack, vector_norm, ** 2)",
          hbm_bytes=3 * n * NORM_BYTES, launches=TOTAL_NORM_LAUNCHES + 1)
    _norm_all_reduces(g, "FSDP.clip_grad_norm_", groups)
    g.add("compute", COMPUTE, "FSDP.clip_grad_norm_ clip coefficient", hbm_bytes=0,
          launches=1 + CLIP_COEF_LAUNCHES)
    casts = n if s.storage_bytes != NORM_BYTES else 0  # coef.to(grad.dtype): a kernel unless already fp32
    return g.add("compute", COMPUTE, f"FSDP.clip_grad_norm_ grad.mul_ per gradient ({n})", hbm_bytes=2 * grad_bytes,
                 launches=n + casts)


def _on_host(step, last: Op | None, shards: list[int], groups: tuple[str, ...]) -> Op:
    """The gradients are host tensors: the norm and the multiply on the CPU (per tensor: torch's foreach
    kernels are CUDA-only, `_foreach_utils._get_foreach_kernels_supported_devices`). FSDP1 all-reduces
    the norm on the GPU between them; FSDP2's gloo all-reduce is not priced (module docstring)."""
    g, s = step.g, step.s
    grad_bytes = sum(shards) * s.storage_bytes
    op = g.add("compute", CPU_STREAM, f"clip_grad_norm_ norms on the CPU ({len(shards)} gradients)", deps=(last,),
               comm_bytes=grad_bytes, group=CPU, launches=0)
    if s.version == 1:
        op = _norm_all_reduces(g, "FSDP.clip_grad_norm_", groups, after=op)
    return g.add("compute", CPU_STREAM, f"clip_grad_norm_ grad.mul_ on the CPU ({len(shards)} gradients)", deps=(op,),
                 comm_bytes=2 * grad_bytes, group=CPU, launches=0)


def _norm_all_reduces(g, label: str, groups: tuple[str, ...], after: Op | None = None) -> Op | None:
    """The total norm made whole: one all-reduce of one fp32 scalar per partial process group, in order on
    the current stream. `after`: an op on another stream the first waits for (the host path's CPU norm),
    each then waiting for the one before. Returns the last all-reduce (`after` when there is none)."""
    op = after
    for group in groups:
        deps = (op,) if after is not None else ()
        op = g.add("all_reduce", COMPUTE, f"{label} total norm all-reduce ({group})", deps=deps, group=group,
                   comm_bytes=NORM_BYTES)
    return op


def foreach_norm_launches(shards: list[int]) -> int:
    """Kernels `torch._foreach_norm` launches on CUDA tensors of `shards` elements."""
    return FOREACH_NORM_FILLS + multi_tensor_apply_launches(shards) + -(-len(shards) // NORM_CLEANUP_TENSORS)


def _partials_bytes(shards: list[int]) -> int:
    """`_foreach_norm`'s fp32 partial sums: ntensors x the most chunks of any tensor, and the global buffer."""
    chunks = max(-(-n // FOREACH_CHUNK_ELEMENTS) for n in shards)
    return (len(shards) * chunks + FOREACH_NORM_GLOBAL_ENTRIES) * NORM_BYTES
