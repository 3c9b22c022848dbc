"""Hugging Face config.json -> workload: parameter counts against the published totals, the families'
layouts, MoE routing, vision towers, bad configs, and the shipped scenarios that use them.

The published totals are the model cards' / papers' numbers (e.g. Llama 3 8B: 8.03B, Mixtral: 46.7B,
ViT-H/14: 632M), not values computed by this code.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import scenario_dict

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import load_scenario, parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.workload import PRESETS, TransformerDims, build_transformer
from fsdp_sim.workload.hf_config import build_from_hf_config, build_from_hf_dict
from fsdp_sim.wrap import make_units

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "scenarios" / "hf"

PUBLISHED = {  # config file -> total parameters as published
    "llama3-8b": 8.03e9,  # meta-llama/Meta-Llama-3-8B
    "mistral-7b-v0.1": 7.24e9,  # mistralai/Mistral-7B-v0.1
    "qwen2-7b": 7.62e9,  # Qwen/Qwen2-7B
    "gemma-7b": 8.54e9,  # google/gemma-7b
    "phi3-mini-4k": 3.82e9,  # microsoft/Phi-3-mini-4k-instruct
    "gpt2": 124.4e6,  # openai-community/gpt2
    "pythia-1.4b": 1_414_647_808,  # EleutherAI/pythia-1.4b (Pythia paper, Table 1)
    "mixtral-8x7b": 46.7e9,  # mistralai/Mixtral-8x7B-v0.1
    "vit-huge-patch14-224": 632e6,  # ViT-H/14 (Dosovitskiy et al. 2021, Table 1), with a 1000-class head
    "clip-vit-large-patch14": 428e6,  # openai/clip-vit-large-patch14
    "llava-1.5-7b": 7.06e9,  # llava-hf/llava-1.5-7b-hf
    "gemma-2-9b": 9.24e9,  # google/gemma-2-9b (exact figures: tests/test_hf_families.py)
    "gemma-3-1b-pt": 1.0e9,  # google/gemma-3-1b-pt
    "qwen2.5-7b": 7.61e9,  # Qwen/Qwen2.5-7B
    "qwen3-8b": 8.2e9,  # Qwen/Qwen3-8B
}


def build(name: str, micro_batch: int = 1, seq_len: int = 64, act_dtype: str = "bf16"):
    return build_from_hf_config(HF / f"{name}.json", micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype)


def mixtral_like(**overrides) -> dict:
    cfg = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "num_local_experts": 4,
           "num_experts_per_tok": 1}
    return {**cfg, **overrides}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_the_published_total(name):
    wl = build(name)
    assert wl.numel == pytest.approx(PUBLISHED[name], rel=0.01)


def test_every_shipped_config_has_a_published_total():
    assert {p.stem for p in HF.glob("*.json")} == set(PUBLISHED)


def test_llama3_8b_config_is_the_llama3_8b_preset():
    """Same model; Hugging Face's LlamaRMSNorm upcasts to fp32 and casts back before its weight."""
    wl = build("llama3-8b", micro_batch=2, seq_len=4096)
    dims = replace(PRESETS["llama3-8b"], norm_impl="hf_llama")
    preset = build_transformer(dims, micro_batch=2, seq_len=4096, act_dtype="bf16", name="llama3-8b")
    assert wl.numel == preset.numel
    assert sum(m.saved_bytes for m in wl.modules) == sum(m.saved_bytes for m in preset.modules)
    assert wl.modules == preset.modules and wl.model_flops == preset.model_flops


def test_exact_counts_of_the_dense_families():
    """Spot values that pin each family's layout (biases, tying, head_dim, learned positions)."""
    assert build("gpt2").numel == 124_439_808  # tied head, learned positions, biases everywhere
    assert build("gpt2").numel == build_transformer(PRESETS["gpt2"], micro_batch=1, seq_len=64, act_dtype="bf16",
                                                    name="gpt2").numel
    assert build("qwen2-7b").numel == 7_615_616_512  # q/k/v bias only
    assert build("gemma-7b").numel == 8_537_680_896  # head_dim 256 != 3072 / 16, tied embeddings
    assert build("phi3-mini-4k").numel == 3_821_079_552
    assert build("mistral-7b-v0.1").numel == 7_241_732_096
    assert build("mixtral-8x7b").numel == 46_702_792_704
    assert build("clip-vit-large-patch14").numel == 427_616_513  # openai/clip-vit-large-patch14 exactly
    assert build("llava-1.5-7b").numel == 7_063_427_072


