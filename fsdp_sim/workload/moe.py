"""Mixture-of-experts blocks (Mixtral, Qwen2-MoE) as the Hugging Face implementations run them.

A sparse block is still one module (`is_block=True`, one FSDP unit under `per_block`): the dense
block's attention half, then a router `Linear(hidden, experts)` and `experts` SwiGLU MLPs, each its
own `nn.Linear`s (as in `MixtralSparseMoeBlock`, so FSDP2 shards each expert's weights on their own
dim 0). Every token is sent to `top_k` experts:
- compute: the router, plus `top_k` x the dense SwiGLU MLP's FLOPs per token;
- saved for backward: per routed token, what a dense SwiGLU MLP saves (its gathered input, the w1
  output, the silu output, the w3 output, their product), plus the expert output and routing weight
  kept by the weighting multiply; per token, the router logits (kept for the load-balancing loss), the
  fp32 softmax probabilities, the top-k indices and normalised weights.
Qwen2-MoE adds a shared expert (a dense SwiGLU MLP every token runs) with a sigmoid gate
`Linear(hidden, 1)`; its layers listed in `mlp_only_layers` (or off `decoder_sparse_step`) stay dense.

Kernels (`moe_kernels`), in the order `MixtralSparseMoeBlock.forward` launches them: the dense block's
attention half (`attention_kernels`), the router GEMM (tokens x experts x hidden), the fp32 softmax, top-k
(and Mixtral's renormalisation), the one-hot expert mask; then for every expert a token gather, its three
GEMMs over the tokens routed to it (tokens x top_k / experts with balanced routing, the remainder spread
one token each over the first experts), the routing-weight gather and multiply and the `index_add_` into
the output; the shared expert; the residual add. The byte counts are each eager op's reads and writes.
The gathers' backward is the costly part: each expert's `index` backward zero-fills a (tokens, hidden)
gradient, index-puts its rows in, and autograd adds it to the hidden states' gradient. Each expert's
`nonzero` also syncs the host with the GPU, which is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.workload.kernels import attention_kernels, elementwise, gemm
from fsdp_sim.workload.model import Kernel, Module, Param, Workload
from fsdp_sim.workload.transformer import MAX_WIDTH, TransformerDims, _linear, block_activations, block_params

MAX_EXPERTS = 4096  # experts per sparse block (published models: 8 to 256)
MAX_EXPERT_MLPS = 1 << 16  # sparse layers x experts, each expert three nn.Linear parameters


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    """Experts of one sparse block: how many, how many each token uses, their MLP width, a shared expert."""

    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0  # Qwen2-MoE shared expert width; 0 means none
    norm_topk: bool = True  # the top-k weights renormalised to sum to 1 (Mixtral; Qwen2-MoE's norm_topk_prob)

    def __post_init__(self) -> None:
        limits = {"experts": MAX_EXPERTS, "top_k": MAX_EXPERTS, "expert_ffn": MAX_WIDTH, "shared_ffn": MAX_WIDTH}
        for key, limit in limits.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "shared_ffn" else 1):
                raise ScenarioError(f"model.hf_config: {key} must be a positive integer, got {show(value)}")
            if value > limit:
                raise ScenarioError(f"model.hf_config: {key} {value:,} is past the limit of {limit:,}")

    def expert_params(self, hidden: int) -> int:
        return 3 * hidden * self.expert_ffn


def moe_block_params(d: TransformerDims, spec: MoESpec, prefix: str) -> list[Param]:
    """The dense block's attention and norms around the router, the experts and the shared expert."""
    h, ff = d.hidden, f"{prefix}.feed_forward"
    params = _linear(f"{ff}.router", h, spec.experts, False)
    for j in range(spec.experts):
        e = f"{ff}.experts.{j}"
        params += _linear(f"{e}.w1", h, spec.expert_ffn, False) + _linear(f"{e}.w3", h, spec.expert_ffn, False)
        params += _linear(f"{e}.w2", spec.expert_ffn, h, False)
    if spec.shared_ffn:
        s = f"{ff}.shared_expert"
        params += _linear(f"{s}.w1", h, spec.shared_ffn, False) + _linear(f"{s}.w3", h, spec.shared_ffn, False)
        params += _linear(f"{s}.w2", spec.shared_ffn, h, False)
        params += _linear(f"{ff}.shared_expert_gate", h, 1, False)
    return block_params(d, prefix, ffn=params)


