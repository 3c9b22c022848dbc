"""FSDP1 (`fsdp.version: 1`, FullyShardedDataParallel): FlatParameter padding, BACKWARD_PRE / BACKWARD_POST /
none, the rate limiter, the sharding strategies, no_sync, and FSDP1 beside FSDP2 on the same job.

The closed forms are computed here from the model's parameter shapes, independently of the runtime:
a unit's FlatParameter has N = sum of its parameters' numels (use_orig_params=False), each rank keeps
S = ceil(N / W) fp32 elements, the all-gather fills S x W elements in the compute dtype.
"""

from __future__ import annotations

import math

import pytest
from conftest import scenario_dict
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.fsdp1 import flat_param_numel
from fsdp_sim.simulate import simulate

MODEL = {"hidden": 64, "layers": 3, "heads": 4, "vocab": 509}
GPU_BOUND = {"hidden": 2048, "layers": 6, "heads": 16, "vocab": 1024}  # compute far longer than a launch


def _scenario(model=MODEL, gpus=4, nodes=1, training=None, **fsdp):
    return parse_scenario(scenario_dict(model, nodes=nodes, gpus_per_node=gpus, training=training,
                                        fsdp={"version": 1, "mixed_precision": {"reduce_dtype": "fp32"}} | fsdp))


def _flat_numel(unit) -> int:
    return sum(math.prod(p.shape) for p in unit.params)


def _live_at_ops(ops) -> dict[str, int]:
    """Allocated bytes (issue order) when each compute op named '<module> backward' runs."""
    live, out = 0, {}
    for op in ops:
        if op.kind == "alloc":
            live += op.buffer.nbytes
        elif op.kind == "free":
            live -= op.buffer.nbytes
        elif op.kind == "compute" and op.name.endswith(" backward"):
            out[op.name] = live
    return out


