"""Selective activation checkpointing as torchtitan applies it (`workload/checkpointing.py`): which blocks
`selective_layer` wraps, what `selective_op`'s policy keeps per block in closed form, what the recompute
runs, and the direction each mode moves memory and time."""

from __future__ import annotations

import pytest
from conftest import run, scenario_dict
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.workload.checkpointing import checkpoint_plans, op_policy
from fsdp_sim.workload.model import Workload
from fsdp_sim.workload.transformer import TransformerDims, build_transformer

B, S, P = 2, 64, 2


def _workload(**dims) -> Workload:
    d = TransformerDims(**({"hidden": 128, "layers": 6, "heads": 4, "kv_heads": 2, "ffn_hidden": 352,
                            "vocab": 1000} | dims))
    return build_transformer(d, micro_batch=B, seq_len=S, act_dtype="bf16", name="t")


def _block(wl: Workload):
    return next(m for m in wl.modules if m.is_block)


@pytest.mark.parametrize("every, wrapped", [(1, [0, 1, 2, 3, 4, 5]), (2, [1, 3, 5]), (3, [2, 5]), (4, [3]), (7, [])])
def test_selective_layer_wraps_the_blocks_whose_count_from_one_is_a_multiple_of_k(every, wrapped):
    """`_apply_layer_sac`: the counter is bumped before `_layer_sac_count % ac_freq == 0` is tested."""
    plans = checkpoint_plans(_workload(), "selective_layer", every)
    assert sorted(plans) == [f"layers.{i}" for i in wrapped]


def test_selective_layer_every_block_is_full_checkpointing():
    wl = _workload()
    assert checkpoint_plans(wl, "selective_layer", 1) == checkpoint_plans(wl, "full", 1)


def test_op_policy_keeps_odd_mms_and_sdpa_of_a_rotary_gqa_block_in_closed_form():
    """mm #1 wq, #3 wv, #5 w1, #7 w2 are saved; #2 wk, #4 wo, #6 w3 recomputed; SDPA saved. Autograd keeps
    SDPA's output and lse and w1's output anyway; q (rotary embedding follows) and the unexpanded v do
    not, nor w2's output (the residual add saves nothing)."""
    wl = _workload()
    tok, h, qd, kvd, f, a = B * S, 128, 128, 2 * 32, 352, 4
    sdpa = tok * qd * P + B * a * S * 4
    ck = op_policy(_block(wl), P)
    assert ck.cache_bytes == tok * qd * P + tok * kvd * P + sdpa + tok * f * P + tok * h * P
    assert ck.shared_bytes == sdpa + tok * f * P
    not_rerun = [k.name for k in ck.recompute_kernels if not k.recompute]
    assert not_rerun == ["wq", "wv", "scaled_dot_product_attention", "w1", "w2", "mlp residual add"]


def test_op_policy_shares_q_and_v_without_rotary_embedding_or_grouped_query_heads():
    wl = _workload(kv_heads=4, learned_pos=True, max_seq=S)
    tok, qd, f = B * S, 128, 352
    ck = op_policy(_block(wl), P)
    assert ck.cache_bytes - ck.shared_bytes == tok * 128 * P  # only w2's output is kept in addition
    assert ck.shared_bytes == 2 * tok * qd * P + tok * qd * P + B * 4 * S * 4 + tok * f * P


def test_a_biased_block_dispatches_addmm_so_only_its_attention_is_saved():
    ck = op_policy(_block(_workload(bias=True)), P)
    assert ck.cache_bytes == ck.shared_bytes == B * S * 128 * P + B * 4 * S * 4
    assert [k.name for k in ck.recompute_kernels if k.kind == "gemm" and k.recompute] == ["wq", "wk", "wv", "wo", "w1", "w3"]


def test_recompute_flops_full_reruns_all_but_w2_and_op_only_the_even_mms():
    wl = _workload()
    blk = _block(wl)
    tok, h, kvd, f = B * S, 128, 64, 352
    full, op = checkpoint_plans(wl, "full", 1)[blk.name], checkpoint_plans(wl, "selective_op", 1)[blk.name]
    w2 = 2 * tok * f * h
    assert full.recompute_flops == pytest.approx(blk.fwd_flops - w2)
    assert op.recompute_flops == pytest.approx(2 * tok * (h * kvd + h * 128 + h * f))  # wk, wo, w3


