"""Vision transformers and the models built on them: ViT classification, CLIP, LLaVA.

The encoder blocks are the decoder's pre-norm blocks (`block_params` / `block_activations`: LayerNorm,
GELU MLP, biases) without a causal mask, so attention FLOPs are not halved. Images come in as fp32
`pixel_values` (what an image processor yields); with a lower compute dtype FSDP2 casts them on the way
into the root module, and the patch convolution keeps that copy for its weight gradient. The
convolution has no input gradient (pixels do not require grad), so its backward is one weight-gradient
GEMM, as many FLOPs as its forward.

The workload is one chain (each module's output is the next one's input), so the two-tower and
multimodal models are laid out in the order they run:
- CLIP: vision tower, visual projection, text tower, text projection, the b x b logits, the loss. The
  text tower's embedding keeps its input (the image embeddings, b x projection_dim) alive until its
  backward, standing in for the logits that really hold it: a few kilobytes either way.
- LLaVA: vision tower, multi-modal projector, then the language model, whose embedding merges the
  projected image features into the token embeddings (so it consumes the projector's output).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import ScenarioError
from fsdp_sim.workload.model import Module, Param, Workload
from fsdp_sim.workload.transformer import (NORM_STAT_TENSORS, TransformerDims, _linear, _norm, block_activations,
                                           block_params, build_transformer)


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionDims:
    """A ViT-style image encoder: its transformer, image and patch sizes, and which embedding layout.

    `style` "vit" is Hugging Face's `ViTEmbeddings` (conv with bias, `cls_token` (1, 1, h) and
    `position_embeddings` (1, n + 1, h): dim 0 is 1, so FSDP2 pads them to a full copy per rank);
    "clip" is `CLIPVisionEmbeddings` (conv without bias, `class_embedding` (h,), an `nn.Embedding` of
    positions) followed by `pre_layrnorm`.
    """

    tower: TransformerDims
    image_size: int
    patch_size: int
    channels: int = 3
    style: str = "vit"
    qkv_bias: bool = True

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ScenarioError(f"model.hf_config: patch_size {self.patch_size} does not divide "
                                f"image_size {self.image_size}")

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq(self) -> int:
        return self.patches + 1  # the CLS token

    def pixel_bytes(self, images: int) -> int:
        return images * self.channels * self.image_size ** 2 * 4


def prefixed(modules, prefix: str) -> list[Module]:
    """The modules with `prefix` put before their names and their parameters' names."""
    def param(p: Param) -> Param:
        return replace(p, name=prefix + p.name)
    return [replace(m, name=prefix + m.name, params=tuple(param(p) for p in m.params),
                    tied_params=tuple(prefix + n for n in m.tied_params)) for m in modules]


def _tower_flops(params: int, layers: int, q_dim: int, seq: int, tokens: int) -> float:
    """torchtitan's flop_per_token (6 N + 12 L h s) x tokens, attention counted unmasked."""
    return float((6 * params + 12 * layers * q_dim * seq) * tokens)


def vision_tower(v: VisionDims, *, prefix: str, b: int, p: int) -> list[Module]:
    """Patch + position embeddings (and CLIP's pre-LayerNorm), then the encoder blocks; no final norm."""
    d, h, n, s = v.tower, v.tower.hidden, v.patches, v.seq
    tok = b * s
    bsh = tok * h * p
    conv = (h, v.channels, v.patch_size, v.patch_size)
    if v.style == "vit":
        emb = [Param("embeddings.cls_token", (1, 1, h)), Param("embeddings.position_embeddings", (1, s, h)),
               Param("embeddings.patch_embeddings.projection.weight", conv),
               Param("embeddings.patch_embeddings.projection.bias", (h,))]
    else:
        emb = [Param("embeddings.class_embedding", (h,)), Param("embeddings.patch_embedding.weight", conv),
               Param("embeddings.position_embedding.weight", (s, h))]
    conv_flops = 2 * b * n * h * v.channels * v.patch_size ** 2
    pixels = v.pixel_bytes(b)
    cast = pixels // 4 * p if p != 4 else 0  # the compute-dtype copy of the pixels, saved by the conv
    mask = tok * h if d.dropout else 0  # embedding dropout mask (bool)
    modules = [Module(
        "embeddings", "embedding", tuple(emb), fwd_flops=conv_flops, bwd_flops=conv_flops,
        fwd_hbm_bytes=pixels + cast + 4 * bsh, saved_bytes=cast + mask, fwd_temp_bytes=bsh, output_bytes=bsh,
        saves_input=False)]
    stats = NORM_STAT_TENSORS[d.norm] * tok * 4
    if v.style == "clip":
        modules.append(Module("pre_layrnorm", "norm", tuple(_norm("pre_layrnorm", d)), fwd_hbm_bytes=2 * bsh,
                              saved_bytes=stats, output_bytes=bsh))
    act = block_activations(d, b, s, p)
    for i in range(d.layers):
        params = block_params(d, f"layers.{i}")
        if not v.qkv_bias:
            params = [pr for pr in params if not pr.name.endswith(("wq.bias", "wk.bias", "wv.bias"))]
        matmul = 2 * tok * sum(pr.numel for pr in params if len(pr.shape) == 2)
        fwd = matmul + 4 * b * s * s * d.q_dim  # no causal mask: the whole s x s attention is computed
        modules.append(Module(
            f"layers.{i}", "block", tuple(params), fwd_flops=fwd, bwd_flops=2 * fwd,
            fwd_hbm_bytes=2 * (act.saved + bsh), saved_bytes=act.saved, fwd_temp_bytes=act.fwd_temp,
            bwd_temp_bytes=act.bwd_temp, output_bytes=bsh, saves_input=act.saves_input, is_block=True))
    return prefixed(modules, prefix)


