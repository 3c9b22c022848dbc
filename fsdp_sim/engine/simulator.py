"""Play an op graph on SimPy: a CPU issue thread, CUDA streams as FIFO queues, NCCL lanes in issue order.

No FSDP knowledge lives here. The ops are in CPU issue order; the issue thread spends `host_s(op)` on each
(eager kernel launches: Python, dispatcher, driver), so op i is issued at the running sum of those costs and
no stream can start it earlier: a small model becomes CPU-bound as it does on a GPU. An op with `cpu_wait`
is issued only once the op it names has ended (a blocking `Event.synchronize()`, FSDP1's rate limiter), and
so is everything after it (`_IssueThread`). Each stream takes its
ops in issue order; an op starts when the stream is free, it has been issued, and every op it waits on (a
CUDA event) has finished. A stream is a loop that runs until it must wait and leaves its resume function
where the wait ends, not a SimPy process: only issue times and device completions are SimPy timeouts, so
the ~80 % of ops that take no time (alloc, free) and every CUDA event cost no SimPy event. Resumptions due
at one time run in FIFO order, as the processes they replace resumed, so the times are the same to the
last bit (checked against the process-based player on the shipped scenarios and sweep points). A
collective is handed to its process group's lane,
which runs collectives one at a time in issue order (one NCCL stream per group), so an all-gather queued
behind a reduce-scatter waits for it whatever its stream.

Ops that run beside a collective may slow each other: the device (`device.py`) runs timed ops under
processor sharing. The SimPy environment owns event order: (time, priority, sequence number), deterministic.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import simpy
from simpy.events import NORMAL

from fsdp_sim.engine.device import Device, Slowdowns, WakeUp
from fsdp_sim.schedule.ops import COLLECTIVES, TIMED_KINDS, Op

_TIMED = frozenset(TIMED_KINDS)  # a set: one hash probe per op instead of up to five string compares
_COLLECTIVE = frozenset(COLLECTIVES)


@dataclass(slots=True)
class Timing:
    """Start and end time (s) of every op, indexed by op id, and the time each was issued by the CPU."""

    start: np.ndarray
    end: np.ndarray
    issued: np.ndarray

    @property
    def makespan(self) -> float:
        return float(self.end.max()) if len(self.end) else 0.0


class _Player:
    """Streams and lanes as resumable loops over their queues, driven by SimPy timeouts.

    A stream or lane that cannot go on (an op it waits on has not finished, the CPU has not issued its
    next op, its op runs on the device) registers the function that resumes it and returns. Resumptions
    due at the current time go through one FIFO queue (`kick`), in the order SimPy would have resumed
    the processes that woke, so no SimPy event is spent on a CUDA event or a stream's next op: only the
    CPU's issue times and the device's completions are timeouts.
    """

    def __init__(self, ops: list[Op], durations: list[float], issued: list[float], slowdowns: Slowdowns | None) -> None:
        n = len(ops)
        self.env = simpy.Environment()
        self.now = 0.0  # env.now, read once per SimPy event (a property, else read ~1,000 times a step)
        self.ops, self.durations, self.issued = ops, durations, issued  # by op id: alone on the GPU, when the CPU issues it
        self.device = Device(self, slowdowns) if slowdowns is not None else None
        self.start, self.end = [0.0] * n, [0.0] * n
        self.finished = [False] * n
        self.arrived = [False] * n
        # by op id: what resumes when it finishes (a list, not a dict: every op that ends looks itself up)
        self.waiters: list[list[Callable[[], None]] | None] = [None] * n
        self.arrivals: dict[int, Callable[[], None]] = {}  # collective id -> its lane, waiting for it
        self.ready: deque[Callable[[], None]] = deque()
        self.draining = False
        self.unissued: list[Callable[[], None]] = []  # streams at an op the blocked CPU has not issued yet

    def kick(self, resume: Callable[[], None]) -> None:
        """Queue `resume` at the current time; run the queue unless it is already running."""
        self.ready.append(resume)
        if self.draining:
            return
        self.draining = True
        ready = self.ready
        while ready:
            ready.popleft()()
        self.draining = False
        if self.device is not None:
            self.device.flush()  # every SimPy callback ends here: its wake-up is made before SimPy goes on

    def timeout(self, delay: float, callback: Callable[[WakeUp], None]) -> None:
        """`callback` after `delay`, as a SimPy timeout made after the device's decided wake-up would call
        it (see `Device.flush`, `WakeUp`)."""
        if self.device is not None:
            self.device.flush()
        self.env.schedule(WakeUp(callback), NORMAL, delay)

    def at_timeout(self, resume: Callable[[], None]) -> None:
        """What a SimPy timeout's callback does: the clock moves to the timeout's time, then `resume` runs."""
        self.now = self.env.now
        self.kick(resume)

    def wait_for(self, i: int, resume: Callable[[], None]) -> None:
        """Queue `resume` when op i (not finished) finishes, after what already waits on it."""
        if (resumes := self.waiters[i]) is None:
            self.waiters[i] = [resume]
        else:
            resumes.append(resume)

    def _finish(self, i: int) -> None:
        self.end[i] = self.now
        self.finished[i] = True
        if (resumes := self.waiters[i]) is not None:
            self.waiters[i] = None  # dropped once run: a resume function refers back to the player
            self.ready.extend(resumes)

    def _timed(self, op: Op, dur: float, then: Callable[[], None], collective: bool) -> None:
        if self.device is None:
            self.timeout(dur, lambda _e: self.at_timeout(then))
        else:
            self.device.run(op, dur, then, collective)

    def stream(self, items: list) -> Callable[[], None]:
        """The resume function of a stream taking its queue (`QueueLayout.streams`' items) in order."""
        return _Stream(self, items).advance

    def lane(self, items: list[int]) -> Callable[[], None]:
        """The resume function of a process group's lane: its collectives one at a time, in issue order."""
        return _Lane(self, items).advance


class _Stream:
    """A CUDA stream's queue, run from `pos` until an op must wait (alloc and free inline: the hot path).

    An object, not a closure that registers itself: the player holds no stream, so when the step ends
    nothing refers to one and reference counting frees it (a closure naming itself is a cycle that waits
    for the garbage collector, which a sweep then pays for in the next point's parsing)."""

    __slots__ = ("player", "items", "pos", "waited")

    def __init__(self, player: _Player, items: list) -> None:
        self.player = player
        self.items = items  # `QueueLayout.streams`' items: a tuple unpacked at once, or an untimed op's id alone
        self.pos = 0
        self.waited = -1  # the position whose issue time was waited for: it is not waited for again

    def advance(self) -> None:
        p, items = self.player, self.items
        start, end, finished, waiters, issued, durations = p.start, p.end, p.finished, p.waiters, p.issued, p.durations
        now = p.now
        pos, n = self.pos, len(items)
        while pos < n:
            i = items[pos]
            if i.__class__ is int:  # an alloc or free waiting on nothing (three ops in four): its own short path
                if issued[i] > now and self.waited != pos:
                    self._wait_issue(pos, issued[i] - now)
                    return
                start[i] = end[i] = now
                finished[i] = True
                if (resumes := waiters[i]) is not None:
                    waiters[i] = None
                    p.ready.extend(resumes)
                pos += 1
                continue
            i, deps, collective = i
            for d in deps:
                if not finished[d]:
                    self.pos = pos
                    p.wait_for(d, self.advance)
                    return
            dur = durations[i]
            if issued[i] > now and self.waited != pos:
                self._wait_issue(pos, issued[i] - now)
                return
            if collective:
                p.arrived[i] = True
                if (lane := p.arrivals.pop(i, None)) is not None:
                    p.ready.append(lane)
                if not finished[i]:
                    self.pos = pos
                    p.wait_for(i, self._next)
                    return
                pos += 1
                continue
            start[i] = now
            if dur > 0:
                self.pos = pos
                p._timed(p.ops[i], dur, self._timed_done, False)  # a collective runs in its lane
                return
            end[i] = now
            finished[i] = True
            if (resumes := waiters[i]) is not None:
                waiters[i] = None
                p.ready.extend(resumes)
            pos += 1
        self.pos = pos

    def _wait_issue(self, pos: int, delay: float) -> None:
        """Stop at `pos` until the CPU issues its op, `delay` from now (inf: behind a CPU synchronize, resumed
        once it returns); the op is not waited for again, even if the clock lands a rounding short of it."""
        self.pos = pos
        if delay == _NOT_ISSUED:
            self.player.unissued.append(self.advance)
            return
        self.waited = pos
        self.player.timeout(delay, self._issued)

    def _issued(self, _event: WakeUp) -> None:
        self.player.at_timeout(self.advance)

    def _timed_done(self) -> None:
        """The op at `pos` ended: `_Player._finish` and `_next`, inline (once per timed op)."""
        p = self.player
        i = self.items[self.pos][0]
        p.end[i] = p.now
        p.finished[i] = True
        if (resumes := p.waiters[i]) is not None:
            p.waiters[i] = None
            p.ready.extend(resumes)
        self.pos += 1
        self.advance()

    def _next(self) -> None:
        self.pos += 1
        self.advance()


class _Lane:
    """A process group's NCCL stream: its collectives one at a time, each once its stream has reached it."""

    __slots__ = ("player", "queue", "pos")

    def __init__(self, player: _Player, queue: list[int]) -> None:
        self.player, self.queue, self.pos = player, queue, 0  # queue: the collectives' ids

    def advance(self) -> None:
        p, queue = self.player, self.queue
        while self.pos < len(queue):
            i = queue[self.pos]
            if not p.arrived[i]:
                p.arrivals[i] = self.advance
                return
            p.start[i] = p.now
            if (dur := p.durations[i]) > 0:
                p._timed(p.ops[i], dur, self._done, True)
                return
            p._finish(i)
            self.pos += 1

    def _done(self) -> None:
        self.player._finish(self.queue[self.pos])
        self.pos += 1
        self.advance()


_NOT_ISSUED = float("inf")  # the issue time of an op the CPU has not reached past a blocking synchronize


class _IssueThread:
    """The CPU issue thread of a graph in which it blocks: an op with `cpu_wait` is issued only after the op it
    waits has ended (`Event.synchronize()`, FSDP1's rate limiter), and every later op after it.

    Issue times are filled in order up to the next such op whose event has not ended; the thread then waits
    for that op to finish, as a stream waits an event, and the streams that reached an op not yet issued
    resume when it is."""

    def __init__(self, player: _Player, ops: list[Op], host: list[float], first: int) -> None:
        self.player, self.ops, self.host, self.next = player, ops, host, first
        self.clock = player.issued[first - 1] if first else 0.0  # when the CPU issued the op before `next`

    def resume(self) -> None:
        p, ops, issued = self.player, self.ops, self.player.issued
        t = self.clock
        while self.next < len(ops):
            wait = ops[self.next].cpu_wait
            if wait >= 0:
                if not p.finished[wait]:
                    p.wait_for(wait, self.resume)
                    break
                t = max(t, p.end[wait])
            t += self.host[self.next]
            issued[self.next] = t
            self.next += 1
        self.clock = t
        p.ready.extend(p.unissued)
        p.unissued.clear()


@dataclass(frozen=True, slots=True)
class QueueLayout:
    """What only the ops' order, kinds, streams, groups, deps and CPU waits decide, so that ops of one
    structure (a sweep's re-sized and re-priced steps: `OpGraph.derived`) share it: each stream's queue, in order of
    first use, of (id, deps, collective?) or the id alone of an alloc or free that waits on nothing; each
    process group's lane of collective ids in issue order; the timed ops; the first op the CPU issues only
    after a synchronize (-1: none)."""

    streams: list[list]
    lanes: list[list[int]]
    timed: list[int]
    first_wait: int


def queue_layout(ops: list[Op]) -> QueueLayout:
    """The `QueueLayout` of `ops` (issue order), in one pass."""
    streams: defaultdict[str, list] = defaultdict(list)
    lanes: defaultdict[str, list[int]] = defaultdict(list)
    timed = []
    first_wait = -1
    for op in ops:
        kind = op.kind
        if kind not in _TIMED:  # most ops, and most wait on none: those are their id alone, no tuple
            streams[op.stream].append((op.id, op.deps, False) if op.deps else op.id)
        else:
            timed.append(op.id)
            collective = kind in _COLLECTIVE
            streams[op.stream].append((op.id, op.deps, collective))
            if collective:
                lanes[op.group].append(op.id)
        if op.cpu_wait >= 0 and first_wait < 0:
            first_wait = op.id
    return QueueLayout(list(streams.values()), list(lanes.values()), timed, first_wait)


def play(ops: list[Op], duration: Callable[[Op], float], *, host_s: Callable[[Op], float] | None = None,
         slowdowns: Slowdowns | None = None, layout: QueueLayout | None = None) -> Timing:
    """Simulate `ops` (issue order); `duration(op)` prices timed ops alone on the GPU (alloc and free take
    no time), `host_s(op)` is the CPU issue thread's cost of a timed op (none if omitted: an alloc or free
    costs the issue thread nothing of its own, as the caching allocator runs inside the launch of the
    kernel that needs the memory), `slowdowns(running)` the factors >= 1 by which each op of `running` runs
    slower beside the others (none if omitted). `layout`: `queue_layout(ops)`, when the caller keeps it."""
    if layout is None:
        layout = queue_layout(ops)
    n = len(ops)
    durations, host = [0.0] * n, [0.0] * n
    for i in layout.timed:  # each timed op priced once
        op = ops[i]
        durations[i] = duration(op)
        if host_s is not None:
            host[i] = host_s(op)
    first_wait = layout.first_wait
    issued = list(accumulate(host))
    if first_wait >= 0:  # issue times past the first synchronize are known only as the step plays
        issued[first_wait:] = [_NOT_ISSUED] * (n - first_wait)
    player = _Player(ops, durations, issued, slowdowns)
    if first_wait >= 0:
        _IssueThread(player, ops, host, first_wait).resume()
    player.draining = True  # every stream, then every lane, starts at time 0 in this order
    player.ready.extend(player.stream(items) for items in layout.streams)
    player.ready.extend(player.lane(items) for items in layout.lanes)
    player.draining = False
    player.kick(lambda: None)
    player.env.run()
    player.device = None  # it holds player.kick: without the cycle, reference counting frees the step
    if not all(player.finished):
        first = next(op for op, done in zip(ops, player.finished) if not done)
        raise RuntimeError(f"deadlock: ops never ran, first {first.name!r}")
    # fromiter: two thirds of np.array's time on a list of floats
    return Timing(*(np.fromiter(times, dtype=np.float64, count=n) for times in (player.start, player.end, issued)))
