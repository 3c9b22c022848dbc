"""The engine's time rules in closed form: the CPU issue thread, processor sharing between ops that slow each
other, and the end-to-end directions they give a simulated step (CPU-bound small models, overlap that costs)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from fsdp_sim.engine import play
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.ops import OpGraph
from fsdp_sim.simulate import simulate


def _chain(n: int, stream: str = "compute"):
    g = OpGraph()
    for i in range(n):
        g.add("compute", stream, f"k{i}", flops=1.0)
    return g.ops


def test_a_launch_bound_chain_takes_kernels_times_launch_cost():
    """Kernels shorter than their launch: the stream waits for the CPU, step = n x launch + the last kernel."""
    ops = _chain(50)
    timing = play(ops, lambda op: 1e-6, host_s=lambda op: 8e-6)
    assert timing.makespan == pytest.approx(50 * 8e-6 + 1e-6)
    # and kernels longer than their launch hide it: step = first launch + n x kernel
    timing = play(ops, lambda op: 20e-6, host_s=lambda op: 8e-6)
    assert timing.makespan == pytest.approx(8e-6 + 50 * 20e-6)


def test_two_ops_that_slow_each_other_share_the_device():
    """A (1 s) and a collective B (3 s), each twice as slow while both run: A ends at 2 s having done its
    1 s of work at half speed; B has done 1 s by then and finishes its last 2 s alone, at 4 s."""
    g = OpGraph()
    a = g.add("compute", "compute", "a", flops=1.0)
    b = g.add("all_gather", "all_gather", "b", comm_bytes=3.0, group="g")
    dur = {a.id: 1.0, b.id: 3.0}
    timing = play(g.ops, lambda op: dur[op.id], slowdowns=lambda running: [2.0] * len(running))
    assert timing.end[a.id] == pytest.approx(2.0) and timing.end[b.id] == pytest.approx(4.0)
    # without contention each takes its own time
    timing = play(g.ops, lambda op: dur[op.id])
    assert timing.end[a.id] == pytest.approx(1.0) and timing.end[b.id] == pytest.approx(3.0)


def test_nothing_contends_without_a_collective():
    g = OpGraph()
    a = g.add("compute", "compute", "a", flops=1.0)
    b = g.add("copy", "side", "b", hbm_bytes=1.0)
    timing = play(g.ops, lambda op: 1.0, slowdowns=lambda running: [2.0] * len(running))
    assert timing.end[a.id] == timing.end[b.id] == pytest.approx(1.0)


def test_a_slowdown_applies_only_while_the_other_op_runs():
    g = OpGraph()
    a = g.add("compute", "compute", "a", flops=1.0)
    g.add("compute", "compute", "a2", flops=1.0)
    b = g.add("all_gather", "all_gather", "b", comm_bytes=1.0, group="g", deps=(a,))  # starts when a ends, beside a2
    timing = play(g.ops, lambda op: 1.0, slowdowns=lambda running: [1.5] * len(running))
    assert timing.end[a.id] == pytest.approx(1.0)
    assert timing.end[b.id] == pytest.approx(2.5) and timing.makespan == pytest.approx(2.5)


TINY = {"hidden": 256, "layers": 4, "heads": 4, "vocab": 1000}


def test_a_small_model_on_short_sequences_is_cpu_bound():
    r = simulate(parse_scenario({"model": TINY, "training": {"seq_len": 128},
                                 "hardware": {"profile": "h100-sxm", "gpus_per_node": 1}}))
    br = r.compute()["breakdown"]
    assert br["cpu_bound_s"] > 0.5 * r.step_time_s
    last = max((op for op in r.graph.ops if op.kind == "compute"), key=lambda op: op.id)  # the optimizer step
    # the step ends when the last kernel, launched last, has run
    assert r.step_time_s == pytest.approx(r.timing.issued[last.id] + r.alone_s(last).total)
    assert br["matmul_s"] + br["attention_s"] + br["memory_bound_s"] < 0.5 * r.step_time_s


def test_torch_compile_shortens_a_launch_bound_step():
    base = {"model": TINY, "training": {"seq_len": 128}, "hardware": {"profile": "h100-sxm", "gpus_per_node": 1}}
    eager = simulate(parse_scenario(base)).step_time_s
    compiled = simulate(parse_scenario(base | {"compute": {"torch_compile": True}})).step_time_s
    # fewer launches: Inductor's kernels (workload/compiled_block.py: 18 forward, 27 backward in an MHA
    # block, against eager's 24 and 35), each at Inductor's launch cost
    assert compiled < 0.9 * eager


def test_overlapped_compute_and_collectives_both_slow():
    sc = parse_scenario({"model": "llama3-8b", "training": {"seq_len": 4096},
                         "hardware": {"profile": "h100-sxm", "nodes": 2}})
    r = simulate(sc)
    assert r.compute()["breakdown"]["interference_s"] > 0
    from fsdp_sim.hardware.costs import OpCosts
    s = sc.settings
    costs = OpCosts(sc.cluster, shard_size=s.shard_size, replicate_size=s.replicate_size, compute_dtype=s.param_dtype,
                    options=sc.compute)
    slower = [op for op in r.graph.ops if op.kind == "all_gather"
              and r.timing.end[op.id] - r.timing.start[op.id] > costs.duration(op) * (1 + 1e-9)]
    assert slower, "no all-gather was slowed by the compute it overlapped"


@settings(max_examples=15, deadline=None)
@given(hidden=st.sampled_from([256, 1024, 4096]), seq=st.sampled_from([128, 2048, 16384]),
       profile=st.sampled_from(["a100-80gb", "h100-sxm", "b200", "mi300x", "rtx-4090"]),
       dtype=st.sampled_from(["bf16", "fp32"]), tf32=st.booleans(), compiled=st.booleans())
def test_mfu_never_exceeds_one(hidden, seq, profile, dtype, tf32, compiled):
    """Numerator and time model count the same FLOPs and no kernel beats its peak, so MFU <= 1."""
    sc = parse_scenario({"model": {"hidden": hidden, "layers": 2, "heads": 8, "vocab": 32000},
                         "training": {"seq_len": seq}, "hardware": {"profile": profile, "gpus_per_node": 2},
                         "fsdp": {"mixed_precision": {"param_dtype": dtype}},
                         "compute": {"allow_tf32": tf32, "torch_compile": compiled}})
    mfu = simulate(sc).compute()["mfu"]
    assert 0 < mfu <= 1


def test_two_collectives_of_different_groups_share_the_nic():
    """HSDP with shard groups spanning two nodes: a reduce-scatter and a replicate all-reduce in flight
    together both cross the NICs, so each runs at least 1.5x slower than alone (two shares of the link)."""
    from fsdp_sim.hardware.costs import OpCosts
    sc = parse_scenario({"model": TINY, "hardware": {"profile": "a100-80gb", "nodes": 4},
                         "fsdp": {"sharding_strategy": "HYBRID_SHARD", "shard_size": 16}})
    s = sc.settings
    costs = OpCosts(sc.cluster, shard_size=s.shard_size, replicate_size=s.replicate_size, compute_dtype=s.param_dtype,
                    options=sc.compute)
    g = OpGraph()
    rs = g.add("reduce_scatter", "reduce_scatter", "rs", comm_bytes=1 << 30, group="shard")
    ar = g.add("all_reduce", "all_reduce", "ar", comm_bytes=1 << 26, group="replicate")
    assert min(costs.slowdowns([rs, ar])) >= 1.5
    assert costs.slowdowns([rs]) == [1.0]
