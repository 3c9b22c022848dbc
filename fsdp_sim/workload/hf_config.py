"""A workload from a Hugging Face `config.json`, read as plain JSON (no `transformers` needed).

Families (`model_type`):
- decoders: llama, mistral, qwen2 (Qwen 2 and 2.5), qwen3, gemma, gemma2, gemma3_text, phi3, gpt2, gpt_neox,
  and the mixture-of-experts mixtral and qwen2_moe (see `moe.py`); built by `build_transformer` (`micro_batch`
  sequences of `seq_len` tokens), Gemma 2 / 3's and Qwen 3's extra norms, softcapping and sliding windows
  by `hf_families.py`, and with `parallelism.tp` one rank's share of a TP plan (`build_from_hf_config(tp=)`);
- vit: `ViTForImageClassification` (`micro_batch` images, sequence = patches + 1; see `vision.py`);
- clip: `CLIPModel` with its contrastive loss (`seq_len` text tokens, at most the text tower's positions);
- llava: CLIP vision tower, projector, and a decoder `text_config` over `seq_len` text tokens plus the
  image tokens.

Every key that sets a shape is required: a missing one raises `ScenarioError` naming it (configs saved
by recent `transformers` list them all; older ones may leave class defaults out, which are not guessed
here). Keys that only switch a feature (biases, tied embeddings, dropout) take the family's default.

Gated MLPs (SwiGLU, Gemma's GeGLU, Phi-3's fused gate_up) save the same tensors whatever the activation.
Modelled as their memory and FLOPs, not their exact kernels: GPT-NeoX's parallel residual is treated as
sequential (one extra (b, s, h) tensor saved per block); Phi-3's fused qkv / gate_up projections are kept
as separate parameters (same count, slightly different FSDP2 dim-0 padding); sliding-window attention
is computed in full; rotary embeddings have no parameters. Every module carries the kernels its builder
lists (`Module.kernels`: the decoder's `block_kernels`, the MoE and vision builders' own); of the configs'
activations only the vision and CLIP towers' `hidden_act` is read (CLIP's `quick_gelu` is three kernels).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

from fsdp_sim.dtypes import itemsize
from fsdp_sim.datafile import read_data
from fsdp_sim.errors import ScenarioError, show, warn
from fsdp_sim.workload.model import Param, Workload
from fsdp_sim.workload.hf_families import QK_NORM, SANDWICH, apply_family
from fsdp_sim.workload.moe import MoESpec, apply_moe
from fsdp_sim.workload.tensor_parallel import TensorParallel, build_tp_transformer, tp_dims
from fsdp_sim.workload.transformer import MAX_VOCAB, TransformerDims, build_transformer
from fsdp_sim.workload.vision import VisionDims, build_clip, build_llava, build_vit

_MISSING = object()
ATTN, MLP = ("wq", "wk", "wv", "wo"), ("w1", "w2", "w3")
# family -> (gated MLP, norm, tie_word_embeddings default)
DECODERS = {
    "llama": ("swiglu", "rmsnorm", False), "mistral": ("swiglu", "rmsnorm", False),
    "qwen2": ("swiglu", "rmsnorm", False), "gemma": ("swiglu", "rmsnorm", True),
    "phi3": ("swiglu", "rmsnorm", False), "gpt2": ("gelu", "layernorm", True),
    "gpt_neox": ("gelu", "layernorm", False), "mixtral": ("swiglu", "rmsnorm", False),
    "qwen2_moe": ("swiglu", "rmsnorm", False), "qwen3": ("swiglu", "rmsnorm", False),
    "gemma2": ("swiglu", "rmsnorm", True), "gemma3_text": ("swiglu", "rmsnorm", True),
}
FAMILY_EXTRAS = (*SANDWICH, *QK_NORM)  # hf_families.py
# families whose base_model_tp_plan is Llama's (q/k/v/gate/up colwise, o/down rowwise); Phi-3's gathers its
# fused qkv / gate_up outputs (`colwise_gather_output` / `rowwise_split_input`), GPT-2 and GPT-NeoX have none
LLAMA_TP_PLAN = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
GEMMA = ("gemma", "gemma2", "gemma3_text")  # Gemma's RMSNorm: fp32 throughout, `* (1 + weight)
SUPPORTED = sorted([*DECODERS, "vit", "clip", "llava"])
MAX_COUNT = 1 << 40  # any count or size a config sets; the dims and expert checks state tighter limits


class _Config:
    """One (sub-)config mapping; its getters raise `ScenarioError` naming the key and the file."""

    def __init__(self, data, where: str, source: str, model_type: str | None = None) -> None:
        if not isinstance(data, dict):
            raise ScenarioError(f"model.hf_config: {where.rstrip('.') or 'the file'} in {source} must be a JSON object")
        self.data, self.where, self.source = data, where, source
        self.model_type = model_type if model_type is not None else data.get("model_type")

    def _find(self, names: tuple[str, ...], default):
        for key in names:
            if self.data.get(key) is not None:
                return key, self.data[key]
        if default is _MISSING:
            alias = f" (or {', '.join(repr(self.where + n) for n in names[1:])})" if len(names) > 1 else ""
            needed = f" (required for model_type {self.model_type!r})" if isinstance(self.model_type, str) else ""
            raise ScenarioError(f"model.hf_config: {self.where + names[0]!r}{alias} missing in {self.source}{needed}")
        return None, default

    def int(self, *names: str, default=_MISSING, positive: bool = True, maximum: int = MAX_COUNT):
        key, value = self._find(names, default)
        if key is None:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or (positive and value <= 0) or value < 0:
            raise self.bad(key, f"a {'positive' if positive else 'non-negative'} integer", value)
        if value > maximum:
            raise ScenarioError(f"model.hf_config: {self.where + key!r} in {self.source} is {value:,}, past the "
                                f"limit of {maximum:,}")
        return value

    def float(self, *names: str, default=_MISSING) -> float:
        key, value = self._find(names, default)
        if key is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                or not math.isfinite(value if isinstance(value, float) else 0.0) or abs(value) > 1e300):
            raise self.bad(key, "a finite number", value)
        return float(value)

    def bool(self, *names: str, default=_MISSING) -> bool:
        key, value = self._find(names, default)
        if key is not None and not isinstance(value, bool):
            raise self.bad(key, "true or false", value)
        return value

    def str(self, *names: str, default=_MISSING) -> str:
        key, value = self._find(names, default)
        if key is not None and not isinstance(value, str):
            raise self.bad(key, "a string", value)
        return value

    def bad(self, key: str, expected: str, value) -> ScenarioError:
        return ScenarioError(f"model.hf_config: {self.where + key!r} in {self.source} must be {expected}, "
                             f"got {show(value)}")

    def reraise(self, exc: ScenarioError) -> ScenarioError:
        """A dims check failed: say which file (and sub-config) it came from."""
        where = f", {self.where.rstrip('.')}" if self.where else ""
        return ScenarioError(f"model.hf_config ({self.source}{where}): {exc}")

    def sub(self, key: str, model_type: str | None = None) -> _Config:
        self._find((key,), _MISSING)
        sub = _Config(self.data[key], f"{self.where}{key}.", self.source)
        if model_type is not None and sub.model_type is None:
            sub.model_type = model_type
        return sub

    def model_type_in(self, allowed) -> str:
        mt = self.str("model_type") if self.model_type is None or "model_type" in self.data else self.model_type
        if mt not in allowed:
            raise ScenarioError(f"model.hf_config: {self.where + 'model_type'!r} {mt!r} in {self.source} is not "
                                f"supported, expected one of {sorted(allowed)}")
        return mt


def load_hf_config(path: str | Path) -> dict:
    data = read_data(path, "model.hf_config", fmt="json")
    if not isinstance(data, dict):
        raise ScenarioError(f"model.hf_config: {path} must hold a JSON object")
    return data


def build_from_hf_config(path: str | Path, *, micro_batch: int, seq_len: int, act_dtype: str,
                         tp: TensorParallel | None = None) -> Workload:
    """The workload of one training step of the model a Hugging Face `config.json` describes; with `tp` (more
    than one rank) one rank's share of its decoder under `tp.plan`. Built once per config text and arguments
    (`_built`), as `build_transformer` is per dimensions: a sweep's points then share the workload and what
    is derived from it (units, module bytes, the last build's view)."""
    path = Path(path)
    name = path.parent.name if path.stem == "config" else path.stem
    return _built(json.dumps(load_hf_config(path)), micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype,
                  name=name, source=path.name, tp=tp)


@lru_cache(maxsize=256)  # as many as build_transformer keeps; a Workload is frozen
def _built(config: str, **arguments) -> Workload:
    """`build_from_hf_dict` of a config read as JSON, remembered by its text (exact: the config is JSON). What
    the build warns of is said at the first build only, as the CLI says each warning once per process."""
    return build_from_hf_dict(json.loads(config), **arguments)


def build_from_hf_dict(data: dict, *, micro_batch: int, seq_len: int, act_dtype: str, name: str = "hf",
                       source: str = "config.json", tp: TensorParallel | None = None) -> Workload:
    if micro_batch <= 0 or seq_len <= 0:
        raise ScenarioError(f"training: micro_batch and seq_len must be positive, got {micro_batch}, {seq_len}")
    itemsize(act_dtype)
    c = _Config(data, "", source)
    mt = c.model_type_in(SUPPORTED)
    meta = {"source": "hf_config", "model_type": mt}
    tp = tp if tp is not None and tp.size > 1 else None
    if tp is not None and (mt not in DECODERS or mt in ("mixtral", "qwen2_moe")):
        raise ScenarioError(f"parallelism.tp: needs a dense decoder, not model_type {mt!r} (model.hf_config)")
    if tp is not None and tp.plan == "hf" and mt not in LLAMA_TP_PLAN:
        raise ScenarioError(f"parallelism.tp_plan: hf is modelled for {list(LLAMA_TP_PLAN)}, whose base_model_tp_plan "
                            f"is Llama's colwise / rowwise; not model_type {mt!r}")
    if mt in DECODERS:
        wl = build_decoder(c, micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype, name=name, tp=tp)
    elif mt == "vit":
        v = vision_dims(c, "vit")
        id2label = c.data.get("id2label")
        if id2label is not None and not isinstance(id2label, dict):
            raise c.bad("id2label", "a mapping of class index to label", id2label)
        labels = c.int("num_labels", default=None, maximum=MAX_VOCAB) or (len(id2label) if id2label else 1000)
        wl = build_vit(v, num_labels=labels, micro_batch=micro_batch, act_dtype=act_dtype, name=name)
    elif mt == "clip":
        text = c.sub("text_config", "clip_text_model")
        tdims = _clip_text_dims(text)
        if seq_len > tdims.max_seq:
            raise ScenarioError(f"training.seq_len: {seq_len} exceeds the CLIP text tower's max_position_embeddings "
                                f"{tdims.max_seq} (text_config.max_position_embeddings)")
        wl = build_clip(vision_dims(c.sub("vision_config", "clip_vision_model"), "clip"), tdims,
                        projection_dim=c.int("projection_dim"), text_seq=seq_len, micro_batch=micro_batch,
                        act_dtype=act_dtype, name=name, text_act=_activation(text, "quick_gelu"))
    else:
        wl = _build_llava(c, micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype, name=name)
    return replace(wl, meta={**meta, **wl.meta})


# ---- decoders -------------------------------------------------------------------------------------
def _check_heads(c: _Config, hidden: int, heads: int, kv: int | None, head_dim: int | None,
                 keys=("hidden_size", "num_attention_heads"), *, decoder: bool = True) -> None:
    """The attention's shape checks, worded with the config's own keys."""
    if head_dim is None and hidden % heads:
        hint = " (and no 'head_dim' is given)" if decoder else ""
        raise ScenarioError(f"model.hf_config: {c.where + keys[1]!r} {heads} in {c.source} does not divide "
                            f"{c.where + keys[0]!r} {hidden}{hint}")
    if kv is not None and heads % kv:
        raise ScenarioError(f"model.hf_config: {c.where + 'num_key_value_heads'!r} {kv} in {c.source} does not "
                            f"divide {c.where + keys[1]!r} {heads}")


def decoder_dims(c: _Config) -> tuple[TransformerDims, set[str], bool]:
    """The dims, the linear layers that carry a bias (beyond `dims.bias`), and whether embeddings use dropout."""
    mt = c.model_type
    mlp, norm, tie_default = DECODERS[mt]
    keys = ("n_embd", "n_layer", "n_head") if mt == "gpt2" else \
        ("hidden_size", "num_hidden_layers", "num_attention_heads")
    hidden, layers, heads = (c.int(k) for k in keys)
    kv, head_dim = c.int("num_key_value_heads", default=None), c.int("head_dim", default=None)
    _check_heads(c, hidden, heads, kv, head_dim, (keys[0], keys[2]))
    ffn = c.int("n_inner", default=4 * hidden) if mt == "gpt2" else c.int("intermediate_size")
    biases: set[str] = set()
    if mt == "gpt2":
        biases = {*ATTN, *MLP}
    elif mt == "gpt_neox":
        biases = {*MLP, *(ATTN if c.bool("attention_bias", default=True) else ())}
    elif mt in ("qwen2", "qwen2_moe"):
        biases = {"wq", "wk", "wv"}  # Qwen2Attention: bias on q/k/v only
    elif mt in ("llama", "mistral", "qwen3", *GEMMA):
        biases = {*(ATTN if c.bool("attention_bias", default=False) else ()),
                  *(MLP if c.bool("mlp_bias", default=False) else ())}
    resid_dropout = {"gpt2": ("resid_pdrop", 0.1), "phi3": ("resid_pdrop", 0.0), "gpt_neox": ("hidden_dropout", 0.0)}
    emb_dropout = {"gpt2": ("embd_pdrop", 0.1), "phi3": ("embd_pdrop", 0.0)}
    dropout = mt in resid_dropout and c.float(resid_dropout[mt][0], default=resid_dropout[mt][1]) > 0
    emb_drop = mt in emb_dropout and c.float(emb_dropout[mt][0], default=emb_dropout[mt][1]) > 0
    learned = mt == "gpt2"
    values = dict(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv, ffn_hidden=ffn, vocab=c.int("vocab_size"),
        mlp=mlp, norm=norm, bias=biases == {*ATTN, *MLP},
        tie_embeddings=c.bool("tie_word_embeddings", default=tie_default), learned_pos=learned,
        max_seq=c.int("n_positions", "n_ctx") if learned else 0, dropout=dropout, head_dim=head_dim,
        # Hugging Face's RMSNorms upcast to fp32 (transformer.norm_saves); Gemma's applies its weight in fp32
        norm_impl="composite" if mt in GEMMA else "hf_llama",
        # Gemma 2's softcapped attention runs eager (SDPA has no softcap; hf_families.py)
        attention="eager" if mt == "gemma2" and c.float("attn_logit_softcapping", default=0.0) > 0 else "sdpa")
    try:
        dims = TransformerDims(**values)
    except ScenarioError as exc:  # say which file the values came from
        raise c.reraise(exc) from None
    return dims, (set() if dims.bias else biases), emb_drop


def _moe_spec(c: _Config, d: TransformerDims) -> tuple[MoESpec, list[bool]]:
    if c.model_type == "mixtral":
        spec = MoESpec(experts=c.int("num_local_experts"), top_k=c.int("num_experts_per_tok"), expert_ffn=d.ffn)
        sparse = [True] * d.layers
    else:  # qwen2_moe
        spec = MoESpec(experts=c.int("num_experts"), top_k=c.int("num_experts_per_tok"),
                       expert_ffn=c.int("moe_intermediate_size"),
                       shared_ffn=c.int("shared_expert_intermediate_size", default=0, positive=False),
                       norm_topk=c.bool("norm_topk_prob", default=False))
        step = c.int("decoder_sparse_step", default=1)
        dense = c.data.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise c.bad("mlp_only_layers", "a list of layer indices", dense)
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(d.layers)]
    if spec.top_k > spec.experts:
        raise ScenarioError(f"model.hf_config: {c.where + 'num_experts_per_tok'!r} {spec.top_k} exceeds the "
                            f"{spec.experts} experts in {c.source}")
    return spec, sparse


