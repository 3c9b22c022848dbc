"""A picture of the step: memory by category over time above the streams' activity.

Needs matplotlib (`pip install 'fsdp-sim[plot]'`); the core never imports this module. Returns the
figure; the CLI saves it.
"""

from __future__ import annotations

from fsdp_sim.errors import ScenarioError
from fsdp_sim.results.analysis import StepResult
from fsdp_sim.results.export import TRACE_STREAMS
from fsdp_sim.schedule.ops import CATEGORIES

GiB = 1 << 30


def step_figure(result: StepResult):
    """Stacked memory (GiB) per category with the peak marked; one lane of op boxes per stream."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ScenarioError("--plot needs matplotlib: pip install 'fsdp-sim[plot]'") from None
    mem = result.memory
    fig, (ax_mem, ax_ops) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, height_ratios=(3, 1),
                                          constrained_layout=True)
    t_ms = mem.time * 1e3
    shown = [i for i, _ in enumerate(CATEGORIES) if mem.levels[:, i].any()]
    ax_mem.stackplot(t_ms, *(mem.levels[:, i] / GiB for i in shown), labels=[CATEGORIES[i] for i in shown],
                     step="post", alpha=0.85)
    peak = result.peak(top=0)
    ax_mem.axvline(peak["time_s"] * 1e3, color="black", lw=0.8, ls="--")
    ax_mem.annotate(f"peak {peak['allocated_bytes'] / GiB:.2f} GiB ({peak['phase']})",
                    (peak["time_s"] * 1e3, peak["allocated_bytes"] / GiB), textcoords="offset points",
                    xytext=(6, 6), fontsize=9)
    capacity = result.scenario.cluster.gpu.memory_bytes / GiB
    ax_mem.axhline(capacity, color="red", lw=0.8)
    ax_mem.set_ylabel("allocated (GiB)")
    ax_mem.set_ylim(0, max(capacity, peak["allocated_bytes"] / GiB) * 1.05)
    ax_mem.set_title(f"{result.scenario.name}: memory by category (red: GPU capacity)")
    ax_mem.legend(loc="upper left", fontsize=8, ncols=2)
    streams = [s for s in TRACE_STREAMS if any(op.stream == s for op in result.graph.ops)]
    start, end = result.timing.start * 1e3, result.timing.end * 1e3
    for lane, stream in enumerate(streams):
        boxes = [(start[op.id], end[op.id] - start[op.id]) for op in result.graph.ops
                 if op.stream == stream and op.kind not in ("alloc", "free") and end[op.id] > start[op.id]]
        ax_ops.broken_barh(boxes, (lane - 0.4, 0.8))
    ax_ops.set_yticks(range(len(streams)), streams, fontsize=8)
    ax_ops.set_xlabel("time (ms)")
    ax_ops.invert_yaxis()
    return fig
