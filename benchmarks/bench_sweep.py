"""Configurations per second of the 10,000-point llama3-8b sweep (8x H100) and of a mixed 1,000-point one, in
wall and CPU time.

The grid is `benchmarks/llama3-8b-10k.grid.yaml` over `scenarios/llama3-8b-8xh100.yaml`: micro-batch 1..25 x
seq_len 1024..16384 (5) x wrap (per block, every 2 / 4 / 8 blocks, whole model) x backward prefetch x
activation checkpointing x FULL_SHARD / SHARD_GRAD_OP x reduce dtype fp32 / bf16. Points run in a fixed
shuffled order in chunks of CHUNK until the budget is spent, the rate of what ran extrapolated to all
10,000; `all` runs every point in one call, as `fsdp-sim sweep` does (so `sweep_points` dispatches the
points that allocate alike together, which a chunk of a shuffled order cannot). CPU time is this process's
and its finished workers' (`resource`), so other work on a shared machine does not count; wall time is
what a user waits.

The mixed grid, `benchmarks/mixed-1k.grid.yaml` (micro-batch 1..10 x seq_len 1024..16384 x checkpointing x
backward prefetch x 1..16 nodes), changes what a point allocates or its mesh at almost every step, so its
points share fewer graphs and replays than the 10,000's: it runs whole, after the 10,000-point grid, on each
executor.

Last, the mixed grid as a user runs it, `fsdp-sim sweep scenarios/llama3-8b-8xh100.yaml --grid
benchmarks/mixed-1k.grid.yaml --jobs JOBS -q -o rows.csv`, in a fresh process: wall time from its start to
its exit (interpreter start, imports, pool start-up, the rows written, exit), best of three, and its CPU
time (the command's and its workers').

Then one core's cost per point: parsing, simulating and reducing to a row (against the full `to_dict()`
a `run` builds), and where a point's time goes by phase over points in a worker's order (cProfile's shares
of parse, graph build, pricing and play, memory replay, row, scaled to the unprofiled time; a sampling
profiler such as py-spy gives the build less and the replay more).

EXECUTORS (comma-separated, default local) are where the points run (fsdp_sim/executors.py): `local`
processes, `dask-local` (a Dask LocalCluster of JOBS single-threaded worker processes; its start-up is
timed apart), or `dask=ADDRESS` (an existing cluster). Each gets the same budget.

Run: python benchmarks/bench_sweep.py [BUDGET_S=60 | all] [JOBS=all cores] [EXECUTORS=local]
e.g. python benchmarks/bench_sweep.py all 2 local
"""

from __future__ import annotations

import compileall
import cProfile
import os
import pstats
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fsdp_sim.datafile import read_data
from fsdp_sim.engine.reserved import MEMO
from fsdp_sim.executors import open_runner
from fsdp_sim.grid import combine, load_grid
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.sweep import _row, dispatch_order, points, run_point, sweep_points

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "llama3-8b-8xh100.yaml"
GRID = ROOT / "benchmarks" / "llama3-8b-10k.grid.yaml"
MIXED = ROOT / "benchmarks" / "mixed-1k.grid.yaml"
CHUNK = 1000
# the phases of a point, as the functions that run them (file suffix, function name)
PHASES = {"parse": ("fsdp_sim/scenario.py", "parse_scenario"), "graph": ("fsdp_sim/schedule/build.py", "build_step"),
          "play": ("fsdp_sim/engine/simulator.py", "play"), "replay": ("fsdp_sim/engine/ledger.py", "replay"),
          "row": ("fsdp_sim/sweep.py", "_row")}


def _todo(grid: Path = GRID) -> list[dict]:
    base = read_data(SCENARIO, "scenario")  # read once for the whole sweep
    todo = [data for _, data in points(base, combine(load_grid(str(grid)), []))]
    random.Random(0).shuffle(todo)
    return todo


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that have finished (the pool's, once closed)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def throughput(budget_s: float, jobs: int | None, executor: str = "local", grid: Path = GRID) -> tuple:
    todo = _todo(grid)
    name, _, scheduler = executor.partition("=")
    t_open = time.perf_counter()
    cpu0 = _cpu_s()
    with open_runner(name, jobs=jobs, scheduler=scheduler or None) as runner:
        started = time.perf_counter() - t_open
        workers = runner.workers() if hasattr(runner, "client") else getattr(runner, "jobs", 1)
        done, errors, t0 = 0, 0, time.perf_counter()
        while done < len(todo) and time.perf_counter() - t0 < budget_s:
            rows = sweep_points(todo[done:done + (CHUNK if budget_s < float("inf") else len(todo))], SCENARIO.parent,
                                runner=runner)
            errors += sum(bool(r["error"]) for r in rows)
            done += len(rows)
        elapsed = time.perf_counter() - t0
    cpu = _cpu_s() - cpu0  # workers of a remote cluster are not counted
    return name, workers, done, errors, elapsed, cpu, started


def one_core(repeats: int = 30) -> None:
    base = read_data(SCENARIO, "scenario")
    parse, sim, row, full = [], [], [], []
    for _ in range(repeats):
        t0 = time.process_time()
        scenario = parse_scenario(base, base=SCENARIO.parent)
        t1 = time.process_time()
        result = simulate(scenario)
        t2 = time.process_time()
        _row(result)
        t3 = time.process_time()
        result._activity_cache = None  # what a `run` pays for the same figures and the rest
        result.to_dict()
        t4 = time.process_time()
        parse.append(t1 - t0), sim.append(t2 - t1), row.append(t3 - t2), full.append(t4 - t3)
    ms = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in (("parse", parse), ("simulate", sim), ("row", row), ("to_dict", full))}
    print(f"one core, the base scenario (median of {repeats}): parse {ms['parse']:.1f} ms, simulate {ms['simulate']:.1f} ms, "
          f"row {ms['row']:.1f} ms (to_dict would be {ms['to_dict']:.1f} ms)")


