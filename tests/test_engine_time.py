"""The engine's time rules in closed form: the CPU issue thread, processor sharing between ops that slow each
other, and the end-to-end directions they give a simulated step (CPU-bound small models, overlap that costs)."""

from __future__ import annotations

import pytest

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
    timing = play(g.ops, lambda op: dur[op.id], slowdown=lambda op, running: 2.0)
    assert timing.end[a.id] == pytest.approx(2.0) and timing.end[b.id] == pytest.approx(4.0)
    # without contention each takes its own time
    timing = play(g.ops, lambda op: dur[op.id])
    assert timing.end[a.id] == pytest.approx(1.0) and timing.end[b.id] == pytest.approx(3.0)


def test_nothing_contends_without_a_collective():
    g = OpGraph()
    a = g.add("compute", "compute", "a", flops=1.0)
    b = g.add("copy", "side", "b", hbm_bytes=1.0)
    timing = play(g.ops, lambda op: 1.0, slowdown=lambda op, running: 2.0)
    assert timing.end[a.id] == timing.end[b.id] == pytest.approx(1.0)


def test_a_slowdown_applies_only_while_the_other_op_runs():
    g = OpGraph()
    a = g.add("compute", "compute", "a", flops=1.0)
    g.add("compute", "compute", "a2", flops=1.0)
    b = g.add("all_gather", "all_gather", "b", comm_bytes=1.0, group="g", deps=(a,))  # starts when a ends, beside a2
    timing = play(g.ops, lambda op: 1.0, slowdown=lambda op, running: 1.5)
    assert timing.end[a.id] == pytest.approx(1.0)
    assert timing.end[b.id] == pytest.approx(2.5) and timing.makespan == pytest.approx(2.5)


TINY = {"hidden": 256, "layers": 4, "heads": 4, "vocab": 1000}


def test_a_small_model_on_short_sequences_is_cpu_bound():
    r = simulate(parse_scenario({"model": TINY, "training": {"seq_len": 128},
                                 "hardware": {"profile": "h100-sxm", "gpus_per_node": 1}}))
    br = r.compute()["breakdown"]
    host = r.timing.issued[-1]
    assert br["cpu_bound_s"] > 0.5 * r.step_time_s
    last = max((op for op in r.graph.ops if op.kind == "compute"), key=lambda op: op.id)  # the optimizer step
    # the step ends when the last kernel, launched last, has run
    assert r.step_time_s == pytest.approx(r.timing.issued[last.id] + r.alone_s(last).total)
    assert br["matmul_s"] + br["attention_s"] + br["memory_bound_s"] < 0.5 * r.step_time_s


def test_torch_compile_shortens_a_launch_bound_step():
    base = {"model": TINY, "training": {"seq_len": 128}, "hardware": {"profile": "h100-sxm", "gpus_per_node": 1}}
    eager = simulate(parse_scenario(base)).step_time_s
    compiled = simulate(parse_scenario(base | {"compute": {"torch_compile": True}})).step_time_s
    assert compiled < 0.8 * eager  # fewer launches: one per memory-bound chain


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
