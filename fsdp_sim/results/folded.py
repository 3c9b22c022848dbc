"""A step of many micro-batches, priced from three: first, one middle, last.

Gradient accumulation repeats the same forward and backward: every micro-batch between the first and the
last issues the same ops, allocates the same buffers and meets the same streams (the first starts from an
idle GPU, the last reduces and steps). So a step of more than three is simulated with two and with three
micro-batches (`scenario.folds`; any count then costs about two simulations), and each additive figure of n micro-batches is the three-batch figure plus n - 3 times what
the middle one added (the three-batch figure less the two-batch one): step time, busy and idle time by
cause, communication time, exposure and bytes. Memory is the three-batch step's: the middle micro-batches
hold what the middle one holds. Ratios (overlap, MFU, throughput) follow from the extrapolated figures.
The trace, timeline and plots show the three-batch step.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_sim.results.analysis import StepResult
from fsdp_sim.scenario import FOLDED_MICRO_BATCHES as SIMULATED  # first, one middle, last


@dataclass(slots=True)
class FoldedResult(StepResult):
    """`StepResult` of the three-batch step (`graph`, `timing`, `memory`), for `scenario` (n micro-batches),
    with `twin`, the two-batch step, to tell what one middle micro-batch adds."""

    twin: StepResult | None = None
    micro_batches: int = SIMULATED

    def _extra(self, three: float, two: float) -> float:
        return three + (self.micro_batches - SIMULATED) * (three - two)

    @property
    def step_time_s(self) -> float:
        return self._extra(self.timing.makespan, self.twin.step_time_s)

    def _exposure(self) -> tuple[float, float]:
        return tuple(self._extra(a, b) for a, b in zip(StepResult._exposure(self), self.twin._exposure()))

    def cpu_bound_s(self) -> float:
        return self._extra(StepResult.cpu_bound_s(self), self.twin.cpu_bound_s())

    def communication(self) -> dict:
        three, two = StepResult.communication(self), self.twin.communication()
        out = {k: self._extra(v, two[k]) for k, v in three.items() if k not in ("exposed_by_collective_s", "overlap_fraction")}
        out |= {k: int(out[k]) for k in ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes")}
        out["exposed_by_collective_s"] = {k: max(0.0, self._extra(v, two["exposed_by_collective_s"][k]))
                                          for k, v in three["exposed_by_collective_s"].items()}
        out["exposed_s"], out["overlap_fraction"] = self.exposed_communication()
        return out

    def compute(self) -> dict:
        three, two = StepResult.compute(self), self.twin.compute()
        return three | {"busy_s": self._extra(three["busy_s"], two["busy_s"]),
                        "breakdown": {k: self._extra(v, two["breakdown"][k]) for k, v in three["breakdown"].items()},
                        "folded": {"micro_batches_simulated": SIMULATED,
                                   "middle_micro_batch_s": self.timing.makespan - self.twin.step_time_s}}
