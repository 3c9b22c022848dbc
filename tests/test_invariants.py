"""Invariants of one simulated step (docs: /work/shared/DESIGN.md, "Invariants"), over random setups.

Hypothesis draws small transformers, world sizes, wrap policies, sharding strategies, precisions,
optimizers, checkpointing and prefetch (tests/conftest.py::scenario_dicts); each property below must
hold for every one of them. Expected values are computed here from first principles (shapes, dtypes,
the op list), never read back from the code under test.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest
from conftest import padded_shard_numel, run, scenario_dict, scenario_dicts
from hypothesis import HealthCheck, given, settings

from fsdp_sim.dtypes import DTYPE_BYTES
from fsdp_sim.simulate import op_costs
from fsdp_sim.schedule.ops import CATEGORIES, COLLECTIVES, TIMED_KINDS

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _alloc_free_counts(graph):
    allocs = Counter(op.buffer.id for op in graph.ops if op.kind == "alloc")
    frees = Counter(op.buffer.id for op in graph.ops if op.kind == "free")
    return allocs, frees


# ---- memory ------------------------------------------------------------------------------------
@SETTINGS
@given(scenario_dicts())
def test_every_transient_buffer_is_allocated_once_and_freed_once(data):
    """(a) A non-persistent buffer has exactly one alloc and one free op; persistent state has neither."""
    _, r = run(data)
    allocs, frees = _alloc_free_counts(r.graph)
    persistent = {b.id for b in r.graph.persistent}
    for buf in r.graph.buffers:
        if buf.id in persistent:
            assert (allocs[buf.id], frees[buf.id]) == (0, 0), buf.name
        else:
            assert (allocs[buf.id], frees[buf.id]) == (1, 1), buf.name
    # a free never precedes its alloc in issue order
    first = {}
    for op in r.graph.ops:
        if op.kind == "alloc":
            first[op.buffer.id] = op.id
        elif op.kind == "free" and op.buffer.id not in persistent:
            assert first.get(op.buffer.id, np.inf) < op.id, op.name


@SETTINGS
@given(scenario_dicts())
def test_memory_never_negative_and_never_below_persistent(data):
    """(b) Every category level is >= 0 at every event, and the total never drops below persistent state."""
    _, r = run(data)
    mem = r.memory
    persistent = sum(b.nbytes for b in r.graph.persistent)
    assert (mem.levels >= 0).all()
    assert mem.total[0] == persistent
    assert (mem.total >= persistent).all()
    assert np.all(np.diff(mem.time) >= 0), "the ledger timeline must be monotone"


@SETTINGS
@given(scenario_dicts())
def test_step_leaks_nothing(data):
    """(c) The live set at the end of the step is the persistent set at its start: same ids, same bytes."""
    _, r = run(data)
    allocs, frees = _alloc_free_counts(r.graph)
    by_id = {b.id: b for b in r.graph.buffers}
    live = {b.id for b in r.graph.persistent} | {i for i in allocs if allocs[i] > frees[i]}
    expected = {b.id: b.nbytes for b in r.graph.persistent}
    assert {i: by_id[i].nbytes for i in live} == expected
    assert {b.id: b.nbytes for b in r.memory.live_at_end} == expected
    assert r.memory.total[-1] == sum(expected.values())


@SETTINGS
@given(scenario_dicts())
def test_bytes_are_conserved_per_category(data):
    """(d) Over the step, bytes allocated == bytes freed in every memory category."""
    _, r = run(data)
    alloc, free = defaultdict(int), defaultdict(int)
    for op in r.graph.ops:
        if op.kind == "alloc":
            alloc[op.buffer.category] += op.buffer.nbytes
        elif op.kind == "free":
            free[op.buffer.category] += op.buffer.nbytes
    assert set(alloc) | set(free) <= set(CATEGORIES)
    assert dict(alloc) == dict(free)
    np.testing.assert_array_equal(r.memory.levels[-1], r.memory.levels[0])


# ---- communication -----------------------------------------------------------------------------
@SETTINGS
@given(scenario_dicts())
def test_collective_bytes_match_closed_forms(data):
    """(e) All-gather output = W x padded shard x param itemsize; reduce-scatter input likewise in the
    reduce dtype; per micro-batch one all-gather per unit, two if it reshards after forward (not the
    root); one reduce-scatter per micro-batch, or only in the last without gradient sync; the
    reported bytes per rank are the ring volume (W-1)/W of those.

    With W == 1 PyTorch issues no all-gather at all (FSDPParamGroup.unshard returns early) and no
    reduce-scatter (foreach_reduce copies the input into the output), so the moved bytes are 0.
    """
    sc, r = run(data)
    s = sc.settings
    w = s.shard_size
    pbytes, rbytes = DTYPE_BYTES[s.param_dtype], DTYPE_BYTES[s.reduce_dtype]
    ops = defaultdict(list)
    for op in r.graph.ops:
        if op.kind in COLLECTIVES:
            ops[op.kind, op.unit].append(op)
    for u in sc.units:
        shard = sum(padded_shard_numel(p.shape, w) for p in u.params)
        ags, rss, ars = ops["all_gather", u.name], ops["reduce_scatter", u.name], ops["all_reduce", u.name]
        if not u.params:
            assert not (ags or rss or ars), u.name
            continue
        assert all(op.comm_bytes == w * shard * pbytes for op in ags), u.name
        n = s.grad_accumulation
        reductions = n if s.requires_gradient_sync else 1
        # not resharded after forward: the root, a unit its policy keeps (torchtitan's norm + head), the last
        kept = u.is_root or u.reshard_after_forward is False or (u is sc.units[-1] and not s.reshard_last_unit)
        if w > 1:
            assert len(ags) == n * (2 if s.reshard_after_forward and not kept else 1), u.name
        assert [op.comm_bytes for op in rss] == ([w * shard * rbytes] * reductions if w > 1 else []), u.name
        assert [op.comm_bytes for op in ars] == ([shard * rbytes] * reductions if s.replicate_size > 1 else []), u.name
    comm = r.to_dict()["communication"]
    ag = sum(op.comm_bytes for (kind, _), lst in ops.items() if kind == "all_gather" for op in lst)
    rs = sum(op.comm_bytes for (kind, _), lst in ops.items() if kind == "reduce_scatter" for op in lst)
    assert abs(comm["all_gather_bytes"] - (w - 1) / w * ag) <= 1
    assert abs(comm["reduce_scatter_bytes"] - (w - 1) / w * rs) <= 1
    if w == 1:
        assert comm["all_gather_bytes"] == comm["reduce_scatter_bytes"] == 0


# ---- time --------------------------------------------------------------------------------------
@SETTINGS
@given(scenario_dicts())
def test_timing_respects_streams_events_and_process_groups(data):
    """(f) Each op starts after the CPU issued it, lasts at least its priced duration (exactly it when no
    collective runs beside it: only overlap slows); one stream runs one op at a time in issue order; an op
    starts after every op it waits on; collectives of one process group run one at a time in issue order
    (one NCCL lane per group)."""
    sc, r = run(data)
    start, end = r.timing.start, r.timing.end
    costs = op_costs(sc)  # the pricer the simulation used (its GPU paced as the slowest rank's)
    comm = [(start[op.id], end[op.id], op.id) for op in r.graph.ops if op.kind in COLLECTIVES]
    timed = [(start[op.id], end[op.id], op.id) for op in r.graph.ops if op.kind in TIMED_KINDS]
    last_on_stream, last_in_group = {}, {}
    for op in r.graph.ops:
        i = op.id
        assert end[i] >= start[i] >= r.timing.issued[i] - 1e-15 and start[i] >= 0, op.name
        alone = costs.duration(op)
        assert end[i] - start[i] >= alone * (1 - 1e-9) - 1e-15, op.name
        # a kernel is slowed only beside a collective; a collective beside any kernel
        beside = timed if op.kind in COLLECTIVES else comm
        if not any(a < end[i] and start[i] < b and j != i for a, b, j in beside):
            assert end[i] - start[i] == pytest.approx(alone, rel=1e-9, abs=1e-15), op.name
        for d in op.deps:
            assert d < i and start[i] >= end[d], (op.name, r.graph.ops[d].name)
        if op.stream in last_on_stream:
            assert start[i] >= end[last_on_stream[op.stream]], (op.stream, op.name)
        last_on_stream[op.stream] = i
        if op.kind in COLLECTIVES:
            if op.group in last_in_group:
                assert start[i] >= end[last_in_group[op.group]], (op.group, op.name)
            last_in_group[op.group] = i


def _merged_length(intervals):
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            total += (cur_b - cur_a) if cur_b is not None else 0.0
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + ((cur_b - cur_a) if cur_b is not None else 0.0)


@SETTINGS
@given(scenario_dicts())
def test_step_time_bounds(data):
    """(g) The step lasts at least as long as the compute stream is busy and until every collective ends;
    exposed communication lies between 0 and the communication time."""
    _, r = run(data)
    start, end = r.timing.start, r.timing.end
    ops = r.graph.ops
    busy = _merged_length([(start[o.id], end[o.id]) for o in ops if o.stream == "compute" and o.kind in ("compute", "copy")])
    d = r.to_dict()
    assert d["compute"]["busy_s"] == pytest.approx(busy, rel=1e-9, abs=1e-15)
    assert d["step_time_s"] >= busy * (1 - 1e-12)
    assert d["step_time_s"] == end.max()
    for o in ops:
        if o.kind in COLLECTIVES:
            assert d["step_time_s"] >= end[o.id]
    comm = d["communication"]
    comm_len = _merged_length([(start[o.id], end[o.id]) for o in ops if o.kind in COLLECTIVES])
    assert -1e-15 <= comm["exposed_s"] <= comm_len * (1 + 1e-9) + 1e-15
    # 1 - exposed/total: exactly 0 when nothing overlaps, up to one rounding error (-2.2e-16 seen)
    assert -1e-12 <= comm["overlap_fraction"] <= 1.0 + 1e-12


def test_size_based_wrapping_the_embedding_keeps_root_hooks():
    """fully_shard(model) runs its hooks around the whole model, whichever inner units exist: the root
    must unshard before the first forward compute and reduce its gradients in backward."""
    data = scenario_dict({"hidden": 32, "layers": 1, "heads": 2, "vocab": 1000}, gpus_per_node=2,
                         fsdp={"wrap": "size_based", "min_params": 20000})
    sc, r = run(data)
    assert [u.name for u in sc.units if not u.is_root] == ["tok_embeddings", "output"]
    root = [op for op in r.graph.ops if op.unit == "root"]
    first_compute = next(op.id for op in r.graph.ops if op.kind == "compute")
    assert any(op.kind == "all_gather" and op.id < first_compute for op in root), "root not unsharded in forward"
    assert any(op.kind == "reduce_scatter" for op in root), "root gradients never reduce-scattered"
    persistent = {b.id for b in r.graph.persistent}
    assert [b.name for b in r.memory.live_at_end if b.id not in persistent] == []


@SETTINGS
@given(scenario_dicts())
def test_op_graph_is_a_dag_the_timing_respects(data):
    """The op graph (stream order + event waits, as networkx sees it) has no cycle, every event edge
    points back in issue order, and no op starts before any of its predecessors ends."""
    import networkx as nx

    _, r = run(data)
    dag = r.graph.to_networkx()
    assert nx.is_directed_acyclic_graph(dag)
    start, end = r.timing.start, r.timing.end
    for a, b, why in dag.edges(data="why"):
        assert a < b, f"{why} edge {a} -> {b} points forward in issue order"
        assert start[b] >= end[a] - 1e-15
