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
from fsdp_sim.schedule.ops import CATEGORIES, Buffer, Op

_CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}


class LedgerError(RuntimeError):
    """A schedule broke a memory invariant (double free, free of an unknown buffer, negative level)."""


@dataclass(slots=True)
class MemoryTrace:
    """The ledger's record: one row per event (row 0 is the persistent state at t=0)."""

    time: np.ndarray  # (n+1,) seconds
    levels: np.ndarray  # (n+1, len(CATEGORIES)) bytes per category after each event
    total: np.ndarray  # (n+1,) bytes after each event: each row of `levels` summed (from the events: a quarter of the time)
    events: list[tuple[Op, Buffer, int]]  # (op, buffer, +1 alloc / -1 free), row i+1
    persistent: list[Buffer]
    live_at_end: list[Buffer]
    allocator: ReservedModel  # the caching allocator model's prediction (engine/reserved.py)

    @property
    def reserved_bytes(self) -> int:
        """Peak reserved (`torch.cuda.max_memory_reserved`) in the steady state."""
        return self.allocator.reserved_bytes

    @property
    def reserved(self) -> np.ndarray:
        """Reserved bytes after each event of a steady step (row 0: before it); never decreases."""
        return self.allocator.timeline

    def live_at(self, row: int) -> list[Buffer]:
        """Buffers alive after event `row` (row 0: the persistent state)."""
        live = {b.id: b for b in self.persistent}
        for _, buf, sign in self.events[:row]:
            if sign > 0:
                live[buf.id] = buf
            else:
                del live[buf.id]
        return list(live.values())


def replay(ops: list[Op], persistent: list[Buffer], start: np.ndarray, issued: np.ndarray | None = None,
           end: np.ndarray | None = None, allocator: AllocatorConfig = AllocatorConfig()) -> MemoryTrace:
    """Apply every alloc/free op in issue order; refuse a double free or a free of a dead buffer.

    `start` stamps the events; `issued` (when the CPU issues each op: when the allocator runs) and `end`
    (when a recorded stream's work completes) time the allocator model, `start` standing in for both
    when they are not given.
    """
    live: dict[int, Buffer] = {b.id: b for b in persistent}
    initial = np.zeros(len(CATEGORIES), dtype=np.int64)
    for b in persistent:
        initial[_CAT_INDEX[b.category]] += b.nbytes
    ids, cats, deltas, events, bufs, streams = [], [], [], [], [], []
    waits = False  # a free with record_stream: the allocator's replay then depends on the times
    for op in ops:
        kind = op.kind
        if kind == "alloc":
            buf = op.buffer
            if buf.id in live:
                raise LedgerError(f"buffer {buf.name!r} allocated twice")
            live[buf.id] = buf
            deltas.append(buf.nbytes)
            events.append((op, buf, 1))
        elif kind == "free":
            buf = op.buffer
            if live.pop(buf.id, None) is None:
                raise LedgerError(f"buffer {buf.name!r} freed twice or never allocated (op {op.name!r}, {op.phase})")
            deltas.append(-buf.nbytes)
            events.append((op, buf, -1))
            waits = waits or bool(op.record_stream)
        else:
            continue
        ids.append(op.id)
        bufs.append(buf.id)
        streams.append(op.stream)
        cats.append(_CAT_INDEX[buf.category])
    n = len(events)
    step = np.fromiter(deltas, dtype=np.int64, count=n)  # fromiter: half the time of np.array on a list
    times = np.empty(n + 1)  # each event when its stream reaches it, never before the one before it
    times[0] = 0.0
    op_ids = np.fromiter(ids, dtype=np.intp, count=n)
    times[1:] = start[op_ids]
    np.maximum.accumulate(times, out=times)
    delta = np.zeros((n + 1, len(CATEGORIES)), dtype=np.int64)  # bytes are exact integers
    delta[0] = initial
    delta[np.arange(1, n + 1), np.fromiter(cats, dtype=np.intp, count=n)] = step
    levels = np.cumsum(delta, axis=0, out=delta)
    if levels.min() < 0:
        row, col = np.argwhere(levels < 0)[0]
        raise LedgerError(f"{CATEGORIES[col]} went negative at event {row} ({events[row - 1][1].name!r})")
    total = np.cumsum(np.concatenate(([initial.sum()], step)))
    # what the allocator sees of the events, in order, the times aside: the key of its memo (reserved.py)
    requests = None if waits else (np.fromiter(bufs, dtype=np.intp, count=n), step, streams, op_ids)
    model = replay_allocator(ops, events, persistent, start if issued is None else issued,
                             start if end is None else end, allocator, requests=requests)
    return MemoryTrace(times, levels, total, events, list(persistent), list(live.values()), model)
