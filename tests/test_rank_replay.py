"""The per-rank replay (engine/ranks.py) on graphs small enough to work by hand, the process groups' rank
layout (schedule/tp.rank_groups) against the mesh's definition, and the per-rank exposure
and where each rank's step went (results/ranks.rank_activity) against the representative rank's interval
arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fsdp_sim.engine import play
from fsdp_sim.engine.ranks import play_ranks
from fsdp_sim.results.analysis import _length, _merge
from fsdp_sim.results.ranks import _union_length, rank_activity
from fsdp_sim.schedule.ops import Op
from fsdp_sim.schedule.settings import post_forward_group
from fsdp_sim.schedule.tp import rank_groups

DURATION = {0: 1.0, 1: 0.5, 2: 2.0}


def _graph(cpu_wait: bool = False) -> list[Op]:
    """compute (1 s) -> all-gather on its own stream (0.5 s) -> compute (2 s) waiting for it; with
    `cpu_wait` the CPU issues the second compute only once the first has ended (Event.synchronize)."""
    ops = [Op(0, "compute", "compute", "a", "u", "forward"),
           Op(1, "all_gather", "ag", "gather", "u", "forward", deps=(0,), group="g"),
           Op(2, "compute", "compute", "b", "u", "forward", deps=(1,))]
    if cpu_wait:
        ops[2].cpu_wait = 0
    return ops


def _replay(ops, slowness, groups, host=0.0, keep=(0, 1, 2)):
    timing = play(ops, lambda op: DURATION[op.id], host_s=lambda op: host)
    n = len(slowness)
    return play_ranks(ops, timing, host_s=np.full(3, host), work_s=np.array([1.0, 0.0, 2.0]),
                      slowness=np.array(slowness, dtype=float), groups=groups, keep=np.array(keep),
                      traced=tuple(range(n)))


def test_a_collective_starts_when_its_groups_last_rank_arrives():
    """Rank 1 at 0.8 of the speed (slowness 0.25) takes 1.25 s over the first kernel: the all-gather starts
    at 1.25 on every rank of its group, rank 0 waits 0.25 s, rank 1 held the group back by its lead of
    0.25 s over the second-last, and each rank's second kernel runs at its own speed after 1.75 s."""
    t = _replay(_graph(), [0.0, 0.25, 0.0, 0.0], {"g": (1, 4, 1)})
    assert t.kept_start[1].tolist() == [1.25] * 4 and t.kept_end[1].tolist() == [1.75] * 4
    assert t.end.tolist() == [3.75, 1.75 + 2 * 1.25, 3.75, 3.75]
    assert (t.kept_start[1] - t.kept_ready[0]).tolist() == [0.25, 0.0, 0.25, 0.25]  # waiting for rank 1
    assert t.held_back_s.tolist() == [0.0, 0.25, 0.0, 0.0] and t.held_back_count.tolist() == [0, 1, 0, 0]
    assert t.delays == [(1, 1, 0.25)]
    assert t.traced[1].start[2] == 1.75 and t.traced[1].end[0] == 1.25


def test_only_the_slow_ranks_group_waits_for_it():
    """Two groups of two consecutive ranks, (outer 2, size 2, inner 1): ranks 2 and 3 never meet rank 1."""
    t = _replay(_graph(), [0.0, 0.25, 0.0, 0.0], {"g": (2, 2, 1)})
    assert t.kept_start[1].tolist() == [1.25, 1.25, 1.0, 1.0]
    assert t.end.tolist() == [3.75, 4.25, 3.5, 3.5]


def test_ties_credit_nobody():
    t = _replay(_graph(), [0.25, 0.25, 0.0, 0.0], {"g": (1, 4, 1)})
    assert t.held_back_s.tolist() == [0.0] * 4 and (t.kept_start[1] - t.kept_ready[0]).tolist() == [0.0, 0.0, 0.25, 0.25]
    assert t.delays == []


def test_every_rank_at_the_mean_speed_is_the_play_itself():
    ops = _graph()
    timing = play(ops, lambda op: DURATION[op.id])
    t = _replay(ops, [0.0] * 3, {"g": (1, 3, 1)})
    for r in range(3):
        assert t.traced[r].start.tolist() == timing.start.tolist() and t.traced[r].end.tolist() == timing.end.tolist()


