"""The Pareto front: a set of points -> the ones no other point beats on both axes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fsdp_sim.results.pareto import dominates, pareto_front


def test_hand_checked_front():
    # (required memory, tokens/s): lower memory and higher throughput are better
    points = [(10, 100), (20, 150), (15, 90), (20, 140), (30, 150), (5, 50), (40, 200)]
    assert pareto_front(points) == [0, 1, 5, 6]  # (15, 90) loses to (10, 100); (30, 150) to (20, 150)


def test_both_axes_lower_is_better_and_duplicates_stay():
    points = [(1, 5), (2, 2), (3, 1), (3, 3), (2, 2)]
    assert pareto_front(points, maximize=(False, False)) == [0, 1, 2, 4]
    assert pareto_front([]) == []


def test_three_axes():
    points = [(1, 1, 1), (0, 2, 2), (2, 2, 0), (2, 2, 2)]
    assert pareto_front(points, maximize=(False, False, False)) == [0, 1, 2]


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=40),
       st.tuples(st.booleans(), st.booleans()))
def test_front_is_exactly_the_non_dominated_points(points, maximize):
    expected = [i for i, p in enumerate(points) if not any(dominates(q, p, maximize) for q in points)]
    assert pareto_front(points, maximize) == expected
