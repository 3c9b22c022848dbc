"""Inline SVG figures for the HTML report: the memory timeline stacked by category, the streams' Gantt,
and a sweep's Pareto front. Plain strings, no plotting library; each figure carries the data its page's
script needs for hover (`data-*` attributes and `<title>` tooltips the browser shows by itself).

Readable at 405B: the timeline keeps each pixel's lowest and highest total (`plot.envelope_rows`), and the
Gantt merges a stream's ops that fall within one pixel into one bar that says how many it holds.
"""

from __future__ import annotations

import json
from html import escape

import numpy as np

from fsdp_sim.results.analysis import StepResult
from fsdp_sim.results.export import TRACE_STREAMS, reserved_timeline
from fsdp_sim.results.pareto import colour_label, memory_axis, pareto_front, series
from fsdp_sim.results.plot import envelope_rows, phase_spans
from fsdp_sim.results.report import COLUMNS, fmt_bytes, fmt_time
from fsdp_sim.schedule.ops import CATEGORIES

GiB = 1 << 30
PALETTE = ("#4e79a7", "#f28e2c", "#e15759", "#76b7b2", "#59a14f", "#edc949", "#af7aa1", "#ff9da7", "#9c755f",
           "#bab0ab", "#1f77b4")
PHASES = {"forward": "#4e79a7", "backward": "#f28e2c", "optimizer": "#59a14f"}
W, H, LEFT, RIGHT, TOP, BOTTOM = 1000, 340, 110, 150, 14, 34  # the plot area is [LEFT, W-RIGHT] x [TOP, H-BOTTOM]


def _f(x: float) -> str:
    return f"{x:.1f}"


class _Axes:
    def __init__(self, x0: float, x1: float, y0: float, y1: float, height: int = H, xlog: bool = False):
        self.xlog = xlog
        if xlog:
            x0, x1 = np.log10(x0), np.log10(x1)
        self.x0, self.x1, self.y0, self.y1, self.h = x0, x1 if x1 > x0 else x0 + 1, y0, y1 if y1 > y0 else y0 + 1, height

    def x(self, v: float) -> float:
        if self.xlog:
            v = np.log10(max(v, 1e-12))
        return LEFT + (v - self.x0) / (self.x1 - self.x0) * (W - LEFT - RIGHT)

    def y(self, v: float) -> float:
        return self.h - BOTTOM - (v - self.y0) / (self.y1 - self.y0) * (self.h - TOP - BOTTOM)

    def frame(self, xlabel: str, ylabel: str, xfmt, yfmt, ticks: int = 5) -> list[str]:
        out = [f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{self.h - TOP - BOTTOM}" '
               'fill="none" stroke="#999"/>']
        for i in range(ticks + 1):
            xv = self.x0 + (self.x1 - self.x0) * i / ticks
            yv = self.y0 + (self.y1 - self.y0) * i / ticks
            if self.xlog:  # ticks evenly spaced in log10, labelled with their values
                xv = 10 ** xv
            out.append(f'<text x="{_f(self.x(xv))}" y="{self.h - BOTTOM + 14}" text-anchor="middle">{escape(xfmt(xv))}</text>')
            out.append(f'<text x="{LEFT - 4}" y="{_f(self.y(yv) + 4)}" text-anchor="end">{escape(yfmt(yv))}</text>')
        out.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{self.h - 4}" text-anchor="middle">{escape(xlabel)}</text>')
        out.append(f'<text x="12" y="{(TOP + self.h - BOTTOM) / 2}" text-anchor="middle" '
                   f'transform="rotate(-90 12 {(TOP + self.h - BOTTOM) / 2})">{escape(ylabel)}</text>')
        return out

    def hline(self, v: float, colour: str, dash: str = "") -> str:
        dash = f' stroke-dasharray="{dash}"' if dash else ""
        return f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{_f(self.y(v))}" y2="{_f(self.y(v))}" stroke="{colour}"{dash}/>'


def _labels(items: list[tuple[float, str, str]]) -> list[str]:
    """Labels right of the plot at their lines' heights, pushed apart so that none overlaps the next."""
    out, last = [], -1e9
    for y, colour, text in sorted(items):
        y = max(y + 4, last + 12)
        last = y
        out.append(f'<text x="{W - RIGHT + 4}" y="{_f(y)}" fill="{colour}">{escape(text)}</text>')
    return out


def _svg(ident: str, body: list[str], height: int = H, data: dict | None = None) -> str:
    attr = f" data-series='{escape(json.dumps(data, separators=(',', ':')), quote=True)}'" if data else ""
    return (f'<svg id="{ident}" class="figure" viewBox="0 0 {W} {height}" width="100%" '
            f'xmlns="http://www.w3.org/2000/svg" font-size="11" font-family="sans-serif"{attr}>'
            + "".join(body) + "</svg>")


