"""A transformer block under `compute.torch_compile`: the kernels Inductor generates and what it saves.

torchtitan compiles each block on its own (`apply_compile`), so FSDP2's hooks stay outside the graph
and a block is one forward and one backward graph. What Inductor makes of them is read from its own
output (`compiled_block_data.py`, from `benchmarks/inductor_block.py --emit-all` on torch 2.13), for
three block codes (`table_key`): torchtitan's Llama-3 block, transformers' Llama / Mistral / Qwen2
decoder layer (`LlamaRMSNorm`'s upcast, rotate_half RoPE, `repeat_kv`), and a GPT-2 style block
(LayerNorm, biased Linears, GELU, no rotary embedding), each grouped-query or multi-head, each without a
checkpoint or under torchtitan's op-level selective policy, any head_dim (the tables were read with
heads x head_dim != hidden, so every buffer names its own size):
- GEMMs and SDPA stay library calls: priced as the eager block's (`block_kernels`).
- Every memory-bound chain is what Inductor fused, no more: the norm with the residual add before it
  (one reduction), SiLU x w3 or GELU (one pointwise kernel), the closing residual add, the GQA repeat
  of k and v (a copy each, forward and again in backward); the backward's norm kernels. torchtitan's
  complex RoPE is not generated ("Torchinductor does not support code generation for complex
  operators"): the upcast and the cast back are generated kernels, the complex multiply an eager ATen
  kernel on fp32 data. transformers' rotate_half RoPE is generated: one pointwise kernel for q and one
  for k (the slices, the negation, the concatenation and both multiplies fused), each reading the
  projection and the cos / sin table once.
- The saved set is the partitioner's: k and v before the repeat, no SiLU output (recomputed from w1's
  output), wo's output in place of the residual sum, no fp32 RoPE intermediates. Transients are
  Inductor's schedule played with each buffer freed after its last reader.
- Under torchtitan's op-level selective checkpoint the partitioner follows the policy's tags (MUST_SAVE
  the odd mm outputs and SDPA's, recompute the rest inside the compiled backward): the block keeps the
  table's saved set from its forward to the end of its backward, and its backward reruns the GEMMs the
  policy does not cache (checkpointing.py `compiled_op_policy`); the recomputed memory-bound ops are
  fused into the backward's kernels, whose bytes the table holds.

Not read, so priced as before (every memory-bound chain one fused kernel at hand-written speed, the eager
block's saved bytes: an approximation, named in the summary's software line, `compiled_note`):
LoRA / QLoRA / frozen-base blocks (QLoRA's dequantize stays a bitsandbytes kernel, not one Inductor
generates; `benchmarks/inductor_block.py --lora-rank 8` shows what Inductor makes of peft's LoRA on q / k
/ v / o with dropout 0.05: one graph; each target's dropout mask an Inductor random kernel, the three
masks of the norm's output and their dropped copies written by the norm's own kernel; each adapter's
scale and add fused into the kernel after it (the RoPE upcast, the residual add); saved: the bool masks,
the dropped inputs, lora_A's outputs, 35 % below eager's saves -- not yet a table the LoRA path applies),
tensor-parallel blocks (the table has no DTensor redistributions; torchtitan compiles each block after
`parallelize_module` with `fullgraph=True`, and Dynamo traces the DTensor hooks and redistributions into the graph,
no graph break (tests/test_compiled_block.py `test_tensor_parallel_then_compile_is_one_graph`),
but the table was not read with them), mixture-of-experts blocks, Gemma / Phi-3 / GPT-NeoX / Qwen3
blocks (their norms, fused projections, partial rotary or QK-norms), dropout, eager attention, vision
towers, and blocks under full or per-layer checkpointing (kernels from the table, the eager block's
bytes and checkpoint plan: with torchtitan's full checkpoint the compiled backward's peak is the eager
block's saved bytes and backward transient within 2.5 %, tests/test_compiled_block.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from fsdp_sim.workload import compiled_block_data as data
from fsdp_sim.workload.checkpointing import COMPILED_SAC, INDUCTOR_KERNEL
from fsdp_sim.workload.kernels import block_kernels
from fsdp_sim.workload.model import Kernel, Module, Workload
from fsdp_sim.workload.transformer import BLOCK_RECIPE, TransformerDims

REDUCTION_OPS = ("mean", "sum", "var_mean")  # a generated kernel with these reduces rows (priced by its row width)
# Mix-order reduction (pytorch/pytorch PR #165370, merged 2025-10-13, after 2.9's branch cut: torch 2.10 on;
# per norm since PR #168209): on a GPU Triton backend each norm's weight gradient (a reduction over the
# tokens) is fused into its input gradient's kernel (a reduction over hidden), which reads the same
# tensors. `MixOrderReduction.can_fuse` (torch/_inductor/scheduler.py, 2.13 wheel) takes it when
# tokens x hidden >= 5 x 2^20 elements, tokens >= 2 x hidden, tokens >= 4096 (strict mode, the default)
# and hidden <= 16 x 1024 (a persistent reduction); the CPU backend never does, so the
# table shows the weight gradients as a kernel of their own
MIX_ORDER_FROM = (2, 10)
MIX_ORDER_MIN_NUMEL = 5 * 2**20
MIX_ORDER_MIN_ROWS = 4096
MIX_ORDER_MAX_COLS = 16 * 1024


TABLE_STYLES = {"torchtitan": "torchtitan Llama", "hf_llama": "transformers Llama", "gpt": "GPT-2 style"}
HF_LLAMA = ("llama", "mistral", "qwen2")  # transformers' model types whose decoder layer is Llama's code
_FACTOR = re.compile(r"heads|KV|[THQFSD]")


def _sizes(d: TransformerDims, tok: int, s: int, p: int, symbols) -> dict[str, int]:
    """Bytes of each size symbol the table uses ("TKV_f32": tokens x kv width x 4 bytes, "QH": the wq
    weight in the activation dtype, ...)."""
    dims = {"T": tok, "H": d.hidden, "Q": d.q_dim, "KV": d.kv * d.head_dim, "F": d.ffn, "S": s, "D": d.head_dim,
            "heads": d.heads}
    out = {}
    for sym in symbols:
        base, _, dtype = sym.partition("_")
        out[sym] = math.prod(dims[f] for f in _FACTOR.findall(base)) * (4 if dtype == "f32" else p)
    return out


def _symbols(kernels) -> set[str]:
    return {size for row in kernels for _, size in row[3] + row[4]}


def table_key(d: TransformerDims, meta: dict, *, checkpoint: str = "none") -> tuple[tuple[str, str, str] | None, str]:
    """(the table describing `d`'s block, or None; why not). `meta`: the workload's (an HF config's
    model type picks transformers' code path); `checkpoint` the run's activation checkpointing."""
    source = meta.get("model_type") if meta.get("source") == "hf_config" else None
    ck = "selective_op" if checkpoint == "selective_op" else "none"
    if source is not None and source not in (*HF_LLAMA, "gpt2"):  # Gemma's norms, Phi-3's fused projections, ...
        return None, f"{source} blocks"
    if d.attention != "sdpa" or d.dropout:
        return None, "eager attention" if d.attention != "sdpa" else "dropout"
    if d.mlp == "swiglu" and d.norm == "rmsnorm" and not d.bias and not d.learned_pos:
        style = "hf_llama" if source is not None else "torchtitan"
    elif d.mlp == "gelu" and d.norm == "layernorm" and d.bias and d.learned_pos and d.kv == d.heads:
        style = "gpt"
    else:
        return None, f"{source or 'these'} blocks ({d.mlp}, {d.norm}{', biases' if d.bias else ''})"
    return (style, "mha" if d.kv == d.heads else "gqa", ck), ""


def _table(d: TransformerDims, key: tuple[str, str, str] | None):
    """The table `key` names; None: torchtitan's block without a checkpoint, `d`'s attention."""
    return data.TABLES[key or ("torchtitan", "mha" if d.kv == d.heads else "gqa", "none")]


def mix_order_fusion(d: TransformerDims, tokens: int, torch_version: tuple[int, ...]) -> bool:
    """Whether Inductor on CUDA fuses each norm's weight gradient into its input gradient's kernel."""
    return tuple(torch_version[:2]) >= MIX_ORDER_FROM and tokens * d.hidden >= MIX_ORDER_MIN_NUMEL \
        and tokens >= max(2 * d.hidden, MIX_ORDER_MIN_ROWS) and d.hidden <= MIX_ORDER_MAX_COLS


def compiled_kernels(d: TransformerDims, b: int, s: int, p: int, *, causal: bool, key: tuple[str, str, str] | None = None,
                     torch_version: tuple[int, ...] = (2, 13)) -> tuple[Kernel, ...]:
    """The block's kernels under torch.compile: the eager block's GEMMs and attention, then each kernel
    Inductor generates (`inductor_reduction` / `inductor_pointwise`) and each eager ATen kernel it
    leaves (`elementwise`: the complex RoPE multiply, the rotary table's clone), forward ones with
    forward bytes, backward ones with backward bytes. The forward's last kernel (the closing residual
    add) comes after the last saved tensor: a checkpoint's recompute stops before it. Where mix-order
    reduction fuses the norms' weight gradients into their input gradients' kernels (`mix_order_fusion`),
    their kernel of their own is gone: its reads are those kernels' reads, its writes a hidden-sized row.
    `key`: the table (`table_key`; None: torchtitan's block without a checkpoint)."""
    kernels, _, _ = _table(d, key)
    sizes = _sizes(d, b * s, s, p, _symbols(kernels))
    mix_order = mix_order_fusion(d, b * s, torch_version)
    out = [k for k in block_kernels(d, b, s, p, causal=causal) if k.kind in ("gemm", "attention")]
    last_forward = max(i for i, row in enumerate(kernels) if row[0] == "forward" and row[1] == "generated")
    for i, (graph, kind, ops, reads, writes) in enumerate(kernels):
        if kind == "view" or ops.startswith(("aten.mm", "aten.addmm", "aten._scaled_dot_product")):  # priced as eager
            continue
        if mix_order and graph == "backward" and all(size == "H" for _, size in writes) \
                and any(size == "T_f32" for _, size in reads):  # a norm's weight (and bias) gradient, not a Linear's bias
            continue
        nbytes = sum(sizes[size] for _, size in reads + writes)
        if kind == "generated":
            reduction = any(op in ops.split("+") for op in REDUCTION_OPS)
            kind_, shape = ("inductor_reduction", (b * s, d.hidden)) if reduction else ("inductor_pointwise", ())
        else:
            kind_, shape = "elementwise", ()
        fwd = graph == "forward"
        label = "+".join(op for op in ops.split("+") if not op.startswith("_scaled_dot_product"))  # origin names only
        out.append(Kernel(f"{INDUCTOR_KERNEL}{graph} {label}", kind_, shape, bytes=nbytes if fwd else 0,
                          bwd_bytes=0 if fwd else nbytes, launches=int(fwd), bwd_launches=int(not fwd),
                          recompute=fwd and i != last_forward))
    return tuple(out)


def walk_schedule(rows, graph: str, sizes: dict[str, int], start: dict[str, int], keep: set[str]) -> tuple[int, int, int]:
    """(peak, end, tensors) of the live bytes above `start`'s total over `graph`'s kernels in order
    (`tensors`: how many the graph had made and still held at its peak): each
    output allocated when its kernel runs, each buffer freed after its last reader unless kept; a view
    aliases what it reads; the forward graph's inputs (`primals_*`) are never counted. `rows` as the
    table's (a buffer as (name, size key), `sizes` the bytes of each key); the torch side plays a fresh
    extraction with it (torch_tools/inductor_block.py `Extraction.transient`)."""
    rows = [r for r in rows if r[0] == graph]
    alias: dict[str, str] = {}

    def root(name: str) -> str:
        while name in alias:
            name = alias[name]
        return name

    last: dict[str, int] = {}
    for i, (_, kind, _, reads, writes) in enumerate(rows):
        for name, _ in reads:
            last[root(name)] = i
        if kind == "view":
            for name, _ in writes:
                alias[name] = root(reads[0][0]) if reads else name
    keep = {root(name) for name in keep}
    live = dict(start)
    level = peak = begin = sum(start.values())
    tensors = 0
    for i, (_, kind, _, _, writes) in enumerate(rows):
        if kind != "view":
            for name, size in writes:
                if name not in live:
                    live[name] = sizes[size]
                    level += sizes[size]
        if level > peak:
            peak, tensors = level, sum(1 for name in live if name not in start)
        for name in [n for n, at in last.items() if at == i]:
            if name in live and name not in keep and not name.startswith("primals"):
                level -= live.pop(name)
    return peak - begin, level - begin, tensors


def compiled_activations(d: TransformerDims, b: int, s: int, p: int,
                         key: tuple[str, str, str] | None = None) -> tuple[int, int, int, int]:
    """(saved, forward transient, backward transient, tensors at the backward's peak) bytes of the
    compiled block (the backward's peak is several tensors, which the caching allocator places one
    by one: `Module.bwd_temp_parts`): the partitioner's
    saved set less views of the model's rotary table; the forward's peak above its end state (its
    output and saved set); the backward's peak above its start (saved set and output gradient), with
    its weight gradients and its input's gradient counted as Inductor allocates them. Under the
    selective policy's table the backward's peak includes what it recomputes."""
    kernels, saved, outputs = _table(d, key)
    sizes = _sizes(d, b * s, s, p, _symbols(kernels))
    size_of = {name: size for row in kernels for name, size in row[3] + row[4]}
    # `_conj` (the complex table's conjugate), cos / sin slices: views of the model's table, not the block's
    saved_bytes = sum(sizes[size_of[name]] for name in saved if not size_of[name].startswith("SD"))
    peak, end, _ = walk_schedule(kernels, "forward", sizes, {}, set(outputs["forward"]))
    start = {name: sizes[size_of[name]] for name in saved} | {"tangents_1": sizes["TH"]}
    bwd_peak, _, tensors = walk_schedule(kernels, "backward", sizes, start, set(outputs["backward"]))
    return saved_bytes, peak - end, bwd_peak, max(tensors, 1)


def compiled_note(key: tuple[str, str, str] | None, reason: str) -> str:
    """What the summary's software line says of the compiled blocks."""
    if key is not None:
        style, attn, ck = key
        return (f"Inductor's kernels and saved set read from torch 2.13 ({TABLE_STYLES[style]} block, {attn.upper()}"
                f"{', op-level selective checkpoint' if ck != 'none' else ''})")
    return (f"{reason}: not in Inductor's table, every memory-bound chain one fused kernel at hand-written speed "
            f"(an approximation)")


def compiled_workload(wl: Workload, tp: int = 1, *, checkpoint: str = "none", adapted: bool = False,
                      torch_version: tuple[int, ...] = (2, 13)) -> Workload:
    """`wl` with its dense transformer blocks as Inductor compiles them (kernels, saved bytes, transients);
    anything else (the embedding, final norm, head and loss, which torchtitan leaves eager or compiles
    apart, and blocks the table does not describe: `table_key`) as it was, the reason in
    `meta["compiled_blocks"]`. `checkpoint` (the run's activation checkpointing): `selective_op` the
    table read under torchtitan's op-level policy, its saved set the checkpoint's cache
    (checkpointing.py `compiled_op_policy`); `full` / `selective_layer` the kernels only: the
    partitioner saves the block's input and recomputes inside the compiled backward, whose peak is the
    eager block's saved bytes and backward transient within 2.5 % (tests/test_compiled_block.py), so the
    eager bytes and checkpoint plans stay. `adapted`: LoRA / QLoRA / frozen-base blocks, not read."""
    recipe = wl.meta.get(BLOCK_RECIPE)
    meta = wl.meta | {"torch_compile": True}
    if adapted or recipe is None or tp > 1 or recipe.get("norm_tokens") is not None:
        reason = ("LoRA / frozen-base blocks" if adapted else "tensor-parallel blocks" if tp > 1 or recipe
                  and recipe.get("norm_tokens") is not None else "blocks without a transformer recipe")
        return replace(wl, meta=meta | {"compiled_blocks": compiled_note(None, reason)})
    d = TransformerDims(**recipe["dims"])
    key, reason = table_key(d, wl.meta, checkpoint=checkpoint)
    if key is None:
        return replace(wl, meta=meta | {"compiled_blocks": compiled_note(None, reason)})
    b, s, p = recipe["micro_batch"], recipe["seq_len"], recipe["bytes"]
    eager = block_kernels(d, b, s, p, causal=True)
    kernels = compiled_kernels(d, b, s, p, causal=True, key=key, torch_version=torch_version)
    saved, fwd_temp, bwd_temp, parts = compiled_activations(d, b, s, p, key)
    bytes_too = checkpoint in ("none", "selective_op")
    modules: list[Module] = []
    compiled: list[str] = []
    for m in wl.modules:
        if m.is_block and m.kernels == eager:
            compiled.append(m.name)
            m = replace(m, kernels=kernels, saved_bytes=saved, fwd_temp_bytes=fwd_temp, bwd_temp_bytes=bwd_temp,
                        bwd_temp_parts=parts) if bytes_too else replace(m, kernels=kernels)
        modules.append(m)
    note = compiled_note(key, "") if compiled else compiled_note(None, "blocks whose kernels the table does not "
                                                                 "describe (mixture-of-experts, extra biases or norms)")
    extra = {COMPILED_SAC: tuple(compiled)} if key[2] == "selective_op" else {}
    return replace(wl, modules=tuple(modules), meta=meta | {"compiled_blocks": note} | extra)
