"""Tensor parallel inside a node, FSDP over the rest: the per-rank workload of torchtitan's 2-D mesh.

torchtitan's `parallelize_llama` (`apply_tp`) plans every block as Megatron does: wq / wk / wv / w1 / w3
`ColwiseParallel` (each rank holds 1/k of the output features), wo / w2 `RowwiseParallel` (1/k of the input
features), `tok_embeddings` rowwise (1/k of the vocabulary rows), `output` colwise with loss parallel (the
logits stay sharded on the vocabulary), the norms `SequenceParallel`. So one rank runs a block with 1/k of
the heads and of the MLP width, which is what this module builds: the transformer builder on dimensions
whose heads, kv heads, MLP width and vocabulary are divided by k, the per-head size kept. Its saved
tensors are Korthikanti et al. (2022)'s tensor-parallel layout sbh(10 + 24/t + 5as/(ht)): what stays whole
is the block's input, the two norms' inputs and outputs and the dropout masks.

With sequence parallel (torchtitan's plan always has it; `parallelism.sequence_parallel: false` is the same
plan with `Replicate()` layouts in place of `Shard(1)`) those are sharded on the sequence too, but not all
of the paper's 34/t comes out: PyTorch's colwise Linears save their input, the all-gathered (whole) norm
output, where Megatron saves the sequence shard and all-gathers it again in backward. Each of the two
all-gathered inputs per block costs 2sbh(1 - 1/t) above the paper's figure.

`parallelism.tp_plan` picks whose plan (`TP_PLANS`); the other two are `tp_plans.py`'s (no sequence parallel,
the embedding replicated, the head colwise-then-gathered or replicated). The collectives that join the shards,
and the mesh's process-group layout, are the schedule's (`fsdp_sim/schedule/tp.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from fsdp_sim.datafile import expect_mapping, get_key, reject_unknown_keys
from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import ScenarioError
from fsdp_sim.workload.kernels import embedding_kernels
from fsdp_sim.workload.model import Kernel, Workload
from fsdp_sim.workload.tp_plans import build_replicated_ends
from fsdp_sim.workload.transformer import (BLOCK_RECIPE, TransformerDims, block_recipe, build_transformer,
                                           norm_backward_moment, norm_saves, norm_transients, recipe_activations)

# parallelism.tp_plan: torchtitan's `apply_tp`; transformers' `base_model_tp_plan` with the LM's `_tp_plan`
# (`lm_head: colwise_rep`); `parallelize_module` on the blocks' Linears only (see tp_plans.py)
TP_PLANS = ("torchtitan", "hf", "blocks")
# kernels whose rows a sequence-parallel rank runs on its 1/k of the tokens (norms, residual adds, dropouts)
SEQUENCE_SHARDED = ("norm", "norm_unfused")
SEQUENCE_SHARDED_NAMES = ("attention residual add", "mlp residual add", "attention output dropout", "mlp output dropout")


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """`parallelism.tp` ranks per TP group (1: none), whether the plan is sequence parallel, and whose plan."""
    size: int = 1
    sequence_parallel: bool = True
    plan: str = "torchtitan"


def parse_parallelism(raw, gpus_per_node: int) -> TensorParallel:
    """`parallelism: {tp: k, sequence_parallel: bool, tp_plan: torchtitan | hf | blocks}`: k divides the node
    (TP runs over NVLink only). Only torchtitan's plan has sequence parallel (its default); the hf and blocks
    plans leave the norms unplanned, so their activations are replicated and `sequence_parallel: true` is refused."""
    raw = expect_mapping("parallelism", raw)
    reject_unknown_keys("parallelism", raw, {"tp", "sequence_parallel", "tp_plan"})
    tp = get_key("parallelism", raw, "tp", int, 1, positive=True, maximum=gpus_per_node)
    if gpus_per_node % tp:
        raise ScenarioError(f"parallelism.tp: {tp} must divide hardware.gpus_per_node {gpus_per_node} "
                            "(tensor parallel stays inside a node)")
    plan = get_key("parallelism", raw, "tp_plan", str, "torchtitan")
    if plan not in TP_PLANS:
        raise ScenarioError(f"parallelism.tp_plan: expected one of {list(TP_PLANS)}, got {plan!r}")
    sp = get_key("parallelism", raw, "sequence_parallel", bool, plan == "torchtitan")
    if sp and plan != "torchtitan":
        raise ScenarioError(f"parallelism.sequence_parallel: true needs tp_plan torchtitan (the {plan} plan shards "
                            "no norm on the sequence)")
    return TensorParallel(tp, sp, plan)


def _check_divisible(d: TransformerDims, tp: int, seq_len: int, sp: bool) -> None:
    """The plan shards heads, kv heads and the MLP width evenly (torchtitan refuses otherwise)."""
    for key, value in (("heads", d.heads), ("kv_heads", d.kv), ("ffn_hidden", d.ffn)):
        if value % tp:
            raise ScenarioError(f"parallelism.tp: {tp} does not divide model.{key} {value}")
    if sp and seq_len % tp:
        raise ScenarioError(f"training.seq_len: {seq_len} must be a multiple of parallelism.tp {tp} "
                            "with sequence parallel")


def tp_dims(d: TransformerDims, tp: int) -> TransformerDims:
    """One rank's share: 1/k of the heads, kv heads, MLP width and vocabulary rows (DTensor's `Shard(0)`
    chunks like `torch.chunk`, so the first ranks hold ceil(v / k) rows), the per-head size kept."""
    return replace(d, heads=d.heads // tp, kv_heads=d.kv // tp, ffn_hidden=d.ffn // tp, head_dim=d.head_dim,
                   vocab=-(-d.vocab // tp))


def _replicated_saves(d: TransformerDims, tok: int, p: int) -> int:
    """What a TP block saves whole without sequence parallel and 1/k of with it: the two norms' own saved
    tensors, the residual ffn_norm keeps (when it keeps its input) and the two one-byte dropout masks."""
    norm = norm_saves(d, tok, p)
    return 2 * norm.extra + (tok * d.hidden * p if norm.keeps_input else 0) + (2 * tok * d.hidden if d.dropout else 0)


def _sequence_sharded(kernels: tuple[Kernel, ...], tp: int) -> tuple[Kernel, ...]:
    """A block's kernels as a sequence-parallel rank runs them: norms, residual adds and dropouts on 1/k
    of the rows; the matmuls and attention on the all-gathered (whole) sequence."""
    out = []
    for k in kernels:
        if k.kind in SEQUENCE_SHARDED or k.name in SEQUENCE_SHARDED_NAMES:
            shape = (k.shape[0] // tp, *k.shape[1:]) if k.shape else ()
            k = replace(k, shape=shape, bytes=k.bytes / tp, bwd_bytes=k.bwd_bytes / tp)
        out.append(k)
    return tuple(out)


@lru_cache(maxsize=256)  # as build_transformer: a sweep's points then share the workload and what is derived from it
def build_tp_transformer(d: TransformerDims, tp: TensorParallel, *, micro_batch: int, seq_len: int, act_dtype: str,
                         name: str) -> Workload:
    """The workload one rank of a TP group runs (see the module docstring); a Workload is frozen."""
    k = tp.size
    _check_divisible(d, k, seq_len, tp.sequence_parallel)
    if tp.plan != "torchtitan":
        return build_replicated_ends(d, tp_dims(d, k), k, tp.plan, micro_batch=micro_batch, seq_len=seq_len,
                                     act_dtype=act_dtype, name=name)
    wl = build_transformer(tp_dims(d, k), micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype, name=name)
    meta = wl.meta | {"tp": k, "sequence_parallel": tp.sequence_parallel, "hidden": d.hidden, "tp_plan": tp.plan}
    if not tp.sequence_parallel:
        return replace(wl, meta=meta)
    p, tok = itemsize(act_dtype), micro_batch * seq_len
    meta[BLOCK_RECIPE] = block_recipe(tp_dims(d, k), micro_batch, seq_len, p, tok // k)
    bsh = tok * d.hidden * p
    repl = _replicated_saves(d, tok, p) - _replicated_saves(d, tok // k, p)
    act = recipe_activations(meta[BLOCK_RECIPE])  # the norms on 1/k of the rows
    sharded: dict[int, tuple[Kernel, ...]] = {}  # one tuple per distinct kernel list: op pricing caches by it
    modules = []
    for m in wl.modules:
        if m.kind == "embedding":  # reduce-scattered onto this rank's 1/k of the sequence
            m = replace(m, output_bytes=bsh // k, kernels=embedding_kernels(tok, d.hidden, -(-d.vocab // k), p))
        elif m.is_block:
            kernels = sharded.setdefault(id(m.kernels), _sequence_sharded(m.kernels, k))
            m = replace(m, saved_bytes=m.saved_bytes - repl, fwd_temp_bytes=act.fwd_temp, bwd_temp_bytes=act.bwd_temp,
                        bwd_tail_bytes=act.bwd_tail, output_bytes=bsh // k, kernels=kernels)
        elif m.kind == "norm":
            m = replace(m, saved_bytes=norm_saves(d, tok // k, p).extra, fwd_temp_bytes=norm_transients(d, tok // k, p).fwd,
                        bwd_temp_bytes=norm_backward_moment(d, tok // k, p), output_bytes=bsh // k,
                        kernels=_sequence_sharded(m.kernels, k))
        elif m.kind == "head":  # saves its all-gathered (whole) input; the norm's 1/k output is dropped
            m = replace(m, saved_bytes=m.saved_bytes + bsh, saves_input=False)
        modules.append(m)
    model_flops = sum(m.fwd_flops + m.bwd_flops for m in modules)
    return replace(wl, modules=tuple(modules), model_flops=float(model_flops), meta=meta)

