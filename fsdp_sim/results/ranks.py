"""A step played on every rank (`fsdp-sim run --per-rank`): per-rank figures and who held the step back.

The step's time is its slowest rank's. Per rank: its own step time (its last op's end) and where it went
(`RankActivity`): its compute stream's kernels, its exposed communication (some collective runs, no kernel
does, as `StepResult` counts it for the representative rank), its stall (no kernel, no transfer, some
collective waiting for its group's last rank) and the rest. A collective waits for the group's last rank
mostly beside the rank's own compute (FSDP prefetches): only the stall costs the rank time, so the wait is
reported split in two, never as one figure beside the step. One answer per question: the summary's and the
JSON's compute and communication sections are these figures' mean over the ranks (`compute`,
`communication`), the bytes every rank's. Attribution: at each collective of a group of more than one rank, the last rank to
arrive held the group back by its lead over the second-last (had it arrived with the second-last, the
collective would have started that much sooner); summed over the step's collectives, that is what the rank
cost the step ("rank 17 cost the step 41 ms"). A rank slower than every other all through the step is last
at every collective, and its leads add up to its whole delay; where ranks spread alike, the leads are
small and spread over many ranks. The memory figures and the trace's memory counters are the
representative rank's at the mean speed: memory does not depend on speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fsdp_sim.engine.ranks import RankTiming
from fsdp_sim.results.analysis import StepResult, _stream_order

# the ranks whose cost is measured, by replaying the step with each at the mean speed: those that held their
# groups back longest (a replay is a fraction of a second at 1,024 ranks; three name a straggler and the
# runners-up that would pace the step without it)
ATTRIBUTED_RANKS = 3
# a trace shows every rank of a mesh up to this size: two nodes of 8, a process each, still one screen in Perfetto
TRACE_EVERY_RANK = 16
_COLUMNS = 2048  # ranks per block of the exposure's sort: bounds its temporaries (16 B x ops x this)


def _union_length(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Per column, the length of the union of the intervals [starts[i], ends[i]] of that column (empty ones
    add nothing): sorted by start, each adds what it reaches past the furthest end before it."""
    order = np.argsort(starts, axis=0, kind="stable")
    return _sorted_union(np.take_along_axis(starts, order, 0), np.take_along_axis(ends, order, 0))


