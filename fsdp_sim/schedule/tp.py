"""Tensor parallel's collectives inside each module's compute, and the 2-D mesh's process groups.

A TP plan (torchtitan's `apply_tp`, see `workload/tensor_parallel.py`) joins the shards with Megatron's two
conjugate operators, which DTensor runs as redistributes:
- before a colwise Linear (wq, w1, the output head), `PrepareModuleInput` / `ColwiseParallel`'s input:
  with sequence parallel Shard(1) -> Replicate, an all-gather in forward and (its backward, the Partial
  input gradient -> Shard(1)) a reduce-scatter in backward; without it the input is already Replicate, so
  nothing in forward and an all-reduce of the Partial input gradient in backward (`_FromTorchTensor` /
  `Redistribute` backward, torch 2.13 `distributed/tensor/_api.py` / `_redistribute.py`);
- after a rowwise Linear (wo, w2, the embedding lookup), `RowwiseParallel`'s output Partial -> Shard(1) (a
  reduce-scatter; its backward an all-gather) or -> Replicate (an all-reduce; backward nothing).
Loss parallel (`loss_parallel`, torch `distributed/tensor/parallel/loss.py`) all-reduces three fp32
per-token values in forward (the max and the sum of exponentials in `_log_softmax`, the target logit in
`_nll_loss_forward`); its backward is local.

With torchao float8 (`compute.float8`), torchtitan's plan takes `Float8ColwiseParallel`,
`Float8RowwiseParallel` and `PrepareFloat8ModuleInput` (torchao `float8/float8_tensor_parallel.py`): a block
input is cast to float8 before its all-gather, and a rowwise output's gradient (`NoopFwToFloat8BwDynamic`)
before the all-gather that is its reduce-scatter's backward, so with sequence parallel those all-gathers move
1 byte an element; reduce-scatters and all-reduces stay bf16 (they reduce high-precision matmul outputs).
Each dynamic cast of a TP-sharded tensor takes its amax over the whole tensor (`tensor_to_amax`: a
`Partial(max)` DTensor scalar), an all-reduce of one fp32 value before the cast: the input of wq and w1
(with sequence parallel) and of wo and w2, and every Float8Linear's output gradient but a rowwise one
without sequence parallel (Replicate there). Without the float8 all-gather the weight reaches the Linear
as a TP-sharded bf16 DTensor, which `matmul_with_hp_or_float8_args` casts in forward and again in backward
for the input gradient (it saved the weight in high precision; torchao `float8/float8_linear.py`): one more
amax all-reduce in each pass, and in a recompute. With the float8 all-gather the weight arrives cast
(`tensor_already_casted_to_fp8`) and its amax is FSDP's (schedule/float8.py).

The `hf` and `blocks` plans (`workload/tp_plans.py`) have no `PrepareModuleInput`, no sequence parallel and no
loss parallel: each colwise Linear (wq, wk, wv, w1, w3) wraps its own input, so its input gradient is
all-reduced on its own in backward; each rowwise one (wo, w2) all-reduces its output in forward. Under `hf`
the head (`colwise_rep`) all-gathers the logits on the vocabulary in forward (the `TP_GATHER` label, priced
at an all-gather's ring factor) and all-reduces its input gradient in backward; the embedding is replicated.

Each is a functional collective that the DTensor op waits for inline (`wait_tensor` before the next op), so
on the compute stream it blocks the module's kernels: the module's compute op is split around it, and the
collective runs on the `tp` process group's lane (NVLink inside the node).
"""

from __future__ import annotations

from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.collectives import ProcessGroup
from fsdp_sim.schedule.ops import Op
from fsdp_sim.schedule.settings import post_forward_group
from fsdp_sim.workload.model import Kernel

