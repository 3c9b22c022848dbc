"""Play an op graph on SimPy: CUDA streams as FIFO processes, NCCL lanes in issue order.

No FSDP knowledge lives here. Each stream is a process that takes its ops in issue order; an op
starts when the stream is free and every op it waits on (a CUDA event) has finished. A collective is
handed to its process group's lane, which runs collectives one at a time in issue order (one NCCL
stream per group), so an all-gather queued behind a reduce-scatter waits for it whatever its stream.
The SimPy environment owns event order: (time, priority, sequence number), deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import simpy

from fsdp_sim.schedule.ops import COLLECTIVES, TIMED_KINDS, Op


@dataclass(slots=True)
class Timing:
    """Start and end time (s) of every op, indexed by op id, and the stream each ran on."""

    start: np.ndarray
    end: np.ndarray

    @property
    def makespan(self) -> float:
        return float(self.end.max()) if len(self.end) else 0.0


class _Player:
    def __init__(self, ops: list[Op], duration: Callable[[Op], float]) -> None:
        self.env = simpy.Environment()
        self.ops, self.duration = ops, duration
        n = len(ops)
        self.start, self.end = [0.0] * n, [0.0] * n
        self.finished = [False] * n
        self.arrived = [False] * n
        self.waiters: dict[int, simpy.Event] = {}
        self.arrivals: dict[int, simpy.Event] = {}

    def _finish(self, i: int) -> None:
        self.end[i] = self.env.now
        self.finished[i] = True
        if (ev := self.waiters.pop(i, None)) is not None:
            ev.succeed()

    def _wait(self, i: int) -> simpy.Event:
        ev = self.waiters.get(i)
        if ev is None:
            ev = self.waiters[i] = self.env.event()
        return ev

    def stream(self, ops: list[Op]):
        env, start, end, finished, waiters = self.env, self.start, self.end, self.finished, self.waiters
        duration = self.duration
        now = env.now  # refreshed after every yield: time only moves while this process waits
        for op in ops:
            i = op.id
            for d in op.deps:
                if not finished[d]:
                    yield self._wait(d)
                    now = env.now
            kind = op.kind
            if kind in COLLECTIVES:
                self.arrived[i] = True
                if (ev := self.arrivals.pop(i, None)) is not None:
                    ev.succeed()
                if not finished[i]:
                    yield self._wait(i)
                    now = env.now
                continue
            start[i] = now
            if kind in TIMED_KINDS and (dur := duration(op)) > 0:
                yield env.timeout(dur)
                now = env.now
            end[i], finished[i] = now, True  # inline of _finish: this loop is the engine's hot path
            if waiters and (ev := waiters.pop(i, None)) is not None:
                ev.succeed()

    def lane(self, ops: list[Op]):
        env = self.env
        for op in ops:
            if not self.arrived[op.id]:
                ev = self.arrivals[op.id] = env.event()
                yield ev
            self.start[op.id] = env.now
            dur = self.duration(op)
            if dur > 0:
                yield env.timeout(dur)
            self._finish(op.id)


def play(ops: list[Op], duration: Callable[[Op], float]) -> Timing:
    """Simulate `ops` (issue order); `duration(op)` prices timed ops, the rest (alloc, free) take no time."""
    player = _Player(ops, duration)
    streams: dict[str, list[Op]] = {}
    lanes: dict[str, list[Op]] = {}
    for op in ops:
        streams.setdefault(op.stream, []).append(op)
        if op.kind in COLLECTIVES:
            lanes.setdefault(op.group, []).append(op)
    for queue in streams.values():
        player.env.process(player.stream(queue))
    for queue in lanes.values():
        player.env.process(player.lane(queue))
    player.env.run()
    if not all(player.finished):
        first = next(op for op, done in zip(ops, player.finished) if not done)
        raise RuntimeError(f"deadlock: ops never ran, first {first.name!r}")
    return Timing(np.array(player.start), np.array(player.end))