def timeline(result: StepResult, memory: dict) -> str:
    """Memory by category over the step (stacked steps), reserved, required, budget and capacity drawn,
    forward / backward / optimizer shaded, the peak marked. `memory` is `to_dict()["memory"]`."""
    mem = result.memory
    total = mem.total
    rows = envelope_rows(total, 1000)
    times = mem.time[rows]
    end = max(result.step_time_s, float(mem.time[-1]))
    reserved = reserved_timeline(result)[rows]
    cats = [i for i, _ in enumerate(CATEGORIES) if mem.levels[:, i].any()]
    top = max(memory["capacity_bytes"], memory["required_bytes"], int(total.max())) * 1.04
    ax = _Axes(0.0, end, 0.0, top / GiB)
    body = []
    for phase, a, b in phase_spans(result):
        body.append(f'<rect x="{_f(ax.x(a))}" y="{TOP}" width="{_f(max(ax.x(b) - ax.x(a), 0.5))}" '
                    f'height="{H - TOP - BOTTOM}" fill="{PHASES.get(phase, "#ccc")}" opacity="0.08">'
                    f"<title>{escape(phase)} {fmt_time(a)} - {fmt_time(b)}</title></rect>")
    body += ax.frame("time in the step", "GiB", fmt_time, lambda v: f"{v:.0f}")
    base = np.zeros(len(rows))
    xs = [ax.x(float(t)) for t in times] + [ax.x(end)]
    for k, c in enumerate(cats):
        level = mem.levels[rows, c] / GiB
        upper, lower = base + level, base
        pts = []
        for i in range(len(rows)):  # a step: each level holds until the next event
            pts += [f"{_f(xs[i])},{_f(ax.y(upper[i]))}", f"{_f(xs[i + 1])},{_f(ax.y(upper[i]))}"]
        for i in reversed(range(len(rows))):
            pts += [f"{_f(xs[i + 1])},{_f(ax.y(lower[i]))}", f"{_f(xs[i])},{_f(ax.y(lower[i]))}"]
        body.append(f'<polygon points="{" ".join(pts)}" fill="{PALETTE[c % len(PALETTE)]}" opacity="0.85">'
                    f"<title>{CATEGORIES[c]}</title></polygon>")
        base = upper
    steps = []
    for i in range(len(rows)):
        steps += [f"{_f(xs[i])},{_f(ax.y(reserved[i] / GiB))}", f"{_f(xs[i + 1])},{_f(ax.y(reserved[i] / GiB))}"]
    body.append(f'<polyline points="{" ".join(steps)}" fill="none" stroke="#333" stroke-width="1.2"/>')
    lines = [("capacity", "capacity_bytes", "#000", ""), ("budget", "budget_bytes", "#c00", "6 3"),
             ("required", "required_bytes", "#a0a", "2 2")]
    body += [ax.hline(memory[key] / GiB, colour, dash) for _, key, colour, dash in lines]
    body += _labels([(ax.y(reserved[-1] / GiB), "#333", f"reserved {fmt_bytes(int(reserved[-1]))}")]
                    + [(ax.y(memory[key] / GiB), colour, f"{name} {fmt_bytes(memory[key])}")
                       for name, key, colour, _ in lines])
    peak = int(np.argmax(total))
    px, py = ax.x(float(mem.time[peak])), ax.y(total[peak] / GiB)
    body.append(f'<circle cx="{_f(px)}" cy="{_f(py)}" r="4" fill="#c00"/><text x="{_f(px + 6)}" y="{_f(max(py - 6, TOP + 10))}" '
                f'fill="#c00">peak {fmt_bytes(int(total[peak]))}</text>')
    body.append(f'<line class="cursor" x1="0" x2="0" y1="{TOP}" y2="{H - BOTTOM}" stroke="#000" visibility="hidden"/>')
    data = {"x0": LEFT, "x1": W - RIGHT, "end": end, "t": [round(float(t), 9) for t in times],
            "reserved": reserved.tolist(), "names": [CATEGORIES[c] for c in cats],
            "levels": [mem.levels[rows, c].tolist() for c in cats]}
    legend = "".join(f'<span><i style="background:{PALETTE[c % len(PALETTE)]}"></i>{CATEGORIES[c]}</span>' for c in cats)
    return _svg("timeline", body, data=data) + f'<div class="legend">{legend}</div>'


