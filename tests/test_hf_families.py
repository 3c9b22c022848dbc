"""Gemma 2, Gemma 3, Qwen 2.5 and Qwen 3 from their published config.json files (scenarios/hf/): parameter
counts against the published figures, what each family adds (hf_families.py), and TP on a model given by an
HF config (`build_from_hf_config(tp=...)`)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from fsdp_sim.errors import ScenarioError
from fsdp_sim.workload.hf_config import build_from_hf_config, build_from_hf_dict, load_hf_config
from fsdp_sim.workload.tensor_parallel import TensorParallel

HF = Path(__file__).parent.parent / "scenarios" / "hf"


def _build(name: str, seq: int = 4096, **kw):
    return build_from_hf_config(HF / f"{name}.json", micro_batch=1, seq_len=seq, act_dtype="bf16", **kw)


def _counts(wl) -> tuple[int, int]:
    total = sum(m.numel for m in wl.modules)
    return total, total - sum(p.numel for m in wl.modules if m.kind in ("embedding", "head") for p in m.params)


@pytest.mark.parametrize("name,published,places,non_embedding", [
    ("gemma-2-9b", 9_241_705_984, None, None),  # google/gemma-2-9b safetensors: 9,241,705,984 parameters
    ("gemma-3-1b-pt", 999_885_952, None, None),  # google/gemma-3-1b-pt safetensors: 999,885,952
    ("qwen2.5-7b", 7.61e9, 0.01e9, 6.53e9),  # Qwen2.5-7B card: 7.61B, 6.53B non-embedding
    ("qwen3-8b", 8.2e9, 0.1e9, 6.95e9),  # Qwen3-8B card: 8.2B, 6.95B non-embedding
])
def test_parameter_counts_match_the_published(name, published, places, non_embedding):
    total, body = _counts(_build(name))
    if places is None:
        assert total == published
    else:  # the card rounds: to its last digit
        assert abs(total - published) <= places / 2 + 1e7 * (places < 0.1e9)
        assert abs(body - non_embedding) <= 0.005e9


def test_gemma2_prices_eager_softcapped_attention_and_logit_softcap_without_warning():
    """SDPA has no softcap, so attention is the explicit-scores kernel with three softcap kernels; tanh saves
    its (b, heads, s, s) output, and the final softcap's tanh a logits-sized tensor. No 'not modelled'
    warning for gemma2; model_type gemma still warns of the same fields."""
    data = load_hf_config(HF / "gemma-2-9b.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wl = build_from_hf_dict(data, micro_batch=1, seq_len=4096, act_dtype="bf16")
    plain = build_from_hf_dict(data | {"attn_logit_softcapping": None, "final_logit_softcapping": None},
                               micro_batch=1, seq_len=4096, act_dtype="bf16")
    blk, ref = wl.modules[1], plain.modules[1]
    names = [k.name for k in blk.kernels]
    assert "attention (explicit scores)" in names and "attention softcap tanh" in names
    assert ref.kernels[[k.name for k in ref.kernels].index("wo") - 1].kind == "attention"  # sdpa without softcap
    head = next(m for m in wl.modules if m.kind == "head")
    assert head.saved_bytes == 4096 * 256_000 * 2
    assert "post_attention_norm" in names and "post_ffn_norm" in names
    with pytest.warns(UserWarning, match="attn_logit_softcapping 50.0 is not modelled"):
        build_from_hf_dict(data | {"model_type": "gemma"}, micro_batch=1, seq_len=128, act_dtype="bf16")


def test_gemma3_sliding_layers_pass_a_mask_once_the_sequence_reaches_the_window():
    """Five of every six layers slide (window 512): at 4096 tokens their SDPA takes an explicit mask (the
    memory-efficient kernel over every block: not causal-skipped), the sixth stays causal; at 256 tokens
    transformers skips the mask and every layer is causal."""
    causal = lambda wl: [next(k for k in m.kernels if k.kind == "attention").causal for m in wl.modules if m.is_block]  # noqa: E731
    long = causal(_build("gemma-3-1b-pt", 4096))
    assert long == [bool((i + 1) % 6 == 0) for i in range(26)]
    assert all(causal(_build("gemma-3-1b-pt", 256)))


def test_qwen3_q_k_norms_and_no_bias_against_qwen25_bias():
    shapes = lambda wl: {p.name: p.shape for p in wl.modules[1].params}  # noqa: E731
    q3, q25 = shapes(_build("qwen3-8b", 128)), shapes(_build("qwen2.5-7b", 128))
    assert q3["layers.0.attention.q_norm.weight"] == q3["layers.0.attention.k_norm.weight"] == (128,)
    assert not any(n.endswith(".bias") for n in q3)
    assert q25["layers.0.attention.wq.bias"] == (3584,) and "layers.0.attention.q_norm.weight" not in q25


@pytest.mark.parametrize("plan,emb_rows,head_rows", [("hf", 151936, 151936 // 8), ("blocks", 151936, 151936),
                                                      ("torchtitan", 151936 // 8, 151936 // 8)])
def test_tp_on_an_hf_config(plan, emb_rows, head_rows):
    """One rank's share of Qwen3 8B under each plan: 1/8 of the heads and MLP, q/k norms whole (replicated)."""
    wl = _build("qwen3-8b", 128, tp=TensorParallel(8, plan == "torchtitan", plan))
    shapes = {p.name: p.shape for m in wl.modules for p in m.params}
    assert shapes["layers.0.attention.wq.weight"] == (512, 4096)
    assert shapes["layers.0.feed_forward.w2.weight"] == (4096, 1536)
    assert shapes["layers.0.attention.q_norm.weight"] == (128,)
    assert shapes["tok_embeddings.weight"] == (emb_rows, 4096) and shapes["output.weight"] == (head_rows, 4096)
    assert wl.meta["tp_plan"] == plan and wl.meta["source"] == "hf_config"


def test_tp_on_an_hf_config_refusals():
    with pytest.raises(ScenarioError, match=r"^parallelism.tp: needs a dense decoder, not model_type 'mixtral'"):
        _build("mixtral-8x7b", 128, tp=TensorParallel(2))
    with pytest.raises(ScenarioError, match=r"^model.hf_config \(gemma-3-1b-pt.json\): parallelism.tp: 8 does not divide model.heads 4"):
        _build("gemma-3-1b-pt", 128, tp=TensorParallel(8, False, "hf"))
    with pytest.raises(ScenarioError, match=r"^parallelism.tp_plan: hf is modelled for .* not model_type 'phi3'"):
        _build("phi3-mini-4k", 128, tp=TensorParallel(2, False, "hf"))
