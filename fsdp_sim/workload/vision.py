"""Vision transformers and the models built on them: ViT classification, CLIP, LLaVA.

The encoder blocks are the decoder's pre-norm blocks (`block_params` / `block_activations`: LayerNorm,
GELU MLP, biases) without a causal mask, so attention FLOPs are not halved. Images come in as fp32
`pixel_values` (what an image processor yields); with a lower compute dtype FSDP2 casts them on the way
into the root module, and the patch convolution keeps that copy for its weight gradient. The
convolution has no input gradient (pixels do not require grad), so its backward is one weight-gradient
GEMM, as many FLOPs as its forward.

Kernels (`Module.kernels`, what the time model prices): the encoder blocks are `block_kernels` without a
causal mask (the whole s x s attention) and without rotary embeddings (positions are learned and added in
the embeddings); the patch convolution is a GEMM (m = images x patches, n = hidden, k = channels x
patch^2); layer norms, heads and projections as the Hugging Face modules launch them. CLIP's
`quick_gelu` is three eager kernels (`kernels.quick_gelu`). The convolution's kernel is a GEMM without
an input gradient, so its backward is the one weight-gradient GEMM it runs. Each module's FLOPs are its
kernels' (attention's backward 2.5x its forward), and `model_flops` their sum, as the decoder builder counts.

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
from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.workload.kernels import block_kernels, elementwise, gemm, loss_kernels, norm, with_activation
from fsdp_sim.workload.model import Kernel, Module, Param, Workload
from fsdp_sim.workload.transformer import (NORM_STAT_TENSORS, TransformerDims, _linear, _norm, block_activations,
                                           block_params, build_transformer)


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionDims:
    """A ViT-style image encoder: its transformer, image and patch sizes, and which embedding layout.

    `style` "vit" is Hugging Face's `ViTEmbeddings` (conv with bias, `cls_token` (1, 1, h) and
    `position_embeddings` (1, n + 1, h): dim 0 is 1, so FSDP2 pads them to a full copy per rank);
    "clip" is `CLIPVisionEmbeddings` (conv without bias, `class_embedding` (h,), an `nn.Embedding` of
    positions) followed by `pre_layrnorm`. `act` is the MLP's `hidden_act`: "quick_gelu" (CLIP's default)
    is three eager kernels; any other is priced as one GELU kernel (exact and tanh GELU are).
    """

    tower: TransformerDims
    image_size: int
    patch_size: int
    channels: int = 3
    style: str = "vit"
    qkv_bias: bool = True
    act: str = "gelu"

    def __post_init__(self) -> None:
        for key, limit in (("image_size", 1 << 16), ("patch_size", 1 << 16), ("channels", 1 << 10)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
                raise ScenarioError(f"model.hf_config: {key} must be a positive integer of at most {limit:,}, "
                                    f"got {show(value)}")
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


def _flops(kernels: tuple[Kernel, ...]) -> dict:
    """A module's FLOP fields from its kernels."""
    return {"fwd_flops": sum(k.fwd_flops for k in kernels), "bwd_flops": sum(k.bwd_flops for k in kernels),
            "kernels": kernels}


def _model_flops(modules) -> float:
    """What the kernels of one forward and backward execute (no recompute), as `build_transformer` counts."""
    return float(sum(m.fwd_flops + m.bwd_flops for m in modules))


def encoder_block_kernels(d: TransformerDims, b: int, s: int, p: int, act: str) -> tuple[Kernel, ...]:
    """A ViT / CLIP encoder block: `block_kernels` without a causal mask or rotary embeddings (the towers
    add learned positions in their embeddings; `learned_pos` says so to `block_kernels`)."""
    return with_activation(block_kernels(replace(d, learned_pos=True), b, s, p, causal=False), act, p)


