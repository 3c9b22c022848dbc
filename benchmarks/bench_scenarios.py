"""How long one simulated step takes, for every shipped scenario (and a sweep's worth of repeats).

Prints a table: scenario, world size, FSDP units, ops in the graph, and the median / min wall time of
`simulate()` over N runs on one core (scenario parsing excluded; it happens once per sweep point too,
so it is timed separately), beside the SimPy floor: a bare chain of one timeout per op, the least any
SimPy player of that many ops costs; then the throughput of a 64-point sweep on all cores.
Run: python benchmarks/bench_scenarios.py [N]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import simpy

from fsdp_sim.scenario import load_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.sweep import sweep

ROOT = Path(__file__).resolve().parents[1]


def bench(path: Path, repeats: int) -> tuple:
    t0 = time.perf_counter()
    scenario = load_scenario(path)
    parse = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = simulate(scenario)
        result.to_dict()
        times.append(time.perf_counter() - t0)
    return (path.stem, scenario.cluster.world_size, len(scenario.units), len(result.graph.ops),
            parse, statistics.median(times), min(times), simpy_floor(len(result.graph.ops), repeats))


def simpy_floor(n: int, repeats: int) -> float:
    """Best time of a bare SimPy process yielding `n` timeouts."""
    def chain(env):
        for _ in range(n):
            yield env.timeout(1e-6)
    best = float("inf")
    for _ in range(repeats):
        env = simpy.Environment()
        env.process(chain(env))
        t0 = time.perf_counter()
        env.run()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    rows = [bench(p, repeats) for p in sorted((ROOT / "scenarios").glob("*.yaml")) if not p.name.endswith(".grid.yaml")]  # grids are sweep axes
    print(f"{'scenario':<34}{'GPUs':>6}{'units':>7}{'ops':>7}{'parse ms':>10}{'median ms':>11}{'min ms':>9}"
          f"{'floor ms':>10}{'x floor':>9}")
    for name, world, units, ops, parse, med, best, floor in rows:
        print(f"{name:<34}{world:>6}{units:>7}{ops:>7}{parse * 1e3:>10.1f}{med * 1e3:>11.1f}{best * 1e3:>9.1f}"
              f"{floor * 1e3:>10.1f}{best / floor:>9.1f}")
    print(f"(simulate() + to_dict(), {repeats} runs each, one process, one core)")
    sweep_throughput()


def sweep_throughput() -> None:
    """Configurations per second of `fsdp-sim sweep` over a 64-point llama3-8b grid, all cores."""
    axes = ["training.micro_batch=1,2,4,8", "fsdp.wrap=per_block,whole_model",
            "training.activation_checkpointing=none,full", "fsdp.reshard_after_forward=true,false",
            "fsdp.backward_prefetch=true,false"]
    t0 = time.perf_counter()
    _, rows = sweep(str(ROOT / "scenarios" / "llama3-8b-8xh100.yaml"), axes)
    elapsed = time.perf_counter() - t0
    print(f"sweep: {len(rows)} llama3-8b configurations in {elapsed:.2f} s "
          f"({len(rows) / elapsed:.0f} configurations/s on {os.cpu_count()} cores, process start included)")


if __name__ == "__main__":
    main()
