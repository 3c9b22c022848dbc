"""The Pareto front of a sweep: the configurations no other beats on both axes at once.

Pure functions of numbers; the plot (results/plot.py) and the recommendation use them.
"""

from __future__ import annotations

from collections.abc import Sequence


def dominates(a: Sequence[float], b: Sequence[float], maximize: Sequence[bool]) -> bool:
    """a is at least as good as b on every axis and better on one."""
    better = False
    for x, y, up in zip(a, b, maximize):
        if up:
            x, y = -x, -y
        if x > y:
            return False
        better = better or x < y
    return better


def pareto_front(points: Sequence[Sequence[float]], maximize: Sequence[bool] = (False, True)) -> list[int]:
    """Indices of the non-dominated points, in input order. The default axes are (memory: lower is
    better, throughput: higher is better). Equal points are all kept.

    Two axes take a sort and one pass (n log n); more axes compare every pair.
    """
    n = len(points)
    if n == 0:
        return []
    if len(maximize) != 2:
        return [i for i in range(n) if not any(dominates(points[j], points[i], maximize) for j in range(n))]
    sign = [-1.0 if up else 1.0 for up in maximize]  # both axes as "lower is better"
    keyed = sorted(range(n), key=lambda i: (sign[0] * points[i][0], sign[1] * points[i][1]))
    front, best_y, best_x = [], float("inf"), None
    for i in keyed:
        x, y = sign[0] * points[i][0], sign[1] * points[i][1]
        if y < best_y:
            front.append(i)
            best_y, best_x = y, x
        elif y == best_y and x == best_x:  # the same point again
            front.append(i)
    return sorted(front)
