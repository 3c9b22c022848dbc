"""The sweep's shortcuts give what the full result gives: a row's memory figures skip the capped allocator
replay when the step's allocated peak alone passes the allocator's limit, since that replay must then
run out of memory; the overlap of communication and compute in numpy is the interval walk's; the chunks
the points go to the workers in."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fsdp_sim.executors import CHUNK, _starts
from fsdp_sim.results.analysis import _intersection, _length, _merge
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.sweep import _row

BASE = {"model": "llama3-8b", "hardware": {"profile": "h100-sxm", "gpus_per_node": 8}}


# on 8x H100 these cover: within the limit; past it unconstrained, the capped replay gets by (6144 x 1) or
# runs out (4096 x 2); allocated alone past it (4096 x 4, x 8)
@pytest.mark.parametrize("seq_len,micro_batch", [(4096, 1), (6144, 1), (4096, 2), (4096, 4), (4096, 8)])
def test_row_memory_equals_the_full_result_and_an_allocated_peak_past_the_limit_runs_out(seq_len, micro_batch):
    data = BASE | {"training": {"seq_len": seq_len, "micro_batch": micro_batch}}
    result = simulate(parse_scenario(data))
    row = _row(result)
    limit, allocated = result.allocator_limit(), row["peak_allocated_bytes"]
    capped = result.memory.allocator.capped(limit)  # played even where the row did not need it
    assert capped.oom or allocated <= limit  # the shortcut's premise: reserved never holds less than allocated
    # what the row's reserved is by definition: the capped replay's peak where the unconstrained figure
    # passes the limit and the capped replay gets by, else the unconstrained figure
    reserved = result.memory.reserved_bytes
    expected = capped.reserved_bytes if reserved > limit and not capped.oom else reserved
    overheads = result.scenario.cluster.gpu.cuda_context_bytes + sum(result.nccl_groups().values())
    assert row["required_bytes"] == expected + overheads
    full = simulate(parse_scenario(data)).to_dict()
    assert (row["required_bytes"], row["fits"], row["headroom_bytes"]) == (
        full["memory"]["required_bytes"], full["memory"]["fits"], full["memory"]["headroom_bytes"])
    assert full["allocator"]["out_of_memory"] == (reserved > limit and capped.oom)


def _walk(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The overlap of two merged interval lists by a two-pointer walk over the pairs (as the row first did)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


_intervals = st.lists(st.tuples(st.integers(0, 40).map(lambda n: n / 4), st.floats(0, 3)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(_intervals, _intervals)
def test_the_overlap_in_numpy_is_the_walks_to_the_bit(xs, ys):
    """`_intersection` finds the overlapping pairs with `searchsorted` and adds their pieces in the walk's
    order: the same float, bit for bit, with touching and nested intervals (starts on a quarter grid)."""
    merged = []
    for pairs in (xs, ys):
        starts = np.array([s for s, _ in pairs], dtype=float)
        merged.append(_merge(starts, starts + np.array([d for _, d in pairs], dtype=float)))
    a, b = ([tuple(p) for p in zip(s.tolist(), e.tolist())] for s, e in merged)
    assert _intersection(*merged) == _walk(a, b)
    assert _length(merged[0]) == sum(e - s for s, e in a)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 80), max_size=40), st.integers(1, 8))
def test_chunks_cover_the_points_in_order_shrink_to_the_end_and_keep_groups_whole_where_they_can(runs, workers):
    """`_starts`: every point once, in order; at most CHUNK each; without groups each chunk a (2 x workers)-th
    of what is left (so no larger than the one before); with groups, a chunk ends at a group's end whenever
    one falls in its second half."""
    groups = [g for g, length in enumerate(runs) for _ in range(length)]
    n = len(groups)
    plain = _starts(n, workers)
    sizes = [b - a for a, b in zip(plain, plain[1:])]
    assert plain[0] == 0 and plain[-1] == n and all(0 < s <= CHUNK for s in sizes)
    assert sizes == sorted(sizes, reverse=True)
    grouped = _starts(n, workers, groups)
    assert grouped[0] == 0 and grouped[-1] == n and all(a < b for a, b in zip(grouped, grouped[1:]))
    for a, b in zip(grouped, grouped[1:-1]):
        size = min(CHUNK, -(-(n - a) // (2 * workers)))
        assert b - a <= size
        ends = [p for p in range(a + size // 2 + 1, a + size + 1) if p < n and groups[p] != groups[p - 1]]
        assert b == (ends[-1] if ends else a + size)