TP_GROUP = "tp"  # the TP mesh dimension's process group
TP_GATHER = "tp_gather"  # the same process group's logits all-gather under the hf plan, at its own ring factor
COLWISE_FIRST = ("wq", "w1", "output")  # the first colwise Linear reading a redistributed input
ROWWISE = ("wo", "w2", "embedding lookup")  # a rowwise op whose Partial output is redistributed
PER_LINEAR_COLWISE = ("wq", "wk", "wv", "w1", "w3")  # hf / blocks: each colwise Linear wraps its own input
PER_LINEAR_ROWWISE = ("wo", "w2")
LOSS_KERNEL = "log_softmax + nll_loss"
LOSS_PARALLEL_ALL_REDUCES = 3  # max, sum of exp (`_log_softmax`), the target logit (`_nll_loss_forward`)
AMAX_BYTES = 4  # a float8 cast's amax: one fp32 scalar (torchao `float8_utils.tensor_to_amax`)
FLOAT8_BYTES = 1  # float8_e4m3fn / e5m2


def _amax_all_reduce(name: str, backward: bool, sequence_parallel: bool) -> bool:
    """Whether a Float8Linear `name`'s dynamic cast in this pass reads a TP-sharded tensor (see the module):
    forward, its input (wk / wv / w3 read the one PrepareFloat8ModuleInput cast for wq / w1); backward,
    its output gradient."""
    if backward:
        return sequence_parallel or name not in ROWWISE
    if name in COLWISE_FIRST:
        return sequence_parallel
    return name in ROWWISE


def conjugates(sequence_parallel: bool) -> dict[str, tuple[str | None, str | None]]:
    """(forward, backward) collective before a colwise Linear ("f") and after a rowwise one ("g")."""
    if sequence_parallel:
        return {"f": ("all_gather", "reduce_scatter"), "g": ("reduce_scatter", "all_gather")}
    return {"f": (None, "all_reduce"), "g": ("all_reduce", None)}


