"""Configurations per second of a 10,000-point llama3-8b sweep (8x H100), on all cores.

The grid: micro-batch 1..25 x seq_len 1024..16384 (5) x wrap (per block, every 2 / 4 / 8 blocks, whole
model) x backward prefetch x activation checkpointing x FULL_SHARD / SHARD_GRAD_OP x reduce dtype fp32 /
bf16 = 10,000 points. Points run in a fixed shuffled order in chunks of CHUNK until the time budget is
spent; the rate of what ran is extrapolated to all 10,000. Then one core's cost per point, split into
parsing, simulating, and reducing to a row (against the full `to_dict()` a `run` builds).

EXECUTORS (comma-separated, default local) are where the points run (fsdp_sim/executors.py): `local`
processes, `dask-local` (a Dask LocalCluster of JOBS single-threaded worker processes; its start-up is
timed apart), or `dask=ADDRESS` (an existing cluster). Each gets the same budget.

Run: python benchmarks/bench_sweep.py [BUDGET_S=60] [JOBS=all cores] [EXECUTORS=local]
e.g. python benchmarks/bench_sweep.py 60 2 local,dask-local
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

from fsdp_sim.datafile import read_data
from fsdp_sim.executors import open_runner
from fsdp_sim.grid import Axis, combine
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.sweep import _row, points, sweep_points

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "llama3-8b-8xh100.yaml"
CHUNK = 1000
AXES = [
    Axis.of("training.micro_batch", list(range(1, 26))),
    Axis.of("training.seq_len", [1024, 2048, 4096, 8192, 16384]),
    Axis("wrap", ({"fsdp.wrap": "per_block"}, *({"fsdp.wrap": "every_k_blocks", "fsdp.blocks_per_unit": k}
                                               for k in (2, 4, 8)), {"fsdp.wrap": "whole_model"})),
    Axis.of("fsdp.backward_prefetch", [True, False]),
    Axis.of("training.activation_checkpointing", ["none", "full"]),
    Axis("sharding", ({"fsdp.sharding_strategy": "FULL_SHARD", "fsdp.reshard_after_forward": True},
                      {"fsdp.sharding_strategy": "SHARD_GRAD_OP", "fsdp.reshard_after_forward": False})),
    Axis.of("fsdp.mixed_precision.reduce_dtype", ["fp32", "bf16"]),
]


def throughput(budget_s: float, jobs: int | None, executor: str = "local") -> None:
    base = read_data(SCENARIO, "scenario")  # parsed once for the whole sweep
    todo = [data for _, data in points(base, combine(AXES, []))]
    random.Random(0).shuffle(todo)
    name, _, scheduler = executor.partition("=")
    t_open = time.perf_counter()
    with open_runner(name, jobs=jobs, scheduler=scheduler or None) as runner:
        started = time.perf_counter() - t_open
        workers = runner.workers() if hasattr(runner, "client") else getattr(runner, "jobs", 1)
        done, errors, t0 = 0, 0, time.perf_counter()
        while done < len(todo) and time.perf_counter() - t0 < budget_s:
            rows = sweep_points(todo[done:done + CHUNK], SCENARIO.parent, runner=runner)
            errors += sum(bool(r["error"]) for r in rows)
            done += len(rows)
        elapsed = time.perf_counter() - t0
    rate = done / elapsed
    print(f"sweep [{name}]: {done:,} of {len(todo):,} llama3-8b configurations in {elapsed:.1f} s: {rate:.0f} "
          f"configurations/s on {workers} workers ({errors} rows with errors; start-up {started:.1f} s apart)")
    if done < len(todo):
        print(f"  extrapolated: all {len(todo):,} in {len(todo) / rate:.0f} s")


def one_core(repeats: int = 30) -> None:
    base = read_data(SCENARIO, "scenario")
    parse, sim, row, full = [], [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scenario = parse_scenario(base, base=SCENARIO.parent)
        t1 = time.perf_counter()
        result = simulate(scenario)
        t2 = time.perf_counter()
        _row(result)
        t3 = time.perf_counter()
        result._activity_cache = None  # what a `run` pays for the same figures and the rest
        result.to_dict()
        t4 = time.perf_counter()
        parse.append(t1 - t0), sim.append(t2 - t1), row.append(t3 - t2), full.append(t4 - t3)
    ms = {k: 1e3 * statistics.median(v) for k, v in (("parse", parse), ("simulate", sim), ("row", row), ("to_dict", full))}
    print(f"one core, per point (median of {repeats}): parse {ms['parse']:.1f} ms, simulate {ms['simulate']:.1f} ms, "
          f"row {ms['row']:.1f} ms (to_dict would be {ms['to_dict']:.1f} ms)")


if __name__ == "__main__":
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    jobs = int(sys.argv[2]) if len(sys.argv) > 2 else None
    executors = sys.argv[3].split(",") if len(sys.argv) > 3 else ["local"]
    one_core()
    for executor in executors:
        throughput(budget, jobs, executor)
