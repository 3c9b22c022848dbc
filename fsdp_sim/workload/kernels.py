"""The kernels a transformer's modules launch, listed op by op as eager PyTorch runs them.

Shapes and ideal bytes only (each input read once, each output written once); how fast each kind runs is
the hardware model's business (`fsdp_sim/hardware/kernels.py`). Launch counts are those of the eager
torchtitan / Hugging Face code paths, counted from the implementations (torchtitan's Llama model,
transformers' `modeling_llama.py`): a
fused `nn.RMSNorm` is one kernel and its backward two (input and weight gradients); Hugging Face's
`LlamaRMSNorm` is eight (to-fp32, pow, mean, +eps, rsqrt, mul, to-dtype, *weight); rotary embedding about
five per tensor; `silu(a) * b` two. Backward launches are the autograd nodes' kernels (about twice the
forward's for memory-bound ops).
"""

from __future__ import annotations

from fsdp_sim.workload.model import Kernel

UNFUSED_NORM_LAUNCHES = 8  # HF LlamaRMSNorm / composite RMSNorm forward kernels (component-timing §4.2)
ROPE_LAUNCHES_PER_TENSOR = 5  # rotary embedding on q or k, eager (component-timing §4.2)


def gemm(name: str, m: int, n: int, k: int, *, recompute: bool = True, input_grad: bool = True, aten_op: str = "",
         output_saved: bool = False) -> Kernel:
    """`nn.Linear` on m tokens, k -> n features (a bias is fused into `addmm`)."""
    return Kernel(name, "gemm", (m, n, k), launches=1, bwd_launches=2 if input_grad else 1, recompute=recompute,
                  input_grad=input_grad, aten_op=aten_op, output_saved=output_saved)


def elementwise(name: str, nbytes: float, bwd_bytes: float, *, launches: int = 1, bwd_launches: int = 1,
                recompute: bool = True) -> Kernel:
    return Kernel(name, "elementwise", bytes=nbytes, bwd_bytes=bwd_bytes, launches=launches,
                  bwd_launches=bwd_launches, recompute=recompute)


def norm(name: str, tok: int, hidden: int, p: int, *, fused: bool) -> Kernel:
    """Forward reads x and writes y; backward reads x and dy and writes dx (weight gradient reduced on chip)."""
    return Kernel(name, "norm" if fused else "norm_unfused", (tok, hidden), bytes=2 * tok * hidden * p, bwd_bytes=3 * tok * hidden * p,
                  launches=1 if fused else UNFUSED_NORM_LAUNCHES, bwd_launches=2 if fused else 2 * UNFUSED_NORM_LAUNCHES)


def block_kernels(d, b: int, s: int, p: int, *, causal: bool) -> tuple[Kernel, ...]:
    """A pre-norm block (attention then MLP, each with a residual add), `d` a `TransformerDims`."""
    tok, h, f = b * s, d.hidden, d.ffn
    qd, kvd = d.q_dim, d.kv * d.head_dim
    fused_norm = d.norm == "layernorm" or d.norm_impl == "fused"
    # a 3-D Linear dispatches aten.mm without a bias, aten.addmm with one (ATen's `linear`); autograd keeps
    # a projection's output when SDPA takes it as it is: q without rotary embedding, k and v unexpanded
    mm = "addmm" if d.bias else "mm"
    mha = d.kv == d.heads
    ks = [norm("attention_norm", tok, h, p, fused=fused_norm),
          gemm("wq", tok, qd, h, aten_op=mm, output_saved=d.learned_pos),
          gemm("wk", tok, kvd, h, aten_op=mm, output_saved=d.learned_pos and mha),
          gemm("wv", tok, kvd, h, aten_op=mm, output_saved=mha)]
    if not d.learned_pos:  # rotary position embedding on q and k (GPT-2 style models add positions instead)
        rope = 2 * tok * (qd + kvd) * p
        ks.append(Kernel("rotary embedding", "rope", (tok, qd + kvd), bytes=rope, bwd_bytes=rope, launches=2 * ROPE_LAUNCHES_PER_TENSOR,
                         bwd_launches=2 * ROPE_LAUNCHES_PER_TENSOR))
    if d.kv != d.heads:  # grouped-query k and v expanded to every head (repeat_interleave), summed back in backward
        expand = 2 * tok * (kvd + qd) * p
        ks.append(elementwise("repeat k, v", expand, expand, launches=2, bwd_launches=2))
    if d.attention == "sdpa":
        ks.append(Kernel("scaled_dot_product_attention", "attention", (b, d.heads, s, d.head_dim), causal=causal,
                         aten_op="sdpa", output_saved=True))  # its output and logsumexp: saved by itself (and wo)
    else:  # q @ k^T, scale, mask, softmax (and dropout), @ v
        ks.append(Kernel("attention (explicit scores)", "attention_eager", (b, d.heads, s, d.head_dim), causal=causal,
                         launches=5 + d.dropout, bwd_launches=8 + d.dropout))
    residual = 3 * tok * h * p  # read both summands, write the sum; backward adds the two gradient paths
    ks += [gemm("wo", tok, h, qd, aten_op=mm), elementwise("attention residual add", residual, residual),
           norm("ffn_norm", tok, h, p, fused=fused_norm)]
    if d.dropout:
        drop = 2 * tok * h * p + tok * h  # read, write, one-byte mask
        ks.insert(len(ks) - 1, elementwise("attention output dropout", drop, drop))
    if d.mlp == "swiglu":
        ks += [gemm("w1", tok, f, h, aten_op=mm, output_saved=True), gemm("w3", tok, f, h, aten_op=mm, output_saved=True),
               Kernel("silu(w1) * w3", "activation", (tok, f), bytes=3 * tok * f * p, bwd_bytes=5 * tok * f * p,
                      launches=2, bwd_launches=4)]
    else:
        ks += [gemm("w1", tok, f, h, aten_op=mm, output_saved=True),
               Kernel("gelu", "activation", (tok, f), bytes=2 * tok * f * p, bwd_bytes=3 * tok * f * p, launches=1, bwd_launches=1)]
    # after w2's input, the last tensor the block saves: a non-reentrant recompute stops before these
    ks.append(gemm("w2", tok, h, f, recompute=False, aten_op=mm))
    if d.dropout:
        ks.append(elementwise("mlp output dropout", 2 * tok * h * p + tok * h, 2 * tok * h * p + tok * h, recompute=False))
    ks.append(elementwise("mlp residual add", residual, residual, recompute=False))
    return tuple(ks)


