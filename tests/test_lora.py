"""LoRA and QLoRA (`model.lora`): adapters only in the training state, the 4-bit base as bitsandbytes stores
it, the time and memory directions, bad input, and referee cases against FSDPMemTracker (peak within 2 %)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.workload.lora import PEFT_NAMES, nf4_bytes

TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 1000}
LLAMA_70B = {"preset": "llama2-70b"}
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _scenario(model: dict, *, gpus: int = 8, profile: str = "a100-80gb", **training) -> dict:
    return {"model": model, "training": {"micro_batch": 1, "seq_len": 64} | training,
            "hardware": {"profile": profile, "gpus_per_node": gpus}}


def _linear_shapes(d: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each block Linear, in peft's names, from the dimensions (Llama layout)."""
    h, f = d["hidden"], d["ffn_hidden"]
    kv = h // d["heads"] * d["kv_heads"]
    return {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}


def _persistent(result, category: str) -> int:
    return sum(b.nbytes for b in result.graph.persistent if b.category == category)


def test_optimizer_state_is_two_fp32_states_of_the_adapters_only():
    """AdamW keeps exp_avg and exp_avg_sq (zeros_like, fp32) for the adapters and nothing for the base:
    2 x 4 B x r (in + out) per target, over W ranks (every adapter's dim 0 divides W here)."""
    rank, world = 8, 8
    targets = ["q_proj", "v_proj", "down_proj"]
    result = simulate(parse_scenario(_scenario(TINY | {"lora": {"rank": rank, "targets": targets}}, gpus=world)))
    shapes = _linear_shapes(TINY)
    adapters = TINY["layers"] * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)
    assert _persistent(result, "optimizer_states") == 2 * 4 * adapters // world
    d = result.to_dict()["model"]
    assert d["trainable_params"] == adapters
    assert d["trainable_params"] + d["frozen_params"] == result.scenario.workload.numel


def test_reduce_scatter_moves_the_adapters_gradients_only():
    rank, world = 16, 4
    sc = parse_scenario(_scenario(TINY | {"lora": {"rank": rank, "targets": "all-linear"}}, gpus=world))
    result = simulate(sc)
    shapes = _linear_shapes(TINY)
    per_block = sum(rank * (o + i) for o, i in shapes.values())
    rs = sum(op.comm_bytes for op in result.graph.ops if op.kind == "reduce_scatter")
    assert rs == TINY["layers"] * per_block * 2  # bf16 gradients, each block one reduce-scatter input


def test_nf4_bytes_match_bitsandbytes_and_the_qlora_paper():
    """quantize_4bit: (n + 1) // 2 packed bytes and one absmax per 64 (fp32: 0.5 bit per weight); double
    quantization: uint8 absmax, one fp32 scale per 256 blocks and the fp32 offset (0.127 bit, QLoRA §3)."""
    n = 8192 * 28672
    packed, scales = nf4_bytes(n, double_quant=False)
    assert packed == n // 2 and scales == 4 * n // 64
    assert (packed + scales) * 8 / n == 4.5
    packed, scales = nf4_bytes(n, double_quant=True)
    assert scales == n // 64 + 4 * math.ceil(n / 64 / 256) + 4
    assert abs(scales * 8 / n - (8 / 64 + 32 / (64 * 256))) < 1e-6
    assert nf4_bytes(65, True) == (33, 2 + 4 + 4)


def test_qlora_stores_every_block_linear_in_4_bits_and_gathers_the_bytes():
    world = 4
    sc = parse_scenario(_scenario(TINY | {"lora": {"rank": 8, "targets": ["q_proj"], "quantize": "nf4"}}, gpus=world))
    result = simulate(sc)
    shapes = _linear_shapes(TINY)
    packed = sum(sum(nf4_bytes(o * i, True)) for o, i in shapes.values())
    block_unit = next(u for u in sc.units if u.name == "layers.0")
    padded = sum(p.padded_shard_numel(world) * (1 if p.dtype == "uint8" else 4 if p.trainable else 2)
                 for p in block_unit.params)
    sharded = next(b.nbytes for b in result.graph.persistent if b.name == "layers.0 sharded params")
    assert sharded == padded
    norms = 2 * TINY["hidden"] * 2  # two bf16 norm weights
    adapters = 8 * (2 * TINY["hidden"]) * 4
    assert abs(sharded * world - (packed + norms + adapters)) <= world * 16  # dim-0 padding of the chunks
    # the 4-bit codes and scales are gathered as stored; the fp32 adapters cast to bf16, the bf16 norms as they are
    gather = next(op for op in result.graph.ops if op.kind == "all_gather" and op.unit == "layers.0")
    assert gather.comm_bytes == world * sum(p.padded_shard_numel(world) * (1 if p.dtype == "uint8" else 2)
                                            for p in block_unit.params)