def _cross_entropy(name: str, rows: int, classes: int, p: int, *, fp32_cast: bool = True) -> Module:
    """A cross-entropy loss outside the model (as `build_transformer`'s): log_softmax on fp32 logits."""
    q = 4 if fp32_cast else p
    logits = rows * classes * q
    cast = logits if fp32_cast and p != 4 else 0
    return Module(name, "loss", fwd_hbm_bytes=3 * logits, saved_bytes=logits, fwd_temp_bytes=cast,
                  bwd_temp_bytes=logits + cast, output_bytes=4, saves_input=False, in_model=False)


def build_vit(v: VisionDims, *, num_labels: int, micro_batch: int, act_dtype: str, name: str) -> Workload:
    """`ViTForImageClassification`: encoder, final LayerNorm over all tokens, a Linear head on the CLS token.

    `micro_batch` is images; the sequence is patches + 1.
    """
    b, p, d = micro_batch, itemsize(act_dtype), v.tower
    h, s = d.hidden, v.seq
    tok = b * s
    bsh = tok * h * p
    modules = vision_tower(v, prefix="vit.", b=b, p=p)
    modules.append(Module("vit.layernorm", "norm", tuple(_norm("vit.layernorm", d)), fwd_hbm_bytes=2 * bsh,
                          saved_bytes=NORM_STAT_TENSORS[d.norm] * tok * 4, output_bytes=bsh))
    # the head reads the CLS row, a view: saving it keeps the whole LayerNorm output alive
    head = 2 * b * h * num_labels
    modules.append(Module("classifier", "head", tuple(_linear("classifier", h, num_labels, True)), fwd_flops=head,
                          bwd_flops=2 * head, fwd_hbm_bytes=b * num_labels * p, output_bytes=b * num_labels * p))
    modules.append(_cross_entropy("loss", b, num_labels, p))
    n_params = sum(m.numel for m in modules)
    return Workload(name=name, modules=tuple(modules), activation_dtype=act_dtype,
                    input_bytes=v.pixel_bytes(b) + b * 8, tokens=tok,
                    model_flops=_tower_flops(n_params, d.layers, d.q_dim, s, tok),
                    meta={"images": b, "seq": s, "patches": v.patches, "num_labels": num_labels})