def test_qwen2_has_bias_on_q_k_v_only():
    names = {p.name for p in build("qwen2-7b").modules[1].params}
    assert {"layers.0.attention.wq.bias", "layers.0.attention.wk.bias", "layers.0.attention.wv.bias"} <= names
    assert "layers.0.attention.wo.bias" not in names
    assert not any("feed_forward" in n and n.endswith("bias") for n in names)


def test_gemma_head_dim_sets_the_attention_width():
    wl = build("gemma-7b", seq_len=64)
    shapes = {p.name: p.shape for p in wl.modules[1].params}
    assert shapes["layers.0.attention.wq.weight"] == (16 * 256, 3072)
    assert shapes["layers.0.attention.wo.weight"] == (3072, 16 * 256)
    d = TransformerDims(hidden=3072, layers=1, heads=16, head_dim=256, ffn_hidden=24576, vocab=256000)
    d_default = TransformerDims(hidden=3072, layers=1, heads=16, ffn_hidden=24576, vocab=256000)
    assert d_default.head_dim == 192 and d.q_dim == 4096
    one = build_transformer(d, micro_batch=1, seq_len=64, act_dtype="bf16", name="g").modules[1]
    ref = build_transformer(d_default, micro_batch=1, seq_len=64, act_dtype="bf16", name="g").modules[1]
    # q, expanded k, v and the SDPA output (which wo keeps as its input) are heads x head_dim wide
    assert one.saved_bytes - ref.saved_bytes == 4 * 64 * (4096 - 3072) * 2


def test_a_preset_override_of_heads_recomputes_a_derived_head_dim():
    scenario = parse_scenario(scenario_dict({"preset": "llama3-8b", "hidden": 2048, "heads": 16, "kv_heads": 8}))
    wq = next(p for p in scenario.workload.params if p.name == "layers.0.attention.wq.weight")
    assert wq.shape == (2048, 2048)