def embedding_kernels(tok: int, hidden: int, vocab: int, p: int) -> tuple[Kernel, ...]:
    """Row gather forward; backward zero-fills the weight gradient and index-adds the rows into it."""
    return (elementwise("embedding lookup", 2 * tok * hidden * p, 2 * tok * hidden * p + vocab * hidden * p,
                        bwd_launches=3),)


def loss_kernels(tok: int, vocab: int, p: int, *, upcast: bool = True) -> tuple[Kernel, ...]:
    """`cross_entropy(logits.float())`: the upcast, then log_softmax + nll_loss; backward the reverse.
    Without `upcast`, `cross_entropy(logits)` in the logits' own dtype.

    Per logit, in the loss's dtype (q bytes): log_softmax reads the logits and writes its output (2q;
    nll_loss gathers one value a row). Backward moves twice that: nll_loss_backward zero-fills a
    logits-sized gradient and scatters one value a row into it (q), then log_softmax_backward reads that
    gradient and the saved output and writes the input's gradient (3q) (torch/_decomp/decompositions.py
    `nll_loss_backward`: `torch.zeros_like(self)` then `scatter`; `_log_softmax_backward_data`:
    `grad_output - exp(output) * grad_output.sum(dim)`); the cast back to the logits' dtype is the
    upcast's backward. Liger's CSV measures the fp32 pair at 20.7 ms forward, 60.4 ms forward + backward
    (A100, 16384 x 131072; component-timing 3.2): backward 1.92x forward, these bytes 2x
    (tests/test_loss_backward.py holds the ratio)."""
    cast = tok * vocab * (p + 4) if p != 4 and upcast else 0
    q = 4 if upcast else p
    ks = (Kernel("log_softmax + nll_loss", "cross_entropy", (tok, vocab), bytes=2 * tok * vocab * q, bwd_bytes=4 * tok * vocab * q,
                 launches=3, bwd_launches=4),)
    return ((elementwise("logits to fp32", cast, cast),) if cast else ()) + ks


def attention_kernels(d, b: int, s: int, p: int, *, causal: bool) -> tuple[Kernel, ...]:
    """`block_kernels`' first half: attention_norm to ffn_norm (attention, its residual add, the MLP's norm),
    for blocks whose MLP is not the dense one (mixture-of-experts)."""
    ks = block_kernels(d, b, s, p, causal=causal)
    end = next(i for i, k in enumerate(ks) if k.name == "ffn_norm")
    return ks[:end + 1]


def quick_gelu(tok: int, f: int, p: int) -> tuple[Kernel, ...]:
    """CLIP's `QuickGELUActivation`, `x * sigmoid(1.702 * x)`: three eager kernels, each its real traffic.

    Backward: the scalar multiply's (and the sum of x's two gradients), the sigmoid's, and the product's two
    multiplies."""
    t = tok * f * p
    return (elementwise("quick_gelu 1.702 * x", 2 * t, 2 * t + 3 * t, bwd_launches=2),
            elementwise("quick_gelu sigmoid", 2 * t, 3 * t),
            elementwise("quick_gelu x * sigmoid", 3 * t, 6 * t, bwd_launches=2))


def with_activation(kernels: tuple[Kernel, ...], act: str, p: int) -> tuple[Kernel, ...]:
    """`kernels` with a GELU MLP's activation replaced by `act`'s: "quick_gelu" (CLIP), else unchanged
    (`nn.functional.gelu`, exact or tanh, is one kernel)."""
    if act != "quick_gelu":
        return kernels
    out: list[Kernel] = []
    for k in kernels:
        out += quick_gelu(*k.shape, p) if k.kind == "activation" and k.name == "gelu" else [k]
    return tuple(out)