def test_70b_on_8_a100s_full_vs_lora_vs_qlora_directions():
    """Full fine-tune does not fit; LoRA does; QLoRA needs less memory than LoRA and moves fewer all-gather
    bytes but computes longer (the dequantize kernels); LoRA's backward skips the base weight gradients."""
    base = {"micro_batch": 1, "seq_len": 4096, "activation_checkpointing": "full"}
    full = simulate(parse_scenario(_scenario(LLAMA_70B, **base))).to_dict()
    qkvo = {"lora": {"rank": 16, "targets": list(ALL[:4])}}
    lora = simulate(parse_scenario(_scenario(LLAMA_70B | qkvo, **base))).to_dict()
    qlora = simulate(parse_scenario(_scenario(LLAMA_70B | {"lora": {"rank": 16, "targets": "all-linear",
                                                                     "quantize": "nf4"}}, **base))).to_dict()
    assert not full["memory"]["fits"] and lora["memory"]["fits"] and qlora["memory"]["fits"]
    assert qlora["peak"]["allocated_bytes"] < lora["peak"]["allocated_bytes"] < full["peak"]["allocated_bytes"]
    assert qlora["communication"]["all_gather_bytes"] < lora["communication"]["all_gather_bytes"] / 3
    assert lora["compute"]["busy_s"] < full["compute"]["busy_s"]
    assert qlora["compute"]["breakdown"]["memory_bound_s"] > lora["compute"]["breakdown"]["memory_bound_s"]


def test_dropout_keeps_a_copy_and_a_mask_per_target():
    rank, tok = 8, 64
    no = parse_scenario(_scenario(TINY | {"lora": {"rank": rank, "targets": ["q_proj", "v_proj"]}})).workload
    yes = parse_scenario(_scenario(TINY | {"lora": {"rank": rank, "targets": ["q_proj", "v_proj"],
                                                    "dropout": 0.05}})).workload
    # per target its dropout output (bf16, kept by lora_A) and bool mask; without dropout A keeps the
    # norm output the base read, with it nothing else reads that output (wk is frozen): it is not kept
    per_target = tok * TINY["hidden"] * (2 + 1)
    second_no, second_yes = no.modules[2], yes.modules[2]
    assert second_yes.saved_bytes - second_no.saved_bytes == 2 * per_target - tok * TINY["hidden"] * 2
    # the first block's attention reads a tensor without grad (frozen embedding, frozen attention_norm):
    # its dropouts record no node and keep no mask, only the output lora_A saves
    first_no, first_yes = no.modules[1], yes.modules[1]
    assert first_yes.saved_bytes - first_no.saved_bytes == 2 * tok * TINY["hidden"] * 2 - tok * TINY["hidden"] * 2


def test_the_first_blocks_attention_inputs_need_no_gradient():
    """Behind a frozen embedding the first block's frozen attention_norm gives wq / wk / wv (and the
    adapters beside them) an input without grad: their backward runs no input-gradient GEMM, and the norm
    no backward at all; the second block's do."""
    rank, tok = 8, 64
    wl = parse_scenario(_scenario(TINY | {"lora": {"rank": rank, "targets": ["q_proj", "v_proj"]}})).workload
    first, second = wl.modules[1], wl.modules[2]
    shapes = _linear_shapes(TINY)
    skipped = sum(2 * tok * out * fan_in for out, fan_in in (shapes[t] for t in ("q_proj", "k_proj", "v_proj")))
    skipped += 2 * (2 * tok * rank * TINY["hidden"])  # lora_A of q and v
    assert second.bwd_flops - first.bwd_flops == skipped
    assert first.kernels[0].bwd_launches == 0 < second.kernels[0].bwd_launches


