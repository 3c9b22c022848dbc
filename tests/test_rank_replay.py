"""The per-rank replay (engine/ranks.py) on graphs small enough to work by hand, the process groups' rank
layout (schedule/tp.rank_groups) against the mesh's definition, and the per-rank exposure
(results/ranks.py) against the representative rank's interval arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fsdp_sim.engine import play
from fsdp_sim.engine.ranks import play_ranks
from fsdp_sim.results.analysis import _length, _merge
from fsdp_sim.results.ranks import _union_length, exposed_per_rank
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


def _replay(ops, slowness, groups, host=0.0):
    timing = play(ops, lambda op: DURATION[op.id], host_s=lambda op: host)
    n = len(slowness)
    return play_ranks(ops, timing, host_s=np.full(3, host), work_s=np.array([1.0, 0.0, 2.0]),
                      slowness=np.array(slowness, dtype=float), groups=groups, keep=np.array([0, 1, 2]),
                      traced=tuple(range(n)))


def test_a_collective_starts_when_its_groups_last_rank_arrives():
    """Rank 1 at 0.8 of the speed (slowness 0.25) takes 1.25 s over the first kernel: the all-gather starts
    at 1.25 on every rank of its group, rank 0 waits 0.25 s, rank 1 held the group back by its lead of
    0.25 s over the second-last, and each rank's second kernel runs at its own speed after 1.75 s."""
    t = _replay(_graph(), [0.0, 0.25, 0.0, 0.0], {"g": (1, 4, 1)})
    assert t.kept_start[1].tolist() == [1.25] * 4 and t.kept_end[1].tolist() == [1.75] * 4
    assert t.end.tolist() == [3.75, 1.75 + 2 * 1.25, 3.75, 3.75]
    assert t.collective_wait_s.tolist() == [0.25, 0.0, 0.25, 0.25]
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
    assert t.held_back_s.tolist() == [0.0] * 4 and t.collective_wait_s.tolist() == [0.0, 0.0, 0.25, 0.25]
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
    assert exposed_per_rank(start, end, kernels=2)[0] == pytest.approx(2.0)
