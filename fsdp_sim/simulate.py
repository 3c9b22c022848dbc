"""One call from a scenario to a result: schedule, price, play, replay memory."""

from __future__ import annotations

import gc
from dataclasses import replace

from fsdp_sim.engine import play, queue_layout, replay
from fsdp_sim.hardware.costs import OpCosts
from fsdp_sim.hardware.variation import paced_profile, slowest_rank_factor
from fsdp_sim.results.analysis import StepResult
from fsdp_sim.results.folded import FoldedResult
from fsdp_sim.scenario import FOLDED_MICRO_BATCHES, Scenario, folds
from fsdp_sim.schedule.build import build_step
from fsdp_sim.schedule.settings import post_forward_group
from fsdp_sim.schedule.tp import tp_pricing


def simulate(scenario: Scenario) -> StepResult:
    """Simulate one training step of `scenario` on one representative rank; a step of more than three
    micro-batches is priced from two and three of them (results/folded.py)."""
    n = scenario.settings.grad_accumulation
    if not folds(n):
        return _simulate(scenario)
    two, three = (_simulate(replace(scenario, settings=replace(scenario.settings, grad_accumulation=k)))
                  for k in (FOLDED_MICRO_BATCHES - 1, FOLDED_MICRO_BATCHES))
    return FoldedResult(scenario, three.graph, three.timing, three.memory, three.alone_s, three.alone_duration,
                        twin=two, micro_batches=n)


def _simulate(scenario: Scenario) -> StepResult:
    """Simulate one training step of `scenario` on one representative rank, every micro-batch.

    The cyclic garbage collector is paused meanwhile: a step creates thousands of small acyclic
    objects (ops, buffers, events), and collection passes over them are pure overhead in a sweep.
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        graph = build_step(scenario.workload, scenario.units, scenario.settings)
        costs = op_costs(scenario)
        layout = graph.derived("queues", lambda: queue_layout(graph.ops))  # one per build (a sweep's twins share it)
        timing = play(graph.ops, costs.duration, host_s=costs.host_s, slowdowns=costs.slowdowns, layout=layout)
        memory = replay(graph, timing.start, timing.issued, timing.end, scenario.allocator)
        return StepResult(scenario, graph, timing, memory, costs.times, costs.duration)
    finally:
        if paused:
            gc.enable()


def op_costs(scenario: Scenario) -> OpCosts:
    """The pricer of a scenario's ops on its mesh: the shard and replicate groups and, with
    `reshard_after_forward: k` (hpZ), the post-forward group of k consecutive ranks that the backward
    all-gathers run in."""
    s = scenario.settings
    cluster = scenario.cluster
    # the step runs at its slowest rank's pace: every collective waits for it (hardware/variation.py)
    factor = slowest_rank_factor(cluster.world_size, scenario.gpu_speed_spread)
    cluster = replace(cluster, gpu=paced_profile(cluster.gpu, factor)) if factor != 1.0 else cluster
    return OpCosts(cluster, shard_size=s.shard_size, replicate_size=s.replicate_size,
                   compute_dtype=s.param_dtype, options=scenario.compute,
                   consecutive_groups={post_forward_group(k): k for k in s.post_forward_sizes},
                   **tp_pricing(s, cluster))  # a tensor-parallel mesh's groups (none without TP)
