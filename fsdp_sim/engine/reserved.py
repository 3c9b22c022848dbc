"""Reserved memory through the training loop: the ledger's requests and frees played on the caching
allocator model (engine/allocator.py), the first step and then steady steps.

The first step differs from the others: an optimizer creates its states lazily, in its first `step()`
(`torch.optim.Adam._init_group`: `state["exp_avg"] = torch.zeros_like(p, ...)` when the state is empty),
so during the first forward and backward they do not exist and they are allocated, on the compute stream,
where the optimizer phase begins: into the cache the first backward left. Segments are never returned
(no `empty_cache` in the loop), so the next steps start from that cache; they are replayed until one
adds no reserved memory (the steady state), up to `MAX_STEPS`.

That is what a GPU with room to spare would reserve. On the scenario's GPU the driver gives the
allocator only what is left (`ReservedModel.capped`): a request it cannot serve makes `malloc` return
the cache's free segments and retry, and only then raise an OOM; there steps are replayed until the
allocator's state at a step's start repeats, when every later step does the same (its retries).

A sweep replays many steps that make the same requests (micro-batch 2 x 1024 tokens allocates as 1 x 2048
does): where no free waits for a recorded stream, no time moves the replay, and `MEMO` remembers each
replay by a digest of what it reads, so such a step costs its key.

Times: a request is made when the CPU issues it (`Timing.issued`), which is when `malloc` runs
`process_events`; a free with `record_stream` waits for the event recorded on that stream at the free,
which completes when the last op that stream had queued by then ends. Step k runs k step times later.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from fsdp_sim.engine.allocator import AllocatorConfig, CachingAllocator, OutOfMemory
from fsdp_sim.engine.placement import same_places
from fsdp_sim.engine.step_plan import MemoryEvents, StepPlan, step_plan

MAX_STEPS = 4  # the first step and up to three more; a step that adds nothing ends the replay early
# A steady step's allocator layout is compared with the previous steady step's at these fractions (1/k) of
# its events: on the 10,000-point llama3-8b grid the step that confirms the steady state matches its
# predecessor after 14-24 % of its events on most points, so it stops there instead of playing the rest
CHECKPOINTS = (8, 4, 2)
# The same under a limit (`replay_capped`): on the capped replays of 600 points of each of the mixed-1k and
# llama3-8b-10k grids, a steady step that repeats the steady step before does so within 1/64 of its
# events on most (llama3-405b-1024xh100's at event 33 of 6,130), at 5-35 % of them on the others
CAPPED_CHECKPOINTS = (64, 8, 2)


@dataclass(frozen=True, slots=True)
class CappedReplay:
    """The steps replayed with the driver limited to `limit_bytes` (what the GPU leaves the allocator)."""

    limit_bytes: int
    oom: bool  # a request failed even after releasing the cache and retrying (`OutOfMemoryError`)
    reserved_bytes: int  # the most reserved at once (`max_memory_reserved`); <= limit_bytes unless oom
    retries_per_step: int  # `num_alloc_retries` in the last step replayed (steady if its state repeated; oom: the failing one)
    retries: int  # `num_alloc_retries` over every step replayed (the first steps may release what later ones reuse)
    steps: int  # steps replayed to the end (the one that ran out of memory not counted)


@dataclass(frozen=True, slots=True)
class Restart:
    """Where a replay under a limit may begin past the first step: the unconstrained replay's state at each
    step's start, when no free waits for a recorded stream and segments do not grow. Then a step ends with
    only the persistent blocks in use and every other range of a segment one free block (free neighbours
    always merge), so that state is the segments made by then (a prefix of the last step's: without a limit
    none is returned) and the persistent blocks, and a capped replay whose steps reserved no more than its
    limit played them alike (`replay_capped`)."""

    starts: list[tuple[int, int, int]]  # at each step's start: (reserved, the next segment's address, segments)
    segments: np.ndarray  # (address, size) of each segment at the end, ascending
    pools: list[tuple[str, bool]]  # each segment's pool (one tuple per pool)
    allocated: np.ndarray  # (address, size) of each persistent buffer's block, ascending


@dataclass(slots=True)
class ReservedModel:
    """What the allocator model predicts for the step."""

    timeline: np.ndarray  # (n+1,) reserved bytes after each ledger event of the last step replayed (row 0: before it)
    reserved_bytes: int  # peak reserved (`torch.cuda.max_memory_reserved`): reserved after the last step
    first_step_allocated_bytes: int  # peak allocated of the first step (no optimizer states until its optimizer phase)
    first_step_row: int  # the ledger row of that peak (0: before the step; an optimizer state creation: its phase's first event)
    first_step_reserved_bytes: int  # reserved at the end of the first step
    releasable_bytes: int  # what `torch.cuda.empty_cache()` would return after the step
    by_stream: dict[str, int]  # reserved per stream (its small and large pools)
    steps: int  # steps replayed until reserved stopped growing (MAX_STEPS: it still grew)
    plan_of: Callable[[], StepPlan] = field(repr=False)  # the events as the allocator plays them, built when asked
    _capped: dict[int, CappedReplay] = field(default_factory=dict, repr=False)  # by limit; shared by a memo's hits
    _plan: StepPlan | None = field(default=None, repr=False)
    restart: Restart | None = field(default=None, repr=False)  # where a capped replay may begin (None: at the start)

    @property
    def plan(self) -> StepPlan:
        if self._plan is None:
            self._plan = self.plan_of()
        return self._plan

    def capped(self, limit: int) -> CappedReplay:
        """The same steps when the driver can give the allocator only `limit` bytes (remembered)."""
        if limit not in self._capped:
            self._capped[limit] = replay_capped(self.plan, limit, self.restart)
        return self._capped[limit]


class _Memo:
    """The replays of this process by what the allocator sees (`replay_allocator`'s key), least recently
    used first, within a budget of timeline bytes: a sweep's points that make the same requests in the
    same order (the same structure at the same tokens per micro-batch: micro-batch 2 x 1024 and 1 x 2048)
    replay alike. A hit shares the figures, the read-only timeline and the capped replays."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget, self.used = budget_bytes, 0
        self.entries: OrderedDict[bytes, ReservedModel] = OrderedDict()
        self.lock = threading.Lock()  # a Dask worker may run points in threads

    def get(self, key: bytes) -> ReservedModel | None:
        with self.lock:
            model = self.entries.get(key)
            if model is not None:
                self.entries.move_to_end(key)
            return model

    def put(self, key: bytes, model: ReservedModel) -> None:
        model.timeline.flags.writeable = False  # shared by every hit
        with self.lock:
            if key not in self.entries:
                # the plan stays with its step, and the restart (a hit's capped replays, seldom under
                # another limit than the first's, which are remembered, play from the start)
                self.entries[key] = replace(model, plan_of=_no_plan, _plan=None, restart=None)
                self.used += model.timeline.nbytes
            while self.used > self.budget:
                self.used -= self.entries.popitem(last=False)[1].timeline.nbytes

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.used = 0


def _no_plan() -> StepPlan:
    raise AssertionError("a remembered replay is only read through a copy that builds its own plan")


# 64 MiB of timelines: ~5,000 llama3-8b steps (1,500 events of 8 B), ~1,300 of a 126-layer llama3-405b
MEMO = _Memo(64 << 20)


def _start(plan: StepPlan, alloc: CachingAllocator) -> dict:
    """The persistent buffers (the optimizer states aside), allocated before the first step."""
    return {i: alloc.malloc(n, "compute") for i, n in plan.persistent}


def _step(plan: StepPlan, alloc: CachingAllocator, kept: dict, step: int, record: bool, *, mark: bool = False,
          before: dict | None = None, fixed: frozenset = frozenset(),
          checkpoints: tuple | None = None) -> tuple[list[int] | None, dict, bool]:
    """Play step `step` (the first creates the optimizer states, into `kept`); with `record`, reserved
    before and after each event. Returns that record, with `mark` the step's layouts at the `checkpoints`
    (CHECKPOINTS unless given; each with the allocator's retries so far), and whether it stopped early:
    with `before` (the previous steady step's layouts), at the first checkpoint where the layout is the
    same (`_same`), since from there the step replays the one before, so it adds nothing and ends as it
    began (the record is constant from there). The persistent buffers are never freed in a step: they
    stay out of the step's `blocks`, so a layout compares what the step changes. The pools `fixed`
    (`_replay`'s) are left out of the layouts' comparison, and of the step unless it is recorded:
    replayed or not, they are where they were in the step before."""
    offset = step * plan.period
    reserved = [alloc.reserved] if record else None
    events, n = plan.events, len(plan.events)
    first = step == 0
    if first:  # where the optimizer states are created
        cuts = [plan.lazy_at] if plan.lazy else []
    elif mark or before is not None:  # where layouts are taken
        cuts = sorted({n // k for k in (CHECKPOINTS if checkpoints is None else checkpoints)} - {0, n})
    else:
        cuts = []
    blocks: dict = {}
    marks: dict = {}
    done = 0
    skip = fixed if reserved is None else frozenset()
    for cut in cuts:
        alloc.play(_outside(events[done:cut], skip), offset, blocks, reserved)
        done = cut
        if first:  # the first optimizer step creates the states
            for i, nbytes in plan.lazy:
                kept[i] = alloc.malloc(nbytes, "compute", plan.lazy_now)
            continue
        layout = alloc.layout(blocks, offset)
        marks[cut] = layout, alloc.retries
        if before is not None and cut in before and _same(before[cut][0], layout, fixed, alloc):
            if reserved is not None:
                reserved.extend([alloc.reserved] * (n - cut))
            return reserved, marks, True
    alloc.play(_outside(events[done:], skip), offset, blocks, reserved)
    for block in blocks.values():  # alive past the step's end: freed before the next
        alloc.free(block)
    return reserved, marks, False


def _outside(events: list, fixed: frozenset) -> list:
    """The events of pools other than `fixed` (a free's pool is its request's: `StepPlan.events`)."""
    return [e for e in events if e[3] not in fixed] if fixed else events


def _same(before: tuple, layout: tuple, fixed: frozenset, alloc: CachingAllocator) -> bool:
    """Whether two layouts of `alloc` (`CachingAllocator.layout`) are the same outside the pools `fixed`
    (the segment a block lies in says its pool); under a limit, whether they place everything alike
    (placement.py `same_places`: `fixed` is empty there, as nothing is left out)."""
    if alloc.limit is not None:
        return same_places(before, layout)
    if before[0] != layout[0]:
        return False
    if not fixed:
        return before[1] == layout[1]
    starts = [seg.address for seg in alloc.segments]
    pools = [(seg.stream, seg.small) for seg in alloc.segments]
    outside = [[e for e in live if pools[bisect_right(starts, e[1]) - 1] not in fixed] for live in (before[1], layout[1])]
    return outside[0] == outside[1]


def _held(alloc: CachingAllocator) -> dict:
    """Reserved bytes in each pool."""
    held: dict = {}
    for seg in alloc.segments:
        held[seg.stream, seg.small] = held.get((seg.stream, seg.small), 0) + seg.size
    return held


def replay_allocator(ops, events: MemoryEvents, persistent, issued: np.ndarray, end: np.ndarray,
                     config: AllocatorConfig = AllocatorConfig(), *, timeless: bool = False) -> ReservedModel:
    """Play `events` (the ledger's, in issue order) on the allocator model, the first step with lazily
    created optimizer states, then steady steps (see the module).

    A steady step that stops early at a checkpoint (`_step`) ends as the step before it ended, so what is
    read off the last step (what empty_cache would return) is read at the end of the one before. Only
    without `record_stream` frees: with them a step's end leaves events pending that the final
    synchronize would complete.

    `timeless`: no free waits for a recorded stream, so no time moves the allocator; then what it sees
    (each event's buffer, bytes, stream and op, the persistent buffers, where the optimizer phase starts
    and the options) keys `MEMO`."""
    plan_of = partial(step_plan, ops, events, persistent, issued, end, config, timeless)
    key = None
    if timeless:
        key = _memo_key(events.optimizer_from, persistent, config, events)
        known = MEMO.get(key)
        if known is not None:
            return replace(known, plan_of=plan_of)
    model = _replay(plan_of())
    if key is not None:
        MEMO.put(key, model)
    return model


def _memo_key(optimizer_from: int | None, persistent, config: AllocatorConfig, events: MemoryEvents) -> bytes:
    """A digest of everything a replay reads when no time moves it: the options, the persistent buffers
    (the optimizer states among them created where the optimizer phase starts), and each event's buffer,
    bytes, kind, stream and op (which places the optimizer phase among them). 32 bytes of BLAKE2b, so a
    remembered step costs its figures and timeline, not its event list. The last key is kept with what it
    digests: a re-priced step (schedule/build.py) shares its events and persistent buffers."""
    of = (events, persistent, len(persistent), optimizer_from, config)
    last = getattr(_last_key, "entry", None)
    if last is not None and last[0][0] is events and last[0][1] is persistent and last[0][2:] == of[2:]:
        return last[1]
    key = _digest(optimizer_from, persistent, config, events)
    _last_key.entry = of, key
    return key


_last_key = threading.local()  # this thread's last memo key: (what it digests, the key)


def _digest(optimizer_from: int | None, persistent, config: AllocatorConfig, events: MemoryEvents) -> bytes:
    h = _order_digest(events).copy()
    h.update(repr((config, optimizer_from, [(b.id, b.nbytes, b.category) for b in persistent])).encode())
    h.update(events.deltas.tobytes())
    return h.digest()


def _order_digest(events: MemoryEvents):
    """The digest of what a re-sized step shares with the one it was made from (each event's buffer, kind,
    op and stream: the ledger's columns derived once per build), kept for the last columns digested."""
    of = (events.buffers, events.allocs, events.op_ids, events.streams)
    last = getattr(_last_order, "entry", None)
    if last is not None and all(a is b for a, b in zip(of, last[0])):
        return last[1]
    h = hashlib.blake2b()
    for part in of[:3]:
        h.update(part.tobytes())
    h.update("\0".join(events.streams).encode())
    _last_order.entry = of, h
    return h


_last_order = threading.local()  # this thread's last `_order_digest`: (what it digests, the hash so far)


def _replay(plan: StepPlan) -> ReservedModel:
    """`replay_allocator`'s steps on `plan`."""
    alloc = CachingAllocator(plan.config)
    kept = _start(plan, alloc)
    early = not plan.waits
    steps, before, first_reserved, timeline, marks, releasable, converged = 0, -1, 0, None, None, None, False
    starts, held, fixed = [], None, frozenset()
    while steps < MAX_STEPS and alloc.reserved != before:
        before = alloc.reserved
        starts.append((before, alloc.next_address, len(alloc.segments)))
        if early and steps:
            # a pool whose segments the steady step before left as they were starts this one as it started
            # that one (a step ends with only the persistent blocks in use, every gap one free block): its
            # requests and frees, which meet no other pool's without a limit, replay that step's alike
            held, last = _held(alloc), held
            fixed = frozenset(k for k, n in held.items() if last is not None and last.get(k) == n)
        # only the last possible step needs reserved event by event: an earlier one is the last replayed
        # only if it added nothing, when reserved stayed `before` throughout
        record = steps == MAX_STEPS - 1
        timeline, layouts, converged = _step(plan, alloc, kept, steps, record, mark=early and 0 < steps < MAX_STEPS - 1,
                                             before=marks, fixed=fixed)
        if steps == 0:
            first_reserved = alloc.reserved
        steps += 1
        if converged:
            break
        if early and steps > 1:  # a steady step: the next may stop early against it
            marks, releasable = layouts, alloc.releasable()
    if timeline is None:
        timeline = [before] * (len(plan.events) + 1)
    if not converged:
        alloc.synchronize()
        releasable = alloc.releasable()
    by_stream: dict[str, int] = {}
    for seg in alloc.segments:
        by_stream[seg.stream] = by_stream.get(seg.stream, 0) + seg.size
    reserved = alloc.reserved
    restart = None
    if early and not plan.config.expandable_segments:
        pools: dict = {}
        restart = Restart(starts, np.array([(s.address, s.size) for s in alloc.segments], dtype=np.int64).reshape(-1, 2),
                          [pools.setdefault((s.stream, s.small), (s.stream, s.small)) for s in alloc.segments],
                          np.array(sorted((b.address, b.size) for b in kept.values()), dtype=np.int64).reshape(-1, 2))
    alloc.close()
    first_peak, first_row = _first_step_peak(plan)
    return ReservedModel(np.fromiter(timeline, dtype=np.int64, count=len(timeline)), reserved, first_peak, first_row, first_reserved,
                         releasable, by_stream, steps, lambda: plan, _plan=plan, restart=restart)


def _first_step_peak(plan: StepPlan) -> tuple[int, int]:
    """Peak allocated of the first step and its row: the optimizer states count from their creation."""
    allocated = np.empty(len(plan.events) + 1, dtype=np.int64)
    allocated[0] = sum(n for _, n in plan.persistent)
    np.cumsum(plan.deltas, out=allocated[1:])
    allocated[1:] += allocated[0]
    allocated[plan.lazy_at + 1:] += sum(n for _, n in plan.lazy)
    row = int(np.argmax(allocated))
    return int(allocated[row]), row


def replay_capped(plan: StepPlan, limit: int, restart: Restart | None = None) -> CappedReplay:
    """The steps of `plan` with the driver limited to `limit` bytes, until the state at a step's start
    repeats (events all complete at a step's end first: the next step's first request would run them).

    With `restart` (the unconstrained replay's), the steps that reserved no more than `limit` there are
    not played again: the first step that starts within it and is not the first begins from its state.
    They would play alike (a request that never passes the limit never meets it), and none of them
    repeated its start (a step that adds no segment ends the unconstrained replay).

    A steady step whose layout at a checkpoint (CAPPED_CHECKPOINTS) places everything as the steady step
    before did at the same event (placement.py `same_places`) stops there (`_step`): its rest replays that
    step's, so it runs out of memory nowhere, retries as often as that step did from there, reserves no
    value that step did not reach (the peak is a maximum of them), and ends as that step ended, which
    ends the replay after it (or MAX_STEPS does). Only where no free waits for a recorded stream: a
    layout leaves pending frees out, and the same times shifted by another step's offset may round
    differently against the requests'."""
    alloc = CachingAllocator(plan.config, limit=limit)
    steps, retries, seen = 0, 0, None
    early = not plan.waits
    marks, ended, rest = None, 0, 0  # the steady step before's layouts and retries at its end; retries not played
    try:
        known = [k for k, start in enumerate(restart.starts) if k and start[0] <= limit] if restart else []
        if known:  # reserved only grows: the last such step
            steps = known[-1]
            _, address, count = restart.starts[steps]
            alloc.restore(zip(*restart.segments[:count].T.tolist(), restart.pools[:count]), restart.allocated.tolist(), address)
            kept, seen = {}, alloc.state()  # a steady step never touches `kept`
        else:
            kept = _start(plan, alloc)
        while steps < MAX_STEPS:
            retries = alloc.retries
            checked = early and steps > 0  # a steady step: its layouts compare with the next one's
            _, layouts, repeats = _step(plan, alloc, kept, steps, False, mark=checked and steps < MAX_STEPS - 1,
                                        before=marks, checkpoints=CAPPED_CHECKPOINTS)
            steps += 1
            if repeats:  # from the last layout on, the step before's retries
                rest = ended - marks[next(reversed(layouts))][1]
                break
            alloc.synchronize()
            state = alloc.state()  # the first step's start (no optimizer states) is never compared
            if state == seen:
                break
            seen = state
            if checked:
                marks, ended = layouts, alloc.retries
    except OutOfMemory:
        return CappedReplay(limit, True, alloc.peak, alloc.retries - retries, alloc.retries, steps)
    finally:
        alloc.close()
    return CappedReplay(limit, False, alloc.peak, alloc.retries - retries + rest, alloc.retries + rest, steps)
