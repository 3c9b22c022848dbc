"""How long one simulated step takes, for every shipped scenario (and a sweep's worth of repeats).

Prints a table: scenario, world size, FSDP units, ops in the graph, and the median / min wall time of
`simulate()` over N runs on one core (scenario parsing excluded; it happens once per sweep point too,
so it is timed separately). Run: python benchmarks/bench_scenarios.py [N]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from fsdp_sim.scenario import load_scenario
from fsdp_sim.simulate import simulate

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
            parse, statistics.median(times), min(times))


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    rows = [bench(p, repeats) for p in sorted((ROOT / "scenarios").glob("*.yaml"))]
    print(f"{'scenario':<34}{'GPUs':>6}{'units':>7}{'ops':>7}{'parse ms':>10}{'median ms':>11}{'min ms':>9}")
    for name, world, units, ops, parse, med, best in rows:
        print(f"{name:<34}{world:>6}{units:>7}{ops:>7}{parse * 1e3:>10.1f}{med * 1e3:>11.1f}{best * 1e3:>9.1f}")
    print(f"(simulate() + to_dict(), {repeats} runs each, one process, one core)")


if __name__ == "__main__":
    main()
