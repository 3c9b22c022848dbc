"""Pictures: a step's memory over time above the streams' activity; a sweep's Pareto front.

Needs matplotlib (`pip install -e '.[plot]'`); the core never imports this module. Functions return the
figure; the CLI saves it.
"""

from __future__ import annotations

import numpy as np

from fsdp_sim.errors import ScenarioError
from fsdp_sim.results.analysis import StepResult
from fsdp_sim.results.export import TRACE_STREAMS
from fsdp_sim.results.pareto import colour_label, memory_axis, pareto_front, series
from fsdp_sim.results.report import verdict
from fsdp_sim.schedule.ops import CATEGORIES

GiB = 1 << 30
PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ScenarioError("--plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)") from None
    return plt


def phase_spans(result: StepResult) -> list[tuple[str, float, float]]:
    """(phase, start s, end s) of forward, backward and optimizer (per micro-batch under accumulation),
    back to back: a phase runs from its first compute-stream kernel to the next phase's first one."""
    start, end = result.timing.start, result.timing.end
    spans: list[list] = []
    for op in result.graph.ops:
        if op.stream != "compute" or op.kind in ("alloc", "free"):
            continue
        if not spans or spans[-1][0] != op.phase:
            if spans:
                spans[-1][2] = float(start[op.id])
            spans.append([op.phase, 0.0 if not spans else float(start[op.id]), float(end[op.id])])
        spans[-1][2] = max(spans[-1][2], float(end[op.id]))
    if spans:
        spans[-1][2] = max(spans[-1][2], result.step_time_s)
    return [(p, a, b) for p, a, b in spans]


def envelope_rows(total, max_rows: int = 4000) -> np.ndarray:
    """Row indices that keep each time bin's lowest and highest total, in order: a timeline with more
    rows than pixels keeps its peaks and troughs (and the step's peak exactly) without drawing them all."""
    n = len(total)
    if n <= max_rows:
        return np.arange(n)
    edges = np.linspace(0, n, max_rows // 2 + 1).astype(int)
    keep = [0, n - 1, int(np.argmax(total))]
    for a, b in zip(edges[:-1], edges[1:]):
        if b > a:
            chunk = total[a:b]
            keep += [a + int(np.argmin(chunk)), a + int(np.argmax(chunk))]
    return np.unique(keep)


def _shade(axes, spans) -> None:
    for phase, a, b in spans:
        colour = PHASE_COLOURS.get(phase.split(" ")[0], "grey")
        for ax in axes:
            ax.axvspan(a * 1e3, b * 1e3, color=colour, alpha=0.07, lw=0)
        axes[0].text((a + b) / 2 * 1e3, 1.0, phase, transform=axes[0].get_xaxis_transform(), ha="center",
                     va="bottom", fontsize=8, color=colour)


def step_figure(result: StepResult):
    """Stacked allocated memory (GiB) per category; capacity, budget, peak reserved and required drawn
    as lines, so the verdict can be read off the picture; forward / backward / optimizer shaded; one lane
    of op boxes per stream below."""
    plt = _pyplot()
    mem = result.memory
    fig, (ax_mem, ax_ops) = plt.subplots(2, 1, figsize=(14, 7), sharex=True, height_ratios=(3, 1),
                                          constrained_layout=True)
    rows = envelope_rows(mem.total)
    t_ms, levels = mem.time[rows] * 1e3, mem.levels[rows]
    shown = [i for i, _ in enumerate(CATEGORIES) if levels[:, i].any()]
    ax_mem.stackplot(t_ms, *(levels[:, i] / GiB for i in shown), labels=[CATEGORIES[i] for i in shown],
                     step="post", alpha=0.85)
    peak = result.peak(top=0)
    summary = result.memory_summary(peak)
    ax_mem.axvline(peak["time_s"] * 1e3, color="black", lw=0.8, ls="--")
    ax_mem.annotate(f"peak allocated {peak['allocated_bytes'] / GiB:.2f} GiB ({peak['phase']})",
                    (peak["time_s"] * 1e3, peak["allocated_bytes"] / GiB), textcoords="offset points",
                    xytext=(6, 6), fontsize=9, bbox={"fc": "white", "alpha": 0.75, "lw": 0})
    lines = [(summary["capacity_bytes"], "red", "-", "GPU capacity"),
             (summary["budget_bytes"], "red", "--", f"budget ({100 * summary['safety_margin']:.0f} % margin)"),
             (summary["required_bytes"], "black", ":", "required (reserved + CUDA context + NCCL)"),
             (peak["reserved_bytes"], "dimgrey", "-.", "peak reserved (allocator pools)")]
    for value, colour, style, label in lines:
        ax_mem.axhline(value / GiB, color=colour, lw=1.0, ls=style, label=f"{label} {value / GiB:.2f} GiB")
    top = max(v for v, *_ in lines + [(peak["allocated_bytes"],)])
    ax_mem.set_ylim(0, top / GiB * 1.08)
    ax_mem.set_ylabel("memory (GiB)")
    ax_mem.set_title(f"{result.scenario.name}: memory by category — required "
                     f"{summary['required_bytes'] / GiB:.2f} GiB, budget {summary['budget_bytes'] / GiB:.2f} GiB: "
                     f"{verdict(summary)}", pad=14)
    ax_mem.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, framealpha=0.85)
    streams = [s for s in TRACE_STREAMS if any(op.stream == s for op in result.graph.ops)]
    start, end = result.timing.start * 1e3, result.timing.end * 1e3
    for lane, stream in enumerate(streams):
        boxes = [(start[op.id], end[op.id] - start[op.id]) for op in result.graph.ops
                 if op.stream == stream and op.kind not in ("alloc", "free") and end[op.id] > start[op.id]]
        ax_ops.broken_barh(boxes, (lane - 0.4, 0.8))
    ax_ops.set_yticks(range(len(streams)), streams, fontsize=8)
    ax_ops.set_xlabel("time (ms)")
    ax_ops.invert_yaxis()
    _shade((ax_mem, ax_ops), phase_spans(result))
    return fig


