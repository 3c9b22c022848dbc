"""Play every rank of an SPMD step at once: one op graph, each rank at its own rate, in numpy.

FSDP is SPMD: every rank issues the same ops on the same streams and meets the same collectives, and ranks
differ only in how fast their kernels run. So the step is played once on SimPy (`play`, the representative
rank, where interference between overlapping kernels and collectives is priced), and every rank is then
replayed from that play in CPU issue order, each op an array over the ranks, by the rules `play` follows:
an op starts when its stream is done with the op before it, every op it waits on has ended and the CPU has
issued it; a collective starts once every rank of its process group has reached it and its group's lane is
done with the collective before (NCCL runs a group's collectives in issue order), and holds its stream
until it ends. Issue order is a topological order of all of these (a stream's, a lane's and every event's
earlier op comes first), so one pass suffices, and the work is a few numpy operations per op whatever the
number of ranks: Llama 3 405B's 7,551 ops over 1,024 ranks replay in a fraction of a second.

An op's duration on a rank is its duration in the play, which includes what running beside a collective
cost it there, plus `work` (its seconds alone that scale with the rank's rate) times the rank's
`slowness` (1 / rate - 1). Where ranks drift apart in time that interference is kept as the representative
rank met it, not re-priced per rank: a second-order term beside the drift itself (a rank 10 % slow shifts
a kernel by 10 % of its time; the overlap it then meets changes its time by that shift times the
slowdown, a few percent of it). It lives here, not in results/, because it plays the graph in time by the
engine's own rules (streams, events, lanes, the CPU's issue thread); what the step's figures are is results'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdp_sim.engine.simulator import Timing
from fsdp_sim.schedule.ops import COLLECTIVES, TIMED_KINDS

_TIMED = frozenset(TIMED_KINDS)
_COLLECTIVE = frozenset(COLLECTIVES)


@dataclass(slots=True)
class RankTiming:
    """What every rank did: per rank (arrays over ranks) its step time (its last op's end), the seconds by
    which it, arriving last, held its groups' collectives back past the second-last arrival, and at how many
    collectives it did so; per collective that some rank held back, (op id, the rank with the longest lead
    over its group's second-last, that lead); the start and end of the `keep` ops (rows) on every rank
    (columns), and for the kept collectives (rows, in `keep`'s order) the time each rank was ready to start
    it (its stream, lane, events and CPU done: from then until its start it waits for its group's last
    rank); and the full `Timing` of each traced rank."""

    end: np.ndarray
    held_back_s: np.ndarray
    held_back_count: np.ndarray
    delays: list[tuple[int, int, float]]
    kept_start: np.ndarray
    kept_end: np.ndarray
    kept_ready: np.ndarray
    traced: dict[int, Timing]


def _held_back(ready: np.ndarray, shape: tuple[int, int, int], held: np.ndarray,
               count: np.ndarray) -> tuple[np.ndarray, int, float]:
    """The time each group's collective can start (the last arrival, for every rank), crediting the last
    arrival's lead over the second-last to that rank (the lowest rank of those tied: deterministic); and
    of all the groups, the rank with the longest lead and that lead (-1, 0.0: nobody led)."""
    outer, size, inner = shape
    a = ready.reshape(outer, size, inner)
    last = a.argmax(axis=1)  # (outer, inner)
    o, i = np.indices(last.shape)
    top = a[o, last, i]
    others = a.copy()
    others[o, last, i] = -np.inf
    lead = top - others.max(axis=1)
    late = lead > 0
    worst, longest = -1, 0.0
    if late.any():
        ranks = (o * size + last) * inner + i
        np.add.at(held, ranks[late], lead[late])
        np.add.at(count, ranks[late], 1)
        k = np.unravel_index(np.argmax(lead), lead.shape)
        worst, longest = int(ranks[k]), float(lead[k])
    return np.broadcast_to(top[:, None, :], a.shape).reshape(-1), worst, longest


def play_ranks(ops: list, timing: Timing, *, host_s: np.ndarray, work_s: np.ndarray, slowness: np.ndarray,
               groups: dict[str, tuple[int, int, int]], keep: np.ndarray, traced: tuple[int, ...] = ()) -> RankTiming:
    """Replay `ops` (issue order), played once as `timing`, on every rank: `slowness[r]` = 1 / rate - 1 of
    rank r, `work_s[i]` op i's seconds alone that scale with the rate, `host_s[i]` its CPU issue cost (for
    the issue thread of a graph in which the CPU synchronises, `Op.cpu_wait`), `groups` each process group's
    members as (outer, size, inner) (`schedule/tp.rank_groups`), `keep` the op ids whose per-rank times are
    returned, `traced` the ranks whose every op's times are."""
    n_ranks = len(slowness)
    r_start, r_end, r_issued = (t.tolist() for t in (timing.start, timing.end, timing.issued))
    last_use: dict[int, int] = {}  # op id -> the last op waiting on it (an event or the CPU)
    for op in ops:
        for d in op.deps + ((op.cpu_wait,) if op.cpu_wait >= 0 else ()):
            last_use[d] = op.id
    needed = set(last_use)
    release: dict[int, list[int]] = {}  # op id -> the ends no op after it reads: dropped once it is played
    for d, i in last_use.items():
        release.setdefault(i, []).append(d)
    ends: dict[int, np.ndarray] = {}  # op id -> its end on every rank, for the ops something waits on
    zero = np.zeros(n_ranks)
    free: dict[str, np.ndarray] = {}  # stream -> when every rank's stream is done with its last op
    issued_last: dict[str, float | np.ndarray] = {}  # stream -> the issue time of its last op (skipped ops)
    lanes: dict[str, np.ndarray] = {}  # process group -> when its last collective ended
    held, count = np.zeros(n_ranks), np.zeros(n_ranks, dtype=np.int64)
    delays: list[tuple[int, int, float]] = []
    row = {int(i): k for k, i in enumerate(keep)}
    kept_start, kept_end = np.empty((len(keep), n_ranks)), np.empty((len(keep), n_ranks))
    ready_row = {i: k for k, i in enumerate(i for i in row if ops[i].kind in _COLLECTIVE)}
    kept_ready = np.empty((len(ready_row), n_ranks))
    t_idx = np.array(traced, dtype=np.intp)
    t_start, t_end = np.empty((len(ops), len(traced))), np.empty((len(ops), len(traced)))
    t_issued = np.empty((len(ops), len(traced)))
    clock = None  # the CPU's issue clock on every rank, once it has synchronised (else the played issue times)
    for op in ops:
        i, stream = op.id, op.stream
        if op.cpu_wait >= 0 or clock is not None:  # the issue thread as engine/simulator._IssueThread runs it
            if clock is None:
                clock = r_issued[i - 1] if i else 0.0
            if op.cpu_wait >= 0:
                clock = np.maximum(clock, ends[op.cpu_wait])
            clock = clock + host_s[i]
            issued = clock
        else:
            issued = r_issued[i]
        if len(traced):
            t_issued[i] = issued if np.isscalar(issued) else issued[t_idx]
        timed = op.kind in _TIMED
        if not timed and not op.deps and i not in needed:
            # an alloc or free waiting on nothing, that nothing waits on: it only moves its stream to its
            # issue time, which the stream's next op (issued no earlier) or the step's end takes up
            issued_last[stream] = issued
            if len(traced):
                t_start[i] = t_end[i] = np.maximum(free.get(stream, zero)[t_idx], t_issued[i])
            for d in release.get(i, ()):  # the event its CPU waited on
                del ends[d]
            continue
        start = free.get(stream, zero)
        for d in op.deps:
            start = np.maximum(start, ends[d])
        start = np.maximum(start, issued)
        if op.kind in _COLLECTIVE:
            lane = lanes.get(op.group)
            ready = start if lane is None else np.maximum(start, lane)
            if groups[op.group][1] > 1:
                start, worst, longest = _held_back(ready, groups[op.group], held, count)
                if worst >= 0:
                    delays.append((i, worst, longest))
            else:
                start = ready
            if i in ready_row:
                kept_ready[ready_row[i]] = ready
            end = r_end[i] + (start - r_start[i])
            lanes[op.group] = end
        elif timed:
            end = r_end[i] + (start - r_start[i])
            if work_s[i] > 0:
                end = end + work_s[i] * slowness
        else:
            end = start
        free[stream] = end
        issued_last.pop(stream, None)
        if i in needed:
            ends[i] = end
        if i in row:
            kept_start[row[i]], kept_end[row[i]] = start, end
        if len(traced):
            t_start[i], t_end[i] = start[t_idx], end[t_idx]
        for d in release.get(i, ()):
            del ends[d]
    step = zero
    for stream, done in free.items():
        step = np.maximum(step, done)
    for last in issued_last.values():
        step = np.maximum(step, last)
    timings = {r: Timing(t_start[:, k].copy(), t_end[:, k].copy(), t_issued[:, k].copy()) for k, r in enumerate(traced)}
    return RankTiming(step, held, count, delays, kept_start, kept_end, kept_ready, timings)