def test_the_policy_cache_lives_from_each_blocks_forward_to_its_backward():
    data = scenario_dict({"hidden": 128, "layers": 6, "heads": 4, "kv_heads": 2, "ffn_hidden": 352, "vocab": 1000},
                         gpus_per_node=2, training={"micro_batch": B, "seq_len": S, "activation_checkpointing": "selective_op"})
    sc, r = run(data)
    cached = [b for b in r.graph.buffers if b.name.endswith("saved by the checkpoint policy")]
    assert len(cached) == 6 and {b.nbytes for b in cached} == {op_policy(_block(sc.workload), P).cache_bytes}
    freed = {op.buffer.id for op in r.graph.ops if op.kind == "free" and op.buffer is not None}
    assert all(b.id in freed for b in cached)


def _peak_and_time(ac: str, **extra):
    data = scenario_dict({"hidden": 256, "layers": 8, "heads": 8, "kv_heads": 2, "ffn_hidden": 704, "vocab": 512},
                         gpus_per_node=4, training={"micro_batch": 4, "seq_len": 512, "activation_checkpointing": ac} | extra)
    r = run(data)[1]
    return r.peak()["allocated_bytes"], r.step_time_s


def test_each_mode_trades_memory_for_time_in_order():
    none, op, layer2, full = (_peak_and_time("none"), _peak_and_time("selective_op"),
                              _peak_and_time("selective_layer", ac_every=2), _peak_and_time("full"))
    assert none[0] > op[0] > full[0] and none[0] > layer2[0] > full[0]
    assert none[1] < op[1] < full[1] and none[1] < layer2[1] < full[1]


@settings(max_examples=40, deadline=None)
@given(hidden=st.sampled_from([64, 128, 256]), heads=st.sampled_from([2, 4]), gqa=st.booleans(),
       mlp=st.sampled_from(["swiglu", "gelu"]), bias=st.booleans(), learned_pos=st.booleans(),
       attention=st.sampled_from(["sdpa", "eager"]))
def test_the_policy_never_keeps_less_than_it_shares_nor_reruns_more_than_full(hidden, heads, gqa, mlp, bias,
                                                                             learned_pos, attention):
    wl = _workload(hidden=hidden, heads=heads, kv_heads=1 if gqa else heads, mlp=mlp, bias=bias,
                   learned_pos=learned_pos, max_seq=S if learned_pos else 0, attention=attention)
    blk = _block(wl)
    op, full = op_policy(blk, P), checkpoint_plans(wl, "full", 1)[blk.name]
    assert 0 <= op.shared_bytes <= min(op.cache_bytes, blk.saved_bytes)
    assert op.recompute_flops <= full.recompute_flops


@pytest.mark.parametrize("training, message", [
    ({"activation_checkpointing": "selective_layer"}, "training.ac_every: missing"),
    ({"activation_checkpointing": "full", "ac_every": 2}, "training.ac_every: only selective_layer"),
    ({"activation_checkpointing": "selective_layer", "ac_every": 0}, "training.ac_every: must be positive"),
    ({"activation_checkpointing": "selective"}, "training.activation_checkpointing"),
])
def test_bad_checkpointing_keys_are_one_line(training, message):
    with pytest.raises(ScenarioError, match=message):
        parse_scenario({"model": "gpt2", "training": training, "hardware": {"profile": "h100-sxm"}})


def test_selective_op_refuses_a_workload_whose_kernels_do_not_name_their_aten_op():
    from dataclasses import replace

    wl = _workload()
    bare = replace(wl, modules=tuple(replace(m, kernels=tuple(replace(k, aten_op="") for k in m.kernels))
                                     for m in wl.modules))
    with pytest.raises(ScenarioError, match="selective_op needs each block's kernels"):
        checkpoint_plans(bare, "selective_op", 1)


@pytest.mark.parametrize("case_id", ["selective-layer-2", "selective-layer-3-w2-no-reshard", "selective-op",
                                     "selective-op-gqa-gelu-w8", "selective-op-bias"])
def test_selective_checkpointing_agrees_with_fsdp_mem_tracker(case_id):
    """torchtitan's wrappers on the ReferenceTransformer under FSDPMemTracker: the peak within 2 %."""
    pytest.importorskip("torch")
    from fsdp_sim.torch_tools.technique_referee import relative_errors

    errors = relative_errors(case_id)
    assert all(abs(e) <= 0.02 for e in errors.values()), errors