def test_moe_routed_flops_and_activations_scale_with_top_k():
    b, s = 2, 32
    h, f = 64, 96
    top1 = build_from_hf_dict(mixtral_like(), micro_batch=b, seq_len=s, act_dtype="bf16")
    top2 = build_from_hf_dict(mixtral_like(num_experts_per_tok=2), micro_batch=b, seq_len=s, act_dtype="bf16")
    blk1, blk2 = top1.modules[1], top2.modules[1]
    dense_mlp = 2 * b * s * 3 * h * f  # one SwiGLU MLP per token
    assert blk2.fwd_flops - blk1.fwd_flops == dense_mlp
    # backward is the kernels' sum: two GEMMs per GEMM, and SDPA's backward 2.5x its forward (as torch's
    # flop_counter counts it), so a little more than twice the forward
    attn = 4 * b * s * s * h * 0.5  # causal flash attention
    assert blk2.bwd_flops == sum(k.bwd_flops for k in blk2.kernels) == 2 * (blk2.fwd_flops - attn) + 2.5 * attn
    # the experts' GEMMs run over the tokens routed to each: tokens x top_k / experts
    assert {k.shape[0] for k in blk2.kernels if k.name.startswith("experts.") and k.kind == "gemm"} == {b * s * 2 // 4}
    # each extra routed token keeps its gathered input, four ffn-wide tensors, its output, weight and index
    per_routed = h * 2 + 4 * f * 2 + h * 2 + 2 + 8 + (8 + 4)
    assert blk2.saved_bytes - blk1.saved_bytes == b * s * per_routed
    assert top1.numel == top2.numel
    assert top2.meta["active_params"] - top1.meta["active_params"] == 2 * 3 * h * f  # one expert more per layer
    assert top2.model_flops > top1.model_flops
    # 4 experts (each its own w1/w2/w3) and a router per block, one module per block
    names = [p.name for p in blk1.params]
    assert "layers.0.feed_forward.router.weight" in names and "layers.0.feed_forward.experts.3.w2.weight" in names
    assert blk1.is_block and sum(m.is_block for m in top1.modules) == 2


def test_qwen2_moe_with_shared_expert_and_dense_layers():
    """Qwen1.5-MoE-A2.7B's config (14.3B parameters); then a dense layer via mlp_only_layers."""
    cfg = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
           "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936, "num_experts": 60,
           "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
           "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
    wl = build_from_hf_dict(cfg, micro_batch=1, seq_len=64, act_dtype="bf16")
    assert wl.numel == pytest.approx(14.3e9, rel=0.01)
    mixed = build_from_hf_dict({**cfg, "mlp_only_layers": [0]}, micro_batch=1, seq_len=64, act_dtype="bf16")
    assert not any("experts" in p.name for p in mixed.modules[1].params)
    assert any("experts" in p.name for p in mixed.modules[2].params)


def test_vit_is_non_causal_over_patches_plus_cls():
    b = 4
    wl = build("vit-huge-patch14-224", micro_batch=b, seq_len=999)  # seq_len does not apply to a ViT
    s, h = 257, 1280
    assert wl.tokens == b * s and wl.meta["seq"] == s
    blk = wl.modules[1]
    matmul = 2 * b * s * sum(p.numel for p in blk.params if len(p.shape) == 2)
    assert blk.fwd_flops == matmul + 4 * b * s * s * h  # the full s x s attention, not halved
    # backward: two GEMMs per GEMM, SDPA's backward 2.5x its forward (torch's flop_counter counts it so)
    assert blk.bwd_flops == 2 * matmul + 2.5 * 4 * b * s * s * h
    attention = [k for k in blk.kernels if k.kind == "attention"]
    assert [(k.shape, k.causal) for k in attention] == [((b, 16, s, 80), False)]
    assert not any(k.kind == "rope" for k in blk.kernels)  # positions are learned, added in the embeddings
    conv = next(k for k in wl.modules[0].kernels if k.kind == "gemm")
    assert conv.shape == (b * 256, h, 3 * 14 * 14)  # images x patches, hidden, channels x patch^2
    assert wl.modules[-2].params[0].shape == (1000, h)  # classifier head
    assert not wl.modules[-1].in_model


def test_vision_blocks_of_both_towers_get_their_own_units():
    wl = build("llava-1.5-7b", micro_batch=1, seq_len=128)
    names = [m.name for m in wl.modules]
    assert len(names) == len(set(names))
    units = make_units(wl, "per_block")
    inner = {u.name for u in units[1:]}
    assert {f"vision_tower.layers.{i}" for i in range(24)} <= inner
    assert {f"language_model.layers.{i}" for i in range(32)} <= inner and len(inner) == 56
    root = units[0]
    assert "multi_modal_projector" in root.modules and "language_model.tok_embeddings" in root.modules
    # the language model runs over the text tokens plus the 576 image tokens
    assert wl.tokens == 128 + 576


def test_clip_has_both_towers_and_a_contrastive_loss():
    b = 8
    wl = build("clip-vit-large-patch14", micro_batch=b, seq_len=77)
    assert sum(m.is_block for m in wl.modules) == 24 + 12
    assert wl.modules[-2].output_bytes == b * b * 2  # b x b logits
    logits = next(k for k in wl.modules[-2].kernels if k.kind == "gemm")
    assert logits.shape == (b, b, 768) and wl.modules[-2].fwd_flops == 2 * b * b * 768
    vision, text = wl.modules[2], next(m for m in wl.modules if m.name == "text_model.layers.0")
    assert [k.causal for k in vision.kernels + text.kernels if k.kind == "attention"] == [False, True]
    # CLIP's hidden_act quick_gelu, x * sigmoid(1.702 x), is three eager kernels in both towers
    for blk in (vision, text):
        assert [k.name for k in blk.kernels if k.name.startswith("quick_gelu")] == \
            ["quick_gelu 1.702 * x", "quick_gelu sigmoid", "quick_gelu x * sigmoid"]
    with pytest.raises(ScenarioError, match="max_position_embeddings"):
        build("clip-vit-large-patch14", seq_len=78)


@pytest.mark.parametrize("drop, missing", [("hidden_size", "hidden_size"), ("num_hidden_layers", "num_hidden_layers"),
                                           ("intermediate_size", "intermediate_size")])
def test_a_missing_key_is_named(tmp_path, drop, missing):
    cfg = json.loads((HF / "llama3-8b.json").read_text())
    del cfg[drop]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ScenarioError, match=missing) as err:
        build_from_hf_config(path, micro_batch=1, seq_len=16, act_dtype="bf16")
    assert "\n" not in str(err.value)