@settings(max_examples=15, deadline=None)
@given(rank=st.integers(1, 32), targets=st.sets(st.sampled_from(ALL), min_size=1),
       world=st.sampled_from([1, 2, 4, 8]), quantize=st.booleans(), storage=st.sampled_from(["fp32", "bf16"]))
def test_lora_invariants(rank, targets, world, quantize, storage):
    """Any rank, targets, world and storage dtype: the trainable parameters are exactly the adapters, every
    base GEMM runs no weight gradient, the state is two zeros_like(adapter) per adapter shard, and the
    step's memory returns to its persistent set."""
    lora = {"rank": rank, "targets": sorted(targets)} | ({"quantize": "nf4"} if quantize else {})
    sc = parse_scenario(_scenario(TINY | {"lora": lora}, gpus=world, param_storage_dtype=storage))
    wl = sc.workload
    assert all((".lora_" in p.name) == p.trainable for p in wl.params)
    ours = {PEFT_NAMES[t] for t in targets}
    for m in wl.modules:
        for k in m.kernels:
            if k.kind == "gemm":
                assert k.weight_grad == (" lora_" in k.name)
                assert " lora_" not in k.name or k.name.split()[0] in ours
    result = simulate(sc)
    shards = sum(p.padded_shard_numel(world) for p in wl.params if p.trainable)
    assert _persistent(result, "optimizer_states") == 2 * shards * (4 if storage == "fp32" else 2)
    expected = {b.id: b.nbytes for b in result.graph.persistent}
    assert {b.id: b.nbytes for b in result.memory.live_at_end} == expected
    assert result.memory.total[-1] == sum(expected.values())


@pytest.mark.parametrize("lora, key", [
    ({"rank": 0}, "model.lora.rank"),
    ({"targets": ["qkv"]}, "model.lora.targets"),
    ({"dropout": 1.5}, "model.lora.dropout"),
    ({"double_quant": False}, "model.lora.double_quant"),
    ({"quantize": "int8"}, "model.lora.quantize"),
    ({"rnak": 8}, "model.lora.rnak"),
    ("all", "model.lora"),
])
def test_bad_lora_input_names_the_key(lora, key):
    with pytest.raises(ScenarioError, match=key.replace(".", r"\.")):
        parse_scenario(_scenario(TINY | {"lora": lora}))


# ---- referee: FSDPMemTracker on the CPU, the model prepared as peft would leave it ----------------------
try:
    from fsdp_sim.torch_tools.lora_referee import LORA_CASES as _CASES
except ImportError:  # no torch: the referee cases are skipped
    _CASES = []


@pytest.mark.parametrize("case_id, model, run, prep", [c for c in _CASES if c[0].startswith("lora")],
                         ids=[c[0] for c in _CASES if c[0].startswith("lora")])
def test_lora_peak_agrees_with_fsdp_mem_tracker(case_id, model, run, prep):
    check_referee_case(model, run, prep)


def check_referee_case(model: dict, run: dict, prep: dict) -> None:
    """The tracker's peak (iteration 1, fake tensors on the CPU) against fsdp-sim's, within 2 %; the parameter,
    gradient and optimizer-state categories at the peak to the KiB."""
    from fsdp_sim.torch_tools.lora_referee import run_case

    sim, tracker = run_case(model, run, prep)
    error = (sim["peak_bytes"] - tracker["peak_bytes"]) / tracker["peak_bytes"]
    assert abs(error) <= 0.02, (f"simulated peak {sim['peak_bytes']} vs tracker {tracker['peak_bytes']} "
                                f"({100 * error:+.2f} %), sim at {sim['phase']}/{sim['op']}, "
                                f"tracker at {tracker['peak_where']}")
    for category in ("Sharded Param", "Unsharded Param", "OptState", "Sharded Grad"):
        assert abs(sim["peak_by_category"].get(category, 0) - tracker["peak_by_category"][category]) <= 1024, category
