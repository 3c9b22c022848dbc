"""A transformer block under `compute.torch_compile`: the kernels Inductor generates and what it saves.

torchtitan compiles each block on its own (`apply_compile`), so FSDP2's hooks stay outside the graph
and a block is one forward and one backward graph. What Inductor makes of them is read from its own
output (`compiled_block_data.py`, from `benchmarks/inductor_block.py` on torch 2.13):
- GEMMs and SDPA stay library calls: priced as the eager block's (`block_kernels`).
- Every memory-bound chain is what Inductor fused, no more: the RMSNorm with the residual add before
  it (one reduction), SiLU x w3 (one pointwise kernel), the closing residual add, the GQA repeat of
  k and v (a copy each, forward and again in backward); the backward's norm kernels (input gradient,
  and both norms' weight gradients in one reduction). torchtitan's complex RoPE is not generated
  ("Torchinductor does not support code generation for complex operators"): the upcast and the cast
  back are generated kernels, the complex multiply stays an eager ATen kernel on fp32 data.
- The saved set is the partitioner's: k and v before the repeat, no SiLU output (recomputed from w1's
  output), wo's output in place of the residual sum (recomputed in the kernels that read it), no fp32
  RoPE intermediates. Transients are Inductor's schedule played with each buffer freed after its last
  reader (the compiled backward drops its saved inputs as it goes).

Applies to the blocks the table describes: a SwiGLU MLP, RMSNorm, SDPA, no biases, no dropout, rotary
positions, heads x head_dim = hidden, no tensor parallel, no adapters or frozen weights (those keep
the eager block's kernels and bytes: `compiled_workload` leaves them as they are).
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_sim.workload import compiled_block_data as data
from fsdp_sim.workload.kernels import block_kernels
from fsdp_sim.workload.model import Kernel, Module, Workload
from fsdp_sim.workload.transformer import BLOCK_RECIPE, TransformerDims

REDUCTION_OPS = ("mean", "sum")  # a generated kernel with these reduces rows (priced by its row width)
# Mix-order reduction (pytorch/pytorch PR #165370, merged 2025-10-13, after 2.9's branch cut: torch 2.10 on;
# per norm since PR #168209): on a GPU Triton backend each norm's weight gradient (a reduction over the
# tokens) is fused into its input gradient's kernel (a reduction over hidden), which reads the same
# tensors. `MixOrderReduction.can_fuse` (torch/_inductor/scheduler.py, 2.13 wheel) takes it when
# tokens x hidden >= 5 x 2^20 elements and tokens >= 2 x hidden; the CPU backend never does, so the
# table shows the weight gradients as a kernel of their own
MIX_ORDER_FROM = (2, 10)
MIX_ORDER_MIN_NUMEL = 5 * 2**20


def _sizes(d: TransformerDims, tok: int, s: int, p: int) -> dict[str, int]:
    h, kv, f = d.hidden, d.kv * d.head_dim, d.ffn
    return {"TH": tok * h * p, "TKV": tok * kv * p, "TF": tok * f * p, "T_f32": tok * 4, "Theads_f32": tok * d.heads * 4,
            "TH_f32": tok * h * 4, "TKV_f32": tok * kv * 4, "H": h * p, "HH": h * h * p, "KVH": kv * h * p, "FH": f * h * p,
            "SD2_c64": s * d.head_dim // 2 * 8}  # the complex rotary table (the model's; the backward clones it)


def _table(d: TransformerDims):
    return (data.KERNELS_MHA, data.SAVED_MHA, data.OUTPUTS_MHA) if d.kv == d.heads else \
        (data.KERNELS_GQA, data.SAVED_GQA, data.OUTPUTS_GQA)


def applies(d: TransformerDims, tp: int = 1) -> bool:
    """Whether `d`'s block is the one the table was read from."""
    return (d.mlp == "swiglu" and d.norm == "rmsnorm" and d.attention == "sdpa" and not d.bias and not d.dropout
            and not d.learned_pos and d.q_dim == d.hidden and tp == 1)


def mix_order_fusion(d: TransformerDims, tokens: int, torch_version: tuple[int, ...]) -> bool:
    """Whether Inductor on CUDA fuses each norm's weight gradient into its input gradient's kernel."""
    return tuple(torch_version[:2]) >= MIX_ORDER_FROM and tokens * d.hidden >= MIX_ORDER_MIN_NUMEL \
        and tokens >= 2 * d.hidden