# fields that change a step's memory or time, which the decoder builder does not price: each is named in a
# warning when the config sets it, never silently ignored (Gemma 2's relabelled as gemma, say)
UNPRICED = {
    "attn_logit_softcapping": "Gemma 2's attention softcapping: SDPA's flash kernels have none, so attention runs eager",
    "final_logit_softcapping": "Gemma 2's logit softcapping: a tanh over the logits, more loss memory and time",
}


def _unpriced(c: _Config, seq_len: int) -> None:
    """Warn, one line each, of what the config says that the workload does not model."""
    for key, what in UNPRICED.items():
        if c.data.get(key) is not None and c.model_type != "gemma2":  # gemma2's are modelled (hf_families.py)
            warn(f"hf_config: {key} {show(c.data[key])} is not modelled ({what}); model_type {c.model_type}")
    window = c.data.get("sliding_window")
    if isinstance(window, int) and not isinstance(window, bool) and 0 < window < seq_len \
            and c.data.get("use_sliding_window", True) and c.model_type not in ("gemma2", "gemma3_text"):
        warn(f"hf_config: sliding_window {window} < training.seq_len {seq_len}: attention is priced over the whole "
             "sequence, not the window")
    positions = c.data.get("max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool) and 0 < positions < seq_len:
        warn(f"training.seq_len: {seq_len} is past the model's max_position_embeddings {positions} "
             "(simulated as asked; the model was not trained that long)")


def build_decoder(c: _Config, *, micro_batch: int, seq_len: int, act_dtype: str, name: str,
                  tp: TensorParallel | None = None) -> Workload:
    """A causal LM: `build_transformer` (one TP rank's share with `tp`), then the family's extra biases (on the
    per-rank weights: a colwise bias is sharded with its rows), norms and softcaps, embedding dropout and experts."""
    _unpriced(c, seq_len)
    d, biases, emb_dropout = decoder_dims(c)
    if tp is None:
        wl = build_transformer(d, micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype, name=name)
        local, norm_rows = d, None
    else:
        try:
            wl = build_tp_transformer(d, tp, micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype, name=name)
        except ScenarioError as exc:
            raise c.reraise(exc) from None
        local = tp_dims(d, tp.size)
        norm_rows = micro_batch * seq_len // tp.size if tp.sequence_parallel else None
    if c.model_type in FAMILY_EXTRAS:
        wl = apply_family(wl, c, local, micro_batch=micro_batch, seq_len=seq_len, p=itemsize(act_dtype),
                          norm_rows=norm_rows)
    if c.model_type in ("mixtral", "qwen2_moe"):
        spec, sparse = _moe_spec(c, d)
        wl = apply_moe(wl, d, spec, sparse, micro_batch=micro_batch, seq_len=seq_len)
    if biases:
        wl = _add_biases(wl, biases)
    if emb_dropout:
        emb = wl.modules[0]
        mask = micro_batch * seq_len * d.hidden  # bool mask; the pre-dropout sum is a transient
        wl = replace(wl, modules=(replace(emb, saved_bytes=emb.saved_bytes + mask,
                                          fwd_temp_bytes=emb.fwd_temp_bytes + emb.output_bytes), *wl.modules[1:]))
    return wl


def _add_biases(wl: Workload, linears: set[str]) -> Workload:
    """Give each block's named attention / MLP linear layers a bias (Qwen2's q/k/v, Llama's attention_bias)."""
    modules = []
    for m in wl.modules:
        if m.is_block:
            params: list[Param] = []
            for p in m.params:
                params.append(p)
                for lin in linears:
                    if p.name in (f"{m.name}.attention.{lin}.weight", f"{m.name}.feed_forward.{lin}.weight"):
                        params.append(Param(p.name[:-len("weight")] + "bias", (p.shape[0],), p.dtype, p.trainable))
            m = replace(m, params=tuple(params))
        modules.append(m)
    return replace(wl, modules=tuple(modules))


# ---- vision ---------------------------------------------------------------------------------------
def _encoder_dims(c: _Config, dropout_key: str) -> TransformerDims:
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    _check_heads(c, hidden, heads, None, None, decoder=False)
    values = dict(hidden=hidden, layers=c.int("num_hidden_layers"), heads=heads, ffn_hidden=c.int("intermediate_size"),
                  vocab=c.int("vocab_size", default=1), mlp="gelu", norm="layernorm", bias=True,
                  dropout=c.float(dropout_key, default=0.0) > 0)
    try:
        return TransformerDims(**values)
    except ScenarioError as exc:
        raise c.reraise(exc) from None


def vision_dims(c: _Config, style: str) -> VisionDims:
    """`ViTConfig` (style "vit") or `CLIPVisionConfig` (style "clip")."""
    if style == "clip":
        c.model_type_in(("clip_vision_model",))
    tower = _encoder_dims(c, "hidden_dropout_prob" if style == "vit" else "dropout")
    act = _activation(c, "gelu" if style == "vit" else "quick_gelu")
    return VisionDims(tower=replace(tower, vocab=1), image_size=c.int("image_size"), patch_size=c.int("patch_size"),
                      channels=c.int("num_channels", default=3), style=style,
                      qkv_bias=c.bool("qkv_bias", default=True) if style == "vit" else True, act=act)


def _activation(c: _Config, default: str) -> str:
    """`hidden_act` of a vision or CLIP text config (ViTConfig's default gelu, CLIP's quick_gelu); it sets
    the MLP's kernels only (`vision.VisionDims.act`)."""
    return c.str("hidden_act", default=default)


def _clip_text_dims(c: _Config) -> TransformerDims:
    c.model_type_in(("clip_text_model",))
    d = _encoder_dims(c, "dropout")
    return replace(d, vocab=c.int("vocab_size"), learned_pos=True, max_seq=c.int("max_position_embeddings"))


def _build_llava(c: _Config, *, micro_batch: int, seq_len: int, act_dtype: str, name: str) -> Workload:
    v = vision_dims(c.sub("vision_config", "clip_vision_model"), "clip")
    text = c.sub("text_config", "llama")
    text.model_type_in(DECODERS)
    strategy = c.str("vision_feature_select_strategy", default="default")
    if strategy not in ("default", "full"):
        raise ScenarioError(f"model.hf_config: 'vision_feature_select_strategy' {strategy!r} in {c.source} is not "
                            "one of ['default', 'full']")
    image_tokens = v.patches if strategy == "default" else v.seq  # "default" drops the CLS token
    lm = build_decoder(text, micro_batch=micro_batch, seq_len=seq_len + image_tokens, act_dtype=act_dtype, name=name)
    d = decoder_dims(text)[0]
    return build_llava(v, lm, text_hidden=d.hidden, projector_bias=c.bool("multimodal_projector_bias", default=True),
                       feature_tokens=image_tokens, micro_batch=micro_batch, act_dtype=act_dtype, name=name)