def test_a_missing_nested_key_is_named_with_its_section():
    cfg = json.loads((HF / "llava-1.5-7b.json").read_text())
    del cfg["vision_config"]["patch_size"]
    with pytest.raises(ScenarioError, match="vision_config.patch_size"):
        build_from_hf_dict(cfg, micro_batch=1, seq_len=16, act_dtype="bf16")


def test_an_unknown_model_type_is_named(tmp_path):
    (tmp_path / "t5.json").write_text(json.dumps({"model_type": "t5", "d_model": 512}))
    data = scenario_dict({"hf_config": "t5.json"})
    with pytest.raises(ScenarioError, match=r"model_type.*'t5'.*not supported"):
        parse_scenario(data, base=tmp_path)


def test_bad_values_and_files(tmp_path):
    with pytest.raises(ScenarioError, match="num_attention_heads"):
        build_from_hf_dict(mixtral_like(num_attention_heads="four"), micro_batch=1, seq_len=8, act_dtype="bf16")
    with pytest.raises(ScenarioError, match="num_experts_per_tok"):
        build_from_hf_dict(mixtral_like(num_experts_per_tok=5), micro_batch=1, seq_len=8, act_dtype="bf16")
    with pytest.raises(ScenarioError, match="not found"):
        build_from_hf_config(tmp_path / "nope.json", micro_batch=1, seq_len=8, act_dtype="bf16")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ScenarioError, match="not valid JSON"):
        build_from_hf_config(tmp_path / "bad.json", micro_batch=1, seq_len=8, act_dtype="bf16")
    with pytest.raises(ScenarioError, match="seq_len"):  # GPT-2's learned positions stop at 1024
        build("gpt2", seq_len=2048)


def test_hf_config_path_resolves_from_the_scenario_folder():
    scenario = parse_scenario(scenario_dict({"hf_config": "hf/gpt2.json"}), base=ROOT / "scenarios")
    assert scenario.workload.numel == 124_439_808


@pytest.mark.parametrize("name", ["vit-h14-8xa100-40gb", "llava-1.5-7b-8xa100-80gb-bf16", "mixtral-8x7b-16xh100",
                                  "mistral-7b-8xh100-hf"])
def test_shipped_hf_scenarios_run_and_fit(name):
    scenario = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
    result = simulate(scenario)
    data = result.to_dict()
    assert result.step_time_s > 0
    assert data["memory"]["fits"], data["memory"]


def test_tensor_parallel_runs_on_a_model_given_by_an_hf_config(tmp_path):
    """scenario.py hands `parallelism` to the HF config builder (workload/hf_config.py `tp=`)."""
    from pathlib import Path

    from fsdp_sim.scenario import parse_scenario

    config = Path(__file__).resolve().parents[1] / "scenarios" / "hf" / "qwen3-8b.json"
    data = {"model": {"hf_config": str(config)}, "training": {"micro_batch": 1, "seq_len": 1024},
            "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": 8}, "parallelism": {"tp": 8, "tp_plan": "hf"}}
    sc = parse_scenario(data)
    assert sc.settings.tp == 8