def _sorted_union(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """`_union_length` of intervals already sorted by start in each column."""
    reach = np.maximum.accumulate(e, axis=0)
    before = np.vstack([np.full((1, s.shape[1]), -np.inf), reach[:-1]])
    return np.clip(reach - np.maximum(s, before), 0.0, None).sum(axis=0)


def _rows(order: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """`order` (row ids, sorted per column) less the rows `keep` (a mask over row ids) drops; every column
    holds the same rows, so as many survive in each, still sorted."""
    chosen = keep[order]
    return order.T[chosen.T].reshape(order.shape[1], -1).T


@dataclass(frozen=True, slots=True)
class RankActivity:
    """Per rank (arrays over ranks) where its step went. `busy_s`: its compute stream's kernels;
    `exposed_s`: some collective runs, no kernel does (as `StepResult.communication` counts it), by kind in
    `exposed_by_kind_s`; `stalled_s`: no kernel and no collective runs while some collective of the rank
    waits for its group's last rank; `busy_s + exposed_s + stalled_s` never passes the rank's step, and the
    rest is other idle (the CPU, copies). `waiting_s`: some collective waits for its group's last rank,
    `stalled_s` of it with the compute stream idle, the rest beside kernels or transfers (prefetched);
    `active_s`: some collective runs."""

    busy_s: np.ndarray
    exposed_s: np.ndarray
    exposed_by_kind_s: dict[str, np.ndarray]
    stalled_s: np.ndarray
    waiting_s: np.ndarray
    active_s: np.ndarray


def rank_activity(start: np.ndarray, end: np.ndarray, ready: np.ndarray, kernels: int,
                  kinds: list[str]) -> RankActivity:
    """`RankActivity` from the kept ops' per-rank times (`RankTiming.kept_*`): rows the compute stream's
    `kernels` kernels, then the collectives, whose kinds are `kinds` and when each rank was ready to start
    them `ready`. Two sorts a block of ranks: by start, and by start with each collective's from when the
    rank was ready; every union of a subset of rows is read off those orders."""
    n_rows, n = start.shape
    is_comm = np.arange(n_rows) >= kernels
    kind = np.array([""] * kernels + list(kinds))
    of_kind = {k: ~is_comm | (kind == k) for k in dict.fromkeys(kinds)}
    busy = np.clip(end[:kernels] - start[:kernels], 0.0, None).sum(axis=0)
    out = {k: np.empty(n) for k in ("all", "active", "from_ready", "waiting", *of_kind)}
    for c in range(0, n, _COLUMNS):
        b = slice(c, c + _COLUMNS)
        s, e = start[:, b], end[:, b]
        order = np.argsort(s, axis=0, kind="stable")

        def union(rows: np.ndarray, s=s, e=e) -> np.ndarray:
            return _sorted_union(np.take_along_axis(s, rows, 0), np.take_along_axis(e, rows, 0))

        out["all"][b] = union(order)
        out["active"][b] = union(_rows(order, is_comm))
        for k, keep in of_kind.items():
            out[k][b] = union(_rows(order, keep))
        early = s.copy()
        early[kernels:] = ready[:, b]  # a collective from when the rank was ready: its wait, then its run
        order = np.argsort(early, axis=0, kind="stable")
        out["from_ready"][b] = union(order, early)
        waits = _rows(order, is_comm)
        out["waiting"][b] = _sorted_union(np.take_along_axis(early, waits, 0), np.take_along_axis(s, waits, 0))
    clip = lambda x: np.clip(x, 0.0, None)  # noqa: E731
    return RankActivity(busy, clip(out["all"] - busy), {k: clip(out[k] - busy) for k in of_kind},
                        clip(out["from_ready"] - out["all"]), out["waiting"], out["active"])


def kept_ops(result: StepResult) -> tuple[np.ndarray, int]:
    """The op ids whose per-rank times the exposure reads: the compute stream's kernels, then every
    collective; and how many kernels lead."""
    _, kernels, collectives, *_ = result.graph.derived("stream order", lambda: _stream_order(result.graph.ops))
    return np.concatenate([kernels, collectives]), len(kernels)


@dataclass(slots=True)
class PerRankResult(StepResult):
    """`StepResult` of the representative rank played at the mean speed (`graph`, `timing`, `memory`), with
    every rank replayed (`ranks`, engine/ranks.py) at `speeds`: the step time is the slowest rank's, the
    compute and communication figures the ranks' mean (`activity`), the memory the representative rank's."""

    ranks: RankTiming | None = None
    speeds: np.ndarray | None = None
    kernels: int = 0  # the leading rows of `ranks.kept_*` that are compute-stream kernels
    costs: dict[int, float] = field(default_factory=dict)  # rank -> the step less the step with it at the mean speed
    _ranks_activity: RankActivity | None = field(default=None, init=False, repr=False)

    @property
    def step_time_s(self) -> float:
        return float(self.ranks.end.max())

    def pace_factor(self) -> float:
        return 1.0  # every rank at its own speed: the representative rank is not paced

    def activity(self) -> RankActivity:
        """Where each rank's step went (`rank_activity`), computed once."""
        if self._ranks_activity is None:
            t, ops = self.ranks, self.graph.ops
            kept, _ = kept_ops(self)
            kinds = [ops[i].kind for i in kept[self.kernels:].tolist()]
            self._ranks_activity = rank_activity(t.kept_start, t.kept_end, t.kept_ready, self.kernels, kinds)
        return self._ranks_activity

    def compute(self) -> dict:
        """`StepResult.compute` over every rank: busy and its compute-bound classes (matmul, attention, which
        run at each rank's speed) the mean of the ranks'; memory-bound, what NCCL added and the CPU's share
        as the representative rank met them (engine/ranks.py keeps them); MFU the slowest rank's step's."""
        d = StepResult.compute(self)
        scale = float(np.mean(1.0 / self.speeds))  # a compute-bound second on the mean rank
        d["busy_s"] = float(self.activity().busy_s.mean())
        d["breakdown"]["matmul_s"] *= scale
        d["breakdown"]["attention_s"] *= scale
        return d

    def communication(self) -> dict:
        """`StepResult.communication` over every rank: the bytes and the transfers' seconds are every rank's
        (a collective runs alike on each once its group's last rank arrives); what is exposed, by kind, and
        the overlap are the mean of the ranks' (`rank_activity`)."""
        d = StepResult.communication(self)
        a = self.activity()
        exposed, active = float(a.exposed_s.mean()), float(a.active_s.mean())
        d["exposed_s"] = exposed
        d["exposed_by_collective_s"] = {k: float(a.exposed_by_kind_s[k].mean()) if k in a.exposed_by_kind_s else 0.0
                                        for k in d["exposed_by_collective_s"]}
        d["overlap_fraction"] = min(1.0, max(0.0, 1 - exposed / active)) if active > 0 else 1.0
        return d

    def slowest_rank(self) -> int:
        """The rank whose step ends last; of those ending together (a step's tail after its last collective
        is memory-bound: alike on every rank), the slowest GPU."""
        return int(np.lexsort((self.speeds, -self.ranks.end))[0])

    def fastest_rank(self) -> int:
        """The rank whose step ends first; of those ending together, the fastest GPU."""
        return int(np.lexsort((-self.speeds, self.ranks.end))[0])

    def candidates(self) -> list[int]:
        """The ranks that held their groups' collectives back longest, longest first (rank order among
        equals): those whose cost to the step is measured."""
        held = self.ranks.held_back_s
        return [int(r) for r in np.lexsort((np.arange(len(held)), -held))[:ATTRIBUTED_RANKS] if held[r] > 0]

    def attribution(self) -> list[dict]:
        """What the candidates cost the step, costliest first: the step time less that of the step replayed
        with the rank at the mean speed (another rank then paces the step: a straggler costs its whole delay
        past the runner-up's); how long it held its groups back, summed over its leads at the collectives it
        arrived last at, and at how many (prefetched collectives wait beside compute, so that sum can pass
        the cost)."""
        t = self.ranks
        rows = [{"rank": r, "speed": float(self.speeds[r]), "cost_s": self.costs[r],
                 "held_back_s": float(t.held_back_s[r]), "collectives": int(t.held_back_count[r])} for r in self.costs]
        return sorted(rows, key=lambda a: (-a["cost_s"], a["rank"]))

    def default_traced(self) -> tuple[int, ...]:
        """The ranks a trace shows unless told: all of a small mesh; else rank 0, the slowest, the fastest
        and the one that cost the step most."""
        n = len(self.speeds)
        if n <= TRACE_EVERY_RANK:
            return tuple(range(n))
        costliest = [a["rank"] for a in self.attribution()[:1]]
        return tuple(sorted({0, self.slowest_rank(), self.fastest_rank(), *costliest}))

    def to_dict(self) -> dict:
        d = StepResult.to_dict(self)
        sc, t, a = self.scenario, self.ranks, self.activity()
        var = sc.variation

        def spread(x: np.ndarray) -> dict:
            return {"max": float(x.max()), "mean": float(x.mean())}

        d["per_rank"] = {
            "ranks": len(self.speeds), "seed": var.seed, "gpu_speed_spread": var.spread,
            "stragglers": [{"rank": r, "speed": s} for r, s in var.stragglers],
            "nodes": [{"node": n, "speed": s} for n, s in var.nodes],
            "slowest_rank": self.slowest_rank(), "fastest_rank": self.fastest_rank(),
            "step_time_s": {"slowest": float(t.end.max()), "mean": float(t.end.mean()), "fastest": float(t.end.min())},
            "representative_step_time_s": self.timing.makespan,  # every rank at the mean speed
            # where a rank's step went: they and other idle (the CPU, copies) sum to its step (RankActivity)
            "compute_busy_s": spread(a.busy_s), "exposed_communication_s": spread(a.exposed_s),
            "stalled_s": spread(a.stalled_s),
            "collective_wait_s": spread(a.waiting_s),  # stalled_s of it with the compute stream idle
            "attribution": self.attribution(),
            # each collective some rank held back: the rank with the longest lead over its group's second-last
            "collectives": [{"name": self.graph.ops[i].name, "rank": r, "held_back_s": lead} for i, r, lead in t.delays]}
        d["ranks"] = [{"rank": r, "speed": s, "step_time_s": e, "compute_busy_s": b, "exposed_communication_s": x,
                       "stalled_s": st, "collective_wait_s": w, "held_back_s": h, "held_back_collectives": c}
                      for r, (s, e, b, x, st, w, h, c) in enumerate(zip(
                          self.speeds.tolist(), t.end.tolist(), a.busy_s.tolist(), a.exposed_s.tolist(),
                          a.stalled_s.tolist(), a.waiting_s.tolist(), t.held_back_s.tolist(),
                          t.held_back_count.tolist()))]
        return d
