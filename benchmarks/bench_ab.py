"""This checkout against an earlier commit, on sweep points, interleaved in one process.

On a shared machine whose speed moves by more than a change saves (this project's 2-core machines moved 1.6x
within an hour), two runs one after the other compare the machine, not the code. Here both versions run in
one process, alternating in small batches, so each meets the same machine: the commit is exported with
`git archive` to a temporary folder, its package renamed `fsdp_sim_ab` (every import rewritten), and the
points, taken from the 10,000-point llama3-8b grid in this checkout's worker order (consecutive points of
`dispatch_order`, 40 from every 1,000), run BATCH at a time by each version in turn, the allocator memos
emptied at each round's start. It prints CPU ms per point for each and their ratio, in both orders (the
second version of a batch gets a warm cache: the two orders' geometric mean cancels that).

First it checks that a change meant to be faster left every answer alone: each sampled point's row and each
shipped scenario's full `to_dict()`, from both versions, compared as JSON text (byte for byte); a difference
is named and the run exits 1 before any timing.

Run: python benchmarks/bench_ab.py COMMIT [ROUNDS=3]
e.g. python benchmarks/bench_ab.py HEAD~1
"""

from __future__ import annotations

import importlib
import io
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "llama3-8b-8xh100.yaml"
GRID = ROOT / "benchmarks" / "llama3-8b-10k.grid.yaml"
BATCH = 20


def export(commit: str, folder: Path) -> None:
    """The commit's `fsdp_sim/` as package `fsdp_sim_ab` and its `hardware_profiles/` beside it (the
    profiles are found from the package's own path)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "fsdp_sim", "hardware_profiles"],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (folder / "fsdp_sim").rename(folder / "fsdp_sim_ab")
    for path in (folder / "fsdp_sim_ab").rglob("*.py"):
        path.write_text(re.sub(r"\bfsdp_sim\b", "fsdp_sim_ab", path.read_text()))


def sample() -> list[dict]:
    """The points both versions run, in this checkout's worker order."""
    from fsdp_sim.datafile import read_data
    from fsdp_sim.grid import combine, load_grid
    from fsdp_sim.sweep import dispatch_order, points

    todo = [data for _, data in points(read_data(SCENARIO, "scenario"), combine(load_grid(str(GRID)), []))]
    random.Random(0).shuffle(todo)
    order = dispatch_order(todo)
    return [todo[i] for c in range(0, len(order), 1000) for i in order[c:c + 40]]


def load(package: str):
    """(run one point, empty the allocator memo) of `package`."""
    sweep, reserved = (importlib.import_module(f"{package}.{n}") for n in ("sweep", "engine.reserved"))
    return (lambda data: sweep.run_point(data, SCENARIO.parent)), reserved.MEMO.clear


def answers(package: str, points: list[dict]) -> dict[str, str]:
    """Every answer of `package` as JSON text: each point's row and each shipped scenario's `to_dict()`."""
    scenario, simulate = (importlib.import_module(f"{package}.{n}") for n in ("scenario", "simulate"))
    run, _ = load(package)
    out = {f"point {i}": json.dumps(run(data), sort_keys=True, default=repr) for i, data in enumerate(points)}
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        if not path.name.endswith(".grid.yaml"):  # grids are sweep axes, not scenarios
            result = simulate.simulate(scenario.load_scenario(path)).to_dict()
            out[path.name] = json.dumps(result, sort_keys=True, default=repr)
    return out


def differing(commit: str, points: list[dict]) -> list[str]:
    """The answers in which this checkout and `commit` differ."""
    new, old = answers("fsdp_sim", points), answers("fsdp_sim_ab", points)
    return [name for name in new if new[name] != old.get(name)]


def interleaved(first, second, points: list[dict], rounds: int) -> tuple[float, float]:
    """CPU ms per point of `first` and `second`, each batch run by `first` and then by `second`."""
    spent = [0.0, 0.0]
    for run, _ in (first, second):
        for data in points:  # prices and workloads, as a worker has them after its first points
            run(data)
    for _ in range(rounds):
        first[1](), second[1]()
        for i in range(0, len(points), BATCH):
            for k, (run, _) in enumerate((first, second)):
                t0 = time.process_time()
                for data in points[i:i + BATCH]:
                    run(data)
                spent[k] += time.process_time() - t0
    n = rounds * len(points)
    return spent[0] / n * 1e3, spent[1] / n * 1e3


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    commit, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with tempfile.TemporaryDirectory() as tmp:
        export(commit, Path(tmp))
        sys.path[:0] = [tmp, str(ROOT)]
        points = sample()
        if diff := differing(commit, points):
            sys.exit(f"answers differ from {commit} in {len(diff)}: {', '.join(diff[:10])}")
        print(f"answers byte-identical to {commit}: {len(points)} points' rows and every shipped scenario's to_dict()")
        new, old = load("fsdp_sim"), load("fsdp_sim_ab")
        a_old, a_new = interleaved(old, new, points, rounds)
        b_new, b_old = interleaved(new, old, points, rounds)
    ratio = ((a_new / a_old) * (b_new / b_old)) ** 0.5
    print(f"{len(points)} grid points x {rounds} rounds, batches of {BATCH}, CPU ms per point")
    print(f"{'order':<22}{commit:>12}{'this checkout':>16}{'ratio':>8}")
    print(f"{'commit first':<22}{a_old:>12.3f}{a_new:>16.3f}{a_new / a_old:>8.3f}")
    print(f"{'this checkout first':<22}{b_old:>12.3f}{b_new:>16.3f}{b_new / b_old:>8.3f}")
    print(f"this checkout / {commit}: {ratio:.3f} (geometric mean of both orders)")


if __name__ == "__main__":
    main()
