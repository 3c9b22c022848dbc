"""The two tensor-parallel plans that leave the ends of the model replicated: `hf` and `blocks`.

`parallelism.tp_plan: hf` is transformers' plan (`base_model_tp_plan` in each model's configuration file, e.g.
`configuration_llama.py`: q/k/v/gate/up_proj "colwise", o_proj / down_proj "rowwise"; the LM class's
`_tp_plan = {"lm_head": "colwise_rep"}`), applied by `integrations/tensor_parallel.py`: every parameter the
plan does not name gets "replicate" (`ReplicateParallel`, a Replicate DTensor: no collective), so the
embedding and the norms are whole on every rank. `blocks` is `parallelize_module` with torch's default
`ColwiseParallel()` / `RowwiseParallel()` on the blocks' Linears only, the embedding and head left as they
are. The block styles are the same in both (transformers' classes copy torch's hooks):
- a colwise Linear's input hook wraps its plain-tensor input with `DTensor.from_local(x, Replicate())` (a view:
  q, k and v share the one saved input) and the output is `Shard(-1)` handed back local; nothing moves in
  forward, and in backward each Linear's input gradient is `Partial`, redistributed to `Replicate` by its own
  `_FromTorchTensor.backward`: one all-reduce of the (b, s, h) input gradient per colwise Linear (wq, wk, wv,
  w1, w3: five per SwiGLU block, four with a GELU MLP) -- where torchtitan's `PrepareModuleInput` makes the
  one DTensor the attention's (or MLP's) Linears share, so one per half;
- a rowwise Linear's output is `Partial`, redistributed to `Replicate`: an all-reduce in forward, nothing
  in backward (the Replicate gradient splits locally onto the Shard(-1) input).
There is no sequence parallel and no loss parallel: the norms, residual adds and the loss run on every
token, as `build_transformer` builds them on the per-rank dimensions.

The head: under `blocks` a plain replicated `Linear(h, V)` (full logits, no collective). Under `hf`,
"colwise_rep" is `ColwiseParallel(output_layouts=Replicate())`: the weight is 1/k of the vocabulary rows,
the GEMM writes (b, s, ceil(V/k)) and its `Shard(-1) -> Replicate` redistribute all-gathers the logits
(`funcol.all_gather_tensor(gather_dim=-1)`: an all-gather into a (k b, s, V/k) buffer, then `torch.cat` of
its chunks on the last dimension), so every rank holds the whole logits and runs the whole loss. Backward,
the Replicate gradient is chunked locally (`Shard._split_tensor`, made contiguous) and the input gradient
all-reduced. A tied head (`tie_word_embeddings`) shares the embedding's weight, which the plan replicates
(transformers shards the checkpoint's tensors by their own names: only `embed_tokens.weight` is stored),
so it is priced replicated as under `blocks`, and said so in a warning.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import warn
from fsdp_sim.workload.kernels import elementwise, gemm
from fsdp_sim.workload.model import Module, Param, Workload
from fsdp_sim.workload.transformer import TransformerDims, build_transformer

LOGITS_GATHER = "logits all-gather: cat on the vocabulary"  # the head's kernel after its all-gather (schedule/tp.py)


def build_replicated_ends(d: TransformerDims, local: TransformerDims, k: int, plan: str, *, micro_batch: int,
                          seq_len: int, act_dtype: str, name: str) -> Workload:
    """One rank's workload under the `hf` or `blocks` plan (module docstring), `local` its share of `d`'s heads
    and MLP width (`tensor_parallel.tp_dims`): blocks on those, the embedding whole, the head whole (`blocks`,
    a tied `hf` head) or vocabulary-sharded and gathered (`hf`)."""
    wl = build_transformer(replace(local, vocab=d.vocab), micro_batch=micro_batch, seq_len=seq_len,
                           act_dtype=act_dtype, name=name)
    meta = wl.meta | {"tp": k, "sequence_parallel": False, "hidden": d.hidden, "tp_plan": plan}
    if plan == "blocks":
        return replace(wl, meta=meta)
    if d.tie_embeddings:
        warn("parallelism.tp_plan: hf with tied embeddings: the head shares the replicated embedding weight, so it "
             "is priced replicated (no colwise_rep logits all-gather)")
        return replace(wl, meta=meta | {"tp_head": "replicated"})
    modules = tuple(colwise_rep_head(m, d, k, micro_batch * seq_len, itemsize(act_dtype)) if m.kind == "head" else m
                    for m in wl.modules)
    model_flops = sum(m.fwd_flops + m.bwd_flops for m in modules)
    return replace(wl, modules=modules, model_flops=float(model_flops), meta=meta | {"tp_head": "colwise_rep"})


def colwise_rep_head(m: Module, d: TransformerDims, k: int, tok: int, p: int) -> Module:
    """transformers' `lm_head: colwise_rep` on `tok` rows: 1/k of the vocabulary rows (DTensor's Shard pads an
    uneven split to ceil(V/k) for the all-gather); forward the GEMM's (tok, ceil(V/k)) shard lives beside the
    all-gather's (tok, k ceil(V/k)) buffer until `torch.cat` has written the whole logits (the module's
    output); backward holds the gradient's contiguous local chunk."""
    v_local = -(-d.vocab // k)
    shard, gathered = tok * v_local * p, tok * v_local * k * p
    flops = 2 * tok * d.hidden * v_local
    # the cat reads the gathered buffer and writes the logits; its backward (the chunk) copies one shard
    cat = elementwise(LOGITS_GATHER, 2 * gathered, 2 * shard, recompute=False)
    return replace(m, params=(Param("output.weight", (v_local, d.hidden)),), fwd_flops=flops, bwd_flops=2 * flops,
                   fwd_hbm_bytes=shard + 2 * gathered, fwd_temp_bytes=shard + gathered, bwd_temp_bytes=shard,
                   output_bytes=tok * d.vocab * p, kernels=(gemm("output", tok, v_local, d.hidden), cat))
