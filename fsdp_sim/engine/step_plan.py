"""The ledger's allocs and frees as the caching allocator model plays them (engine/reserved.py): each request's
`round_size` and `get_pool` worked out once for every step of every replay, each free given its request's
pool and, where it was recorded on another stream (`Tensor.record_stream`), the time that stream's event
completes."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

import numpy as np

from fsdp_sim.engine.allocator import AllocatorConfig, pool_key, round_size


@dataclass(frozen=True, slots=True)
class MemoryEvents:
    """The ledger's allocs and frees in issue order, as columns (the graph's, `OpGraph.memory_ops`...)."""

    op_ids: np.ndarray  # each event's op (rising)
    buffers: np.ndarray  # its buffer's id
    deltas: np.ndarray  # signed bytes: + alloc, - free
    allocs: np.ndarray  # bool: an alloc (a buffer of no bytes has delta 0 either way)
    streams: list[str]  # its stream
    optimizer_from: int | None  # the first op of the optimizer phase (`optimizer_start`; None: the step has none)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The ledger's events as the allocator plays them, built once for every step of every replay."""

    config: AllocatorConfig
    persistent: list[tuple[int, int]]  # (buffer id, bytes) allocated before the first step, lazy states aside
    lazy: list[tuple[int, int]]  # optimizer states, created where the first optimizer phase begins
    lazy_at: int  # the index of the event they are created before (len(events): after the last)
    lazy_now: float  # when the CPU creates them
    events: list[tuple]  # (buffer, +bytes / -bytes, rounded bytes (0: a free), pool, issued, ready): each
    # request's `round_size` and `get_pool` worked out once (`CachingAllocator.play`'s events; a free's pool
    # is its request's, which `play` does not read: a steady step leaves out the pools that cannot change)
    kept: frozenset[int]  # the persistent buffers: alive across steps
    period: float  # one step's time
    deltas: np.ndarray  # each event's signed bytes (the ledger's column)
    waits: bool  # some free waits for a recorded stream (an event's `ready` is set): time then moves the replay


def _ready_times(ops, end: np.ndarray, issued: np.ndarray) -> dict[int, float]:
    """For each free with `record_stream`: when the event recorded on that stream at the free completes
    (the end of the last op the stream had queued; the free's own issue time if it had queued none)."""
    last: dict[str, int] = {}
    ready = {}
    for op in ops:
        if op.kind == "free" and op.record_stream and op.record_stream != op.stream:
            i = last.get(op.record_stream)
            ready[op.id] = float(end[i]) if i is not None else float(issued[op.id])
        last[op.stream] = op.id
    return ready


def optimizer_start(ops) -> int | None:
    """The id of the first op of the optimizer phase (None: the step has none)."""
    return next((op.id for op in ops if op.phase == "optimizer"), None)


def step_plan(ops, events: MemoryEvents, persistent, issued: np.ndarray, end: np.ndarray, config: AllocatorConfig,
              timeless: bool) -> StepPlan:
    """The plan of `events` (the ledger's, in issue order); `timeless`: no free waits for a recorded stream
    (`replay_allocator`'s)."""
    optimizer_from = events.optimizer_from
    ready = {} if timeless else _ready_times(ops, end, issued)
    period = float(max(end.max(), issued.max())) if len(end) else 0.0
    lazy = [(b.id, b.nbytes) for b in persistent if b.category == "optimizer_states" and optimizer_from is not None]
    late = {i for i, _ in lazy}
    plan = list(zip(events.buffers.tolist(), events.deltas.tolist(), *_pools(events), issued[events.op_ids].tolist(),
                    [ready.get(op) for op in events.op_ids.tolist()] if ready else repeat(None)))
    n = len(plan)
    lazy_at = int(np.searchsorted(events.op_ids, optimizer_from)) if lazy else n  # op ids rise with the events
    return StepPlan(config, [(b.id, b.nbytes) for b in persistent if b.id not in late], lazy, lazy_at,
                    plan[lazy_at][4] if lazy_at < n else period, plan, frozenset(b.id for b in persistent), period,
                    events.deltas, bool(ready))


def _pools(events: MemoryEvents) -> tuple[list[int], list]:
    """Each event's rounded bytes (`round_size`; 0: a free) and pool (`get_pool`; a free's is its request's,
    None for a buffer the step did not allocate), worked out once per distinct (stream, bytes) of a request:
    a step's thousands of requests have a few dozen."""
    allocs, deltas = events.allocs, events.deltas
    names = list(dict.fromkeys(events.streams))
    index = {name: k for k, name in enumerate(names)}
    streams = np.fromiter(map(index.__getitem__, events.streams), dtype=np.int64, count=len(deltas))
    requests = np.flatnonzero(allocs)
    # one integer per (bytes, stream): bytes stay far below 2**63 / streams (an exabyte over a few streams)
    distinct, which = np.unique(deltas[requests] * len(names) + streams[requests], return_inverse=True)
    sizes, pools = [], [None]  # pools[0]: no pool
    for combined in distinct.tolist():
        nbytes, stream = divmod(combined, len(names))
        size = round_size(nbytes)
        sizes.append(size)
        pools.append(pool_key(names[stream], size))
    size = np.zeros(len(deltas), dtype=np.int64)
    size[requests] = np.asarray(sizes, dtype=np.int64)[which]
    pool = np.zeros(len(deltas), dtype=np.intp)
    pool[requests] = which + 1
    frees = np.flatnonzero(~allocs)
    made = np.full(int(events.buffers.max(initial=0)) + 1, -1, dtype=np.intp)  # each buffer's request
    made[events.buffers[requests]] = requests
    request = made[events.buffers[frees]]
    pool[frees] = np.where(request >= 0, pool[request], 0)
    by_number = np.empty(len(pools), dtype=object)  # filled one by one: numpy would unpack the tuples
    for k, key in enumerate(pools):
        by_number[k] = key
    return size.tolist(), by_number[pool].tolist()
