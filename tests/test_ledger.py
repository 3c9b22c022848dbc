"""The memory ledger (engine/ledger.py) reads the graph's memory columns in numpy: its levels are the running
sums a walk over the ops in issue order gives, and it refuses a schedule that frees a buffer twice, frees one
never allocated or allocates one twice."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.engine import LedgerError, replay
from fsdp_sim.schedule.ops import CATEGORIES, Buffer, OpGraph

# a schedule: each step allocates (a category, bytes, a stream) or frees the k-th live buffer
STEPS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.sampled_from(CATEGORIES), st.integers(0, 1 << 30), st.sampled_from(["compute", "comm"])),
    st.tuples(st.just("free"), st.integers(0, 50))), max_size=60)


@settings(max_examples=60, deadline=None)
@given(steps=STEPS, persistent=st.lists(st.integers(0, 1 << 28), max_size=3))
def test_levels_are_the_running_sums_of_a_walk_in_issue_order(steps, persistent):
    g = OpGraph()
    kept = [g.persistent_alloc(f"p{i}", "sharded_params", n) for i, n in enumerate(persistent)]
    live: list[Buffer] = []
    for step in steps:
        if step[0] == "alloc":
            live.append(g.alloc(step[3], f"b{len(g.buffers)}", step[1], step[2]))
        elif live:
            g.free("compute", live.pop(step[1] % len(live)))
        g.add("compute", "kernel", "k")
    start = np.cumsum(np.full(len(g.ops), 1e-3))
    trace = replay(g, start)
    level = dict.fromkeys(CATEGORIES, 0)
    level["sharded_params"] = sum(persistent)
    rows = [dict(level)]
    for op in g.ops:
        if op.kind in ("alloc", "free"):
            level[op.buffer.category] += op.buffer.nbytes if op.kind == "alloc" else -op.buffer.nbytes
            rows.append(dict(level))
    assert trace.levels.tolist() == [[row[c] for c in CATEGORIES] for row in rows]
    assert trace.total.tolist() == [sum(row.values()) for row in rows]
    assert [(op.kind, buf.id, sign) for op, buf, sign in trace.events] == [
        (op.kind, op.buffer.id, 1 if op.kind == "alloc" else -1) for op in g.ops if op.kind in ("alloc", "free")]
    assert {b.id for b in trace.live_at_end} == {b.id for b in kept + live}
    assert bool(trace.allocator.reserved_bytes >= trace.total[-1])


def _graph_with(mistake: str) -> OpGraph:
    g = OpGraph()
    a = g.alloc("compute", "a", "activations", 1024)
    g.free("compute", a)
    if mistake == "free twice":
        g.free("compute", a)
    elif mistake == "free a stranger":
        g.free("compute", Buffer(7, "stranger", "activations", 64, ""))
    return g


@pytest.mark.parametrize("mistake, message", [
    ("free twice", "buffer 'a' freed twice or never allocated"),
    ("free a stranger", "buffer 'stranger' freed twice or never allocated"),
])
def test_a_schedule_that_breaks_the_ledger_is_refused_by_name(mistake, message):
    g = _graph_with(mistake)
    with pytest.raises(LedgerError, match=message):
        replay(g, np.zeros(len(g.ops)))


def test_a_graph_replayed_again_after_it_grew_is_summed_again_and_a_repriced_one_alike():
    """The ledger remembers the last columns it summed: a graph that gained events since is summed anew,
    and a graph sharing the columns (`OpGraph.with_ops`) gets the same levels with its own ops."""
    g = OpGraph()
    a = g.alloc("compute", "a", "activations", 1 << 20)
    first = replay(g, np.zeros(len(g.ops)))
    g.free("compute", a)
    g.alloc("compute", "b", "temporaries", 3 << 20)
    grown = replay(g, np.zeros(len(g.ops)))
    assert first.total.tolist() == [0, 1 << 20]
    assert grown.total.tolist() == [0, 1 << 20, 0, 3 << 20]
    twin = g.with_ops(list(g.ops))
    again = replay(twin, np.arange(len(g.ops), dtype=float))
    assert again.levels.tolist() == grown.levels.tolist() and again.ops is twin.ops
    assert again.time.tolist() == [0.0, 0.0, 1.0, 2.0]