def gantt(result: StepResult) -> str:
    """One row per stream; ops as bars coloured by phase; ops closer than a pixel merged into one bar."""
    start, end = result.timing.start, result.timing.end
    streams = list(TRACE_STREAMS) + sorted({op.stream for op in result.graph.ops} - set(TRACE_STREAMS))
    used = [s for s in streams if any(op.stream == s and op.kind not in ("alloc", "free") for op in result.graph.ops)]
    height = TOP + BOTTOM + 22 * len(used)
    ax = _Axes(0.0, max(result.step_time_s, 1e-12), 0.0, 1.0, height)
    pixel = (ax.x1 - ax.x0) / (W - LEFT - RIGHT)
    body = ax.frame("time in the step", "", fmt_time, lambda v: "", ticks=5)
    for row, stream in enumerate(used):
        y = TOP + 4 + 22 * row
        body.append(f'<text x="{LEFT - 4}" y="{y + 12}" text-anchor="end">{escape(stream)}</text>')
        bar: list = []  # [start, end, phase, ops, first name]

        def flush():
            if bar:
                a, b, phase, n, name = bar
                what = escape(name) if n == 1 else f"{n} ops from {escape(name)}"
                body.append(f'<rect x="{_f(ax.x(a))}" y="{y}" width="{_f(max(ax.x(b) - ax.x(a), 0.6))}" height="16" '
                            f'fill="{PHASES.get(phase, "#999")}"><title>{what} ({escape(phase)}): '
                            f"{fmt_time(a)} - {fmt_time(b)}</title></rect>")

        for op in result.graph.ops:
            if op.stream != stream or op.kind in ("alloc", "free"):
                continue
            a, b = float(start[op.id]), float(end[op.id])
            if bar and a - bar[1] < pixel and bar[2] == op.phase:
                bar[1], bar[3] = max(bar[1], b), bar[3] + 1
            else:
                flush()
                bar = [a, b, op.phase, 1, op.name]
        flush()
    return _svg("gantt", body, height)


def pareto(rows: list[dict], color_by: list[str], best: dict | None = None) -> str:
    """Tokens/s per GPU against required memory; colour by `color_by`'s values; hollow: does not fit;
    the front as a line; the budget drawn; the recommendation starred."""
    ok = [r for r in rows if not r.get("error")]
    if not ok:
        return _svg("pareto", ['<text x="20" y="40">every configuration failed</text>'], 80)
    xs = [r["required_bytes"] / GiB for r in ok]
    ys = [r["tokens_per_s_per_gpu"] for r in ok]
    budget = (ok[0]["required_bytes"] + ok[0]["headroom_bytes"]) / GiB
    x0, x1, xlog = memory_axis(xs, budget)  # zoomed to the points, log when they span more than 8x (as the PNG)
    ax = _Axes(x0, x1, 0.0, max(ys) * 1.08, xlog=xlog)
    body = ax.frame("required memory (GiB)" + (", log scale" if xlog else ""), "tokens/s per GPU",
                    lambda v: f"{v:.3g}", lambda v: f"{v:.0f}")
    bx = ax.x(budget)
    body.append(f'<line x1="{_f(bx)}" x2="{_f(bx)}" y1="{TOP}" y2="{H - BOTTOM}" stroke="#c00" stroke-dasharray="6 3"/>'
                f'<text x="{_f(bx + 3)}" y="{TOP + 12}" fill="#c00">budget {budget:.1f} GiB</text>')
    front = sorted(pareto_front(list(zip(xs, ys))), key=lambda i: xs[i])
    if len(front) > 1:
        pts = " ".join(f"{_f(ax.x(xs[i]))},{_f(ax.y(ys[i]))}" for i in front)
        body.append(f'<polyline points="{pts}" fill="none" stroke="#666" stroke-dasharray="3 2"/>')
    colours = series([colour_label(r, color_by) for r in ok])  # the PNG's colours for the same keys
    for r, x, y in zip(ok, xs, ys):
        colour = colours[colour_label(r, color_by)]
        fill = colour if r["fits"] else "none"
        what = escape(", ".join(f"{k}={v}" for k, v in r.items() if k not in _FIGURES and v is not None))
        body.append(f'<circle cx="{_f(ax.x(x))}" cy="{_f(ax.y(y))}" r="5" fill="{fill}" stroke="{colour}" stroke-width="1.5">'
                    f"<title>{what}: {y:.0f} tokens/s per GPU, required {fmt_bytes(r['required_bytes'])}"
                    f"{'' if r['fits'] else ' (does not fit)'}</title></circle>")
    if best is not None:
        x, y = ax.x(best["required_bytes"] / GiB), ax.y(best["tokens_per_s_per_gpu"])
        star = " ".join(f"{_f(x + rad * np.sin(k * np.pi / 5))},{_f(y - rad * np.cos(k * np.pi / 5))}"
                        for k, rad in zip(range(10), [11, 4.5] * 5))
        body.append(f'<polygon points="{star}" fill="#ffd700" stroke="#000"><title>recommended</title></polygon>')
    legend = "".join(f'<span><i style="background:{c}"></i>{escape(v)}</span>' for v, c in colours.items())
    return _svg("pareto", body) + f'<div class="legend">{legend}<span>hollow: does not fit</span></div>'





_FIGURES = frozenset(COLUMNS)  # the rest of a row is its settings
