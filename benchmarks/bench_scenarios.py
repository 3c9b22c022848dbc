"""How long one simulated step takes, for every shipped scenario (and a sweep's worth of repeats).

Prints a table: scenario, world size, FSDP units, ops in the graph, and the median / min wall time of
`simulate()` over N runs on one core (scenario parsing excluded; it happens once per sweep point too,
so it is timed separately), beside the SimPy floor: a bare chain of one timeout per op, the least any
SimPy player of that many ops costs; then the throughput of a 64-point sweep on all cores.

`warm` (the default) repeats `simulate()` + `to_dict()` on one scenario, as a sweep's alike points meet it:
the repeat re-prices the last graph and finds its allocator replay remembered. `cold` times `simulate()` as a
user's first call meets it: before each run every per-process memo is emptied (`clear_memos`) and the
scenario is loaded anew, and the floor is measured beside each run, so the ratio compares one machine state.
Run: python benchmarks/bench_scenarios.py [N] [warm | cold] [NAME,NAME...]
e.g. python benchmarks/bench_scenarios.py 7 cold llama3-8b-8xh100,llama3-70b-64xh100,llama3-405b-1024xh100
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from pathlib import Path

import simpy

from fsdp_sim.engine import reserved
from fsdp_sim.hardware import compute, graph_pricing, kernels, profiles, variation
from fsdp_sim.scenario import load_scenario
from fsdp_sim.schedule import build, optimizers, param_dtypes
from fsdp_sim.simulate import simulate
from fsdp_sim.sweep import sweep
from fsdp_sim.workload import hf_config, model, moe, tensor_parallel, transformer

ROOT = Path(__file__).resolve().parents[1]


def clear_memos() -> None:
    """Empty every memo this process keeps between steps: the allocator replays and their digests, the
    last build (a sweep's twin graphs, which share `OpGraph.derived`), the kernel prices, what is derived
    from a workload, the unit shards, the remembered workloads, recipes, kernels, GEMM factors, profiles and
    the slowest rank's paced profiles and k_N, the cluster graphs and their pricings (the normal grid they integrate over is a table of the
    standard normal, the same for every scenario, like an import, so it stays)."""
    reserved.MEMO.clear()
    for thread_local in (reserved._last_key, reserved._last_order, build._last):
        thread_local.__dict__.clear()
    compute._SHARED.clear()
    variation._PACED.clear()
    graph_pricing._GRAPHS.clear()
    graph_pricing._PRICINGS.clear()
    model._BY_WORKLOAD.clear()
    param_dtypes._UNIT_SHARDS.clear()
    for cached in (optimizers._state_bytes, transformer._from_recipe, transformer._gemm_shapes,
                   transformer._shared_block_params, transformer.build_transformer, moe.moe_kernels,
                   kernels.gemm_shape_factor, profiles.load_profile, variation.expected_max_of_normals,
                   hf_config._built, tensor_parallel.build_tp_transformer):
        cached.cache_clear()


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


def bench_cold(path: Path, repeats: int) -> tuple:
    """(name, ops, best floor, best cold wall, its CPU, median of each run's wall / the floor beside it, best
    CPU of the step's `to_dict()` after it: the report `fsdp-sim run` prints, with the allocator replayed under
    the GPU's limit where the step reserves more)."""
    walls, cpus, floors, reports = [], [], [], []
    for _ in range(repeats):
        clear_memos()
        gc.collect()
        scenario = load_scenario(path)
        t0, c0 = time.perf_counter(), time.process_time()
        result = simulate(scenario)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        c0 = time.process_time()
        result.to_dict()
        reports.append(time.process_time() - c0)
        floors.append(simpy_floor(len(result.graph.ops), 1))
    ratios = [w / f for w, f in zip(walls, floors)]
    return path.stem, len(result.graph.ops), min(floors), min(walls), min(cpus), statistics.median(ratios), min(reports)


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
    mode = sys.argv[2] if len(sys.argv) > 2 else "warm"
    paths = [p for p in sorted((ROOT / "scenarios").glob("*.yaml")) if not p.name.endswith(".grid.yaml")]  # grids are sweep axes
    if len(sys.argv) > 3:
        paths = [ROOT / "scenarios" / f"{name}.yaml" for name in sys.argv[3].split(",")]
    if mode == "cold":
        print(f"{'scenario':<34}{'ops':>7}{'floor ms':>10}{'cold ms':>9}{'CPU ms':>8}{'x floor':>9}{'median x':>10}"
              f"{'to_dict ms':>12}")
        for name, ops, floor, wall, cpu, ratio, report in (bench_cold(p, repeats) for p in paths):
            print(f"{name:<34}{ops:>7}{floor * 1e3:>10.2f}{wall * 1e3:>9.2f}{cpu * 1e3:>8.2f}{wall / floor:>9.2f}{ratio:>10.2f}"
                  f"{report * 1e3:>12.2f}")
        print(f"(cold simulate(), memos emptied and the scenario loaded anew before each of {repeats} runs; "
              "best wall and CPU, best floor; median x: of each run's ratio to the floor measured beside it; "
              "to_dict: best CPU of the report after it, the capped replay included)")
        return
    rows = [bench(p, repeats) for p in paths]
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
