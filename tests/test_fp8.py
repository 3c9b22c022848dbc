"""torchao float8 training with FSDP2: the float8 all-gather's bytes in closed form, the amax all-reduces with
and without precomputed scales, fp8 GEMM speed on H100, the casts' cost, and the refusals."""

from __future__ import annotations

import pytest
from conftest import run, scenario_dict

from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.kernels import gemm_time
from fsdp_sim.hardware.profiles import load_profile
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.ops import CATEGORIES

MODEL = {"hidden": 256, "layers": 2, "heads": 4, "vocab": 512, "ffn_hidden": 512}
TRAINING = {"micro_batch": 2, "seq_len": 256}
FULL = {"enabled": True, "fsdp_float8_all_gather": True, "precompute_scale": True}


def _scenario(float8: dict | None, profile: str = "h100-sxm", model: dict = MODEL, **training):
    data = scenario_dict(model, training=TRAINING | training, fsdp={"mixed_precision": {"param_dtype": "bf16"}})
    data["hardware"]["profile"] = profile
    if float8 is not None:
        data["compute"] = {"float8": float8}
    return data


def _block_all_gather(r, unit: str = "layers.0"):
    return next(op for op in r.graph.ops if op.kind == "all_gather" and op.unit == unit)


def test_float8_all_gather_bytes_closed_form():
    """Each block's all-gather: one byte per element of its seven Linear weights, two (bf16) for its norms;
    padded shards times the shard group, as FSDP2 gathers them."""
    sc, r = run(_scenario(FULL))
    unit = next(u for u in sc.units if u.name == "layers.0")
    world = sc.settings.shard_size
    expected = sum(p.padded_shard_numel(world) * world * (1 if p.name.endswith(("w1.weight", "w2.weight", "w3.weight",
                   "wq.weight", "wk.weight", "wv.weight", "wo.weight")) else 2) for p in unit.params)
    assert _block_all_gather(r).comm_bytes == expected
    assert len(sc.settings.float8_weights) == 7 * MODEL["layers"]  # the head is filtered out (torchtitan)
    _, base = run(_scenario(None))
    assert _block_all_gather(base).comm_bytes == sum(p.padded_shard_numel(world) * world * 2 for p in unit.params)


def test_precomputed_scales_one_all_reduce_per_step():
    """precompute_float8_dynamic_scale_for_fsdp: one all-reduce of every float8 weight's fp32 amax per step;
    without it each weight's amax is all-reduced in every pre-all-gather (forward and backward unshards)."""
    sc, r = run(_scenario(FULL))
    ars = [op for op in r.graph.ops if op.kind == "all_reduce" and "clip_grad_norm_" not in op.name]
    assert len(ars) == 1 and ars[0].comm_bytes == 4 * len(sc.settings.float8_weights) and ars[0].stream == "compute"
    sc, r = run(_scenario(FULL | {"precompute_scale": False}))
    unshards = sum(op.kind == "all_gather" and op.unit.startswith("layers.") for op in r.graph.ops)
    ars = [op for op in r.graph.ops if op.kind == "all_reduce" and "clip_grad_norm_" not in op.name]
    assert len(ars) == 7 * unshards and all(op.comm_bytes == 4 and op.group == "shard" for op in ars)


def test_fp8_gemm_faster_on_h100():
    """torch._scaled_mm at the H100's fp8 MAMF against bf16's: a large GEMM runs 1402.6 / 794.5 faster, and a
    Llama-3-8B-shaped step's matmuls and the step with them (small shapes lose to the casts, as torchao's
    roofline table shows: 0.80x at 1024 x 2048 x 1024, component-timing 1.6)."""
    gpu = load_profile("h100-sxm")
    m, n, k = 8192, 8192, 8192
    ratio = gemm_time(gpu, m, n, k, "bf16") / gemm_time(gpu, m, n, k, "fp8")
    assert ratio == pytest.approx((1402.6 / 1978.9 * 1978.9e12) / (0.803 * 989.4e12), rel=1e-9)
    large = {"hidden": 4096, "layers": 2, "heads": 32, "kv_heads": 8, "vocab": 1024, "ffn_hidden": 14336}
    _, base = run(_scenario(None, model=large, micro_batch=1, seq_len=8192))
    _, fp8 = run(_scenario(FULL, model=large, micro_batch=1, seq_len=8192))
    matmul = lambda r: sum(r.alone_s(op).matmul for op in r.graph.ops if op.kind == "compute")  # noqa: E731
    assert matmul(fp8) < matmul(base)
    assert fp8.step_time_s < base.step_time_s


def test_weight_casts_priced_without_float8_all_gather():
    """Without the float8 all-gather every forward and backward casts each weight itself (memory-bound
    time added) and the all-gather moves bf16, as without float8."""
    _, fsdp8 = run(_scenario(FULL))
    _, local = run(_scenario({"enabled": True}))
    memory = lambda r: sum(r.alone_s(op).memory for op in r.graph.ops if op.kind == "compute" and op.unit.startswith("layers."))  # noqa: E731
    assert memory(local) > memory(fsdp8)
    _, base = run(_scenario(None))
    assert _block_all_gather(local).comm_bytes == _block_all_gather(base).comm_bytes


def test_float8_saves_what_bf16_saves():
    """Float8Linear saves its high-precision input and the weight as it arrived (ctx.save_for_backward(
    input_hp, weight_hp_t)): the activations are the bf16 run's, the unsharded float8 weights one byte each."""
    _, base = run(_scenario(None))
    _, fp8 = run(_scenario(FULL))
    act = CATEGORIES.index("activations")
    assert fp8.memory.levels[:, act].max() == base.memory.levels[:, act].max()
    unsharded = CATEGORIES.index("unsharded_params")
    assert fp8.memory.levels[:, unsharded].max() < base.memory.levels[:, unsharded].max()


@pytest.mark.parametrize("profile,float8,message", [
    ("a100-80gb", FULL, "compute.float8.enabled: a100-80gb has no fp8 tensor cores"),
    ("h100-sxm", {"enabled": True, "precompute_scale": True}, "compute.float8.precompute_scale: needs"),
    ("h100-sxm", {"enabled": True, "scaling": "rowwise"}, "compute.float8.scaling: unknown key"),
])
def test_refusals(profile, float8, message):
    with pytest.raises(ScenarioError) as err:
        parse_scenario(_scenario(float8, profile))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
