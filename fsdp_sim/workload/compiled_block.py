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
- peft's LoRA on q / k / v / o with dropout around a frozen base (`LORA_TABLES`, read at rank 8 for the
  two Llama codes; `lora_table_rank` says where it applies): one graph; each target's dropout mask an
  Inductor random kernel (a bool tensor), the three masks of the norm's output applied and the dropped
  copies written by the norm's own kernel; each adapter's scale and add fused into the kernel after it
  (the RoPE upcast, the residual add); saved: the masks, the dropped inputs, lora_A's outputs, no input
  only a frozen Linear reads. The GEMMs are the adapted block's own (no weight gradient for the frozen
  base, `frozen.py`). Under the full checkpoint the blocks keep `lora.py`'s eager bytes, as the dense
  blocks do, but there the compiled backward's peak is 10-14 % above them (the dense block's within
  2.5 %; tests/test_compiled_block.py): an underestimate, not a read table.
  The first block is left as it was: the embedding is frozen, so its input needs no gradient and
  Dynamo compiles it as a graph of its own, not read.

Not read, so priced as before (every memory-bound chain one fused kernel at hand-written speed, the eager
block's saved bytes: an approximation, named in the summary's software line, `compiled_note`):
QLoRA (its dequantize stays a bitsandbytes kernel, not one Inductor generates), LoRA on other targets,
without dropout, on a base stored in another dtype, under the op-level selective checkpoint, or outside
FSDP2 (FSDP1's `use_orig_params` and a plain run's autocast casts re-derive the adapted blocks), blocks
with only `model.frozen`, tensor-parallel blocks (the table has no DTensor redistributions; torchtitan
compiles each block after `parallelize_module` with `fullgraph=True`, and Dynamo traces the DTensor hooks and redistributions into the graph,
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
from fsdp_sim.workload.frozen import LORA_A, LORA_B, LORA_DROPOUT, LORA_SCALE_ADD
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
_FACTOR = re.compile(r"heads|KV|[THQFSDR]")
_FIXED = re.compile(r"C(\d+)")  # a size that is no product of the block's: n bytes (the RNG seeds)
DTYPE_BYTES = {"f32": 4, "bool": 1}  # a symbol's `_<dtype>`; none: the activation dtype
# the LoRA table's targets (peft's q_proj, k_proj, v_proj, o_proj) in the workload's names
LORA_TARGETS = frozenset({"wq", "wk", "wv", "wo"})
ADAPTER_KERNELS = (LORA_DROPOUT, LORA_A, LORA_B, LORA_SCALE_ADD)  # the eager adapter's kernels (lora.py)


def _sizes(d: TransformerDims, tok: int, s: int, p: int, symbols, rank: int = 0) -> dict[str, int]:
    """Bytes of each size symbol the table uses ("TKV_f32": tokens x kv width x 4 bytes, "QH": the wq
    weight in the activation dtype, "TH_bool" a dropout mask, "RH" a LoRA A weight, "C32" 32 bytes, ...)."""
    dims = {"T": tok, "H": d.hidden, "Q": d.q_dim, "KV": d.kv * d.head_dim, "F": d.ffn, "S": s, "D": d.head_dim,
            "heads": d.heads, "R": rank}
    out = {}
    for sym in symbols:
        base, _, dtype = sym.partition("_")
        fixed = _FIXED.fullmatch(base)
        out[sym] = int(fixed[1]) if fixed else \
            math.prod(dims[f] for f in _FACTOR.findall(base)) * DTYPE_BYTES.get(dtype, p)
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


def _table(d: TransformerDims, key: tuple[str, str, str] | None, lora: bool = False):
    """The table `key` names (`lora`: the block with peft's adapters on q / k / v / o); None: torchtitan's
    block without a checkpoint, `d`'s attention."""
    return (data.LORA_TABLES if lora else data.TABLES)[key or ("torchtitan", "mha" if d.kv == d.heads else "gqa", "none")]


def mix_order_fusion(d: TransformerDims, tokens: int, torch_version: tuple[int, ...]) -> bool:
    """Whether Inductor on CUDA fuses each norm's weight gradient into its input gradient's kernel."""
    return tuple(torch_version[:2]) >= MIX_ORDER_FROM and tokens * d.hidden >= MIX_ORDER_MIN_NUMEL \
        and tokens >= max(2 * d.hidden, MIX_ORDER_MIN_ROWS) and d.hidden <= MIX_ORDER_MAX_COLS


def compiled_kernels(d: TransformerDims, b: int, s: int, p: int, *, causal: bool, key: tuple[str, str, str] | None = None,
                     torch_version: tuple[int, ...] = (2, 13), lora_rank: int = 0,
                     library: tuple[Kernel, ...] | None = None) -> tuple[Kernel, ...]:
    """The block's kernels under torch.compile: the eager block's GEMMs and attention, then each kernel
    Inductor generates (`inductor_reduction` / `inductor_pointwise`) and each eager ATen kernel it
    leaves (`elementwise`: the complex RoPE multiply, the rotary table's clone), forward ones with
    forward bytes, backward ones with backward bytes. The forward's last kernel (the closing residual
    add) comes after the last saved tensor: a checkpoint's recompute stops before it. Where mix-order
    reduction fuses the norms' weight gradients into their input gradients' kernels (`mix_order_fusion`),
    their kernel of their own is gone: its reads are those kernels' reads, its writes a hidden-sized row.
    `key`: the table (`table_key`; None: torchtitan's block without a checkpoint). `lora_rank` > 0: the
    LoRA table at that rank, `library` the adapted block's own GEMMs and attention (a frozen base runs no
    weight gradient: `frozen.py`) in place of the eager block's."""
    kernels, _, _ = _table(d, key, lora=lora_rank > 0)
    sizes = _sizes(d, b * s, s, p, _symbols(kernels), lora_rank)
    mix_order = mix_order_fusion(d, b * s, torch_version)
    out = [k for k in (library or block_kernels(d, b, s, p, causal=causal)) if k.kind in ("gemm", "attention")]
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


def compiled_activations(d: TransformerDims, b: int, s: int, p: int, key: tuple[str, str, str] | None = None,
                         lora_rank: int = 0) -> tuple[int, int, int, int]:
    """(saved, forward transient, backward transient, tensors at the backward's peak) bytes of the
    compiled block (the backward's peak is several tensors, which the caching allocator places one
    by one: `Module.bwd_temp_parts`): the partitioner's
    saved set less views of the model's rotary table; the forward's peak above its end state (its
    output and saved set); the backward's peak above its start (saved set and output gradient), with
    its weight gradients and its input's gradient counted as Inductor allocates them. Under the
    selective policy's table the backward's peak includes what it recomputes. `lora_rank` > 0: the LoRA
    table at that rank."""
    kernels, saved, outputs = _table(d, key, lora=lora_rank > 0)
    sizes = _sizes(d, b * s, s, p, _symbols(kernels), lora_rank)
    size_of = {name: size for row in kernels for name, size in row[3] + row[4]}
    # `_conj` (the complex table's conjugate), cos / sin slices: views of the model's table, not the block's
    saved_bytes = sum(sizes[size_of[name]] for name in saved if not size_of[name].startswith("SD"))
    peak, end, _ = walk_schedule(kernels, "forward", sizes, {}, set(outputs["forward"]))
    start = {name: sizes[size_of[name]] for name in saved} | {"tangents_1": sizes["TH"]}
    bwd_peak, _, tensors = walk_schedule(kernels, "backward", sizes, start, set(outputs["backward"]))
    return saved_bytes, peak - end, bwd_peak, max(tensors, 1)


def compiled_note(key: tuple[str, str, str] | None, reason: str, lora: str = "") -> str:
    """What the summary's software line says of the compiled blocks; `lora`: how the LoRA table applies
    ("" none, "table", "kernels": under a checkpoint, with the eager bytes)."""
    if key is not None:
        style, attn, ck = key
        adapters = ", peft LoRA on q / k / v / o; the first block, whose input needs no gradient, as before" \
            if lora else ""
        adapters += "; under the checkpoint LoRA's eager bytes (an approximation)" if lora == "kernels" else ""
        return (f"Inductor's kernels and saved set read from torch 2.13 ({TABLE_STYLES[style]} block, {attn.upper()}"
                f"{', op-level selective checkpoint' if ck != 'none' else ''}{adapters})")
    return (f"{reason}: not in Inductor's table, every memory-bound chain one fused kernel at hand-written speed "
            f"(an approximation)")


def lora_table_rank(wl: Workload, checkpoint: str, fsdp2: bool) -> tuple[int, str]:
    """(the rank at which the LoRA table describes `wl`'s adapted blocks, or 0; why not). The table was
    read with peft's LoRA on q / k / v / o, dropout > 0 (a random kernel per target: without dropout the
    graph differs), every other parameter frozen in the activation dtype, no checkpoint; under FSDP2 only:
    FSDP1's `use_orig_params` and a plain run's autocast casts re-derive the blocks from the unfrozen ones
    (`lora.autograd_view`, `lora.peft_input_casts`), which the table does not describe."""
    from fsdp_sim.workload.lora import LORA_CONFIG, PEFT_NAMES

    cfg = wl.meta.get(LORA_CONFIG)
    if cfg is None:
        return 0, "frozen-base blocks"
    targets = {PEFT_NAMES.get(t, t) for t in cfg.targets}
    why = ("QLoRA blocks (bitsandbytes' dequantize is a library kernel)" if cfg.quantize else
           f"LoRA on {', '.join(sorted(targets))} (the table's is on q / k / v / o)" if targets != LORA_TARGETS else
           "LoRA without dropout" if not cfg.dropout else
           f"LoRA on a {cfg.base_dtype} base" if cfg.base_dtype != wl.activation_dtype else
           "LoRA blocks under the op-level selective checkpoint" if checkpoint == "selective_op" else
           "LoRA blocks outside FSDP2" if not fsdp2 else
           "LoRA blocks with more frozen or trained" if any(q.trainable != (".lora_" in q.name) for q in wl.params)
           else "")
    return (0, why) if why else (cfg.rank, "")


def _base_kernel_names(m: Module) -> list[str]:
    return [k.name for k in m.kernels if not k.name.endswith(ADAPTER_KERNELS)]


def compiled_workload(wl: Workload, tp: int = 1, *, checkpoint: str = "none", adapted: bool = False,
                      torch_version: tuple[int, ...] = (2, 13), fsdp2: bool = True) -> Workload:
    """`wl` with its dense transformer blocks as Inductor compiles them (kernels, saved bytes, transients);
    anything else (the embedding, final norm, head and loss, which torchtitan leaves eager or compiles
    apart, and blocks the table does not describe: `table_key`) as it was, the reason in
    `meta["compiled_blocks"]`. `checkpoint` (the run's activation checkpointing): `selective_op` the
    table read under torchtitan's op-level policy, its saved set the checkpoint's cache
    (checkpointing.py `compiled_op_policy`); `full` / `selective_layer` the kernels only: the
    partitioner saves the block's input and recomputes inside the compiled backward, whose peak is the
    eager block's saved bytes and backward transient within 2.5 % (tests/test_compiled_block.py), so the
    eager bytes and checkpoint plans stay. `adapted`: LoRA / QLoRA / frozen-base blocks: the LoRA table
    where it describes them (`lora_table_rank`; the adapted block's own GEMMs, as `frozen.py` runs
    them), but for the first block: under LoRA the embedding is frozen, so that block's input needs no
    gradient, and Dynamo, which guards on `requires_grad`, compiles it as another graph, not read. Under
    `full` / `selective_layer` the LoRA blocks keep the eager bytes too, 10-14 % below the compiled
    backward's peak (tests/test_compiled_block.py): named an approximation in the note."""
    recipe = wl.meta.get(BLOCK_RECIPE)
    meta = wl.meta | {"torch_compile": True}
    rank, why = lora_table_rank(wl, checkpoint, fsdp2) if adapted else (0, "")
    if (adapted and not rank) or recipe is None or tp > 1 or recipe.get("norm_tokens") is not None:
        reason = (why if adapted else "tensor-parallel blocks" if tp > 1 or recipe
                  and recipe.get("norm_tokens") is not None else "blocks without a transformer recipe")
        return replace(wl, meta=meta | {"compiled_blocks": compiled_note(None, reason)})
    d = TransformerDims(**recipe["dims"])
    key, reason = table_key(d, wl.meta, checkpoint=checkpoint)
    if rank and key is not None and key not in data.LORA_TABLES:  # read for the Llama codes only
        key, reason = None, f"LoRA on {TABLE_STYLES[key[0]]} blocks"
    if key is None:
        return replace(wl, meta=meta | {"compiled_blocks": compiled_note(None, reason)})
    b, s, p = recipe["micro_batch"], recipe["seq_len"], recipe["bytes"]
    eager = block_kernels(d, b, s, p, causal=True)
    saved, fwd_temp, bwd_temp, parts = compiled_activations(d, b, s, p, key, lora_rank=rank)
    bytes_too = checkpoint in ("none", "selective_op")
    modules: list[Module] = []
    compiled: list[str] = []
    made: dict[tuple[Kernel, ...], tuple[Kernel, ...]] = {}
    first = True  # the first block: under LoRA a graph of its own (its input needs no gradient)
    for m in wl.modules:
        if m.is_block and (_base_kernel_names(m) == [k.name for k in eager] and not (rank and first)
                           if rank else m.kernels == eager):
            compiled.append(m.name)
            if m.kernels not in made:  # every block alike: worked out once
                made[m.kernels] = compiled_kernels(d, b, s, p, causal=True, key=key, torch_version=torch_version,
                                                   lora_rank=rank, library=m.kernels if rank else None)
            kernels = made[m.kernels]
            m = replace(m, kernels=kernels, saved_bytes=saved, fwd_temp_bytes=fwd_temp, bwd_temp_bytes=bwd_temp,
                        bwd_temp_parts=parts) if bytes_too else replace(m, kernels=kernels)
        first = first and not m.is_block
        modules.append(m)
    note = compiled_note(key, "", ("table" if bytes_too else "kernels") if rank else "") if compiled else compiled_note(
        None, "blocks whose kernels the table does not describe (mixture-of-experts, extra biases or norms)")
    extra = {COMPILED_SAC: tuple(compiled)} if key[2] == "selective_op" else {}
    return replace(wl, modules=tuple(modules), meta=meta | {"compiled_blocks": note} | extra)
