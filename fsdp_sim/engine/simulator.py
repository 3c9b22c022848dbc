"""Play an op graph on SimPy: a CPU issue thread, CUDA streams as FIFO processes, NCCL lanes in issue order.

No FSDP knowledge lives here. The ops are in CPU issue order; the issue thread spends `host_s(op)` on each
(eager kernel launches: Python, dispatcher, driver), so op i is issued at the running sum of those costs and
no stream can start it earlier: a small model becomes CPU-bound as it does on a GPU. Each stream is a
process that takes its ops in issue order; an op starts when the stream is free, it has been issued, and
every op it waits on (a CUDA event) has finished. A collective is handed to its process group's lane,
which runs collectives one at a time in issue order (one NCCL stream per group), so an all-gather queued
behind a reduce-scatter waits for it whatever its stream.

Ops that run beside a collective may slow each other (an NCCL kernel holds SMs and HBM bandwidth; two
collectives share a link): `slowdown(op, running)` says by how much (it is not asked when no collective
runs), and the device advances every running op at its rate,
recomputed only when the set of running ops changes (processor sharing), so a contended op costs one
wake-up per change instead of a fixed timeout. The SimPy environment owns event order: (time, priority,
sequence number), deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import simpy

from fsdp_sim.schedule.ops import COLLECTIVES, TIMED_KINDS, Op

Slowdown = Callable[[Op, list[Op]], float]


@dataclass(slots=True)
class Timing:
    """Start and end time (s) of every op, indexed by op id, and the time each was issued by the CPU."""

    start: np.ndarray
    end: np.ndarray
    issued: np.ndarray

    @property
    def makespan(self) -> float:
        return float(self.end.max()) if len(self.end) else 0.0


class _Device:
    """Runs timed ops concurrently, each at 1 / slowdown of its own speed given what else runs."""

    def __init__(self, env: simpy.Environment, slowdown: Slowdown) -> None:
        self.env, self.slowdown = env, slowdown
        self.running: dict[int, list] = {}  # op id -> [op, remaining uncontended seconds, slowdown, done event]
        self.last = 0.0
        self.generation = 0
        self.wake_at, self.wake_op = float("inf"), -1  # the pending wake-up: when, and which op it completes
        self.collectives = 0  # running collectives: without one nothing contends
        self.contended = False  # some running op's slowdown is not 1

    def run(self, op: Op, work: float) -> simpy.Event:
        self._advance()
        done = self.env.event()
        self.running[op.id] = [op, work, 1.0, done]
        if op.kind in COLLECTIVES:
            self.collectives += 1
        if self.collectives or self.contended:
            self._rerate()
        elif self.wake_op not in self.running or self.env.now + work < self.wake_at:
            self._schedule(work, op.id)  # uncontended: only whether this op ends first matters
        return done

    def _advance(self) -> None:
        now = self.env.now
        if now > self.last:
            dt = now - self.last
            for r in self.running.values():
                r[1] -= dt / r[2]
            self.last = now

    def _rerate(self) -> None:
        running = self.running
        changed = False
        if self.collectives and len(running) > 1:
            ops = [r[0] for r in running.values()]
            for r in running.values():
                factor = self.slowdown(r[0], ops)
                if factor != r[2]:
                    r[2], changed = factor, True
            self.contended = True
        elif self.contended:  # the last collective ended: everything runs at its own speed again
            for r in running.values():
                if r[2] != 1.0:
                    r[2], changed = 1.0, True
            self.contended = False
        soonest, first = float("inf"), -1
        for i, r in running.items():
            if r[1] * r[2] < soonest:
                soonest, first = r[1] * r[2], i
        if first < 0:
            return
        if not changed and self.wake_op in running and self.env.now + soonest >= self.wake_at:
            return  # no rate moved and nothing ends sooner: the pending wake-up still holds
        self._schedule(soonest, first)

    def _schedule(self, delay: float, first: int) -> None:
        """Wake up after `delay` to complete op `first`; any earlier pending wake-up goes stale."""
        delay = max(delay, 0.0)
        self.generation += 1
        self.wake_at, self.wake_op = self.env.now + delay, first
        wake = self.env.timeout(delay)
        wake.callbacks.append(lambda _e, g=self.generation, i=first: self._wake(g, i))

    def _wake(self, generation: int, first: int) -> None:
        if generation != self.generation:
            return  # the running set changed since this wake-up was scheduled
        self._advance()
        done = [i for i, r in self.running.items() if i == first or r[1] * r[2] <= 1e-15]
        for i in done:
            op, _, _, event = self.running.pop(i)
            if op.kind in COLLECTIVES:
                self.collectives -= 1
            event.succeed()
        self._rerate()


class _Player:
    def __init__(self, ops: list[Op], duration: Callable[[Op], float], issued: list[float],
                 slowdown: Slowdown | None) -> None:
        self.env = simpy.Environment()
        self.ops, self.duration, self.issued = ops, duration, issued
        self.device = _Device(self.env, slowdown) if slowdown is not None else None
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

    def _timed(self, op: Op, dur: float) -> simpy.Event:
        return self.env.timeout(dur) if self.device is None else self.device.run(op, dur)

    def stream(self, ops: list[Op]):
        env, start, end, finished, waiters, issued = self.env, self.start, self.end, self.finished, self.waiters, self.issued
        duration = self.duration
        now = env.now  # refreshed after every yield: time only moves while this process waits
        for op in ops:
            i = op.id
            for d in op.deps:
                if not finished[d]:
                    yield self._wait(d)
                    now = env.now
            if issued[i] > now:
                yield env.timeout(issued[i] - now)
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
                yield self._timed(op, dur)
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
                yield self._timed(op, dur)
            self._finish(op.id)


def play(ops: list[Op], duration: Callable[[Op], float], *, host_s: Callable[[Op], float] | None = None,
         slowdown: Slowdown | None = None) -> Timing:
    """Simulate `ops` (issue order); `duration(op)` prices timed ops alone on the GPU (alloc and free take
    no time), `host_s(op)` is the CPU issue thread's cost of op (none if omitted), `slowdown(op, running)`
    the factor >= 1 by which op runs slower beside the ops in `running` (none if omitted)."""
    issued = list(accumulate(host_s(op) for op in ops)) if host_s is not None else [0.0] * len(ops)
    player = _Player(ops, duration, issued, slowdown)
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
    return Timing(np.array(player.start), np.array(player.end), np.array(issued))
