"""One call from a scenario to a result: schedule, price, play, replay memory."""

from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np

from fsdp_sim.engine import play, queue_layout, replay
from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.costs import OpCosts
from fsdp_sim.hardware.variation import pace_factor, paced_profile
from fsdp_sim.results.analysis import StepResult
from fsdp_sim.results.folded import FoldedResult
from fsdp_sim.scenario import FOLDED_MICRO_BATCHES, MAX_MODULE_PASSES, Scenario, folds
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
                        three.collective_pricing, twin=two, micro_batches=n)


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
        return StepResult(scenario, graph, timing, memory, costs.times, costs.duration, costs.pricing())
    finally:
        if paused:
            gc.enable()


def op_costs(scenario: Scenario, paced: bool = True) -> OpCosts:
    """The pricer of a scenario's ops on its mesh: the shard and replicate groups and, with
    `reshard_after_forward: k` (hpZ), the post-forward group of k consecutive ranks that the backward
    all-gathers run in. `paced`: at the slowest rank's pace (the default mode); not where every rank is
    played at its own (`--per-rank`, results/ranks.py)."""
    s = scenario.settings
    cluster = scenario.cluster
    # the step runs at its slowest rank's pace: every collective waits for it (hardware/variation.py)
    factor = pace_factor(scenario.variation, cluster.world_size, cluster.gpus_per_node) if paced else 1.0
    cluster = replace(cluster, gpu=paced_profile(cluster.gpu, factor)) if factor != 1.0 else cluster
    return OpCosts(cluster, shard_size=s.shard_size, replicate_size=s.replicate_size,
                   compute_dtype=s.param_dtype, options=scenario.compute,
                   consecutive_groups={post_forward_group(k): k for k in s.post_forward_sizes},
                   link_faults=scenario.link_faults, **tp_pricing(s, cluster))  # a TP mesh's groups (none without TP)


# ranks `--per-rank` plays at most: four times the largest training job published, Llama 3 405B on 16,384
# H100 (Dubey et al. 2024, arXiv 2407.21783, 3.3.1); its arrays (8 B a rank for each kernel and collective
# kept) stay under 3 GB for 405B's 1,400 such ops
MAX_PER_RANK = 1 << 16


def simulate_ranks(scenario: Scenario, traced: tuple[int, ...] | None = None):
    """Simulate one step on every rank (`fsdp-sim run --per-rank`): the representative rank played once at
    the mean speed (no pacing: each rank's speed is played, hardware/variation.py), then every rank replayed
    at its own (engine/ranks.py). Every micro-batch is played (a rank's drift is not one micro-batch's
    times the count). `traced`: the ranks whose every op a trace shows (None: `default_traced`)."""
    from fsdp_sim.engine.ranks import play_ranks
    from fsdp_sim.hardware.variation import rank_speeds
    from fsdp_sim.results.ranks import PerRankResult, kept_ops
    from fsdp_sim.schedule.tp import rank_groups

    cluster = scenario.cluster
    if cluster.world_size > MAX_PER_RANK:
        raise ScenarioError(f"--per-rank: {cluster.world_size:,} ranks is past the limit of {MAX_PER_RANK:,}")
    for r in traced or ():
        if not 0 <= r < cluster.world_size:
            raise ScenarioError(f"--trace-ranks: rank {r} is out of range: the mesh has {cluster.world_size} ranks")
    passes = len(scenario.workload.modules) * scenario.settings.grad_accumulation
    if passes > MAX_MODULE_PASSES:  # the default mode folds such a step (results/folded.py); this plays it all
        raise ScenarioError(f"--per-rank: {len(scenario.workload.modules):,} modules x "
                            f"{scenario.settings.grad_accumulation} micro-batches is past the limit of "
                            f"{MAX_MODULE_PASSES:,} module passes per step")
    speeds = rank_speeds(scenario.variation, cluster.world_size, cluster.gpus_per_node)
    paused = gc.isenabled()
    gc.disable()
    try:
        graph = build_step(scenario.workload, scenario.units, scenario.settings)
        costs = op_costs(scenario, paced=False)
        layout = graph.derived("queues", lambda: queue_layout(graph.ops))
        timing = play(graph.ops, costs.duration, host_s=costs.host_s, slowdowns=costs.slowdowns, layout=layout)
        memory = replay(graph, timing.start, timing.issued, timing.end, scenario.allocator)
    finally:
        if paused:
            gc.enable()
    n = len(graph.ops)
    host, work = np.zeros(n), np.zeros(n)
    for i in layout.timed:
        op = graph.ops[i]
        host[i] = costs.host_s(op)
        if op.kind == "compute" or op.kind == "copy":
            t = costs.times(op)
            work[i] = t.matmul + t.attention  # compute-bound: at the rank's rate (memory-bound: HBM's, unspread)
    result = PerRankResult(scenario, graph, timing, memory, costs.times, costs.duration, costs.pricing(),
                           speeds=speeds)
    keep, result.kernels = kept_ops(result)
    args = dict(host_s=host, work_s=work, slowness=1.0 / speeds - 1.0, groups=rank_groups(scenario.settings), keep=keep)
    result.ranks = play_ranks(graph.ops, timing, **args)
    step = result.step_time_s
    for r in result.candidates():  # what each rank that held its groups back most cost: the step without it
        mean = args | {"slowness": args["slowness"].copy(), "keep": keep[:0]}
        mean["slowness"][r] = 0.0
        result.costs[r] = step - float(play_ranks(graph.ops, timing, **mean).end.max())
    if traced is None:
        traced = result.default_traced()
    result.ranks.traced = play_ranks(graph.ops, timing, **args, traced=tuple(traced)).traced if traced else {}
    return result
