"""Exporters: a result as JSON-ready data, a Chrome/Perfetto trace, and a memory-timeline CSV.

Each function returns data or text; only the CLI writes files.
"""

from __future__ import annotations

import io

import numpy as np

from fsdp_sim.results.analysis import StepResult
from fsdp_sim.schedule.ops import CATEGORIES

TRACE_STREAMS = ("compute", "all_gather_copy_in", "all_gather", "reduce_scatter", "all_reduce")


def chrome_trace(result: StepResult, rank: int = 0) -> dict:
    """Trace Event Format (microseconds): a process per rank, a thread per stream plus the CPU issue thread
    (each op's launch cost, ending when the op is issued), memory counters (per category, allocated, and
    reserved as the ledger models it; `otherData.memory_counters` says how they are ordered and stamped). A slice's args give the op's time alone (`alone_us`): a slice
    longer than that was slowed by what ran beside it."""
    pid = rank
    events = _op_events(result, result.timing, pid, f"rank {rank} (simulated)")
    mem = result.memory
    previous = None
    reserved = reserved_timeline(result)
    for t, row, held in zip(mem.time, mem.levels, reserved):
        if previous is not None and (row == previous).all():
            continue
        for c, (name, value) in enumerate(zip(CATEGORIES, row)):
            if previous is None or value != previous[c]:
                events.append({"ph": "C", "pid": pid, "name": f"memory {name} (bytes)", "ts": float(t) * 1e6,
                               "args": {"bytes": int(value)}})
        events.append({"ph": "C", "pid": pid, "name": "memory allocated (bytes)", "ts": float(t) * 1e6,
                       "args": {"bytes": int(row.sum())}})
        events.append({"ph": "C", "pid": pid, "name": "memory reserved (bytes)", "ts": float(t) * 1e6,
                       "args": {"bytes": int(held)}})
        previous = row
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"tool": "fsdp-sim", "scenario": result.scenario.name, "memory_counters": MEMORY_COUNTERS}}


def _op_events(result: StepResult, timing, pid: int, name: str) -> list[dict]:
    """One rank's process: its name, a thread per stream plus the CPU issue thread, and a slice per op
    (allocs and frees are the memory counters' business)."""
    events: list[dict] = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}]
    streams = ["cpu"] + list(TRACE_STREAMS) + sorted({op.stream for op in result.graph.ops} - set(TRACE_STREAMS))
    tid = {name: i for i, name in enumerate(streams)}
    for name, i in tid.items():
        events.append({"ph": "M", "pid": pid, "tid": i, "name": "thread_name", "args": {"name": name}})
        events.append({"ph": "M", "pid": pid, "tid": i, "name": "thread_sort_index", "args": {"sort_index": i}})
    start, end, issued = timing.start, timing.end, timing.issued
    previous_issue = 0.0
    for op in result.graph.ops:
        if op.kind in ("alloc", "free"):
            continue
        if issued[op.id] > previous_issue:
            events.append({"ph": "X", "pid": pid, "tid": tid["cpu"], "name": f"launch {op.name}", "cat": "cpu",
                           "ts": previous_issue * 1e6, "dur": (float(issued[op.id]) - previous_issue) * 1e6})
            previous_issue = float(issued[op.id])
        args = {"unit": op.unit, "phase": op.phase, "kind": op.kind, "alone_us": result.alone_duration(op) * 1e6}
        if op.comm_bytes:
            args["bytes"] = int(op.comm_bytes)
        if op.flops:
            args["flops"] = op.flops
        if op.hbm_bytes:
            args["hbm_bytes"] = int(op.hbm_bytes)
        events.append({"ph": "X", "pid": pid, "tid": tid[op.stream], "name": op.name, "cat": op.kind,
                       "ts": float(start[op.id]) * 1e6, "dur": float(end[op.id] - start[op.id]) * 1e6, "args": args})
    return events


def ranks_trace(result) -> dict:
    """`run --per-rank --trace`: a process per traced rank (`PerRankResult.ranks.traced`: every rank of a small
    mesh, else rank 0, the slowest, the fastest and the costliest, or `--trace-ranks`), its ops' slices as
    that rank ran them (`alone_us` is the mean GPU's time alone), named with its speed and step time. No
    memory counters: every rank holds the same memory in the same issue order (`chrome_trace` has them)."""
    events: list[dict] = []
    end = result.ranks.end
    for rank, timing in sorted(result.ranks.traced.items()):
        name = (f"rank {rank} (simulated, speed {result.speeds[rank]:.3f}, step {float(end[rank]) * 1e3:.2f} ms"
                + (", slowest" if rank == result.slowest_rank() else ", fastest" if rank == result.fastest_rank() else "")
                + ")")
        events += _op_events(result, timing, rank, name)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"tool": "fsdp-sim", "scenario": result.scenario.name, "ranks": len(result.speeds),
                          "traced_ranks": sorted(result.ranks.traced)}}


# how a reader must take the memory counters (also in docs/outputs.md)
MEMORY_COUNTERS = ("levels in CPU issue order, as torch.cuda.max_memory_allocated counts them: an allocation "
                   "counts when the CPU issues it, not when its stream runs; each is stamped when its stream reaches "
                   "it and never before the one before it, so a side-stream buffer (an all-gather output) can "
                   "appear after the kernel that fills it has started")


def reserved_timeline(result: StepResult) -> np.ndarray:
    """Reserved bytes after each memory event (row 0: the persistent state) in a steady step, as the
    caching allocator model predicts them (engine/reserved.py). Never decreases (no empty_cache); the last
    value is `peak.reserved_bytes`."""
    return result.memory.reserved


def timeline_csv(result: StepResult) -> str:
    """One row per memory event: time (s), bytes per category, total allocated bytes."""
    out = io.StringIO()
    out.write("time_s," + ",".join(f"{c}_bytes" for c in CATEGORIES) + ",total_bytes\n")
    for t, row in zip(result.memory.time, result.memory.levels):
        out.write(f"{t:.9f}," + ",".join(str(int(v)) for v in row) + f",{int(row.sum())}\n")
    return out.getvalue()