def _embedding_kernels(v: VisionDims, b: int, p: int) -> tuple[Kernel, ...]:
    """Pixel cast, patch convolution (a GEMM), CLS concatenation, position add (and dropout).

    The convolution's output (b, h, n) is transposed into the concatenation, whose backward copies the
    gradient back into the convolution's layout; the position embedding's gradient is a sum over images.
    """
    d, h, n, s = v.tower, v.tower.hidden, v.patches, v.seq
    tok = b * s
    bsh, bnh, sh = tok * h * p, b * n * h * p, s * h * p
    pixels = v.pixel_bytes(b)
    ks = []
    if p != 4:  # FSDP2's cast of the fp32 pixels on the way into the root; no gradient
        ks.append(elementwise("pixel_values cast", pixels + pixels // 4 * p, 0, bwd_launches=0))
    # weight gradient only (pixels do not require grad), priced as a GEMM's two (module docstring)
    ks.append(gemm("patch embedding conv", b * n, h, v.channels * v.patch_size ** 2, input_grad=False))
    if v.style == "vit":  # cuDNN adds the convolution's bias in a second kernel; its gradient is a sum
        ks.append(elementwise("patch embedding bias", 2 * bnh, bnh))
    ks.append(elementwise("cat CLS token", 2 * bsh, 2 * bnh + 2 * b * h * p, bwd_launches=2))
    if v.style == "clip":  # nn.Embedding of the positions: a gather of s rows; backward zero-fills and adds
        ks.append(elementwise("position_embedding lookup", 2 * sh, 3 * sh, bwd_launches=2))
    ks.append(elementwise("+ position embeddings", 2 * bsh + sh, bsh + sh))
    if d.dropout:
        ks.append(elementwise("embedding dropout", 2 * bsh + tok * h, 2 * bsh + tok * h))
    return tuple(ks)


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
        saves_input=False, kernels=_embedding_kernels(v, b, p))]
    stats = NORM_STAT_TENSORS[d.norm] * tok * 4
    if v.style == "clip":
        modules.append(Module("pre_layrnorm", "norm", tuple(_norm("pre_layrnorm", d)), fwd_hbm_bytes=2 * bsh,
                              saved_bytes=stats, output_bytes=bsh, kernels=(norm("pre_layrnorm", tok, h, p, fused=True),)))
    act = block_activations(d, b, s, p)
    # no causal mask: the whole s x s attention is computed (4 b s^2 h forward)
    flops = _flops(encoder_block_kernels(d, b, s, p, v.act))
    for i in range(d.layers):
        params = block_params(d, f"layers.{i}")
        if not v.qkv_bias:
            params = [pr for pr in params if not pr.name.endswith(("wq.bias", "wk.bias", "wv.bias"))]
        modules.append(Module(
            f"layers.{i}", "block", tuple(params), **flops,
            fwd_hbm_bytes=2 * (act.saved + bsh), saved_bytes=act.saved, fwd_temp_bytes=act.fwd_temp,
            bwd_temp_bytes=act.bwd_temp, bwd_tail_bytes=act.bwd_tail, nosave_fwd_peak_bytes=act.nosave_peak,
            output_bytes=bsh, saves_input=act.saves_input, is_block=True))
    return prefixed(modules, prefix)


def _cls_row(name: str, b: int, s: int, h: int, p: int, *, copied: bool) -> Kernel:
    """`hidden[:, 0]`: a view (copied when the next kernel wants it contiguous); backward zero-fills the
    (b, s, h) gradient and copies the row in."""
    row = b * h * p
    return elementwise(name, 2 * row if copied else 0, b * s * h * p + 2 * row, launches=int(copied), bwd_launches=2)


