"""What Gemma 2, Gemma 3 and Qwen 3 add to the decoder `build_transformer` builds, from their modeling files.

- Sandwich norms (Gemma 2 / 3 `*DecoderLayer.forward`): `post_attention_layernorm` on the attention's output
  and `post_feedforward_layernorm` on the MLP's, each before its residual add, besides the two pre-norms
  (`input_layernorm`, `pre_feedforward_layernorm`, the builder's attention_norm / ffn_norm). Each is Gemma's
  RMSNorm (fp32 throughout, `* (1 + weight)`: `norm_impl` composite): its saves and transients are
  `transformer.norm_saves` / `norm_transients`, its kernel the builder's norm. w2's output is now saved
  (the post-norm keeps it), so a checkpoint's recompute runs through w2 and the post-norm.
- q/k norms (Qwen 3 and Gemma 3 `self.q_norm` / `self.k_norm`, an RMSNorm of `head_dim` over every head,
  before RoPE): a (head_dim,) weight each; over tokens x heads rows of head_dim.
- Attention logit softcapping (Gemma 2 `eager_attention_forward`: `attn_weights / softcap; tanh; * softcap`
  on the (b, heads, s, s) scores): three more kernels on the scores, and tanh saves its output. SDPA has no
  softcap (transformers' `sdpa_attention_forward` drops the argument), so Gemma 2 trains with eager
  attention (`Gemma2ForCausalLM.forward` warns "It is strongly recommended to train Gemma2 models with the
  `eager` attention implementation"): priced as the explicit-scores attention, where a sliding window is
  only a mask on the full scores (no saving).
- Final logit softcapping (Gemma 2 `Gemma2ForCausalLM.forward`: `logits / cap; tanh; * cap`): three kernels
  on the logits, and tanh saves its output (a logits-sized tensor).
- Sliding windows under SDPA (Gemma 3's `sliding_attention` layers, `layer_types` or every layer but each
  `sliding_window_pattern`-th): transformers skips the mask (is_causal, the flash kernel) only while the
  sequence fits in the window (`_ignore_causal_mask_sdpa` with `local_attention_size`); past it the layer
  passes an explicit mask, which SDPA's flash kernel does not take, and the memory-efficient kernel computes
  every block of the masked scores: priced as non-causal attention over the whole sequence.
- The embedding's `* sqrt(hidden)` (Gemma's `normalizer`): one elementwise kernel, nothing saved.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_sim.workload.kernels import elementwise, norm
from fsdp_sim.workload.model import Module, Param, Workload
from fsdp_sim.workload.transformer import TransformerDims, norm_saves, norm_transients

SANDWICH = ("gemma2", "gemma3_text")
QK_NORM = ("qwen3", "gemma3_text")
SOFTCAP_KERNELS = 3  # divide, tanh, multiply


def sliding_layers(c, layers: int) -> list[bool]:
    """Which layers are `sliding_attention`: the config's `layer_types`, else the family's default pattern
    (Gemma 2: `(i + 1) % 2`, every other layer from the first; Gemma 3: all but every
    `sliding_window_pattern`-th, default 6)."""
    types = c.data.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or \
                not all(t in ("sliding_attention", "full_attention") for t in types):
            raise c.bad("layer_types", f"a list of {layers} 'sliding_attention' / 'full_attention'", types)
        return [t == "sliding_attention" for t in types]
    every = 2 if c.model_type == "gemma2" else c.int("sliding_window_pattern", default=6)
    return [bool((i + 1) % every) for i in range(layers)]


def _block_extras(m: Module, d: TransformerDims, *, mt: str, tok: int, norm_rows: int, p: int, b: int, s: int,
                  softcap: bool, full_masked: bool) -> Module:
    """One block with its family's extras (module docstring); `d` the per-rank dims."""
    h, hd = d.hidden, d.head_dim
    params, kernels = list(m.params), []
    saved, fwd_temp, bwd_temp = m.saved_bytes, m.fwd_temp_bytes, m.bwd_temp_bytes
    if mt in QK_NORM:
        head_norm = replace(d, hidden=hd)
        for name, heads in (("q_norm", d.heads), ("k_norm", d.kv)):
            params.append(Param(f"{m.name}.attention.{name}.weight", (hd,)))
            rows = tok * heads
            ns = norm_saves(head_norm, rows, p)
            saved += ns.extra + (rows * hd * p if ns.keeps_input else 0)
            fwd_temp = max(fwd_temp, norm_transients(head_norm, rows, p).fwd)
    post = {}
    if mt in SANDWICH:
        ns = norm_saves(d, norm_rows, p)
        for name in ("post_attention_norm", "post_ffn_norm"):
            params.append(Param(f"{m.name}.{name}.weight", (h,)))
            saved += ns.extra + (norm_rows * h * p if ns.keeps_input else 0)
            post[name] = norm(name, norm_rows, h, p, fused=d.norm_impl == "fused")
        nt = norm_transients(d, norm_rows, p)
        fwd_temp, bwd_temp = max(fwd_temp, nt.fwd), max(bwd_temp, nt.bwd + norm_rows * h * p)
    scores = b * d.heads * s * s * p
    if softcap:
        saved += scores  # tanh's output
    fused_norm = d.norm_impl == "fused"
    for k in m.kernels:
        if k.name == "w2" and post:
            k = replace(k, recompute=True)  # its output is saved by post_ffn_norm now
        if k.kind == "attention" and full_masked:
            k = replace(k, causal=False)
        kernels.append(k)
        if k.name == "wq" and mt in QK_NORM:
            kernels.append(norm("q_norm", tok * d.heads, hd, p, fused=fused_norm))
        elif k.name == "wk" and mt in QK_NORM:
            kernels.append(norm("k_norm", tok * d.kv, hd, p, fused=fused_norm))
        elif k.kind == "attention_eager" and softcap:
            kernels += [elementwise("attention softcap / cap", 2 * scores, 2 * scores),
                        elementwise("attention softcap tanh", 2 * scores, 3 * scores),
                        elementwise("attention softcap * cap", 2 * scores, 2 * scores)]
        elif k.name == "wo" and post:
            kernels.append(post["post_attention_norm"])
        elif k.name == "w2" and post:
            kernels.append(replace(post["post_ffn_norm"], recompute=True))
    return replace(m, params=tuple(params), saved_bytes=saved, fwd_temp_bytes=fwd_temp, bwd_temp_bytes=bwd_temp,
                   fwd_flops=sum(k.fwd_flops for k in kernels), bwd_flops=sum(k.bwd_flops for k in kernels),
                   kernels=tuple(kernels))


