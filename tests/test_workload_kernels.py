"""The kernels every builder attaches to its modules: present wherever there is work, FLOPs that add up to
the module's, and the shapes that set their price (non-causal vision attention, per-expert MoE GEMMs).

Analytic counts are written out here from the models' definitions, not read back from the builders.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_sim.hardware.kernels import ComputeOptions, kernels_time
from fsdp_sim.hardware.profiles import load_profile
from fsdp_sim.scenario import load_scenario
from fsdp_sim.workload.hf_config import build_from_hf_config, build_from_hf_dict
from fsdp_sim.workload.moe import MoESpec, expert_tokens

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted(p for p in (ROOT / "scenarios").glob("*.yaml") if not p.name.endswith(".grid.yaml"))  # grids are sweep axes
HF = ROOT / "scenarios" / "hf"


def hf(name: str, micro_batch: int = 1, seq_len: int = 64):
    return build_from_hf_config(HF / f"{name}.json", micro_batch=micro_batch, seq_len=seq_len, act_dtype="bf16")


def gemms(module, prefix: str = "") -> list[tuple[int, ...]]:
    return [k.shape for k in module.kernels if k.kind == "gemm" and k.name.startswith(prefix)]


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_shipped_workload_has_kernels_that_add_up(path):
    wl = load_scenario(path).workload
    for m in wl.modules:
        if m.fwd_flops or m.fwd_hbm_bytes:
            assert m.kernels, f"{m.name} has FLOPs or bytes but no kernels"
        assert sum(k.fwd_flops for k in m.kernels) == pytest.approx(m.fwd_flops, rel=1e-12), m.name


def test_shipped_scenarios_cover_every_builder():
    sources = {load_scenario(p).workload.meta.get("model_type", load_scenario(p).workload.meta.get("source"))
               for p in SCENARIOS}
    assert {"vit", "llava", "mixtral", "fsdp_sim.torch_tools.trace"} <= sources


def test_vit_block_attention_is_non_causal_and_has_no_rotary_embedding():
    b, s = 4, 257  # ViT-H/14 at 224 px: 256 patches and the CLS token
    wl = hf("vit-huge-patch14-224", micro_batch=b)
    blk = wl.modules[1]
    assert [(k.shape, k.causal) for k in blk.kernels if k.kind.startswith("attention")] == [((b, 16, s, 80), False)]
    assert not any(k.kind == "rope" for k in blk.kernels)
    h, f = 1280, 5120
    assert gemms(blk) == [(b * s, h, h)] * 4 + [(b * s, f, h), (b * s, h, f)]  # q, k, v, o; fc1, fc2
    # the patch convolution as a GEMM: images x patches, hidden, channels x patch^2
    assert gemms(wl.modules[0]) == [(b * 256, h, 3 * 14 * 14)]
    assert gemms(wl.modules[-2]) == [(b, 1000, h)]  # the classifier on the CLS rows
    assert [k.kind for k in wl.modules[-1].kernels] == ["elementwise", "cross_entropy"]  # fp32 cast, CE


def test_vision_attention_backward_counts_two_and_a_half_forwards():
    b, s, h = 2, 257, 1280
    blk = hf("vit-huge-patch14-224", micro_batch=b).modules[1]
    matmul = 2 * b * s * sum(p.numel for p in blk.params if len(p.shape) == 2)
    attention = 4 * b * s * s * h
    assert blk.fwd_flops == matmul + attention
    assert blk.bwd_flops == 2 * matmul + 2.5 * attention


def test_llava_projector_and_image_merge():
    wl = hf("llava-1.5-7b", seq_len=128)
    projector = next(m for m in wl.modules if m.name == "multi_modal_projector")
    n, hv, ht = 576, 1024, 4096
    assert gemms(projector) == [(n, ht, hv), (n, ht, ht)]
    assert projector.fwd_flops == 2 * n * (hv * ht + ht * ht)
    emb = next(m for m in wl.modules if m.name == "language_model.tok_embeddings")
    assert [k.name for k in emb.kernels][-1] == "masked_scatter image features"
    assert all(k.kind in ("gemm", "attention") or k.bytes > 0 or k.bwd_bytes > 0 for m in wl.modules for k in m.kernels)


def mixtral(**overrides) -> dict:
    cfg = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "num_local_experts": 4,
           "num_experts_per_tok": 2}
    return {**cfg, **overrides}


def test_moe_expert_gemms_run_over_the_tokens_routed_to_each_expert():
    b, s, h, f, E, k = 2, 32, 64, 96, 4, 2
    blk = build_from_hf_dict(mixtral(), micro_batch=b, seq_len=s, act_dtype="bf16").modules[1]
    per_expert = b * s * k // E
    for j in range(E):  # one GEMM triple per expert, each its own launches
        assert gemms(blk, f"experts.{j}.") == [(per_expert, f, h), (per_expert, f, h), (per_expert, h, f)]
    assert gemms(blk, "router") == [(b * s, E, h)]
    assert len(gemms(blk)) == 4 + 1 + 3 * E  # attention's four, the router, the experts
    # routing (softmax, top-k, masks, gathers, weighting, index_add_) is memory-bound work with bytes
    routing = [kn for kn in blk.kernels if kn.kind == "elementwise" and "experts." in kn.name]
    assert len(routing) == 5 * E and all(kn.bytes > 0 for kn in routing)
    # the expert FLOPs are top_k dense SwiGLU MLPs per token
    assert sum(kn.fwd_flops for kn in blk.kernels if kn.name.startswith("experts.")) == b * s * k * 6 * h * f
    # the block's last saved tensor is the index of the last expert's index_add_: what follows is not recomputed
    assert [kn.name for kn in blk.kernels if not kn.recompute] == [f"experts.{E - 1} index_add_", "mlp residual add"]


def test_moe_uneven_routing_spreads_the_remainder():
    spec = MoESpec(experts=8, top_k=2, expert_ffn=16)
    assert expert_tokens(spec, 13) == [4, 4, 3, 3, 3, 3, 3, 3]
    assert expert_tokens(spec, 3) == [1] * 6 + [0, 0]  # fewer routed tokens than experts: two idle
    wl = build_from_hf_dict(mixtral(num_local_experts=8), micro_batch=1, seq_len=3, act_dtype="bf16")
    assert len(gemms(wl.modules[1], "experts.")) == 3 * 6  # an expert no token reaches launches nothing


def test_qwen2_moe_shared_expert_and_gate():
    cfg = {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 96}
    blk = build_from_hf_dict(cfg, micro_batch=1, seq_len=16, act_dtype="bf16").modules[1]
    assert gemms(blk, "shared_expert.") == [(16, 96, 64), (16, 96, 64), (16, 64, 96)]
    assert gemms(blk, "shared_expert_gate") == [(16, 1, 64)]
    assert not any("renormalisation" in k.name for k in blk.kernels)  # norm_topk_prob defaults to false


def test_kernels_price_a_moe_block_above_its_gemms_alone():
    """The routing's memory traffic and launches are real time on top of the GEMMs."""
    gpu = load_profile("h100-sxm")
    blk = hf("mixtral-8x7b", seq_len=4096).modules[1]
    t = kernels_time(gpu, blk.kernels, "forward", "bf16", ComputeOptions())
    assert t.memory > 0 and t.matmul > 0 and t.attention > 0
    assert t.launches == sum(k.launches for k in blk.kernels)


def test_the_shipped_traced_workload_has_block_kernels_gemm_shapes():
    """`fsdp-sim trace ...reference_model:example_1b --batch 4 --seq 2048` recorded what TinyLlama's block runs."""
    from fsdp_sim.workload.io import load_workload
    from fsdp_sim.workload.kernels import block_kernels
    from fsdp_sim.workload.transformer import TransformerDims

    wl = load_workload(ROOT / "scenarios" / "traced" / "tinyllama-1b-b4-s2048.yaml")
    dims = TransformerDims(hidden=2048, layers=22, heads=32, kv_heads=4, ffn_hidden=5632, vocab=32000)
    analytic = block_kernels(dims, 4, 2048, 2, causal=True)
    blocks = [m for m in wl.modules if m.is_block]
    assert len(blocks) == 22
    for blk in blocks:
        assert gemms(blk) == [k.shape for k in analytic if k.kind == "gemm"]
        assert [(k.shape, k.causal) for k in blk.kernels if k.kind == "attention"] == [((4, 32, 2048, 64), True)]
    assert gemms(wl.modules[-2]) == [(4 * 2048, 32000, 2048)]  # the output head