class TensorParallelCompute:
    """Tensor parallel as a part of the step (techniques.py): `module_compute` emits a module's compute op
    split around the TP collectives. Reads the step's graph, settings and workload; keeps one tuple object
    per distinct kernel segment."""

    def __init__(self, step) -> None:
        self.step = step
        self.segments: dict[tuple[Kernel, ...], tuple[Kernel, ...]] = {}

    def module_compute(self, stream: str, name: str, kernels: tuple[Kernel, ...], kernel_pass: str, *,
                       flops: float, hbm_bytes: float) -> Op | None:
        """The compute op `name` of a module's `kernels` run as `kernel_pass`, with `OpGraph.add`'s flops
        and hbm_bytes; returns it, or None when it was split around TP collectives into several."""
        g = self.step.g
        items = self._tp_items(kernels, kernel_pass)
        if not items:  # a recompute that re-runs none of the kernels
            return g.add("compute", stream, name, flops=flops, hbm_bytes=hbm_bytes, kernels=kernels,
                         kernel_pass=kernel_pass)
        run: list[Kernel] = []
        part = 0

        def flush() -> None:
            nonlocal part
            if run:
                part += 1
                segment = self._tp_segment(tuple(run))
                flops = sum(k.bwd_flops if kernel_pass == "backward" else k.fwd_flops for k in segment)
                g.add("compute", stream, f"{name} ({part})", flops=flops, kernels=segment, kernel_pass=kernel_pass)
                run.clear()

        for item in items:
            if isinstance(item, Kernel):
                run.append(item)
                continue
            flush()
            kind, nbytes, *label = item
            g.add(kind, stream, f"{name} TP {kind.replace('_', '-')}", group=label[0] if label else TP_GROUP,
                  comm_bytes=nbytes)
        flush()
        return None

    def all_reduce_partial_grads(self, u) -> None:
        """FSDP2's post-backward under torchtitan's plan with sequence parallel: FSDPParamGroup.post_backward
        reads each gradient through `FSDPParam._get_grad_inner_tensor` (torch 2.13
        `_fully_shard/_fsdp_param.py`), which redistributes a DTensor gradient to the parameter's placements
        on the non-DP mesh dims: a norm weight's Partial gradient (`sequence_parallel_norm_params`) becomes
        Replicate, one all-reduce on the TP group per such parameter, a functional collective waited for
        inline (on the compute stream), before the unit reshards and reduce-scatters. One kept without
        reduction (`set_requires_gradient_sync(False)`) stays Partial until the backward that reduces it."""
        step = self.step
        if step.wl.meta.get("tp_plan", "torchtitan") != "torchtitan" or not step.s.sequence_parallel:
            return
        for p in sequence_parallel_norm_params(u):
            grad = step.accumulated_grads.get(p.name) or step.unsharded_grads.get(p.name)
            if grad is not None:
                step.g.add("all_reduce", "compute", f"{p.name} grad Partial -> Replicate (TP all-reduce)",
                           group=TP_GROUP, comm_bytes=grad.nbytes)

    def _tp_segment(self, kernels: tuple[Kernel, ...]) -> tuple[Kernel, ...]:
        """One tuple object per distinct segment: op pricing caches by the kernels' identity."""
        return self.segments.setdefault(kernels, kernels)

    def _tp_items(self, kernels: tuple[Kernel, ...], kernel_pass: str) -> list:
        """The module's kernels in execution order with (kind, bytes) collectives between them."""
        s, wl = self.step.s, self.step.wl
        if wl.meta.get("tp_plan", "torchtitan") != "torchtitan":
            return per_linear_items(kernels, kernel_pass, wl, s.param_bytes)
        ops = conjugates(s.sequence_parallel)
        elements = wl.tokens * wl.meta["hidden"]  # the (b, s, h) activation
        hidden_bytes = elements * s.param_bytes
        backward = kernel_pass == "backward"
        items: list = []
        for k in (kernels[::-1] if backward else kernels):
            if kernel_pass == "recompute" and not k.recompute:
                continue  # early stop: nothing after the last saved tensor re-runs, its collectives neither
            before = after = None
            if k.name in COLWISE_FIRST:
                before = ops["f"]
            elif k.name in ROWWISE:
                after = ops["g"]
            # backward runs the kernels in reverse: a forward "before" collective's dual comes after
            if backward:
                before, after = after, before
            pick = 1 if backward else 0
            float8 = k.dtype == "fp8"  # a Float8Linear: its cast, with its amax, precedes the collective before it
            if float8 and _amax_all_reduce(k.name, backward, s.sequence_parallel):
                items.append(("all_reduce", AMAX_BYTES))
            if before and before[pick]:
                kind = before[pick]
                items.append((kind, elements * FLOAT8_BYTES if float8 and kind == "all_gather" else hidden_bytes))
            if float8 and not s.float8_all_gather:
                items.append(("all_reduce", AMAX_BYTES))  # the TP-sharded weight's own cast (module docstring)
            items.append(k)
            if after and after[pick]:
                items.append((after[pick], hidden_bytes))
            if k.name == LOSS_KERNEL and not backward:
                items += [("all_reduce", wl.tokens * 4)] * LOSS_PARALLEL_ALL_REDUCES
        return items


def sequence_parallel_norm_params(u) -> list:
    """The unit's trainable norm parameters (`...norm.weight` / `.bias`): torchtitan's plan gives the norms
    `SequenceParallel`, which keeps their parameters Replicate DTensors on the TP mesh while they read
    Shard(1) inputs, so their gradients come out Partial (a sum over the sequence shards)."""
    return [p for p in u.params if p.trainable and len(p.shape) == 1 and p.name.rsplit(".", 2)[-2].endswith("norm")]