def test_flat_param_padding_closed_form():
    # use_orig_params=False: the numels' sum; True: each parameter 16-byte aligned, the total a multiple of W
    assert flat_param_numel([5, 3, 7], 4, 0) == 15
    assert flat_param_numel([5, 3, 7], 4, 8) == 8 + 8 + 7 + 1  # bf16: 8 elements per 16 bytes, then to 24
    assert flat_param_numel([8, 8], 4, 4) == 16
    sc = _scenario()
    result = simulate(sc)
    w = sc.settings.shard_size
    sharded = {b.unit: b.nbytes for b in result.graph.persistent if b.category == "sharded_params"}
    gathers = {op.unit: op.comm_bytes for op in result.graph.ops if op.kind == "all_gather"}
    for u in sc.units:
        n = _flat_numel(u)
        assert sharded[u.name] == -(-n // w) * 4, u.name
        if u.name in gathers:
            assert gathers[u.name] == -(-n // w) * w * 2, u.name  # the padded unsharded flat parameter, bf16


def test_use_orig_params_pads_each_parameter_to_16_bytes():
    plain, orig = _scenario(), _scenario(use_orig_params=True)
    for u in orig.units:
        sharded = {b.unit: b.nbytes for b in simulate(orig).graph.persistent if b.category == "sharded_params"}
        expected = flat_param_numel([math.prod(p.shape) for p in u.params], 4, 8)
        assert sharded[u.name] == expected // 4 * 4
    assert simulate(orig).peak()["allocated_bytes"] >= simulate(plain).peak()["allocated_bytes"]


def test_backward_pre_holds_exactly_the_next_units_parameters_during_each_gradient_computation():
    pre, none = _scenario(backward_prefetch="BACKWARD_PRE"), _scenario(backward_prefetch="none")
    live_pre, live_none = (_live_at_ops(simulate(sc).graph.ops) for sc in (pre, none))
    blocks = [u for u in pre.units if not u.is_root]
    w = pre.settings.shard_size
    for earlier, later in zip(blocks, blocks[1:]):
        # BACKWARD_PRE all-gathered `earlier` in `later`'s pre-backward, before its gradient kernels
        name = f"{later.modules[0]} backward"
        assert live_pre[name] - live_none[name] == -(-_flat_numel(earlier) // w) * w * 2, name
    first = f"{blocks[0].modules[0]} backward"
    assert live_pre[first] == live_none[first]  # nothing before the first unit in post-forward order
    assert simulate(pre).peak()["allocated_bytes"] >= simulate(none).peak()["allocated_bytes"]


def test_backward_prefetch_issue_points():
    """BACKWARD_PRE: the earlier unit's all-gather before the later unit's gradient kernels; BACKWARD_POST:
    after them, before its reduce-scatter; none: after that reduce-scatter."""
    def order(prefetch):
        ops = [op for op in simulate(_scenario(backward_prefetch=prefetch)).graph.ops if op.phase == "backward"]
        first = lambda kind: {op.unit: op.id for op in reversed(ops) if op.kind == kind}  # noqa: E731
        return first("all_gather"), first("compute"), first("reduce_scatter")
    blocks = [u.name for u in _scenario().units if not u.is_root]
    for prefetch in ("BACKWARD_PRE", "BACKWARD_POST", "none"):
        ag, compute, rs = order(prefetch)
        for earlier, later in zip(blocks, blocks[1:]):
            if prefetch == "BACKWARD_PRE":
                assert ag[earlier] < compute[later]
            elif prefetch == "BACKWARD_POST":
                assert compute[later] < ag[earlier] < rs[later]
            else:
                assert rs[later] < ag[earlier]


def test_forward_prefetch_runs_each_prefetched_units_post_backward_one_unit_late():
    """A forward-prefetched unit's split node is created in the previous unit's pre-forward, so autograd
    runs it (and the post-backward hook: reshard, reduce-scatter) after the previous unit's gradient kernels."""
    def order(forward_prefetch):
        ops = [op for op in simulate(_scenario(forward_prefetch=forward_prefetch)).graph.ops if op.phase == "backward"]
        compute = {op.unit: op.id for op in reversed(ops) if op.kind == "compute"}  # each unit's first kernel
        rs = {op.unit: op.id for op in ops if op.kind == "reduce_scatter"}
        return compute, rs
    blocks = [u.name for u in _scenario().units if not u.is_root]
    (compute, rs), (compute_fp, rs_fp) = order(False), order(True)
    for earlier, later in zip(blocks, blocks[1:]):
        assert rs[later] < compute[earlier]
        assert compute_fp[earlier] < rs_fp[later]


def _in_flight(result) -> list[int]:
    """For each forward all-gather, at its CPU issue time: the units all-gathered by then whose parameters
    the GPU still uses (the compute-stream point recorded at their free has not passed)."""
    ops, t = result.graph.ops, result.timing
    gathered, released, last_compute = {}, {}, None
    for op in ops:
        if op.stream == "compute":
            last_compute = op
        if op.kind == "all_gather":
            gathered.setdefault(op.unit, []).append(op.id)
        if op.kind == "free" and op.name.endswith("unsharded flat param"):
            released.setdefault(op.unit, []).append(t.end[last_compute.id])
    counts = []
    for op in ops:
        if op.kind == "all_gather" and op.phase == "forward":
            now = t.issued[op.id]
            counts.append(sum(1 for unit, ids in gathered.items() for k, i in enumerate(ids)
                              if t.issued[i] <= now and (k >= len(released.get(unit, [])) or released[unit][k] > now)))
    return counts


def test_limit_all_gathers_keeps_at_most_two_all_gathers_in_flight():
    training = {"micro_batch": 1, "seq_len": 1024}
    limited = simulate(_scenario(GPU_BOUND, gpus=8, training=training))
    free = simulate(_scenario(GPU_BOUND, gpus=8, training=training, limit_all_gathers=False))
    # the root keeps its parameters after forward: it is the one more all-gathered unit in flight
    assert max(_in_flight(limited)) <= 2 + 1
    assert max(_in_flight(free)) > 3  # the CPU runs ahead of the GPU and all-gathers every block early
    waits = [op for op in limited.graph.ops if op.cpu_wait >= 0]
    assert waits
    for op in waits:  # the CPU issued nothing past a synchronize before its event ended
        assert limited.timing.issued[op.id] >= limited.timing.end[op.cpu_wait]
    assert limited.peak()["allocated_bytes"] <= free.peak()["allocated_bytes"]


def test_sharding_strategies():
    full, zero2 = simulate(_scenario(sharding_strategy="FULL_SHARD")), simulate(_scenario(sharding_strategy="SHARD_GRAD_OP"))
    backward_gathers = lambda r: [op for op in r.graph.ops if op.kind == "all_gather" and op.phase == "backward"]  # noqa: E731
    assert backward_gathers(full) and not backward_gathers(zero2)
    assert zero2.peak()["allocated_bytes"] > full.peak()["allocated_bytes"]
    hsdp = simulate(_scenario(gpus=4, nodes=2, sharding_strategy="HYBRID_SHARD"))
    reduces = [op for op in hsdp.graph.ops if op.kind == "all_reduce" and op.phase != "optimizer"]
    assert reduces and all(op.stream == "all_reduce" and op.group == "replicate" for op in reduces)
    no_shard = simulate(_scenario(sharding_strategy="NO_SHARD"))
    assert not [op for op in no_shard.graph.ops if op.kind in ("all_gather", "reduce_scatter")]
    sc = _scenario(sharding_strategy="NO_SHARD")
    flat = {u.name: _flat_numel(u) for u in sc.units}
    reduced = {op.unit: op.comm_bytes for op in no_shard.graph.ops if op.kind == "all_reduce" and op.phase != "optimizer"}
    assert reduced == {name: n * 4 for name, n in flat.items()}  # the whole flat gradient, in fp32


def test_no_sync_keeps_the_unsharded_flat_gradients_until_the_last_micro_batch():
    training = {"micro_batch": 1, "seq_len": 16, "grad_accumulation": 2}
    sync, no_sync = _scenario(training=training), _scenario(training=training, no_sync=True)
    rs = lambda sc: [op.phase for op in simulate(sc).graph.ops if op.kind == "reduce_scatter"]  # noqa: E731
    assert set(rs(no_sync)) == {"backward #2"} and set(rs(sync)) == {"backward #1", "backward #2"}
    graph = simulate(no_sync).graph
    kept = {}
    for op in graph.ops:
        if op.phase == "forward #2":
            break
        if op.buffer is not None and op.buffer.category == "unsharded_grads":
            kept[op.buffer.id] = op.buffer.nbytes if op.kind == "alloc" else 0
    assert sum(kept.values()) == sum(_flat_numel(u) * 2 for u in no_sync.units)  # every flat .grad, in bf16
    assert simulate(no_sync).peak()["allocated_bytes"] > simulate(sync).peak()["allocated_bytes"]


def test_fsdp1_beside_fsdp2_on_the_same_job():
    v1, v2 = _scenario(), parse_scenario(scenario_dict(MODEL, gpus_per_node=4, fsdp={"mixed_precision": {"reduce_dtype": "fp32"}}))
    r1, r2 = simulate(v1), simulate(v2)
    sharded = lambda r: sum(b.nbytes for b in r.graph.persistent if b.category == "sharded_params")  # noqa: E731
    numel = sum(_flat_numel(u) for u in v1.units)
    # one padding per flat parameter is at most FSDP2's padding of every parameter's dim 0
    assert numel * 4 // v1.settings.shard_size <= sharded(r1) <= sharded(r2)
    assert not [op for op in r1.graph.ops if "copy-out" in op.name]  # parameters are views of the flat storage
    assert abs(r1.peak()["allocated_bytes"] - r2.peak()["allocated_bytes"]) < 0.25 * r2.peak()["allocated_bytes"]


@pytest.mark.parametrize("fsdp, key", [
    ({"version": 1, "reshard_after_forward": False}, "fsdp.reshard_after_forward"),
    ({"version": 1, "backward_prefetch": 2}, "fsdp.backward_prefetch"),
    ({"version": 1, "wrap": "torchtitan"}, "fsdp.wrap"),
    ({"version": 1, "mixed_precision": {"output_dtype": "fp32"}}, "fsdp.mixed_precision.output_dtype"),
    ({"version": 1, "forward_prefetch": 2}, "fsdp.forward_prefetch"),
    ({"limit_all_gathers": False}, "fsdp.limit_all_gathers"),
    ({"backward_prefetch": "BACKWARD_POST"}, "fsdp.backward_prefetch"),
    ({"version": 3}, "fsdp.version"),
])
def test_each_version_refuses_the_other_versions_keys(fsdp, key):
    with pytest.raises(ScenarioError, match=key.replace(".", r"\.")) as err:
        parse_scenario(scenario_dict(MODEL, gpus_per_node=4, fsdp=fsdp))
    assert "\n" not in str(err.value)


def test_version_1_refuses_what_its_runtime_does_not_model():
    with pytest.raises(ScenarioError, match=r"^parallelism\.tp: "):
        parse_scenario(scenario_dict(MODEL, gpus_per_node=4, fsdp={"version": 1}) | {"parallelism": {"tp": 2}})
    with pytest.raises(ScenarioError, match=r"^fsdp\.cpu_offload: "):
        parse_scenario(scenario_dict(MODEL, gpus_per_node=4, fsdp={"version": 1, "cpu_offload": True,
                                                                   "sharding_strategy": "NO_SHARD"}))


def test_fsdp1_wrap_policy_words():
    named = _scenario(wrap="transformer_auto_wrap_policy")
    assert [u.modules for u in named.units] == [u.modules for u in _scenario(wrap="per_block").units]
    sized = _scenario(wrap="size_based_auto_wrap_policy", min_num_params=10_000)
    assert [u.modules for u in sized.units] == [u.modules for u in _scenario(wrap="size_based", min_params=10_000).units]


@settings(max_examples=25, deadline=None)
@given(strategy=st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]),
       prefetch=st.sampled_from(["BACKWARD_PRE", "BACKWARD_POST", "none"]), limit=st.booleans(),
       forward=st.booleans(), orig=st.booleans(), accumulation=st.integers(1, 2), no_sync=st.booleans(),
       param_dtype=st.sampled_from(["bf16", "fp32"]), offload=st.booleans())
def test_every_step_frees_what_it_allocates(strategy, prefetch, limit, forward, orig, accumulation, no_sync, param_dtype,
                                            offload):
    sc = _scenario(sharding_strategy=strategy, backward_prefetch=prefetch, limit_all_gathers=limit,
                   forward_prefetch=forward, use_orig_params=orig, no_sync=no_sync,
                   cpu_offload=offload and strategy != "NO_SHARD",
                   mixed_precision={"param_dtype": param_dtype, "reduce_dtype": "fp32"},
                   training={"micro_batch": 1, "seq_len": 16, "grad_accumulation": accumulation})
    result = simulate(sc)  # the ledger refuses a double free and a negative level
    assert {b.id for b in result.memory.live_at_end} == {b.id for b in result.graph.persistent}
    w = sc.settings.shard_size
    aligned = (16 // (2 if param_dtype == "bf16" else 4)) if orig else 0
    for op in result.graph.ops:
        if op.kind == "reduce_scatter":  # the padded flat gradient, in fp32
            unit = next(u for u in sc.units if u.name == op.unit)
            n = flat_param_numel([math.prod(p.shape) for p in unit.params], w, aligned)
            assert op.comm_bytes == -(-n // w) * w * 4


def test_cpu_offload_moves_the_closed_form_bytes_over_the_host_link():
    """CPUOffload(offload_params=True): every unshard copies the fp32 shard H2D (the root's backward one too:
    `pre_unshard` skips `needs_unshard` under offload), every reduced shard goes D2H into `_cpu_grad`; the
    shards, `_cpu_grad` and the optimizer states are on the host, not the GPU."""
    sc, plain = _scenario(cpu_offload=True), _scenario()
    result = simulate(sc)
    w = sc.settings.shard_size
    shard_bytes = {u.name: -(-_flat_numel(u) // w) * 4 for u in sc.units}
    h2d = sum(op.comm_bytes for op in result.graph.ops if op.group == "h2d")
    d2h = sum(op.comm_bytes for op in result.graph.ops if op.group == "d2h")
    assert h2d == 2 * sum(shard_bytes.values())  # forward and backward, every unit
    assert d2h == sum(shard_bytes.values())
    assert not [b for b in result.graph.persistent if b.category in ("sharded_params", "optimizer_states")]
    assert result.graph.host.persistent == {"sharded_params": sum(shard_bytes.values()),
                                            "optimizer_states": 2 * sum(shard_bytes.values()),
                                            "sharded_grads": sum(shard_bytes.values())}
    assert result.peak()["allocated_bytes"] < simulate(plain).peak()["allocated_bytes"]
