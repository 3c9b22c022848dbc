"""The device of the engine's player (simulator.py): timed ops run concurrently, each at its own speed over
the slowdown that what else runs causes it (processor sharing), and the light SimPy event that wakes the
player.

Ops that run beside a collective may slow each other (an NCCL kernel holds SMs and HBM bandwidth; two
collectives share a link): `slowdowns(running)` says by how much, for every running op at once (it is not
asked when no collective runs), and the device advances every running op at its rate,
recomputed only when the set of running ops changes (processor sharing), so a contended op costs one
wake-up per change instead of a fixed timeout. The SimPy environment owns event order: (time, priority,
sequence number), deterministic.
"""

from __future__ import annotations

from collections.abc import Callable

from simpy.events import NORMAL

from fsdp_sim.schedule.ops import Op

Slowdowns = Callable[[list[Op]], list[float]]


class WakeUp:
    """A wake-up of the player: what SimPy's `step` reads of an event (its callbacks, that it succeeded) and
    nothing else. It is scheduled as a `Timeout` schedules itself (`env.schedule(event, NORMAL, delay)`), so it
    takes the same (time, priority, sequence number) and the event order is unchanged, without `Timeout`'s
    constructor (its checks, its environment, value and delay kept for a description nobody asks for): the
    player makes one per device completion and per issue-time wait."""

    __slots__ = ("callbacks",)
    _ok = True

    def __init__(self, callback: Callable[[WakeUp], None]) -> None:
        self.callbacks = [callback]


class Device:
    """Runs timed ops concurrently, each at 1 / slowdown of its own speed given what else runs."""

    __slots__ = ("player", "env", "slowdowns", "kick", "running", "last", "wake", "wake_at", "wake_op", "unmade",
                 "collectives", "contended", "rerate_due")

    def __init__(self, player, slowdowns: Slowdowns) -> None:
        """`player`: simulator.py's, whose clock (`now`) the device reads and moves at its wake-ups, whose
        environment it schedules them in and whose `kick` resumes an op's stream or lane when it ends (not
        imported here: the player imports the device)."""
        self.player, self.env, self.slowdowns, self.kick = player, player.env, slowdowns, player.kick
        # op id -> [op, remaining uncontended seconds, slowdown, then, collective?]
        self.running: dict[int, list] = {}
        self.last = 0.0
        self.wake: WakeUp | None = None  # the pending wake-up: any other that fires is stale
        self.wake_at, self.wake_op = float("inf"), -1  # when it fires, and which op it completes
        self.unmade: float | None = None  # the delay of a wake-up decided but not yet made a timeout (`flush`)
        self.collectives = 0  # running collectives: without one nothing contends
        self.contended = False  # some running op's slowdown is not 1
        self.rerate_due = False  # the running set changed while contended: rates are recomputed at `flush`

    def run(self, op: Op, work: float, then: Callable[[], None], collective: bool) -> None:
        """Start op (a collective or not: its lane or stream knows) with `work` uncontended seconds; `then()`
        is queued when it completes."""
        now = self.player.now
        running = self.running
        if now > self.last:
            self._advance(now)
        running[op.id] = [op, work, 1.0, then, collective]
        if collective:
            self.collectives += 1
        if self.collectives or self.contended:
            self.rerate_due = True
        elif self.wake_op not in running or now + work < self.wake_at:  # uncontended: only whether this op ends first matters
            self.wake_at, self.wake_op, self.unmade = now + work, op.id, work  # `_schedule`, inline: work > 0

    def _advance(self, now: float) -> None:
        """Progress every running op to `now` (later than the last advance) at its rate."""
        dt = now - self.last
        for r in self.running.values():
            r[1] -= dt / r[2]
        self.last = now

    def _rerate(self, now: float) -> None:
        running = self.running
        changed = False
        soonest, first = float("inf"), -1  # the op that ends first at the new rates (the first of a tie)
        if self.collectives and len(running) > 1:
            entries = list(running.values())
            ops = [r[0] for r in entries]
            for r, op, factor in zip(entries, ops, self.slowdowns(ops)):
                if factor != r[2]:
                    r[2], changed = factor, True
                if (left := r[1] * factor) < soonest:
                    soonest, first = left, op.id
            self.contended = True
        else:
            if self.contended:  # the last collective ended: everything runs at its own speed again
                for r in running.values():
                    if r[2] != 1.0:
                        r[2], changed = 1.0, True
                self.contended = False
            for i, r in running.items():
                if (left := r[1] * r[2]) < soonest:
                    soonest, first = left, i
        if first < 0:
            return
        if not changed and self.wake_op in running and now + soonest >= self.wake_at:
            return  # no rate moved and nothing ends sooner: the pending wake-up still holds
        self._schedule(now, soonest, first)

    def _schedule(self, now: float, delay: float, first: int) -> None:
        """Wake up after `delay` to complete op `first`; any earlier pending wake-up goes stale."""
        if delay < 0.0:  # as max(delay, 0.0), without the call
            delay = 0.0
        self.wake_at, self.wake_op = now + delay, first
        self.unmade = delay

    def flush(self) -> None:
        """Recompute the rates if the running set changed, and make the decided wake-up a SimPy timeout. The
        player calls this before any other timeout is made and before control returns to SimPy, so the
        timeout gets the place in SimPy's order it would have had if made at `_schedule`; a wake-up replaced
        within one callback (a quarter of them) is never made, and an op that ends and the one its stream
        starts next, at the same time, cost one recomputation of the rates, not two (no time passes between
        them, so no op progressed at the rates in between)."""
        if self.rerate_due:
            self.rerate_due = False
            self._rerate(self.player.now)
        if self.unmade is not None:
            self.wake = wake = WakeUp(self._wake)
            self.env.schedule(wake, NORMAL, self.unmade)
            self.unmade = None

    def _wake(self, event: WakeUp) -> None:
        if event is not self.wake:
            return  # the running set changed since this wake-up was scheduled
        running = self.running
        self.player.now = now = self.env.now
        first = self.wake_op
        if len(running) == 1:  # the common case: `first` ran alone and the device is idle now
            self.last = now
            _, _, _, then, collective = running.pop(first)
            if collective:
                self.collectives -= 1
            self.contended = False  # what _rerate does with nothing running
            self.kick(then)
            return
        done = []  # `first` and every op it ties with: progressed to now (`_advance`, inline), nothing left
        if now > self.last:
            dt = now - self.last
            for i, r in running.items():
                r[1] -= dt / r[2]
                if i == first or r[1] * r[2] <= 1e-15:
                    done.append(i)
            self.last = now
        else:
            done = [i for i, r in running.items() if i == first or r[1] * r[2] <= 1e-15]
        thens = []
        for i in done:
            _, _, _, then, collective = running.pop(i)
            if collective:
                self.collectives -= 1
            thens.append(then)
        self.rerate_due = True
        for then in thens:
            self.kick(then)
