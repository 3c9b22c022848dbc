"""The memory ledger: every allocation and free, replayed in issue order, with its checks inside.

Issue order is what PyTorch's caching allocator counts (`torch.cuda.max_memory_allocated`,
FSDPMemTracker): a free made on the CPU returns the bytes at once; FSDP2 keeps buffers alive across
streams with references and events, which the schedule expresses as frees placed after the waits.
Each event is stamped with the time its stream reaches it, never earlier than the previous event, so
the timeline is monotone and its maximum is the issue-order peak. Reserved memory comes from playing the
same events on the caching allocator model (engine/reserved.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdp_sim.engine.allocator import AllocatorConfig
from fsdp_sim.engine.reserved import ReservedModel, replay_allocator
from fsdp_sim.engine.step_plan import MemoryEvents, optimizer_start
from fsdp_sim.schedule.ops import CATEGORIES, Buffer, Op, OpGraph

_CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}


class LedgerError(RuntimeError):
    """A schedule broke a memory invariant (double free, free of an unknown buffer, negative level)."""


@dataclass(slots=True)
class MemoryTrace:
    """The ledger's record: one row per event (row 0 is the persistent state at t=0)."""

    time: np.ndarray  # (n+1,) seconds
    levels: np.ndarray  # (n+1, len(CATEGORIES)) bytes per category after each event
    total: np.ndarray  # (n+1,) bytes after each event: each row of `levels` summed (from the events: a quarter of the time)
    columns: MemoryEvents  # the events (row i+1 is event i) as the allocator model reads them
    ops: list[Op]  # the graph's, by op id
    persistent: list[Buffer]
    allocator: ReservedModel  # the caching allocator model's prediction (engine/reserved.py)

    @property
    def events(self) -> list[tuple[Op, Buffer, int]]:
        """(op, buffer, +1 alloc / -1 free) of each event, row i+1."""
        ops = self.ops
        return [(ops[i], ops[i].buffer, 1 if a else -1)
                for i, a in zip(self.columns.op_ids.tolist(), self.columns.allocs.tolist())]

    def op_at(self, row: int) -> Op | None:
        """The op of event `row` (None for row 0, the persistent state)."""
        return self.ops[int(self.columns.op_ids[row - 1])] if row else None

    @property
    def live_at_end(self) -> list[Buffer]:
        return self.live_at(len(self.total) - 1)

    @property
    def reserved_bytes(self) -> int:
        """Peak reserved (`torch.cuda.max_memory_reserved`) in the steady state."""
        return self.allocator.reserved_bytes

    @property
    def reserved(self) -> np.ndarray:
        """Reserved bytes after each event of a steady step (row 0: before it); never decreases."""
        return self.allocator.timeline

    def live_at(self, row: int) -> list[Buffer]:
        """Buffers alive after event `row` (row 0: the persistent state), from the events up to it only."""
        live = {b.id: b for b in self.persistent}
        ops = self.ops
        for i, alloc in zip(self.columns.op_ids[:row].tolist(), self.columns.allocs[:row].tolist()):
            buf = ops[i].buffer
            if alloc:
                live[buf.id] = buf
            else:
                del live[buf.id]
        return list(live.values())


def replay(graph: OpGraph, start: np.ndarray, issued: np.ndarray | None = None, end: np.ndarray | None = None,
           allocator: AllocatorConfig = AllocatorConfig()) -> MemoryTrace:
    """Apply every alloc/free of `graph` in issue order; refuse a double free or a free of a dead buffer.

    `start` stamps the events; `issued` (when the CPU issues each op: when the allocator runs) and `end`
    (when a recorded stream's work completes) time the allocator model, `start` standing in for both
    when they are not given. The events are the graph's columns, checked and summed in numpy.
    """
    ops, persistent = graph.ops, graph.persistent
    columns, levels, total = _summed(graph)
    times = np.empty(len(total))  # each event when its stream reaches it, never before the one before it
    times[0] = 0.0
    times[1:] = start[columns.op_ids]
    np.maximum.accumulate(times, out=times)
    model = replay_allocator(ops, columns, persistent, start if issued is None else issued,
                             start if end is None else end, allocator, timeless=not graph.recorded_frees)
    return MemoryTrace(times, levels, total, columns, ops, list(persistent), model)


