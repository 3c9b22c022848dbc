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


# matplotlib's tab10, which the PNG (results/plot.py) and the HTML (results/svg.py) both draw series in, so a
# key has the same colour in both
SERIES_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf")
LOG_SPAN = 8.0  # the memory axis turns logarithmic when the points' required memory spans more than this


def colour_label(row: dict, color_by: Sequence[str]) -> str:
    """The legend label of a row: its values of the `color_by` keys (the key's last part, as the PNG's)."""
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={row.get(k)}" for k in color_by if row.get(k) is not None) or "-"


def series(labels: Sequence[str]) -> dict[str, str]:
    """Each distinct label, in order of first appearance, with its colour (tab10, cycled past ten)."""
    distinct = list(dict.fromkeys(labels))
    return {label: SERIES_COLOURS[i % len(SERIES_COLOURS)] for i, label in enumerate(distinct)}


def memory_axis(required: Sequence[float], budget: float | None = None) -> tuple[float, float, bool]:
    """(low, high, logarithmic) of the required-memory axis: zoomed to the points (and the budget line), log
    when they span more than LOG_SPAN, as a few configurations far past the GPU would squeeze the rest."""
    values = [v for v in [*required, *([budget] if budget else [])] if v > 0]
    lo, hi = min(values), max(values)
    if hi > LOG_SPAN * lo:
        return lo / 1.15, hi * 1.15, True
    pad = 0.06 * (hi - lo) or 0.05 * hi
    return max(0.0, lo - pad), hi + pad, False