def pareto_figure(rows: list[dict], color_by: str | list[str], *, y: str = "tokens_per_s_per_gpu",
                  best: dict | None = None, title: str = ""):
    """Each configuration as a point, required memory (GiB) against `y` (tokens_per_s_per_gpu or
    step_time_s), coloured by the value of `color_by` (a key, or keys whose values are joined); filled
    when it fits, hollow when not; the Pareto front joined; the budget line; `best` starred. The memory
    axis turns logarithmic when the points span more than 8x."""
    plt = _pyplot()
    ok = [r for r in rows if not r.get("error")]
    if not ok:
        raise ScenarioError("--plot: no configuration ran, nothing to draw")
    up = y == "tokens_per_s_per_gpu"
    scale = 1 if up else 1e3
    fig, ax = plt.subplots(figsize=(9, 6), constrained_layout=True)
    by = [color_by] if isinstance(color_by, str) else list(color_by)

    def label(row: dict) -> str:
        return colour_label(row, by)

    colour = series([label(r) for r in ok])  # the HTML report's colours for the same keys (results/pareto.py)
    for v in colour:
        group = [r for r in ok if label(r) == v]
        for fits in (True, False):
            pts = [r for r in group if r["fits"] == fits]
            if pts:
                ax.scatter([r["required_bytes"] / GiB for r in pts], [r[y] * scale for r in pts], s=28,
                           facecolors=colour[v] if fits else "none", edgecolors=colour[v],
                           label=v if fits or not any(r["fits"] for r in group) else None)
    front = sorted((ok[i] for i in pareto_front([(r["required_bytes"], r[y]) for r in ok], (False, up))),
                   key=lambda r: r["required_bytes"])
    ax.plot([r["required_bytes"] / GiB for r in front], [r[y] * scale for r in front], color="black", lw=0.8,
            drawstyle="steps-post", label="Pareto front")
    budgets = [r["required_bytes"] + r["headroom_bytes"] for r in ok]
    if max(budgets) - min(budgets) < 1 << 20:  # one GPU and one margin for all (to rounding)
        ax.axvline(budgets[0] / GiB, color="red", ls="--", lw=1.0, label=f"memory budget {budgets[0] / GiB:.2f} GiB")
    if best is not None:
        ax.scatter([best["required_bytes"] / GiB], [best[y] * scale], marker="*", s=260, color="gold",
                   edgecolors="black", zorder=5, label="recommended")
    one_budget = max(budgets) - min(budgets) < 1 << 20
    x0, x1, xlog = memory_axis([r["required_bytes"] / GiB for r in ok], budgets[0] / GiB if one_budget else None)
    if xlog:
        ax.set_xscale("log")  # a few configurations far past the GPU would squeeze the ones that fit
    ax.set_xlim(x0, x1)
    ax.set_xlabel("required memory per GPU (GiB)")
    ax.set_ylabel("tokens/s per GPU" if up else "step time (ms)")
    ax.set_title(title or f"{len(ok)} configurations (hollow: does not fit)")
    ax.legend(fontsize=8, loc="best", title=", ".join(by), title_fontsize=8)
    ax.grid(alpha=0.3)
    return fig