def apply_family(wl: Workload, c, d: TransformerDims, *, micro_batch: int, seq_len: int, p: int,
                 norm_rows: int | None = None) -> Workload:
    """`wl` (built on the per-rank dims `d`) with its family's extras; `norm_rows` the rows a sequence-parallel
    rank's norms run on (all tokens otherwise)."""
    mt = c.model_type
    tok = micro_batch * seq_len
    rows = tok if norm_rows is None else norm_rows
    softcap = mt == "gemma2" and c.float("attn_logit_softcapping", default=0.0) > 0
    window = c.int("sliding_window", default=None) if mt == "gemma3_text" else None
    sliding = sliding_layers(c, d.layers) if window is not None else []
    cache: dict[bool, tuple] = {}
    modules, i = [], 0
    for m in wl.modules:
        if m.is_block:
            masked = bool(sliding) and sliding[i] and seq_len >= window and d.attention == "sdpa"
            if masked not in cache:
                cache[masked] = _block_extras(m, d, mt=mt, tok=tok, norm_rows=rows, p=p, b=micro_batch, s=seq_len,
                                              softcap=softcap, full_masked=masked)
            done = cache[masked]
            m = replace(done, name=m.name, params=tuple(replace(q, name=m.name + q.name[len(done.name):])
                                                        for q in done.params))
            i += 1
        elif m.kind == "embedding" and mt in SANDWICH:
            bsh = tok * d.hidden * p
            m = replace(m, kernels=m.kernels + (elementwise("embedding * sqrt(hidden)", 2 * bsh, 2 * bsh),))
        elif m.kind == "head" and mt == "gemma2" and c.float("final_logit_softcapping", default=0.0) > 0:
            logits = m.output_bytes
            caps = (elementwise("logit softcap / cap", 2 * logits, 2 * logits),
                    elementwise("logit softcap tanh", 2 * logits, 3 * logits),
                    elementwise("logit softcap * cap", 2 * logits, 2 * logits))
            m = replace(m, kernels=m.kernels + caps, saved_bytes=m.saved_bytes + logits,
                        fwd_temp_bytes=max(m.fwd_temp_bytes, logits))
        modules.append(m)
    return replace(wl, modules=tuple(modules), model_flops=float(sum(m.fwd_flops + m.bwd_flops for m in modules)))
