"""Gradient reduction as FSDP2 runs it under HSDP and without (torch 2.13 `_fsdp_collectives.foreach_reduce`,
`FSDPParamGroup.post_backward` / `finalize_backward`, `FSDPState._root_post_backward_final_callback`).

The compute stream waits each reduce-scatter (the next post_backward drops its input), never an
all-reduce: the all-reduces are waited once, in the final callback, before the optimizer step. With a
reduce dtype other than the fp32 parameters', HSDP's `_all_reduce_state` keeps every group's
reduce-dtype output alive until that callback; without HSDP it dies when `foreach_reduce` returns.
"""

from __future__ import annotations

import numpy as np
from conftest import scenario_dict

from fsdp_sim.engine import play
from fsdp_sim.hardware.costs import OpCosts
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.fsdp2 import build_fsdp2_step
from fsdp_sim.schedule.fsdp2_reduce import gradient_divide_factors
from fsdp_sim.simulate import simulate

MODEL = {"hidden": 64, "layers": 3, "heads": 4, "vocab": 512}


def _scenario(strategy: str = "HYBRID_SHARD", reduce_dtype: str = "fp32", **fsdp):
    """2 nodes x 2 GPUs: HYBRID_SHARD shards inside a node and replicates across the two."""
    return parse_scenario(scenario_dict(MODEL, nodes=2, gpus_per_node=2, fsdp={
        "sharding_strategy": strategy, "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": reduce_dtype}} | fsdp))


def _graph(sc):
    return build_fsdp2_step(sc.workload, sc.units, sc.settings)


def _final_wait(ops):
    """The final callback's compute-stream wait: it rides on the drop of the last reduce-scatter input."""
    return [op for op in ops if op.kind == "free" and op.name.endswith("reduce-scatter input")][-1]


def test_compute_stream_waits_reduce_scatters_not_all_reduces():
    sc = _scenario()
    assert (sc.settings.shard_size, sc.settings.replicate_size) == (2, 2)
    g = _graph(sc)
    ops = g.ops
    on_all_reduce_stream = {op.id for op in ops if op.stream == "all_reduce"}
    assert on_all_reduce_stream, "HSDP issues all-reduces"
    wait = _final_wait(ops)
    # only the final callback's wait depends on the all-reduce stream, and it waits its last op
    for op in ops:
        if op.stream == "compute" and op is not wait:
            assert not on_all_reduce_stream & set(op.deps), op.name
    assert max(on_all_reduce_stream) in wait.deps
    assert wait.id > max(op.id for op in ops if op.kind == "all_reduce" and op.phase != "optimizer")
    # each reduce-scatter input is dropped on the compute stream after waiting its own reduce-scatter
    reduce_scatter = {op.unit: op for op in ops if op.kind == "reduce_scatter"}
    frees = [op for op in ops if op.kind == "free" and op.name.endswith("reduce-scatter input")]
    assert len(frees) == len(sc.units)
    for free in frees[:-1]:
        assert free.stream == "compute" and free.deps == (reduce_scatter[free.buffer.unit].id,), free.name
    assert reduce_scatter[wait.buffer.unit].id in wait.deps
    # the optimizer step comes after the wait
    step = next(op for op in ops if op.phase == "optimizer" and op.kind == "compute")
    assert step.id > wait.id


def test_slow_replicate_link_delays_compute_only_at_the_end():
    """All-reduces of 1 s each: every compute-stream op before the final wait starts exactly when it would
    with instant all-reduces; the wait (and the optimizer after it) waits the last all-reduce."""
    sc = _scenario()
    g = _graph(sc)
    s = sc.settings
    costs = OpCosts(sc.cluster, shard_size=s.shard_size, replicate_size=s.replicate_size, compute_dtype=s.param_dtype)

    def priced(all_reduce_s):
        return lambda op: all_reduce_s if op.kind == "all_reduce" else costs.duration(op)

    fast, slow = play(g.ops, priced(0.0)), play(g.ops, priced(1.0))
    wait = _final_wait(g.ops)
    before = [op.id for op in g.ops if op.stream == "compute" and op.id < wait.id]
    np.testing.assert_array_equal(slow.start[before], fast.start[before])
    all_reduces = [op.id for op in g.ops if op.kind == "all_reduce" and op.phase != "optimizer"]
    assert len(all_reduces) == len(sc.units)
    assert slow.start[wait.id] >= slow.end[all_reduces].max() >= len(all_reduces) * 1.0
    assert slow.makespan > len(all_reduces) * 1.0


def _reduce_outputs(r):
    return [b for b in r.graph.buffers if b.name.endswith("reduce-scatter output")]