def per_linear_items(kernels: tuple[Kernel, ...], kernel_pass: str, wl, param_bytes: int) -> list:
    """`_tp_items` under the hf / blocks plans (module docstring): an all-reduce of the (b, s, h) activation
    after wo's and w2's forward and after each colwise Linear's backward (its input gradient); under hf's
    colwise_rep head, the logits' all-gather (b s x k ceil(V/k) elements, the GEMM's padded shard from each
    rank) after its GEMM in forward and its input gradient's all-reduce in backward."""
    hidden_bytes = wl.tokens * wl.meta["hidden"] * param_bytes
    backward = kernel_pass == "backward"
    colwise = PER_LINEAR_COLWISE + (("output",) if wl.meta.get("tp_head") == "colwise_rep" else ())
    items: list = []
    for k in (kernels[::-1] if backward else kernels):
        if kernel_pass == "recompute" and not k.recompute:
            continue
        if k.dtype == "fp8":
            raise ScenarioError(f"compute.float8: under parallelism.tp_plan {wl.meta['tp_plan']} is not modelled "
                                "(torchao's Float8 TP styles are torchtitan's plan)")
        items.append(k)
        if backward and k.name in colwise:
            items.append(("all_reduce", hidden_bytes))
        elif not backward and k.name in PER_LINEAR_ROWWISE:
            items.append(("all_reduce", hidden_bytes))
        elif not backward and k.name == "output" and "output" in colwise:
            m, n_local, _ = k.shape
            items.append(("all_gather", m * n_local * wl.meta["tp"] * param_bytes, TP_GATHER))
    return items


def dp_process_groups(tp: int, shard_size: int, replicate_size: int, nodes: int, gpus_per_node: int,
                      consecutive: dict[str, int] | None = None) -> dict[str, ProcessGroup]:
    """The process groups of a (replicate, shard, tp) mesh laid out node-major with TP innermost, as
    torchtitan's `ParallelDims` builds it (`init_device_mesh` makes the last dimension consecutive ranks).

    A node holds gpus_per_node / tp ranks of each DP group, so a shard group of s ranks spans
    ceil(s / that) nodes; a replicate group's ranks are one per node once a shard group fills its node's
    share. hpZ's post-forward groups are consecutive DP ranks, laid out like a shard group."""
    per_node = gpus_per_node // tp
    groups = {"shard": ProcessGroup(shard_size, -(-shard_size // per_node)),
              "replicate": ProcessGroup(replicate_size, replicate_size if shard_size >= per_node else nodes),
              TP_GROUP: ProcessGroup(tp, 1)}
    return groups | {name: ProcessGroup(k, -(-k // per_node)) for name, k in (consecutive or {}).items()}


def tp_ring_factor(tp: int, sequence_parallel: bool) -> float:
    """Bytes a rank moves per byte of a TP collective: ring all-gather / reduce-scatter (k-1)/k with sequence
    parallel, all-reduce 2(k-1)/k without (nccl-tests' bus factors; the loss's tiny all-reduces aside)."""
    return (tp - 1) / tp * (1 if sequence_parallel else 2)


def tp_pricing(s, cluster) -> dict:
    """`OpCosts`' keyword arguments for a TP mesh: its process groups and the TP group's ring factor
    (nothing without TP: the 1-D layout stands)."""
    if s.tp == 1:
        return {}
    consecutive = {post_forward_group(k): k for k in s.post_forward_sizes}
    groups = dp_process_groups(s.tp, s.shard_size, s.replicate_size, cluster.nodes, cluster.gpus_per_node, consecutive)
    return {"groups": groups | {TP_GATHER: groups[TP_GROUP]},
            "ring_factors": {TP_GROUP: tp_ring_factor(s.tp, s.sequence_parallel), TP_GATHER: (s.tp - 1) / s.tp}}


def rank_groups(s) -> dict[str, tuple[int, int, int]]:
    """Every process group's members on the (replicate, shard, tp) mesh (`dp_process_groups`' layout: rank =
    (replicate index x shard_size + shard index) x tp + tp index), as (outer, size, inner): the ranks laid out
    as an outer x size x inner array, a group is those that differ only in the middle index. What the
    per-rank replay (engine/ranks.py) waits on at each collective."""
    r, k, t = s.replicate_size, s.shard_size, s.tp
    groups = {"shard": (r, k, t), "replicate": (1, r, k * t), TP_GROUP: (r * k, t, 1), TP_GATHER: (r * k, t, 1)}
    return groups | {post_forward_group(n): (r * k // n, n, t) for n in s.post_forward_sizes}
