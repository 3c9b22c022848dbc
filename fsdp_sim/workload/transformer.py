"""Build the workload of a decoder transformer from its dimensions.

The byte counts come from listing, op by op, the tensors autograd saves in a pre-norm block
(torchtitan / GPT-2 layout), not from a fitted constant. Two attention kernels are modelled:
- `sdpa` (flash / memory-efficient SDPA, what PyTorch uses by default): saves q, k, v, the output and
  the fp32 logsumexp; no (s x s) scores. Grouped-query k/v are expanded to all heads first
  (`repeat_interleave`, as torchtitan and Hugging Face do), and the expanded copies are what is saved.
- `eager` (explicit scores, softmax, dropout): the layout of Korthikanti et al. (2022), whose per-layer
  total sbh(34 + 5as/h) the tests use as an oracle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.workload.kernels import block_kernels, embedding_kernels, gemm, loss_kernels, norm
from fsdp_sim.workload.model import Module, Param, Workload

NORM_STAT_TENSORS = {"rmsnorm": 1, "layernorm": 2}  # fp32 per-row statistics saved: rstd (+ mean)
# Workload.meta's key for what the dense blocks' bytes were built from (`block_recipe`), as plain data so
# that a saved workload keeps it
BLOCK_RECIPE = "block_activations"
# Stated limits, far past any published model, checked before anything is built (a typo such as
# layers: 2147483648 would otherwise build for hours): layers, widths, heads, vocabulary, positions.
MAX_LAYERS, MAX_WIDTH, MAX_HEADS, MAX_VOCAB, MAX_SEQ = 4096, 1 << 20, 1 << 16, 1 << 24, 1 << 24
DIM_LIMITS = {"layers": MAX_LAYERS, "hidden": MAX_WIDTH, "ffn_hidden": MAX_WIDTH, "head_dim": MAX_WIDTH,
              "heads": MAX_HEADS, "kv_heads": MAX_HEADS, "vocab": MAX_VOCAB, "max_seq": MAX_SEQ}


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformerDims:
    """Dimensions of a decoder-only transformer, in the names model cards use."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab: int
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    bias: bool = False
    tie_embeddings: bool = False
    learned_pos: bool = False
    max_seq: int = 0
    attention: str = "sdpa"
    dropout: bool = False
    norm_impl: str = "fused"
    head_dim: int | None = None  # per-head size; None means hidden // heads (Gemma sets its own)

    def __post_init__(self) -> None:
        for key, limit in DIM_LIMITS.items():
            value = getattr(self, key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):  # a float would make float byte counts
                raise ScenarioError(f"model.{key}: expected an integer, got {show(value)}")
            if value > limit:
                raise ScenarioError(f"model.{key}: {value:,} is past the limit of {limit:,}")
        for key in ("hidden", "layers", "heads", "vocab"):
            if getattr(self, key) <= 0:
                raise ScenarioError(f"model.{key}: must be a positive integer, got {getattr(self, key)}")
        if self.max_seq < 0:
            raise ScenarioError(f"model.max_seq: must be zero or more, got {self.max_seq}")
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ScenarioError(f"model.heads: {self.heads} does not divide model.hidden {self.hidden}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        elif self.head_dim <= 0:
            raise ScenarioError(f"model.head_dim: must be a positive integer, got {self.head_dim}")
        if self.kv_heads is not None and (self.kv_heads <= 0 or self.heads % self.kv_heads):
            raise ScenarioError(f"model.kv_heads: {self.kv_heads} must be positive and divide model.heads {self.heads}")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise ScenarioError(f"model.ffn_hidden: must be a positive integer, got {self.ffn_hidden}")
        choices = {"mlp": ("gelu", "swiglu"), "norm": ("rmsnorm", "layernorm"), "attention": ("sdpa", "eager"),
                   "norm_impl": ("fused", "composite", "hf_llama")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ScenarioError(f"model.{key}: {getattr(self, key)!r} is not one of {list(allowed)}")

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def norm_kernel(self) -> str:
        """The norms' kernel: LayerNorm's is always the fused one, RMSNorm's `norm_impl`."""
        return "fused" if self.norm == "layernorm" else self.norm_impl

    @property
    def q_dim(self) -> int:
        """Width of the attention's query/output projection: heads x head_dim (= hidden unless head_dim is set)."""
        return self.heads * self.head_dim


def _linear(name: str, fan_in: int, fan_out: int, bias: bool) -> list[Param]:
    params = [Param(f"{name}.weight", (fan_out, fan_in))]
    if bias:
        params.append(Param(f"{name}.bias", (fan_out,)))
    return params


def _norm(name: str, d: TransformerDims) -> list[Param]:
    params = [Param(f"{name}.weight", (d.hidden,))]
    if d.norm == "layernorm":
        params.append(Param(f"{name}.bias", (d.hidden,)))
    return params


def block_params(d: TransformerDims, prefix: str, ffn: list[Param] | None = None) -> list[Param]:
    """A block's parameters in the order its module registers them (torchtitan's TransformerBlock:
    attention, feed_forward, attention_norm, ffn_norm; HF's decoder layers likewise end on their two norms),
    `ffn` in place of the dense MLP's. The order is the FSDP unit's: its last parameter's gradient is the
    one foreach_reduce keeps to its end (schedule/fsdp2_reduce.py)."""
    h, qd, kvd = d.hidden, d.q_dim, d.kv * d.head_dim
    params = []
    for proj, out in (("wq", qd), ("wk", kvd), ("wv", kvd)):
        params += _linear(f"{prefix}.attention.{proj}", h, out, d.bias)
    params += _linear(f"{prefix}.attention.wo", qd, h, d.bias)
    if ffn is None:
        ff = f"{prefix}.feed_forward"
        if d.mlp == "swiglu":
            ffn = _linear(f"{ff}.w1", h, d.ffn, d.bias) + _linear(f"{ff}.w3", h, d.ffn, d.bias)
        else:
            ffn = _linear(f"{ff}.w1", h, d.ffn, d.bias)
        ffn += _linear(f"{ff}.w2", d.ffn, h, d.bias)
    return params + ffn + _norm(f"{prefix}.attention_norm", d) + _norm(f"{prefix}.ffn_norm", d)


@dataclass(frozen=True, slots=True)
class NormSaves:
    """What one normalization layer keeps for backward: its input or not, and its own extra bytes."""

    keeps_input: bool
    extra: int


def norm_saves(d: TransformerDims, tok: int, p: int) -> NormSaves:
    """Saved tensors of one norm over `tok` rows of `hidden`, by kernel.

    - LayerNorm (`native_layer_norm`) and fused RMSNorm (`nn.RMSNorm` on CUDA, `_fused_rms_norm`) keep
      their input and fp32 per-row statistics (mean and rstd, or rstd).
    - Composite RMSNorm (`nn.RMSNorm` on the CPU; Gemma's RMSNorm) upcasts and applies the weight in
      fp32: it keeps the fp32 input (a new copy when the input is 16-bit, the input itself when it is
      fp32), the fp32 normalized x * rstd for the weight gradient, and rstd.
    - `hf_llama` (Hugging Face's `LlamaRMSNorm` and its copies in Mistral, Qwen2, Phi-3, Mixtral)
      upcasts too but casts back before the weight: `weight * (x32 * rstd).to(dtype)` keeps the fp32
      input, rstd and the normalized x in the activation dtype.
    """
    if d.norm == "layernorm" or d.norm_impl == "fused":
        return NormSaves(True, NORM_STAT_TENSORS[d.norm] * tok * 4)
    fp32_copy = tok * d.hidden * 4 if p != 4 else 0
    return NormSaves(p == 4, fp32_copy + weight_only_saves(d.norm_impl, tok, d.hidden, p) + tok * 4)


@dataclass(frozen=True, slots=True)
class NormTransients:
    """What one normalization layer allocates and drops: `fwd`, its forward's transient peak; `bwd`, what
    its backward holds at its peak beyond its input gradient and its weight's gradient."""

    fwd: int
    bwd: int


def norm_transients(d: TransformerDims, tok: int, p: int) -> NormTransients:
    """A norm's transients over `tok` rows of `hidden`, as `trace_module` measures them on torch 2.13
    (tests/test_norm_kernels.py holds each to autograd): the fused kernels (LayerNorm, fused RMSNorm)
    allocate none beyond their outputs; the upcasting ones (composite, `hf_llama`) hold an fp32
    (tokens, hidden) tensor in forward when the input is 16-bit (`hf_llama` one fp32 value a row more), and
    in backward two fp32 (tokens, hidden) tensors, three for a 16-bit input (the upcast gradient), `hf_llama`
    one (tokens, hidden) tensor in the activation dtype more, less the rstd they release first."""
    if d.norm == "layernorm" or d.norm_impl == "fused":
        return NormTransients(0, 0)
    rows = tok * 4 if d.norm_impl == "hf_llama" else 0
    upcast = p != 4
    fwd = (tok * d.hidden * 4 if upcast else 0) + rows
    bwd = (2 + upcast) * tok * d.hidden * 4 + (tok * d.hidden * p if d.norm_impl == "hf_llama" and upcast else 0) - tok * 4
    return NormTransients(fwd, bwd)


def weight_only_saves(impl: str, tok: int, hidden: int, p: int) -> int:
    """What an unfused RMSNorm keeps only for its weight's gradient, `normalized * weight`'s normalized x
    (fp32 in the composite kernel, the activation dtype in Hugging Face's); a fused kernel, nothing."""
    return tok * hidden * {"composite": 4, "hf_llama": p}.get(impl, 0)


def norm_backward_moment(d: TransformerDims, tok: int, p: int, *, frozen: bool = False) -> int:
    """A norm module's backward peak above the level it began at: its transients, its input gradient and
    its parameters' gradients. With its parameters `frozen`, none of those, while the peak above the
    level stays where it was for the normalized x the norm no longer keeps: the backward still makes a
    tensor of its size (trace_module on torch 2.13: +4 (tokens, hidden) fp32 bytes less the weight's
    gradient for the composite kernel; tests/test_norm_kernels.py)."""
    weights = weight_only_saves(d.norm_kernel, tok, d.hidden, p) if frozen else sum(q.numel for q in _norm("", d)) * p
    return norm_transients(d, tok, p).bwd + tok * d.hidden * p + weights


@dataclass(frozen=True, slots=True)
class BlockActivations:
    """Bytes one block keeps for backward (excluding its input and output), its transient peaks, and
    whether it keeps its input (the previous block's output) alive until its backward."""

    saved: int
    fwd_temp: int
    bwd_temp: int
    saves_input: bool
    bwd_tail: int = 0  # attention_norm's moment above the block's end state (Module.bwd_tail_bytes)
    nosave_peak: int = 0  # the forward's peak when autograd saves nothing (Module.nosave_fwd_peak_bytes)


def block_activations(d: TransformerDims, b: int, s: int, p: int, norm_tokens: int | None = None, *,
                      frozen: frozenset[str] = frozenset(), unkept: frozenset[str] = frozenset(),
                      adapters: frozenset[str] = frozenset(), adapter_input: tuple[int, bool] = (0, False)) -> BlockActivations:
    """Op-by-op list of what a pre-norm block saves; `p` is the activation dtype's size in bytes.
    `norm_tokens`: the rows the norms run on when not all of them (a sequence-parallel rank's 1/k).
    `frozen`: the Linears (wq .. w2) and norms (ffn_norm) whose weights get no gradient, `unkept` the Linears whose input no one
    keeps (`frozen.py` works both out and drops those inputs from `saved`): they move the backward's
    moments (no weight gradient held there; an input never saved is not released there). `adapters`: the
    Linears with a LoRA adapter beside them (`lora.py`), which move the forward's peak without saves;
    `adapter_input`: the bytes per element of peft's copy of an adapter's input and whether a dropout
    follows it (`lora.peft_input_casts`; 0: no copy)."""
    tok = b * s
    norm_tok = tok if norm_tokens is None else norm_tokens
    h, f, a = d.hidden, d.ffn, d.heads
    norm = norm_saves(d, tok, p)
    bsh = tok * h * p
    bsq = tok * d.q_dim * p  # q, (expanded) k, v and the attention output: bsh unless head_dim is set
    mask_h = tok * h if d.dropout else 0  # dropout masks are bool: one byte per element
    dropout_out_h = bsh if d.dropout else 0
    # attention
    saved = norm.extra + bsh  # attention_norm's own saves; its output, saved by wq/wk/wv
    if d.attention == "sdpa":
        saved += 3 * bsq  # q and (expanded) k, v saved by SDPA
        # SDPA's output (stored (b, s, heads, head_dim), so the reshape into wo is a view that wo
        # saves too) and its fp32 logsumexp
        saved += bsq + b * a * s * 4
        scores = 0
    else:
        scores = b * a * s * s * p
        saved += 2 * bsq  # q, k saved by q @ k^T
        saved += scores  # softmax output, saved by softmax (and by attn @ v when no dropout)
        if d.dropout:
            saved += b * a * s * s + scores  # dropout mask and output (saved by attn @ v)
        saved += bsq  # v, saved by attn @ v
        saved += bsq  # attn @ v is (b, heads, s, head_dim): the (b, s, .) copy wo saves
    saved += mask_h  # attention-output dropout mask
    saved += (bsh if norm.keeps_input else 0) + norm.extra  # residual h = x + attn (kept by ffn_norm), ffn_norm's own
    saved += bsh  # ffn_norm output, saved by w1 (and w3)
    bsf = tok * f * p
    if d.mlp == "swiglu":
        saved += 4 * bsf  # w1 out (silu), silu out and w3 out (mul), product (w2)
    else:
        saved += 2 * bsf  # w1 out (gelu), gelu out (w2)
    saved += mask_h  # MLP-output dropout mask
    # transients: the largest tensor created and dropped inside the block's forward
    kv_before_expand = 2 * tok * d.kv * d.head_dim * p if d.kv != d.heads else 0
    fwd_temp = max(scores, kv_before_expand, bsh + dropout_out_h, norm_transients(d, norm_tok, p).fwd)
    # backward: the MLP's moment is at the activation's backward, after w2's: w2's weight (and bias)
    # gradient, the product's gradient and the gradients of the activation's inputs exist, while w2's saved
    # input (the product / gelu output) is already released: +1 (gelu) or +2 (swiglu) ffn-sized tensors
    product_saved = "w2" not in unkept  # w2's input (the product / gelu output): saved by w2 unless unkept
    mlp = (2 * bsf if d.mlp == "swiglu" else bsf) + (0 if product_saved else bsf)
    mlp += (h * f + (h if d.bias else 0)) * p if "w2" not in frozen else 0
    # ffn_norm's backward, after the MLP's: the gradient of its output, its own moment (transients, input and
    # weight gradients) and the MLP's weight gradients, the MLP's saved tensors and the norm's output (saved
    # by w1) released; an upcasting norm's fp32 tensors make it the block's peak where the MLP is narrow (a
    # tensor-parallel rank's). attention_norm's, last, comes once every weight gradient exists and every
    # saved tensor but its own is released: above the block's end state by its output's gradient, its
    # backward transients and what it saved (`bwd_tail`); the peak with a few hundred tokens, where the
    # weight gradients outweigh the activations
    mlp_linears = sum(q.numel for q in block_params(d, "") if q.name.startswith(".feed_forward.")
                      and q.name.split(".")[2] not in frozen) * p
    mlp_saved = ((4 if d.mlp == "swiglu" else 2) - (0 if product_saved else 1)) * bsf + mask_h
    norm_out_saved = bsh if "w1" not in unkept else 0  # ffn_norm's output, saved by w1 and w3
    ffn_norm = norm_tok * h * p + norm_backward_moment(d, norm_tok, p, frozen="ffn_norm" in frozen) + mlp_linears \
        - mlp_saved - norm_out_saved
    # SDPA's backward: the gradients of q, k, v and its output (and of the scores) beside every weight
    # gradient the MLP, ffn_norm and wo have made and the residual's gradient, the MLP's and ffn_norm's saved
    # tensors released
    ffn_saves = norm_saves(d, norm_tok, p)
    later_grads = mlp_linears + ((d.q_dim * h + (h if d.bias else 0)) * p if "wo" not in frozen else 0)
    later_grads += sum(q.numel for q in _norm("", d)) * p if "ffn_norm" not in frozen else 0
    released = mlp_saved + norm_out_saved + (norm_tok * h * p if ffn_saves.keeps_input else 0) + ffn_saves.extra
    attention = 2 * scores + 4 * max(bsh, bsq) + later_grads + norm_tok * h * p - released
    tail = norm_tok * h * p + norm_transients(d, norm_tok, p).bwd + ffn_saves.extra
    return BlockActivations(saved=saved, fwd_temp=fwd_temp, bwd_temp=max(mlp, attention, ffn_norm),
                            saves_input=norm.keeps_input, bwd_tail=tail, nosave_peak=_nosave_peak(d, tok, p, scores, adapters, adapter_input))


def _nosave_peak(d: TransformerDims, tok: int, p: int, scores: int, adapters: frozenset[str] = frozenset(),
                 adapter_input: tuple[int, bool] = (0, False)) -> int:
    """A block's forward peak above its input when autograd saves nothing (a fully checkpointed block: the
    non-reentrant checkpoint drops every tensor autograd would save), its output counted from its
    creation: each tensor lives while the block's code refers to it (torchtitan's and the referee's
    blocks). Attention's moment is wo's: attention_norm's output and q, k, v (expanded) and SDPA's output
    are locals of Attention.forward until it returns; with math attention the scores and their softmax
    coexist. The MLP's: SwiGLU's product (the residual h, ffn_norm's output, silu(w1), w3 and the
    product; w1's output dropped once silu has run), GELU's activation (h, the norm's output, w1's output,
    its GELU); then w2's (the product and its output). Last the block's output (h, the MLP's output).
    A LoRA adapter beside a Linear (`result = base(x); result = result + lora_B(lora_A(x)) * scaling`)
    holds two more tensors of its output's size where the base output lives: the scaled adapter output
    and the sum, before the base output is dropped. With peft's input copy (`adapter_input`) the copy
    lives to the layer's end, and before lora_A returns the dropout's output and lora_A's cast of it too;
    not the dropout's mask: `native_dropout` returns it for autograd alone, and a checkpoint's pack hook
    keeps nothing, so it dies as the op returns (the eager referee's peak +2.57 % with it, -0.01 % without)."""
    bsh, bsq, bsf = tok * d.hidden * p, tok * d.q_dim * p, tok * d.ffn * p
    bkv = tok * d.kv * d.head_dim * p
    copy_bytes, dropout_after = adapter_input

    def adapter(fan_in: int, out: int) -> int:
        if not copy_bytes:
            return 2 * out
        n = tok * fan_in
        copy = n * copy_bytes
        return max(copy + (copy if dropout_after else 0) + n * p, copy + 2 * out)

    fan_in = {"wq": d.hidden, "wk": d.hidden, "wv": d.hidden, "wo": d.q_dim, "w1": d.hidden, "w3": d.hidden, "w2": d.ffn}
    lora = {name: adapter(fan_in[name], out) if name in adapters else 0
            for name, out in (("wq", bsq), ("wk", bkv), ("wv", bkv), ("wo", bsh), ("w1", bsf), ("w3", bsf), ("w2", bsh))}
    # each projection's moment: attention_norm's output, the projections made so far and its own output
    projections = max(bsh + bsq + lora["wq"], bsh + bsq + bkv + lora["wk"], bsh + bsq + 2 * bkv + lora["wv"])
    norm = norm_transients(d, tok, p).fwd + norm_saves(d, tok, p).extra  # stats and upcasts die with the op
    dropout = bsh + tok * d.hidden if d.dropout else 0  # a dropout's output and its one-byte mask
    attention = 2 * bsh + 4 * bsq + lora["wo"]
    if d.attention != "sdpa":
        attention = max(attention, bsh + 3 * bsq + 2 * scores + (scores + scores // p if d.dropout else 0))
    if d.mlp == "swiglu":  # w1's moment (h, the norm's output, w1's), w3's (silu(w1) beside), the product's
        mlp = max(2 * bsh + bsf + lora["w1"], 2 * bsh + 2 * bsf + lora["w3"], 2 * bsh + 3 * bsf)
    else:  # w1's, then its GELU beside it
        mlp = max(2 * bsh + bsf + lora["w1"], 2 * bsh + 2 * bsf)
    # attention_norm's moment (its output, bsh + norm) and the residual add's (2 bsh + dropout) lie under
    # ffn_norm's (h beside it) and the output's
    return max(projections, attention, 2 * bsh + norm, mlp, 3 * bsh + bsf + lora["w2"], 3 * bsh + dropout)


def unsaved_references(recipe: dict, unkept: frozenset[str]) -> dict[str, int]:
    """At each Linear's call (wq .. w2), the tensors the block's code still refers to that autograd does not
    save, where `unkept` (`frozen.unkept_inputs`) names the Linears whose input no one keeps. A moment is
    priced as the saved tensors plus its transients, which assumes every live tensor is saved; a frozen
    base's input is not (`mm` saves its input only for the weight's gradient), yet it lives while the code
    holds it: attention_norm's output is `Attention.forward`'s `x` to its return (wq .. wo); the residual `h`
    is the block's local to its end (saved only by a norm that keeps its input, `norm_saves`), ffn_norm's
    output `FeedForward.forward`'s `x` (w1 .. w2), and the product w2 reads an argument until w2 returns.
    Measured on the plain step's eager referee (`tests/test_eager_referee.py`): w2's moment in a recompute
    held the three of them, 19 MiB beside its 48 MiB of transients."""
    r = dict(recipe)
    d, p = TransformerDims(**dict(r["dims"])), r["bytes"]
    tok = r["micro_batch"] * r["seq_len"]
    bsh, bsf = tok * d.hidden * p, tok * d.ffn * p
    attention = bsh if {"wq", "wk", "wv"} <= unkept else 0
    h = 0 if norm_saves(d, tok, p).keeps_input else bsh
    mlp = h + (bsh if "w1" in unkept else 0)  # w1 and w3 read it: unkept together (`frozen._INPUT_GROUPS`)
    return {"wq": attention, "wk": attention, "wv": attention, "wo": attention, "w1": mlp, "w3": mlp,
            "w2": mlp + (bsf if "w2" in unkept else 0)}


def block_recipe(d: TransformerDims, b: int, s: int, p: int, norm_tokens: int | None = None) -> dict:
    """`block_activations`' arguments as plain data (Workload.meta[BLOCK_RECIPE])."""
    return {"dims": asdict(d), "micro_batch": b, "seq_len": s, "bytes": p, "norm_tokens": norm_tokens}


@lru_cache(maxsize=64)
def _from_recipe(items: tuple, frozen: frozenset[str], unkept: frozenset[str], adapters: frozenset[str],
                 adapter_input: tuple[int, bool] = (0, False)) -> BlockActivations:
    r = dict(items)
    return block_activations(TransformerDims(**dict(r["dims"])), r["micro_batch"], r["seq_len"], r["bytes"],
                             r["norm_tokens"], frozen=frozen, unkept=unkept, adapters=adapters, adapter_input=adapter_input)


def _items(recipe: dict) -> tuple:
    """A `block_recipe` as a hashable key (its dims a tuple of items)."""
    return tuple((k, tuple(v.items()) if k == "dims" else v) for k, v in recipe.items())


def recipe_activations(recipe: dict, *, frozen: frozenset[str] = frozenset(), unkept: frozenset[str] = frozenset(),
                       adapters: frozenset[str] = frozenset(), adapter_input: tuple[int, bool] = (0, False)) -> BlockActivations:
    """`block_activations` of a `block_recipe` (remembered: every block of a model shares it)."""
    return _from_recipe(_items(recipe), frozen, unkept, adapters, adapter_input)


@lru_cache(maxsize=64)
def _gemm_shapes(items: tuple) -> dict[str, tuple[int, ...]]:
    r = dict(items)
    ks = block_kernels(TransformerDims(**dict(r["dims"])), r["micro_batch"], r["seq_len"], r["bytes"], causal=True)
    return {k.name: k.shape for k in ks if k.kind == "gemm"}


def recipe_gemm_shapes(recipe: dict) -> dict[str, tuple[int, ...]]:
    """The shapes of the Linears (wq .. w2) a block built from `recipe` runs (remembered, read-only)."""
    return _gemm_shapes(_items(recipe))


@lru_cache(maxsize=1024)  # a bound on memory: one entry per block of each model a process builds (126 for 405B)
def _shared_block_params(d: TransformerDims, prefix: str) -> tuple[Param, ...]:
    """`block_params` as one tuple per model and block, shared by the workloads of every micro-batch and
    sequence length: a sweep's units then hold the same Param objects, so the keys made of units (the last
    build's, schedule/build.py; FSDP1's flat parameters) compare them by identity instead of field by field."""
    return tuple(block_params(d, prefix))


@lru_cache(maxsize=256)  # a sweep's points share shapes (a 10,000-point grid has 125); a Workload is frozen
def build_transformer(d: TransformerDims, *, micro_batch: int, seq_len: int, act_dtype: str, name: str) -> Workload:
    """The workload of one forward/backward of a decoder LM with a cross-entropy loss on fp32 logits."""
    if micro_batch <= 0 or seq_len <= 0:
        raise ScenarioError(f"training: micro_batch and seq_len must be positive, got {micro_batch}, {seq_len}")
    if d.learned_pos and seq_len > d.max_seq:
        raise ScenarioError(f"training.seq_len: {seq_len} exceeds the model's max_seq {d.max_seq}")
    b, s, p = micro_batch, seq_len, itemsize(act_dtype)
    tok, h, v = b * s, d.hidden, d.vocab
    bsh = tok * h * p
    modules: list[Module] = []

    emb = [Param("tok_embeddings.weight", (v, h))]
    if d.learned_pos:
        emb.append(Param("pos_embeddings.weight", (d.max_seq, h)))
    positions = 8 * s if d.learned_pos else 0  # int64 position ids, kept by the position embedding
    # a tied weight's two gradients meet in autograd's input buffer: the head's waits there from the start of
    # backward, the embedding's joins it out of place (old + new -> their sum, torch 2.13 on the CPU, fake
    # or real tensors), once the embedding's output gradient is released
    tied_sum = max(0, 2 * v * h * p - bsh) if d.tie_embeddings else 0
    modules.append(Module("tok_embeddings", "embedding", tuple(emb), fwd_hbm_bytes=2 * bsh,
                          saved_bytes=positions, bwd_tail_bytes=tied_sum, output_bytes=bsh, saves_input=False,
                          kernels=embedding_kernels(tok, h, v, p)))

    act = block_activations(d, b, s, p)
    kernels = block_kernels(d, b, s, p, causal=True)
    fwd, bwd = sum(k.fwd_flops for k in kernels), sum(k.bwd_flops for k in kernels)
    for i in range(d.layers):
        modules.append(Module(
            f"layers.{i}", "block", _shared_block_params(d, f"layers.{i}"), fwd_flops=fwd, bwd_flops=bwd,
            fwd_hbm_bytes=2 * (act.saved + bsh), saved_bytes=act.saved, fwd_temp_bytes=act.fwd_temp,
            bwd_temp_bytes=act.bwd_temp, bwd_tail_bytes=act.bwd_tail, nosave_fwd_peak_bytes=act.nosave_peak,
            output_bytes=bsh, saves_input=act.saves_input, is_block=True, kernels=kernels))

    final_norm = norm_saves(d, tok, p)
    modules.append(Module("norm", "norm", tuple(_norm("norm", d)), fwd_hbm_bytes=2 * bsh,
                          saved_bytes=final_norm.extra, fwd_temp_bytes=norm_transients(d, tok, p).fwd,
                          bwd_temp_bytes=norm_backward_moment(d, tok, p), output_bytes=bsh,
                          saves_input=final_norm.keeps_input,
                          kernels=(norm("norm", tok, h, p, fused=d.norm == "layernorm" or d.norm_impl == "fused"),)))
    head_params = () if d.tie_embeddings else (Param("output.weight", (v, h)),)
    logits = tok * v * p
    head_flops = 2 * tok * h * v
    tied = ("tok_embeddings.weight",) if d.tie_embeddings else ()
    modules.append(Module("output", "head", head_params, tied_params=tied, fwd_flops=head_flops, bwd_flops=2 * head_flops,
                          fwd_hbm_bytes=logits, output_bytes=logits, kernels=(gemm("output", tok, v, h),)))
    # cross_entropy(logits.float()): the fp32 copy (none when the logits are fp32 already) feeds
    # log_softmax, whose fp32 output nll_loss keeps (with a 4-byte total weight); backward holds the
    # gradients of the log-softmax output and of its input (two fp32 logits-sized tensors) next to it
    fp32_logits = tok * v * 4
    cast_copy = fp32_logits if p != 4 else 0
    modules.append(Module(
        "loss", "loss", fwd_hbm_bytes=3 * fp32_logits, saved_bytes=fp32_logits + 4,
        fwd_temp_bytes=cast_copy, bwd_temp_bytes=2 * fp32_logits, bwd_temp_parts=2, output_bytes=4,
        saves_input=False, in_model=False, kernels=loss_kernels(tok, v, p)))

    # what the kernels of one forward and backward execute (no recompute): matmuls, and attention as a
    # causal flash kernel runs it (half the s x s scores; backward 2.5x forward) -- the time model's count
    model_flops = sum(m.fwd_flops + m.bwd_flops for m in modules)
    # the norms' kernel and what the blocks' bytes were built from, for transforms that change what they
    # keep (a frozen weight: workload/frozen.py)
    meta = {"norm_impl": d.norm_kernel, BLOCK_RECIPE: block_recipe(d, b, s, p)}
    return Workload(name=name, modules=tuple(modules), activation_dtype=act_dtype,
                    input_bytes=2 * tok * 8, tokens=tok, model_flops=float(model_flops), meta=meta)