def test_hsdp_bf16_reduce_outputs_live_until_the_final_callback():
    """reduce_dtype bf16, fp32 parameters: the cast makes a new fp32 sharded grad on the all-reduce
    stream, and `_all_reduce_state` holds each group's bf16 output until finalize_backward."""
    sc = _scenario(reduce_dtype="bf16")
    r = simulate(sc)
    outputs = _reduce_outputs(r)
    assert len(outputs) == len(sc.units)
    assert {b.unit: b.nbytes for b in outputs} == {u.name: u.shard_numel(2, trainable_only=True) * 2 for u in sc.units}
    ops = r.graph.ops
    wait = next(op for op in ops if op.kind == "free" and op.name.endswith("reduce-scatter output"))
    assert set(wait.deps) == {max(op.id for op in ops if op.stream == "all_reduce")}  # finalize_backward's wait
    free_of = {op.buffer.id: op for op in ops if op.kind == "free"}
    for b in outputs:
        assert free_of[b.id].id >= wait.id and free_of[b.id].stream == "compute", b.name
    # on the ledger: just before the first of those frees every one of them is alive at once
    events = r.memory.events
    first = min(i for i, (op, buf, sign) in enumerate(events, 1) if sign < 0 and buf.name.endswith("reduce-scatter output"))
    live = {b.id for b in r.memory.live_at(first - 1)}
    assert {b.id for b in outputs} <= live
    assert r.memory.time[first] >= r.timing.end[[op.id for op in ops if op.kind == "all_reduce" and op.phase != "optimizer"]].max()
    # the cast (and the sharded grads it makes) run on the all-reduce stream
    casts = [op for op in ops if "cast sharded grads" in op.name]
    assert casts and all(op.stream == "all_reduce" for op in casts)


def test_without_hsdp_bf16_reduce_outputs_die_in_foreach_reduce():
    sc = parse_scenario(scenario_dict(MODEL, gpus_per_node=4, fsdp={
        "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"}}))
    r = simulate(sc)
    ops = r.graph.ops
    free_of = {op.buffer.id: op for op in ops if op.kind == "free"}
    inputs = {op.buffer.unit: op.id for op in ops if op.kind == "alloc" and op.name.endswith("reduce-scatter input")}
    for b in _reduce_outputs(r):
        free = free_of[b.id]
        assert free.stream == "reduce_scatter"
        later = [i for unit, i in inputs.items() if i > free.id]
        # freed before the next group's reduce-scatter input is allocated (the root's is last)
        assert b.unit == sc.units[0].name or later, b.name
    assert not [op for op in ops if op.kind == "all_reduce" and op.phase != "optimizer"]


def test_hsdp_fp32_reduce_holds_no_extra_buffer():
    """reduce_dtype fp32 = the parameters' dtype: the all-reduced output *is* the sharded gradient."""
    r = simulate(_scenario(reduce_dtype="fp32"))
    assert _reduce_outputs(r) == []


def test_gradient_divide_kernels_only_for_fp16():
    """NCCL's AVG divides for fp32 and bf16; fp16 divides by ~sqrt(N) before and after (N = 8: 4 then 2)."""
    assert gradient_divide_factors("fp32", 8) == gradient_divide_factors("bf16", 8) == (None, None)
    assert gradient_divide_factors("fp16", 8) == (4, 2)
    assert gradient_divide_factors("fp16", 2) == (2, None)
    assert gradient_divide_factors("fp16", 1) == (None, None)
    sc = _scenario(reduce_dtype="fp16")
    ops = _graph(sc).ops
    pre = [op for op in ops if "pre-divide" in op.name]
    post = [op for op in ops if "post-divide" in op.name]
    assert len(pre) == len(sc.units) and all(op.stream == "reduce_scatter" for op in pre)  # N = 4: 2 then 2
    assert len(post) == len(sc.units) and all(op.stream == "all_reduce" for op in post)
    assert not [op for op in _graph(_scenario(reduce_dtype="bf16")).ops if "divide" in op.name]


def test_shard_group_of_one_copies_instead_of_reduce_scattering():
    """NO_SHARD (shard groups of one): foreach_reduce copies the input into the output; only the
    all-reduce communicates."""
    sc = _scenario("NO_SHARD")
    ops = _graph(sc).ops
    assert not [op for op in ops if op.kind == "reduce_scatter"]
    copies = [op for op in ops if op.name.endswith("(shard group of one)")]
    assert len(copies) == len(sc.units) and all(op.stream == "reduce_scatter" for op in copies)
    assert len([op for op in ops if op.kind == "all_reduce" and op.phase != "optimizer"]) == len(sc.units)


def test_hsdp_accumulating_micro_batch_keeps_its_fp32_outputs_until_its_final_callback():
    """With gradient sync every micro-batch: from the second on the all-reduced fp32 output is added into
    the sharded grad, and `_all_reduce_state` still holds it until that micro-batch's finalize_backward."""
    sc = parse_scenario(scenario_dict(MODEL, nodes=2, gpus_per_node=2, training={"grad_accumulation": 2},
                                      fsdp={"sharding_strategy": "HYBRID_SHARD",
                                            "mixed_precision": {"reduce_dtype": "fp32"}}))
    ops = _graph(sc).ops
    outputs = {op.buffer.id: op for op in ops if op.kind == "alloc" and op.name.endswith("reduce-scatter output")}
    assert len(outputs) == len(sc.units) and all(op.phase == "backward #2" for op in outputs.values())
    last_post_reduce = max(op.id for op in ops if op.stream == "all_reduce")  # the last += into a sharded grad
    assert "accumulate sharded grads" in ops[last_post_reduce].name
    for op in ops:
        if op.kind == "free" and op.buffer.id in outputs:
            assert op.stream == "compute" and last_post_reduce in op.deps, op.name
