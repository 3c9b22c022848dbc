"""The memory ledger: every allocation and free, replayed in issue order, with its checks inside.

Issue order is what PyTorch's caching allocator counts (`torch.cuda.max_memory_allocated`,
FSDPMemTracker): a free made on the CPU returns the bytes at once; FSDP2 keeps buffers alive across
streams with references and events, which the schedule expresses as frees placed after the waits.
Each event is stamped with the time its stream reaches it, never earlier than the previous event, so
the timeline is monotone and its maximum is the issue-order peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdp_sim.schedule.ops import CATEGORIES, Buffer, Op

_CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}
MIN_BLOCK, SMALL_SIZE, ROUND_LARGE = 512, 1 << 20, 2 << 20  # c10 CUDACachingAllocator constants


class LedgerError(RuntimeError):
    """A schedule broke a memory invariant (double free, free of an unknown buffer, negative level)."""


@dataclass(slots=True)
class MemoryTrace:
    """The ledger's record: one row per event (row 0 is the persistent state at t=0)."""

    time: np.ndarray  # (n+1,) seconds
    levels: np.ndarray  # (n+1, len(CATEGORIES)) bytes per category after each event
    events: list[tuple[Op, Buffer, int]]  # (op, buffer, +1 alloc / -1 free), row i+1
    persistent: list[Buffer]
    live_at_end: list[Buffer]
    reserved_bytes: int  # the caching allocator's model: see `replay`

    @property
    def total(self) -> np.ndarray:
        return self.levels.sum(axis=1)

    def live_at(self, row: int) -> list[Buffer]:
        """Buffers alive after event `row` (row 0: the persistent state)."""
        live = {b.id: b for b in self.persistent}
        for _, buf, sign in self.events[:row]:
            if sign > 0:
                live[buf.id] = buf
            else:
                del live[buf.id]
        return list(live.values())


def allocator_size(nbytes: int) -> int:
    """Block size PyTorch's CUDA caching allocator hands out for a request: multiples of 512 B up to
    1 MiB (kMinBlockSize, kSmallSize), multiples of 2 MiB above (kRoundLarge)."""
    if nbytes <= SMALL_SIZE:
        return -(-nbytes // MIN_BLOCK) * MIN_BLOCK
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def replay(ops: list[Op], persistent: list[Buffer], start: np.ndarray) -> MemoryTrace:
    """Apply every alloc/free op in issue order; refuse a double free or a free of a dead buffer.

    Reserved memory is modelled alongside: the caching allocator keeps one pool per stream (a block
    freed on one stream is not reused by another), each pool holds its high-water mark of rounded
    live blocks, and the reserved total is their sum. Fragmentation inside a pool is not modelled,
    so this is a lower bound of `torch.cuda.max_memory_reserved`.
    """
    live: dict[int, tuple[Buffer, str, int]] = {b.id: (b, "compute", allocator_size(b.nbytes)) for b in persistent}
    level = {"compute": sum(block for _, _, block in live.values())}
    high = dict(level)
    initial = np.zeros(len(CATEGORIES), dtype=np.int64)
    for b in persistent:
        initial[_CAT_INDEX[b.category]] += b.nbytes
    times, cats, deltas, events = [0.0], [], [], []
    t = 0.0
    start = start.tolist()
    for op in ops:
        kind = op.kind
        if kind == "alloc":
            buf = op.buffer
            if buf.id in live:
                raise LedgerError(f"buffer {buf.name!r} allocated twice")
            pool, block = op.stream, allocator_size(buf.nbytes)
            live[buf.id] = (buf, pool, block)
            level[pool] = used = level.get(pool, 0) + block
            if used > high.get(pool, 0):
                high[pool] = used
            deltas.append(buf.nbytes)
            events.append((op, buf, 1))
        elif kind == "free":
            buf = op.buffer
            entry = live.pop(buf.id, None)
            if entry is None:
                raise LedgerError(f"buffer {buf.name!r} freed twice or never allocated (op {op.name!r}, {op.phase})")
            level[entry[1]] -= entry[2]
            deltas.append(-buf.nbytes)
            events.append((op, buf, -1))
        else:
            continue
        if start[op.id] > t:
            t = start[op.id]
        times.append(t)
        cats.append(_CAT_INDEX[buf.category])
    delta = np.zeros((len(deltas) + 1, len(CATEGORIES)), dtype=np.int64)  # bytes are exact integers
    delta[0] = initial
    if deltas:
        delta[np.arange(1, len(deltas) + 1), cats] = deltas
    levels = np.cumsum(delta, axis=0)
    if (levels < 0).any():
        row, col = np.argwhere(levels < 0)[0]
        raise LedgerError(f"{CATEGORIES[col]} went negative at event {row} ({events[row - 1][1].name!r})")
    return MemoryTrace(np.array(times), levels, events, list(persistent), [b for b, _, _ in live.values()],
                       int(sum(high.values())))