def _cross_entropy(name: str, rows: int, classes: int, p: int, *, fp32_cast: bool = True) -> Module:
    """A cross-entropy loss outside the model (as `build_transformer`'s): log_softmax on fp32 logits.

    Without the cast (CLIP) it is two cross-entropies in the logits' dtype, one per direction over the
    rows of `logits` and of its transpose, averaged; backward sums the two gradients of the logits."""
    q = 4 if fp32_cast else p
    logits = rows * classes * q
    cast = logits if fp32_cast and p != 4 else 0
    if fp32_cast:
        kernels = loss_kernels(rows, classes, p)
    else:
        kernels = (Kernel("2 x (log_softmax + nll_loss), mean", "cross_entropy", (rows, classes), bytes=2 * logits,
                          bwd_bytes=2 * logits + 3 * logits // 2, launches=2 * 3 + 2, bwd_launches=2 * 4 + 2),)
    return Module(name, "loss", fwd_hbm_bytes=3 * logits, saved_bytes=logits, fwd_temp_bytes=cast,
                  bwd_temp_bytes=logits + cast, output_bytes=4, saves_input=False, in_model=False, kernels=kernels)


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
                          saved_bytes=NORM_STAT_TENSORS[d.norm] * tok * 4, output_bytes=bsh,
                          kernels=(norm("vit.layernorm", tok, h, p, fused=True),)))
    # the head reads the CLS row, a view: saving it keeps the whole LayerNorm output alive
    head = (_cls_row("CLS row", b, s, h, p, copied=False), gemm("classifier", b, num_labels, h))
    modules.append(Module("classifier", "head", tuple(_linear("classifier", h, num_labels, True)), **_flops(head),
                          fwd_hbm_bytes=b * num_labels * p, output_bytes=b * num_labels * p))
    modules.append(_cross_entropy("loss", b, num_labels, p))
    return Workload(name=name, modules=tuple(modules), activation_dtype=act_dtype,
                    input_bytes=v.pixel_bytes(b) + b * 8, tokens=tok, model_flops=_model_flops(modules),
                    meta={"images": b, "seq": s, "patches": v.patches, "num_labels": num_labels})