def expert_tokens(spec: MoESpec, tok: int) -> list[int]:
    """Tokens each expert gets with balanced routing: tok x top_k / experts, the remainder one each."""
    routed = tok * spec.top_k
    return [routed // spec.experts + (j < routed % spec.experts) for j in range(spec.experts)]


def _swiglu(name: str, m: int, h: int, f: int, p: int) -> list[Kernel]:
    """w1, w3, silu(w1) * w3, w2 over m tokens, as `block_kernels` lists a dense SwiGLU MLP (w2 is recomputed
    here: its output is saved by the routing-weight or gate multiply after it)."""
    return [gemm(f"{name}.w1", m, f, h), gemm(f"{name}.w3", m, f, h),
            Kernel(f"{name} silu(w1) * w3", "activation", (m, f), bytes=3 * m * f * p, bwd_bytes=5 * m * f * p,
                   launches=2, bwd_launches=4),
            gemm(f"{name}.w2", m, h, f)]


@cache
def moe_kernels(d: TransformerDims, spec: MoESpec, b: int, s: int, p: int) -> tuple[Kernel, ...]:
    """What a sparse block's forward launches (module docstring); `p` the activation dtype's bytes.

    `recompute=False` marks what follows the block's last saved tensor: the index kept by the last
    expert's `index_add_` (Mixtral) or the shared expert's gate and output kept by their product (Qwen2-MoE).
    """
    tok, h, E, k = b * s, d.hidden, spec.experts, spec.top_k
    routed, bsh = tok * k, tok * h * p
    ks = list(attention_kernels(d, b, s, p, causal=True))
    ks += [gemm("router", tok, E, h),
           # softmax(logits, dtype=float32); backward reads the fp32 gradient and output, writes the logits'
           elementwise("router softmax (fp32)", tok * E * (p + 4), tok * E * (8 + p)),
           # values and int64 indices; backward zero-fills the (tokens, experts) gradient and scatters into it
           elementwise("topk", tok * E * 4 + routed * 12, tok * E * 4 + routed * 16, bwd_launches=2)]
    if spec.norm_topk:  # weights /= weights.sum(-1, keepdim=True); backward the divide's two gradients and their sum
        ks.append(elementwise("top-k renormalisation", 3 * routed * 4 + 2 * tok * 4, 9 * routed * 4,
                              launches=2, bwd_launches=5))
    ks += [elementwise("routing weights to activation dtype", routed * (4 + p), routed * (4 + p)),
           elementwise("zeros (output)", bsh, 0, bwd_launches=0),
           # one_hot (zero-fill, scatter) of the int64 indices, its sum per expert, > 0, nonzero
           elementwise("one_hot expert mask, experts hit", 2 * routed * E * 8 + routed * 16, 0, launches=6,
                       bwd_launches=0)]
    counts = [m for m in expert_tokens(spec, tok) if m]  # HF skips experts no token is routed to
    for j, m in enumerate(counts):
        e = f"experts.{j}"
        last = j == len(counts) - 1 and not spec.shared_ffn
        rows = m * h * p
        ks += [elementwise(f"{e} where(mask)", routed * 8 + 2 * m * 8, 0, launches=3, bwd_launches=0),
               # index backward: zero-fill (tokens, hidden), index_put_ with accumulate (sorts the indices),
               # then autograd adds it to the hidden states' gradient
               elementwise(f"{e} gather tokens", 2 * rows + m * 8, bsh + 2 * rows + m * 8 + 3 * bsh,
                           bwd_launches=6),
               *_swiglu(e, m, h, spec.expert_ffn, p),
               elementwise(f"{e} gather routing weights", 2 * m * 8 + 2 * m * p,
                           routed * p + 2 * m * p + 2 * m * 8 + 3 * routed * p, bwd_launches=6),
               # backward: gradient x weight, and (gradient x output).sum(-1) for the weight
               elementwise(f"{e} * routing weight", 2 * rows + m * p, 5 * rows + 2 * m * p, bwd_launches=3),
               # read-modify-write of the output rows; backward index_select of the gradient
               elementwise(f"{e} index_add_", 3 * rows + m * 8, 2 * rows + m * 8, recompute=not last)]
    if spec.shared_ffn:
        ks += _swiglu("shared_expert", tok, h, spec.shared_ffn, p)
        ks += [gemm("shared_expert_gate", tok, 1, h),
               elementwise("sigmoid(gate)", 2 * tok * p, 3 * tok * p),
               elementwise("sigmoid(gate) * shared_expert", 2 * bsh + tok * p, 5 * bsh + 2 * tok * p,
                           bwd_launches=3, recompute=False),
               elementwise("routed + shared", 3 * bsh, 0, bwd_launches=0, recompute=False)]
    ks.append(elementwise("mlp residual add", 3 * bsh, 3 * bsh, recompute=False))
    return tuple(ks)


def moe_block(d: TransformerDims, spec: MoESpec, name: str, *, b: int, s: int, p: int) -> Module:
    """One sparse block (see the module docstring for what is counted)."""
    tok, h, f, E, k = b * s, d.hidden, spec.expert_ffn, spec.experts, spec.top_k
    routed = tok * k
    bsh = tok * h * p
    # the dense SwiGLU block with the expert width, less its MLP's four (tokens x ffn) tensors
    dense = block_activations(replace(d, mlp="swiglu", ffn_hidden=f), b, s, p)
    saved = dense.saved - 4 * tok * f * p
    saved += tok * E * (p + 4) + routed * (8 + 4)  # router logits, fp32 probabilities; top-k indices, weights
    saved += routed * (h * p + 4 * f * p)  # per routed token: gathered input, w1 / silu / w3 outputs, product
    saved += routed * (h * p + p + 8)  # expert output and routing weight (weighting multiply), token index
    fs = spec.shared_ffn
    if fs:
        saved += 4 * tok * fs * p + bsh + 2 * tok * p  # shared SwiGLU, its output and the sigmoid gate
    # forward: the one-hot expert mask and the output accumulator live through the expert loop
    fwd_temp = max(dense.fwd_temp, bsh + routed * E * 8)
    # backward: the attention's moment over all tokens (a dense block with a negligible MLP), then the
    # experts one after another, each a dense SwiGLU MLP over its tokens (tokens x top_k / experts with
    # balanced routing), and the shared expert over all tokens
    per_expert = math.ceil(routed / E)
    attention_only = block_activations(replace(d, mlp="gelu", ffn_hidden=1), b, s, p)
    one_expert = block_activations(replace(d, mlp="swiglu", ffn_hidden=f, attention="sdpa", dropout=False),
                                   1, per_expert, p)
    bwd_temp = max(attention_only.bwd_temp, one_expert.bwd_temp)
    if fs:
        bwd_temp = max(bwd_temp, block_activations(replace(d, mlp="swiglu", ffn_hidden=fs), b, s, p).bwd_temp)

    params = tuple(moe_block_params(d, spec, name))
    # FLOPs from the kernels: attention, the router, top_k x the dense SwiGLU MLP per token, the shared expert
    kernels = moe_kernels(d, spec, b, s, p)
    return Module(name, "block", params, fwd_flops=sum(kn.fwd_flops for kn in kernels),
                  bwd_flops=sum(kn.bwd_flops for kn in kernels), fwd_hbm_bytes=2 * (saved + bsh),
                  saved_bytes=saved, fwd_temp_bytes=fwd_temp, bwd_temp_bytes=bwd_temp, bwd_tail_bytes=dense.bwd_tail,
                  output_bytes=bsh,
                  saves_input=dense.saves_input, is_block=True, kernels=kernels)


def apply_moe(wl: Workload, d: TransformerDims, spec: MoESpec, sparse: list[bool], *, micro_batch: int,
              seq_len: int) -> Workload:
    """Replace the blocks flagged in `sparse` (one flag per layer, in order) of a dense decoder by MoE blocks.

    `model_flops` is what the kernels execute, as `build_transformer` counts it: each token's `top_k`
    experts only. `meta["active_params"]` leaves the inactive experts' weights out.
    """
    if sum(sparse) * spec.experts > MAX_EXPERT_MLPS:
        raise ScenarioError(f"model.hf_config: {sum(sparse):,} sparse layers x {spec.experts:,} experts is past the "
                            f"limit of {MAX_EXPERT_MLPS:,} expert MLPs")
    p = itemsize(wl.activation_dtype)
    modules, i, inactive = [], 0, 0
    for m in wl.modules:
        if m.is_block:
            if sparse[i]:
                m = moe_block(d, spec, m.name, b=micro_batch, s=seq_len, p=p)
                inactive += (spec.experts - spec.top_k) * spec.expert_params(d.hidden)
            i += 1
        modules.append(m)
    n_params = sum(m.numel for m in modules)
    active = n_params - inactive
    model_flops = sum(m.fwd_flops + m.bwd_flops for m in modules)
    meta = {**wl.meta, "experts": spec.experts, "top_k": spec.top_k, "active_params": active}
    return replace(wl, modules=tuple(modules), model_flops=float(model_flops), meta=meta)
