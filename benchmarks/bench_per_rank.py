"""How long `fsdp-sim run --per-rank` takes at 64, 1,024 and 16,384 ranks, on one core.

The issue's target: Llama 3 405B over 1,024 H100 (scenarios/llama3-405b-1024xh100.yaml) within 15 s on one
core. The same scenario is timed on 8, 128 and 2,048 nodes of 8 (`--set hardware.nodes=N`, as a user would)
with the shipped spread (2.6 %, seed 0): the whole command in this process, `fsdp-sim run --per-rank -q --json F`
(parsing, the representative rank's play, the replay of every rank, the replays that price the attribution,
the JSON), then its parts: `simulate_ranks` and `to_dict`; beside the default mode's `simulate()` and the
process's peak resident memory. BLAS and OpenMP are held to one thread, so one core is what is timed.
Run: python benchmarks/bench_per_rank.py [SCENARIO] [NODES,NODES,...]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import resource  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from fsdp_sim.cli import main  # noqa: E402
from fsdp_sim.datafile import read_data  # noqa: E402
from fsdp_sim.scenario import parse_scenario  # noqa: E402
from fsdp_sim.simulate import simulate, simulate_ranks  # noqa: E402
from fsdp_sim.sweep import with_assignments  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "llama3-405b-1024xh100.yaml"


def _timed(fn):
    """fn()'s result and the CPU seconds this process spent on it: on a shared machine the wall clock
    counts other processes' turns too (`command` shows it beside)."""
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def bench(path: Path, nodes: int) -> dict:
    scenario = parse_scenario(with_assignments(read_data(path, "scenario"), [f"hardware.nodes={nodes}"]),
                              name=path.stem, base=path.parent)  # what `--set hardware.nodes=N` makes
    with tempfile.TemporaryDirectory() as tmp:
        wall = time.perf_counter()
        rc, command = _timed(lambda: main(["run", str(path), "--per-rank", "-q", "--set", f"hardware.nodes={nodes}",
                                           "--json", str(Path(tmp) / "out.json")]))
        wall = time.perf_counter() - wall
        size = (Path(tmp) / "out.json").stat().st_size
    if rc:
        raise SystemExit(f"fsdp-sim run --per-rank exited {rc}")
    result, per_rank = _timed(lambda: simulate_ranks(scenario))
    _, to_dict = _timed(result.to_dict)
    default, default_s = _timed(lambda: simulate(scenario))
    return {"ranks": scenario.cluster.world_size, "ops": len(result.graph.ops), "command_s": command, "wall_s": wall,
            "simulate_ranks_s": per_rank, "to_dict_s": to_dict, "default_s": default_s, "json_bytes": size,
            "step_s": result.step_time_s, "default_step_s": default.step_time_s,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main_(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else SCENARIO
    nodes = [int(n) for n in argv[1].split(",")] if len(argv) > 1 else [8, 128, 2048]
    print(f"{path.name}: fsdp-sim run --per-rank on one core (CPU seconds; the command's wall clock beside; peak RSS "
          "of this process so far)")
    print(f"{'ranks':>7} {'ops':>6} {'command':>8} {'(wall)':>8} {'replay':>8} {'to_dict':>8} {'default':>8} {'JSON':>9} "
          f"{'step per-rank':>14} {'step default':>13} {'RSS':>9}")
    for n in nodes:
        r = bench(path, n)
        print(f"{r['ranks']:>7,} {r['ops']:>6,} {r['command_s']:>8.2f} {r['wall_s']:>8.2f} {r['simulate_ranks_s']:>8.2f} {r['to_dict_s']:>8.2f} "
              f"{r['default_s']:>8.3f} {r['json_bytes'] / 2**20:>7.1f} MiB {r['step_s']:>12.3f} s {r['default_step_s']:>11.3f} s "
              f"{r['rss_mib']:>6.0f} MiB")


if __name__ == "__main__":
    main_(sys.argv[1:])