def compiled_kernels(d: TransformerDims, b: int, s: int, p: int, *, causal: bool,
                     torch_version: tuple[int, ...] = (2, 13)) -> tuple[Kernel, ...]:
    """The block's kernels under torch.compile: the eager block's GEMMs and attention, then each kernel
    Inductor generates (`inductor_reduction` / `inductor_pointwise`) and each eager ATen kernel it
    leaves (`elementwise`: the complex RoPE multiply, the rotary table's clone), forward ones with
    forward bytes, backward ones with backward bytes. The forward's last kernel (the closing residual
    add) comes after the last saved tensor: a checkpoint's recompute stops before it. Where mix-order
    reduction fuses the norms' weight gradients into their input gradients' kernels (`mix_order_fusion`),
    their kernel of their own is gone: its reads are those kernels' reads, its writes a hidden-sized row."""
    sizes = _sizes(d, b * s, s, p)
    mix_order = mix_order_fusion(d, b * s, torch_version)
    kernels, _, _ = _table(d)
    out = [k for k in block_kernels(d, b, s, p, causal=causal) if k.kind in ("gemm", "attention")]
    last_forward = max(i for i, row in enumerate(kernels) if row[0] == "forward" and row[1] == "generated")
    for i, (graph, kind, ops, reads, writes) in enumerate(kernels):
        if kind == "view" or ops.startswith(("aten.mm", "aten._scaled_dot_product")):
            continue
        if mix_order and graph == "backward" and all(size == "H" for _, size in writes):
            continue
        nbytes = sum(sizes[size] for _, size in reads + writes)
        if kind == "generated":
            reduction = any(op in ops.split("+") for op in REDUCTION_OPS)
            kind_, shape = ("inductor_reduction", (b * s, d.hidden)) if reduction else ("inductor_pointwise", ())
        else:
            kind_, shape = "elementwise", ()
        fwd = graph == "forward"
        label = "+".join(op for op in ops.split("+") if not op.startswith("_scaled_dot_product"))  # origin names only
        out.append(Kernel(f"inductor {graph} {label}", kind_, shape, bytes=nbytes if fwd else 0,
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


def compiled_activations(d: TransformerDims, b: int, s: int, p: int) -> tuple[int, int, int, int]:
    """(saved, forward transient, backward transient, tensors at the backward's peak) bytes of the
    compiled block (the backward's peak is several tensors, which the caching allocator places one
    by one: `Module.bwd_temp_parts`): the partitioner's
    saved set less the view of the model's rotary table; the forward's peak above its end state (its
    output and saved set); the backward's peak above its start (saved set and output gradient), with
    its weight gradients and its input's gradient counted as Inductor allocates them."""
    sizes = _sizes(d, b * s, s, p)
    kernels, saved, outputs = _table(d)
    size_of = {name: size for row in kernels for name, size in row[3] + row[4]}
    # `_conj` (the rotary table's conjugate) is a view of the model's table: not the block's bytes
    saved_bytes = sum(sizes[size_of[name]] for name in saved if size_of[name] != "SD2_c64")
    peak, end, _ = walk_schedule(kernels, "forward", sizes, {}, set(outputs["forward"]))
    start = {name: sizes[size_of[name]] for name in saved} | {"tangents_1": sizes["TH"]}
    bwd_peak, _, tensors = walk_schedule(kernels, "backward", sizes, start, set(outputs["backward"]))
    return saved_bytes, peak - end, bwd_peak, max(tensors, 1)


def compiled_workload(wl: Workload, tp: int = 1, *, checkpointed: bool = False,
                      torch_version: tuple[int, ...] = (2, 13)) -> Workload:
    """`wl` with its dense transformer blocks as Inductor compiles them (kernels, saved bytes, transients);
    anything else (the embedding, final norm, head and loss, which torchtitan leaves eager or compiles
    apart, and blocks the table does not describe) as it was. `checkpointed` (activation checkpointing
    on): the kernels only. Under a checkpoint the partitioner saves what the checkpoint's policy tags
    (the block's input; a selective policy's MUST_SAVE outputs) and recomputes inside the compiled
    backward, which the table, read from a block without one, does not show: the eager block's bytes
    and the checkpoint plans (checkpointing.py) stay. With torchtitan's full checkpoint the compiled
    backward's peak is the eager block's saved bytes and backward transient within 2 %, the table's
    10 % short (tests/test_compiled_block.py, compiled on torch 2.13); a selective policy's was not read."""
    recipe = wl.meta.get(BLOCK_RECIPE)
    if recipe is None:
        return wl
    d = TransformerDims(**recipe["dims"])
    if not applies(d, tp) or recipe.get("norm_tokens") is not None:
        return wl
    b, s, p = recipe["micro_batch"], recipe["seq_len"], recipe["bytes"]
    eager = block_kernels(d, b, s, p, causal=True)
    kernels = compiled_kernels(d, b, s, p, causal=True, torch_version=torch_version)
    saved, fwd_temp, bwd_temp, parts = compiled_activations(d, b, s, p)
    modules: list[Module] = []
    for m in wl.modules:
        if m.is_block and m.kernels == eager:
            m = replace(m, kernels=kernels) if checkpointed else \
                replace(m, kernels=kernels, saved_bytes=saved, fwd_temp_bytes=fwd_temp, bwd_temp_bytes=bwd_temp,
                        bwd_temp_parts=parts)
        modules.append(m)
    return replace(wl, modules=tuple(modules), meta=wl.meta | {"torch_compile": True})