def build_clip(v: VisionDims, text: TransformerDims, *, projection_dim: int, text_seq: int, micro_batch: int,
               act_dtype: str, name: str, text_act: str = "quick_gelu") -> Workload:
    """`CLIPModel` with `return_loss=True`: both towers, both projections, the contrastive loss on b x b logits.

    `text_act` is the text tower's `hidden_act` (its blocks are the decoder builder's, whose GELU it replaces)."""
    b, p = micro_batch, itemsize(act_dtype)
    hv, ht, P = v.tower.hidden, text.hidden, projection_dim
    vis = vision_tower(v, prefix="vision_model.", b=b, p=p)
    # post_layernorm on the pooled CLS row (a view of the last block's output, which it keeps alive;
    # LayerNorm copies it contiguous)
    pooled = (_cls_row("pooled CLS row", b, v.seq, hv, p, copied=True), norm("post_layernorm", b, hv, p, fused=True))
    vis.append(Module("vision_model.post_layernorm", "norm", tuple(_norm("vision_model.post_layernorm", v.tower)),
                      fwd_hbm_bytes=2 * b * hv * p, saved_bytes=NORM_STAT_TENSORS[v.tower.norm] * b * 4,
                      output_bytes=b * hv * p, kernels=pooled))
    vis.append(Module("visual_projection", "linear", tuple(_linear("visual_projection", hv, P, False)),
                      **_flops((gemm("visual_projection", b, P, hv),)), fwd_hbm_bytes=b * P * p, output_bytes=b * P * p))
    # the text tower: the decoder builder's embedding, causal blocks and final norm, without its LM head
    txt = build_transformer(text, micro_batch=b, seq_len=text_seq, act_dtype=act_dtype, name="text")
    txt_modules = [m for m in txt.modules if m.name not in ("output", "loss")]
    txt_modules[0] = replace(txt_modules[0], saves_input=True)  # carries the image embeddings (module docstring)
    txt_modules = [replace(m, kernels=with_activation(m.kernels, text_act, p)) if m.is_block else m for m in txt_modules]
    txt_modules = prefixed(txt_modules, "text_model.")
    # the EOS rows are gathered (argmax of the ids, an index copy) and projected; the final norm's output
    # is not kept; the gather's backward zero-fills the (b, s, h) gradient and puts the rows in
    eos = elementwise("EOS rows (argmax, gather)", 2 * b * ht * p + b * text_seq * 8,
                      b * text_seq * ht * p + 2 * b * ht * p, launches=3, bwd_launches=2)
    txt_modules.append(Module("text_projection", "linear", tuple(_linear("text_projection", ht, P, False)),
                              **_flops((eos, gemm("text_projection", b, P, ht))), fwd_hbm_bytes=b * (ht + P) * p,
                              saved_bytes=b * ht * p, output_bytes=b * P * p, saves_input=False))
    # each embedding is divided by its norm (the b x 1 norms are kept), the normalised pair is kept by
    # logits = text @ image^T, and that product by the multiply with logit_scale.exp()
    emb = b * P * p
    logits = b * b * p
    # x / x.norm(dim=-1, keepdim=True): a norm and a divide; backward the divide's two gradients, the
    # norm's, and their sum
    normalize = [elementwise(f"{e} / its norm", 3 * emb + 2 * b * p, 10 * emb, launches=2, bwd_launches=7)
                 for e in ("image_embeds", "text_embeds")]
    head = (*normalize, gemm("text_embeds @ image_embeds.T", b, b, P),
            elementwise("logit_scale.exp()", 8, 8),
            # backward: the logits' gradient times the scale, and (gradient x logits).sum() for the scale
            elementwise("* logit_scale", 2 * logits, 6 * logits, bwd_launches=3))
    txt_modules.append(Module("logits", "head", (Param("logit_scale", ()),), **_flops(head),
                              fwd_hbm_bytes=4 * emb + logits,
                              saved_bytes=2 * emb + 2 * b * p + logits, output_bytes=logits))
    # (CE(logits_per_text) + CE(logits_per_image)) / 2, log_softmax in the logits' dtype, both directions
    loss = _cross_entropy("loss", 2 * b, b, p, fp32_cast=False)
    modules = vis + txt_modules + [loss]
    return Workload(name=name, modules=tuple(modules), activation_dtype=act_dtype,
                    input_bytes=v.pixel_bytes(b) + 2 * b * text_seq * 8, tokens=b * (v.seq + text_seq),
                    model_flops=_model_flops(modules), meta={"images": b, "vision_seq": v.seq, "text_seq": text_seq})


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
    # linear_1 keeps its input (a slice of the last block's output), GELU its input, linear_2 the GELU output
    vis_row = b * hv * p
    kernels = [
        # the tower still runs post_layernorm on the pooled CLS row, whose output LLaVA drops: no backward
        elementwise("pooled CLS row", 2 * vis_row, 0, bwd_launches=0),
        Kernel("vision_tower.post_layernorm", "norm", (b, hv), bytes=2 * vis_row, launches=1, bwd_launches=0)]
    if n < v.seq:  # hidden[:, 1:] drops the CLS token: linear_1 copies it contiguous when b > 1; its
        # backward zero-fills the (b, s, hv) gradient and copies the slice in
        kernels.append(elementwise("image features [:, 1:]", 2 * b * n * hv * p if b > 1 else 0,
                                   b * v.seq * hv * p + 2 * b * n * hv * p, launches=int(b > 1), bwd_launches=2))
    kernels += [gemm("linear_1", b * n, ht, hv),
                Kernel("gelu", "activation", (b * n, ht), bytes=2 * feat, bwd_bytes=3 * feat),
                gemm("linear_2", b * n, ht, ht, recompute=False)]
    projector = Module("multi_modal_projector", "projector", tuple(params), **_flops(tuple(kernels)),
                       fwd_hbm_bytes=b * n * hv * p + 4 * feat, saved_bytes=2 * feat, bwd_temp_bytes=2 * feat,
                       output_bytes=feat)
    lm_modules = list(lm.modules)
    emb = lm_modules[0]
    # the token embeddings are computed, then the image features scattered into a new tensor:
    # `input_ids == image_token_index`, then masked_scatter (a copy of the embeddings, a prefix sum of the
    # mask, the scatter); backward masked_fill for the embeddings' gradient, masked_select for the features'
    out = emb.output_bytes
    merge = elementwise("masked_scatter image features", 2 * out + 2 * feat + lm.tokens * 9,
                        3 * out + 2 * feat + lm.tokens, launches=5, bwd_launches=4)
    lm_modules[0] = replace(emb, fwd_temp_bytes=emb.fwd_temp_bytes + emb.output_bytes,
                            fwd_hbm_bytes=emb.fwd_hbm_bytes + feat + 2 * emb.output_bytes, saves_input=False,
                            kernels=emb.kernels + (merge,))
    lm_modules = [prefixed([m], "language_model.")[0] if m.in_model else m for m in lm_modules]
    modules = vis + [projector] + lm_modules
    return Workload(name=name, modules=tuple(modules), activation_dtype=act_dtype,
                    input_bytes=lm.input_bytes + v.pixel_bytes(b), tokens=lm.tokens, model_flops=_model_flops(modules),
                    meta={**lm.meta, "images": b, "image_tokens": n, "vision_seq": v.seq})
