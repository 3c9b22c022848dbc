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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fsdp_sim.dtypes import itemsize
from fsdp_sim.workload.model import Module, Param, Workload
from fsdp_sim.workload.transformer import TransformerDims, _linear, block_activations, block_params


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    """Experts of one sparse block: how many, how many each token uses, their MLP width, a shared expert."""

    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0  # Qwen2-MoE shared expert width; 0 means none

    def expert_params(self, hidden: int) -> int:
        return 3 * hidden * self.expert_ffn


def moe_block_params(d: TransformerDims, spec: MoESpec, prefix: str) -> list[Param]:
    """The dense block's norms and attention, then the router, the experts and the shared expert."""
    h, ff = d.hidden, f"{prefix}.feed_forward"
    params = [p for p in block_params(d, prefix) if not p.name.startswith(f"{ff}.")]
    params += _linear(f"{ff}.router", h, spec.experts, False)
    for j in range(spec.experts):
        e = f"{ff}.experts.{j}"
        params += _linear(f"{e}.w1", h, spec.expert_ffn, False) + _linear(f"{e}.w3", h, spec.expert_ffn, False)
        params += _linear(f"{e}.w2", spec.expert_ffn, h, False)
    if spec.shared_ffn:
        s = f"{ff}.shared_expert"
        params += _linear(f"{s}.w1", h, spec.shared_ffn, False) + _linear(f"{s}.w3", h, spec.shared_ffn, False)
        params += _linear(f"{s}.w2", spec.shared_ffn, h, False)
        params += _linear(f"{ff}.shared_expert_gate", h, 1, False)
    return params


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
    ff = f"{name}.feed_forward."
    attn_matmul = 2 * tok * sum(pr.numel for pr in params if len(pr.shape) == 2 and not pr.name.startswith(ff))
    router = 2 * tok * h * E
    experts = k * 2 * tok * spec.expert_params(h)  # top_k x the dense SwiGLU MLP per token
    shared = (2 * tok * 3 * h * fs + 2 * tok * h) if fs else 0
    attn = 4 * b * s * s * d.q_dim * (0.5 if d.attention == "sdpa" else 1.0)
    fwd = attn_matmul + router + experts + shared + attn
    return Module(name, "block", params, fwd_flops=fwd, bwd_flops=2 * fwd, fwd_hbm_bytes=2 * (saved + bsh),
                  saved_bytes=saved, fwd_temp_bytes=fwd_temp, bwd_temp_bytes=bwd_temp, output_bytes=bsh,
                  saves_input=dense.saves_input, is_block=True)


def apply_moe(wl: Workload, d: TransformerDims, spec: MoESpec, sparse: list[bool], *, micro_batch: int,
              seq_len: int) -> Workload:
    """Replace the blocks flagged in `sparse` (one flag per layer, in order) of a dense decoder by MoE blocks.

    `model_flops` counts the active parameters only: the inactive experts' weights are left out.
    """
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
    tok = micro_batch * seq_len
    model_flops = (6 * active + 12 * d.layers * d.q_dim * seq_len) * tok
    meta = {**wl.meta, "experts": spec.experts, "top_k": spec.top_k, "active_params": active}
    return replace(wl, modules=tuple(modules), model_flops=float(model_flops), meta=meta)
