"""A step played on every rank (`fsdp-sim run --per-rank`): per-rank figures and who held the step back.

The step's time is its slowest rank's. Per rank: its own step time (its last op's end), the seconds its
collectives waited after it was ready for the last rank of their group, and its exposed communication
(seconds some collective runs while its compute stream runs no kernel, as `StepResult` counts it for the
representative rank). Attribution: at each collective of a group of more than one rank, the last rank to
arrive held the group back by its lead over the second-last (had it arrived with the second-last, the
collective would have started that much sooner); summed over the step's collectives, that is what the rank
cost the step ("rank 17 cost the step 41 ms"). A rank slower than every other all through the step is last
at every collective, and its leads add up to its whole delay; where ranks spread alike, the leads are
small and spread over many ranks. The memory figures, the trace's memory counters and the compute and
communication sections are the representative rank's at the mean speed: memory does not depend on speed.
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
    s, e = np.take_along_axis(starts, order, 0), np.take_along_axis(ends, order, 0)
    reach = np.maximum.accumulate(e, axis=0)
    before = np.vstack([np.full((1, s.shape[1]), -np.inf), reach[:-1]])
    return np.clip(reach - np.maximum(s, before), 0.0, None).sum(axis=0)


def exposed_per_rank(kept_start: np.ndarray, kept_end: np.ndarray, kernels: int) -> np.ndarray:
    """Seconds some collective runs while no compute-stream kernel does, per rank: |comm U kernels| - |kernels|,
    the kernels being the first `kernels` rows (one stream's: they never overlap, so their union is their sum)."""
    busy = np.clip(kept_end[:kernels] - kept_start[:kernels], 0.0, None).sum(axis=0)
    out = np.empty(kept_start.shape[1])
    for c in range(0, len(out), _COLUMNS):
        block = slice(c, c + _COLUMNS)
        out[block] = _union_length(kept_start[:, block], kept_end[:, block]) - busy[block]
    return np.clip(out, 0.0, None)


def kept_ops(result: StepResult) -> tuple[np.ndarray, int]:
    """The op ids whose per-rank times the exposure reads: the compute stream's kernels, then every
    collective; and how many kernels lead."""
    _, kernels, collectives, *_ = result.graph.derived("stream order", lambda: _stream_order(result.graph.ops))
    return np.concatenate([kernels, collectives]), len(kernels)


@dataclass(slots=True)
class PerRankResult(StepResult):
    """`StepResult` of the representative rank played at the mean speed (`graph`, `timing`, `memory`), with
    every rank replayed (`ranks`, engine/ranks.py) at `speeds`."""

    ranks: RankTiming | None = None
    speeds: np.ndarray | None = None
    kernels: int = 0  # the leading rows of `ranks.kept_*` that are compute-stream kernels
    costs: dict[int, float] = field(default_factory=dict)  # rank -> the step less the step with it at the mean speed

    @property
    def step_time_s(self) -> float:
        return float(self.ranks.end.max())

    def pace_factor(self) -> float:
        return 1.0  # every rank at its own speed: the representative rank is not paced

    def exposed_per_rank(self) -> np.ndarray:
        return exposed_per_rank(self.ranks.kept_start, self.ranks.kept_end, self.kernels)

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
        sc, t = self.scenario, self.ranks
        exposed = self.exposed_per_rank()
        var = sc.variation
        d["per_rank"] = {
            "ranks": len(self.speeds), "seed": var.seed, "gpu_speed_spread": var.spread,
            "stragglers": [{"rank": r, "speed": s} for r, s in var.stragglers],
            "nodes": [{"node": n, "speed": s} for n, s in var.nodes],
            "slowest_rank": self.slowest_rank(), "fastest_rank": self.fastest_rank(),
            "step_time_s": {"slowest": float(t.end.max()), "mean": float(t.end.mean()), "fastest": float(t.end.min())},
            "representative_step_time_s": self.timing.makespan,  # every rank at the mean speed
            "collective_wait_s": {"max": float(t.collective_wait_s.max()), "mean": float(t.collective_wait_s.mean())},
            "exposed_communication_s": {"max": float(exposed.max()), "mean": float(exposed.mean())},
            "attribution": self.attribution(),
            # each collective some rank held back: the rank with the longest lead over its group's second-last
            "collectives": [{"name": self.graph.ops[i].name, "rank": r, "held_back_s": lead} for i, r, lead in t.delays]}
        d["ranks"] = [{"rank": r, "speed": s, "step_time_s": e, "collective_wait_s": w, "exposed_communication_s": x,
                       "held_back_s": h, "held_back_collectives": c}
                      for r, (s, e, w, x, h, c) in enumerate(zip(self.speeds.tolist(), t.end.tolist(),
                                                                 t.collective_wait_s.tolist(), exposed.tolist(),
                                                                 t.held_back_s.tolist(), t.held_back_count.tolist()))]
        return d