def _summed(graph: OpGraph) -> tuple[MemoryEvents, np.ndarray, np.ndarray]:
    """The graph's memory columns as arrays, checked, and the levels by category and in total after each
    event: what no time moves. What the bytes do not decide (which event is whose alloc or free, on which
    stream, its category: `_structure`) is derived once per build (`OpGraph.derived`), and the levels are
    kept for the bytes last summed, which a re-priced graph shares (schedule/build.py `with_ops`). Read-only."""
    op_ids, bufs, allocs, event_category, initial, optimizer_from = graph.derived("ledger columns", lambda: _structure(graph))
    memory_bytes = graph.memory_bytes
    last = graph.derived("ledger levels", lambda: [None, None])  # [the bytes summed, the sums]
    if last[0] is memory_bytes:
        return last[1]
    n = len(op_ids)
    step = np.fromiter(memory_bytes, dtype=np.int64, count=n)  # fromiter: half the time of np.array on a list
    delta = np.zeros((n + 1, len(CATEGORIES)), dtype=np.int64)  # bytes are exact integers
    delta[0] = initial
    delta[np.arange(1, n + 1), event_category] = step
    levels = np.cumsum(delta, axis=0, out=delta)
    if levels.min() < 0:
        row, col = np.argwhere(levels < 0)[0]
        raise LedgerError(f"{CATEGORIES[col]} went negative at event {row} ({graph.buffers[bufs[row - 1]].name!r})")
    total = np.cumsum(np.concatenate(([initial.sum()], step)))
    for array in (step, levels, total):
        array.flags.writeable = False
    last[:] = memory_bytes, (MemoryEvents(op_ids, bufs, step, allocs, graph.memory_streams, optimizer_from), levels, total)
    return last[1]


def _structure(graph: OpGraph) -> tuple[np.ndarray, ...]:
    """Each event's op, buffer, whether it allocates and its buffer's category, checked (`_check`), the
    persistent bytes by category and where the optimizer phase starts: what a re-sized graph shares with the
    one it was made from."""
    ops, n = graph.ops, len(graph.memory_ops)
    op_ids = np.fromiter(graph.memory_ops, dtype=np.intp, count=n)
    bufs = np.fromiter(graph.memory_buffers, dtype=np.intp, count=n)
    allocs = np.fromiter((ops[i].kind == "alloc" for i in graph.memory_ops), dtype=bool, count=n)
    _check(graph, op_ids, bufs, allocs)
    initial = np.zeros(len(CATEGORIES), dtype=np.int64)
    for b in graph.persistent:
        initial[_CAT_INDEX[b.category]] += b.nbytes
    category = np.fromiter((_CAT_INDEX[b.category] for b in graph.buffers), dtype=np.intp, count=len(graph.buffers))
    for array in (op_ids, bufs, allocs, initial):
        array.flags.writeable = False
    return op_ids, bufs, allocs, category[bufs], initial, optimizer_start(ops)


def _check(graph: OpGraph, op_ids: np.ndarray, bufs: np.ndarray, allocs: np.ndarray) -> None:
    """Every buffer allocated at most once, and freed at most once, after its allocation (or persistent)."""
    n = max(len(graph.buffers), int(bufs.max()) + 1 if len(bufs) else 0)  # a buffer from elsewhere: never allocated
    made = np.full(n, len(op_ids), dtype=np.intp)  # the event that allocates each buffer (-1: persistent)
    made[[b.id for b in graph.persistent]] = -1
    allocated, freed = bufs[allocs], bufs[~allocs]
    twice = np.flatnonzero(np.bincount(allocated, minlength=n) > 1)
    if len(twice) or (made[allocated] < 0).any():
        buf = graph.buffers[twice[0] if len(twice) else allocated[made[allocated] < 0][0]]
        raise LedgerError(f"buffer {buf.name!r} allocated twice")
    made[allocated] = np.flatnonzero(allocs)
    at = np.flatnonzero(~allocs)
    bad = made[freed] > at
    order = np.argsort(freed, kind="stable")  # a buffer's frees after its first
    bad[order[1:]] |= freed[order[1:]] == freed[order[:-1]]
    if bad.any():
        k = int(at[np.argmax(bad)])
        op = graph.ops[op_ids[k]]
        raise LedgerError(f"buffer {op.buffer.name!r} freed twice or never allocated (op {op.name!r}, {op.phase})")