def phases(n: int = 200) -> None:
    """CPU ms per point by phase over `n` points of the grid in a worker's order (consecutive points of
    `dispatch_order`, from the middle of the grid), each run with the allocator memo empty at its start, as a
    worker's is; cProfile's shares overstate the parts that make many small calls (the graph build)."""
    todo = _todo()
    order = dispatch_order(todo)
    sample = [todo[i] for i in order[len(order) // 2:len(order) // 2 + n]]
    for data in sample:  # prices and workloads, as a worker has them after its first points
        run_point(data, SCENARIO.parent)
    MEMO.clear()
    t0 = time.process_time()
    for data in sample:
        run_point(data, SCENARIO.parent)
    per_point = (time.process_time() - t0) / n
    MEMO.clear()
    profile = cProfile.Profile()
    profile.runcall(lambda: [run_point(data, SCENARIO.parent) for data in sample])
    stats = pstats.Stats(profile).stats  # (file, line, function) -> (calls, _, own s, cumulative s, callers)
    total = max(cum for *_, cum, _ in stats.values())
    share = {phase: sum(cum for (file, _, fn), (*_, cum, _) in stats.items() if file.endswith(suffix) and fn == name)
             / total for phase, (suffix, name) in PHASES.items()}
    share["other"] = 1.0 - sum(share.values())
    print(f"one core, {n} grid points in a worker's order: {per_point * 1e3:.2f} CPU ms per point ({1 / per_point:.0f} configurations/s); "
          "by phase (cProfile shares): " + ", ".join(f"{k} {v * per_point * 1e3:.2f} ms ({v:.0%})" for k, v in share.items()))


def command(jobs: int | None, repeats: int = 3) -> None:
    """The mixed grid's `fsdp-sim sweep` as a user runs it: (wall, CPU) of each run, the best wall shown."""
    runs = []
    compileall.compile_dir(ROOT / "fsdp_sim", quiet=1)  # as an installed copy has them (PYTHONDONTWRITEBYTECODE or not)
    with tempfile.TemporaryDirectory() as folder:
        argv = [sys.executable, "-m", "fsdp_sim.cli", "sweep", str(SCENARIO), "--grid", str(MIXED), "-q",
                "-o", str(Path(folder) / "rows.csv")] + (["--jobs", str(jobs)] if jobs else [])
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        for _ in range(repeats):
            cpu0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
            subprocess.run(argv, env=env, check=True)
            wall, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
            runs.append((wall, cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime))
    wall, cpu = min(runs)
    print(f"the command, fsdp-sim sweep scenarios/{SCENARIO.name} --grid benchmarks/{MIXED.name}"
          f"{f' --jobs {jobs}' if jobs else ''} -q -o rows.csv (1,000 points, start-up and exit included, best of "
          f"{repeats}): {wall:.2f} s wall ({1000 / wall:.0f} configurations/s), {cpu:.2f} CPU s; all runs: "
          + ", ".join(f"{w:.2f} s / {c:.2f} CPU s" for w, c in runs))


def main() -> None:
    budget = float("inf") if len(sys.argv) > 1 and sys.argv[1] == "all" else float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    jobs = int(sys.argv[2]) if len(sys.argv) > 2 else None
    executors = sys.argv[3].split(",") if len(sys.argv) > 3 else ["local"]
    one_core()
    phases()
    print(f"{'grid':<15}{'executor':<12}{'workers':>8}{'points':>9}{'wall s':>9}{'CPU s':>9}{'configs/s':>11}{'configs/CPU s':>15}"
          f"{'s per 10,000':>14}{'CPU s per 10,000':>18}{'errors':>8}{'start-up s':>12}")
    for grid, budget_s in ((GRID, budget), (MIXED, float("inf"))):
        for executor in executors:
            MEMO.clear()  # a forked worker would start with the replays the phases and the last sweep remembered
            name, workers, done, errors, wall, cpu, started = throughput(budget_s, jobs, executor, grid)
            print(f"{grid.name.split('.')[0]:<15}{name:<12}{workers:>8}{done:>9,}{wall:>9.1f}{cpu:>9.1f}"
                  f"{done / wall:>11.0f}{done / cpu:>15.0f}{10_000 * wall / done:>14.1f}{10_000 * cpu / done:>18.1f}"
                  f"{errors:>8}{started:>12.1f}")
    print("(s per 10,000 and CPU s per 10,000 extrapolate the points run to 10,000 points of their grid)")
    command(jobs)


if __name__ == "__main__":
    main()