def build_clip(v: VisionDims, text: TransformerDims, *, projection_dim: int, text_seq: int, micro_batch: int,
               act_dtype: str, name: str) -> Workload:
    """`CLIPModel` with `return_loss=True`: both towers, both projections, the contrastive loss on b x b logits."""
    b, p = micro_batch, itemsize(act_dtype)
    hv, ht, P = v.tower.hidden, text.hidden, projection_dim
    vis = vision_tower(v, prefix="vision_model.", b=b, p=p)
    # post_layernorm on the pooled CLS row (a view of the last block's output, which it keeps alive)
    vis.append(Module("vision_model.post_layernorm", "norm", tuple(_norm("vision_model.post_layernorm", v.tower)),
                      fwd_hbm_bytes=2 * b * hv * p, saved_bytes=NORM_STAT_TENSORS[v.tower.norm] * b * 4,
                      output_bytes=b * hv * p))
    proj_v = 2 * b * hv * P
    vis.append(Module("visual_projection", "linear", tuple(_linear("visual_projection", hv, P, False)),
                      fwd_flops=proj_v, bwd_flops=2 * proj_v, fwd_hbm_bytes=b * P * p, output_bytes=b * P * p))
    # the text tower: the decoder builder's embedding, causal blocks and final norm, without its LM head
    txt = build_transformer(text, micro_batch=b, seq_len=text_seq, act_dtype=act_dtype, name="text")
    txt_modules = [m for m in txt.modules if m.name not in ("output", "loss")]
    txt_modules[0] = replace(txt_modules[0], saves_input=True)  # carries the image embeddings (module docstring)
    txt_modules = prefixed(txt_modules, "text_model.")
    # the EOS rows are gathered (a copy) and projected; the final norm's output is not kept
    proj_t = 2 * b * ht * P
    txt_modules.append(Module("text_projection", "linear", tuple(_linear("text_projection", ht, P, False)),
                              fwd_flops=proj_t, bwd_flops=2 * proj_t, fwd_hbm_bytes=b * (ht + P) * p,
                              saved_bytes=b * ht * p, output_bytes=b * P * p, saves_input=False))
    # each embedding is divided by its norm (the b x 1 norms are kept), the normalised pair is kept by
    # logits = text @ image^T, and that product by the multiply with logit_scale.exp()
    emb = b * P * p
    logits = b * b * p
    head = 2 * b * b * P
    txt_modules.append(Module("logits", "head", (Param("logit_scale", ()),), fwd_flops=head + 6 * b * P,
                              bwd_flops=2 * head, fwd_hbm_bytes=4 * emb + logits,
                              saved_bytes=2 * emb + 2 * b * p + logits, output_bytes=logits))
    # (CE(logits_per_text) + CE(logits_per_image)) / 2, log_softmax in the logits' dtype, both directions
    loss = _cross_entropy("loss", 2 * b, b, p, fp32_cast=False)
    modules = vis + txt_modules + [loss]
    n_vis = sum(m.numel for m in vis)
    n_txt = sum(m.numel for m in txt_modules)
    flops = (_tower_flops(n_vis, v.tower.layers, v.tower.q_dim, v.seq, b * v.seq)
             + _tower_flops(n_txt, text.layers, text.q_dim, text_seq, b * text_seq))
    return Workload(name=name, modules=tuple(modules), activation_dtype=act_dtype,
                    input_bytes=v.pixel_bytes(b) + 2 * b * text_seq * 8, tokens=b * (v.seq + text_seq),
                    model_flops=flops, meta={"images": b, "vision_seq": v.seq, "text_seq": text_seq})


def build_llava(v: VisionDims, lm: Workload, *, text_hidden: int, projector_bias: bool, feature_tokens: int,
                micro_batch: int, act_dtype: str, name: str) -> Workload:
    """`LlavaForConditionalGeneration`: vision tower, 2-layer GELU projector, then the language model `lm`.

    `lm` is the decoder already built over text + image tokens; its embedding takes the projector's
    output (the image features it merges in). `feature_tokens` is 576 for CLIP-L/14 at 336 px without
    the CLS token (`vision_feature_select_strategy: default`).
    """
    b, p = micro_batch, itemsize(act_dtype)
    hv, ht, n = v.tower.hidden, text_hidden, feature_tokens
    vis = vision_tower(v, prefix="vision_tower.", b=b, p=p)
    feat = b * n * ht * p
    params = (_linear("multi_modal_projector.linear_1", hv, ht, projector_bias)
              + _linear("multi_modal_projector.linear_2", ht, ht, projector_bias)
              # the tower's post_layernorm runs on the CLS row LLaVA discards: its weights ride along here
              + _norm("vision_tower.post_layernorm", v.tower))
    proj = 2 * b * n * (hv * ht + ht * ht)
    # linear_1 keeps its input (a slice of the last block's output), GELU its input, linear_2 the GELU output
    projector = Module("multi_modal_projector", "projector", tuple(params), fwd_flops=proj, bwd_flops=2 * proj,
                       fwd_hbm_bytes=b * n * hv * p + 4 * feat, saved_bytes=2 * feat, bwd_temp_bytes=2 * feat,
                       output_bytes=feat)
    lm_modules = list(lm.modules)
    emb = lm_modules[0]
    # the token embeddings are computed, then the image features scattered into a new tensor
    lm_modules[0] = replace(emb, fwd_temp_bytes=emb.fwd_temp_bytes + emb.output_bytes,
                            fwd_hbm_bytes=emb.fwd_hbm_bytes + feat + 2 * emb.output_bytes, saves_input=False)
    lm_modules = [prefixed([m], "language_model.")[0] if m.in_model else m for m in lm_modules]
    modules = vis + [projector] + lm_modules
    n_vis = sum(m.numel for m in vis)
    flops = (_tower_flops(n_vis, v.tower.layers, v.tower.q_dim, v.seq, b * v.seq)
             + 6 * projector.numel * b * n + lm.model_flops)
    return Workload(name=name, modules=tuple(modules), activation_dtype=act_dtype,
                    input_bytes=lm.input_bytes + v.pixel_bytes(b), tokens=lm.tokens, model_flops=flops,
                    meta={**lm.meta, "images": b, "image_tokens": n, "vision_seq": v.seq})