def test_a_blocked_cpu_issues_each_rank_after_its_own_kernel():
    """With the CPU synchronising on the first kernel, the second is issued when that rank's first kernel
    ends plus its launch: the CPU issue thread is replayed per rank (engine/simulator._IssueThread)."""
    t = _replay(_graph(cpu_wait=True), [0.0, 0.25], {"g": (1, 2, 1)}, host=0.01)
    assert t.traced[0].issued[2] == pytest.approx(1.01 + 0.01) and t.traced[1].issued[2] == pytest.approx(1.26 + 0.01)
    assert t.end[0] == pytest.approx(max(1.76, 1.02) + 2.0)


def _members(shape):
    """Each rank's group members as `play_ranks` reads (outer, size, inner)."""
    outer, size, inner = shape
    grid = np.arange(outer * size * inner).reshape(outer, size, inner)
    return {int(r): sorted(grid[o, :, i].tolist()) for o in range(outer) for i in range(inner) for r in grid[o, :, i]}


def test_process_groups_are_the_meshs():
    """rank = (replicate index x shard_size + shard index) x tp + tp index (schedule/tp.dp_process_groups):
    a shard group shares the replicate and TP index, a replicate group the shard and TP index, a TP group
    the DP indices, an hpZ group of k its replicate index, TP index and shard index // k."""
    from types import SimpleNamespace

    s = SimpleNamespace(replicate_size=2, shard_size=4, tp=2, post_forward_sizes=(2,))
    groups = rank_groups(s)
    coords = {(rep * 4 + sh) * 2 + t: (rep, sh, t) for rep in range(2) for sh in range(4) for t in range(2)}
    same = {"shard": lambda a, b: (a[0], a[2]) == (b[0], b[2]), "replicate": lambda a, b: a[1:] == b[1:],
            "tp": lambda a, b: a[:2] == b[:2], post_forward_group(2): lambda a, b: (a[0], a[1] // 2, a[2]) == (b[0], b[1] // 2, b[2])}
    for name, rule in same.items():
        members = _members(groups[name])
        for r, c in coords.items():
            assert members[r] == sorted(q for q, d in coords.items() if rule(c, d)), (name, r)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 5)), min_size=1, max_size=12))
def test_the_union_per_rank_is_the_representatives_union(pairs):
    starts = np.array([a for a, _ in pairs])
    ends = starts + np.array([d for _, d in pairs])
    got = _union_length(starts[:, None], ends[:, None])[0]
    assert got == pytest.approx(_length(_merge(starts, ends)), abs=1e-9)


def test_exposed_is_communication_outside_the_compute_streams_kernels():
    """Kernels [0, 1] and [2, 3]; collectives [0.5, 2.5] and [2.8, 4]: 1.0 + 1.0 s of them outside kernels."""
    start = np.array([[0.0], [2.0], [0.5], [2.8]])
    end = np.array([[1.0], [3.0], [2.5], [4.0]])
    a = rank_activity(start, end, start[2:], kernels=2, kinds=["all_gather", "reduce_scatter"])
    assert a.exposed_s[0] == pytest.approx(2.0) and a.busy_s[0] == 2.0 and a.stalled_s[0] == 0.0
    assert a.exposed_by_kind_s["all_gather"][0] == pytest.approx(1.0) == a.exposed_by_kind_s["reduce_scatter"][0]


def test_a_wait_with_nothing_running_stalls_the_rank():
    """The first graph: rank 0's second kernel needs the all-gather, which waits 0.25 s for rank 1, then runs
    0.5 s: 0.25 s stalled, 0.5 s exposed; busy, exposed and stalled are the whole step (no CPU wait here)."""
    # kept in rank_activity's order: the compute stream's kernels, then the collective
    t = _replay(_graph(), [0.0, 0.25, 0.0, 0.0], {"g": (1, 4, 1)}, keep=(0, 2, 1))
    a = rank_activity(t.kept_start, t.kept_end, t.kept_ready, kernels=2, kinds=["all_gather"])
    assert a.stalled_s.tolist() == [0.25, 0.0, 0.25, 0.25] and a.waiting_s.tolist() == [0.25, 0.0, 0.25, 0.25]
    assert a.exposed_s.tolist() == [0.5] * 4 and a.busy_s.tolist() == [3.0, 3.75, 3.0, 3.0]
    assert np.allclose(a.busy_s + a.exposed_s + a.stalled_s, t.end)


def test_a_prefetched_wait_beside_compute_stalls_nothing():
    """compute a (1 s) -> all-gather (0.5 s, waiting for rank 1 until 1.25) beside compute c (2 s) -> b (2 s)
    needing both: rank 0 waits 0.25 s, all of it while c runs: nothing stalled, nothing exposed."""
    ops = [Op(0, "compute", "compute", "a", "u", "forward"),
           Op(1, "all_gather", "ag", "gather", "u", "forward", deps=(0,), group="g"),
           Op(2, "compute", "compute", "c", "u", "forward"),
           Op(3, "compute", "compute", "b", "u", "forward", deps=(1,))]
    durations = {0: 1.0, 1: 0.5, 2: 2.0, 3: 2.0}
    timing = play(ops, lambda op: durations[op.id], host_s=lambda op: 0.0)
    t = play_ranks(ops, timing, host_s=np.zeros(4), work_s=np.array([1.0, 0.0, 2.0, 2.0]),
                   slowness=np.array([0.0, 0.25]), groups={"g": (1, 2, 1)}, keep=np.array([0, 2, 3, 1]))
    a = rank_activity(t.kept_start, t.kept_end, t.kept_ready, kernels=3, kinds=["all_gather"])
    assert a.waiting_s.tolist() == [0.25, 0.0] and a.stalled_s.tolist() == [0.0, 0.0]
    assert a.exposed_s.tolist() == [0.0, 0.0] and np.allclose(a.busy_s, t.end)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3)), min_size=1, max_size=6),
       st.lists(st.tuples(st.floats(0, 10), st.floats(0, 2), st.floats(0, 3), st.sampled_from(["ag", "rs"])),
                min_size=1, max_size=6))
def test_activity_is_the_representatives_interval_arithmetic(kernels, collectives):
    """Against analysis._merge/_length, one rank: busy |K| (one stream: never overlapping, so laid end to
    end), exposed |K u C| - |K|, by kind |K u C_k| - |K|, stalled |K u C u W| - |K u C|, waiting |W|, active
    |C|, where a collective waits [ready, start] and runs [start, end]."""
    ks, t = [], 0.0
    for gap, d in kernels:
        ks.append((t + gap, t + gap + d))
        t += gap + d
    ready = np.array([r for r, _, _, _ in collectives])
    cs = np.array([(r + w, r + w + d) for r, w, d, _ in collectives])
    kinds = [k for *_, k in collectives]
    start = np.concatenate([[a for a, _ in ks], cs[:, 0]])[:, None]
    end = np.concatenate([[b for _, b in ks], cs[:, 1]])[:, None]
    a = rank_activity(start, end, ready[:, None], kernels=len(ks), kinds=kinds)

    def union(pairs):
        pairs = np.array(pairs, dtype=float).reshape(-1, 2)
        return _length(_merge(pairs[:, 0], pairs[:, 1]))

    k, c, w = list(ks), [tuple(x) for x in cs], [(r, s) for r, s in zip(ready, cs[:, 0])]
    busy = union(k)
    assert a.busy_s[0] == pytest.approx(busy, abs=1e-9)
    assert a.exposed_s[0] == pytest.approx(union(k + c) - busy, abs=1e-9)
    assert a.stalled_s[0] == pytest.approx(union(k + c + w) - union(k + c), abs=1e-9)
    assert a.waiting_s[0] == pytest.approx(union(w), abs=1e-9) and a.active_s[0] == pytest.approx(union(c), abs=1e-9)
    for kind in set(kinds):
        mine = [x for x, kk in zip(c, kinds) if kk == kind]
        assert a.exposed_by_kind_s[kind][0] == pytest.approx(union(k + mine) - busy, abs=1e-9)
