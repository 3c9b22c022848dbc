"""Sweeps: one scenario, the cartesian product of a few of its keys, simulated in parallel processes.

`--set fsdp.wrap=per_block,whole_model --set training.micro_batch=1,2,4` gives six points; `--grid FILE`
gives axes from a file (fsdp_sim/grid.py). A point whose combination is impossible (a shard size that
does not divide the world, say) becomes a row with its error; a key that exists in no scenario is a bad
input for the whole sweep.

The base file is read once; each point is parsed, simulated and reduced to the row's figures (no
live-buffer list, no units table, no exporters). `max_batch=True` replaces the micro-batch axis by a
search: for each point, the largest `training.micro_batch` that fits (`largest_fitting`).

A row holds the swept columns (a named choice: its name, not the keys it sets) and the figures. With
`output`, rows go to that file as their chunk finishes (fsdp_sim/rowfile.py), and `resume` computes only
the points that file does not hold yet.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterable
from functools import partial, wraps
from pathlib import Path
from typing import Any

from fsdp_sim.datafile import expect_mapping, read_data
from fsdp_sim.errors import ScenarioError
from fsdp_sim.executors import check as check_executor, open_runner
from fsdp_sim.grid import SECTIONS, Axis, columns, combinations, combine, load_grid, parse_assignment
from fsdp_sim.results.report import COLUMNS
from fsdp_sim.rowfile import RowFile
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate

__all__ = ["COLUMNS", "parse_assignment", "points", "run_point", "largest_fitting", "search_axes", "sweep", "sweep_points"]

MICRO_BATCH = "training.micro_batch"
MAX_BATCH_LIMIT = 4096


def assign(data: dict, key: str, value: Any) -> None:
    """`key` (dotted) set to `value` in `data`, each section on its path copied rather than changed: the
    others stay shared with whatever `data` was copied from (a sweep's base, its other points), which no
    one changes (parsing reads its data), so a point costs a copy of the few mappings it sets, not of the
    whole scenario."""
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if child is None:
            child = {}
        elif isinstance(child, str) and part == "model":  # a preset name becomes a mapping with overrides
            child = {"preset": child}
        elif not isinstance(child, dict):
            raise ScenarioError(f"--set {key}: {part!r} is not a section of the scenario")
        else:
            child = dict(child)
        node[part] = child
        node = child
    node[leaf] = value


def _axes(axes: Iterable[Axis | tuple[str, list]]) -> list[Axis]:
    return [a if isinstance(a, Axis) else Axis.of(*a) for a in axes]


def points(base: dict, axes: Iterable[Axis | tuple[str, list]]) -> list[tuple[dict, dict]]:
    """(the swept values, the scenario data) for every combination, in the order the axes were given."""
    out = []
    for chosen in combinations(_axes(axes)):
        data = dict(base)  # its own top level, and the sections `assign` sets
        for key, value in chosen.items():
            if "." in key or key in SECTIONS:  # else a named choice's name (grid.py), for the rows only
                assign(data, key, value)
        out.append((chosen, data))
    return out


def _row(result) -> dict:
    """The sweep figures of a step: what `to_dict()` gives, without the live buffers and the units, each
    computed once and only what the row shows (`memory_verdict`, not the whole `memory_summary`)."""
    memory = result.memory
    at = result.peak_row
    op = memory.op_at(at)
    reserved, allocated = memory.reserved_bytes, int(memory.total[at])
    mem, _, capped = result.memory_verdict(allocated, int(reserved))
    # a step that fits may do so only by the allocator releasing its cache and retrying, every step
    retries = capped.retries_per_step if capped is not None and mem["fits"] else 0
    (exposed, overlap), mfu, tp = result.exposed_communication(), result.mfu(), result.throughput()
    return {"step_time_s": result.step_time_s, "tokens_per_s_per_gpu": tp["tokens_per_s_per_gpu"],
            "tokens_per_step": tp["tokens_per_step"], "peak_allocated_bytes": allocated,
            "peak_reserved_bytes": reserved, "required_bytes": mem["required_bytes"], "fits": mem["fits"],
            "within_budget": mem["within_budget"], "headroom_bytes": mem["headroom_bytes"],
            "allocator_retries_per_step": retries, "communication_exposed_s": exposed,
            "overlap_fraction": overlap, "mfu": mfu, "cpu_bound_s": result.cpu_bound_s(),
            "peak_phase": op.phase if op else "before step", "knife_edge": mem["knife_edge"], "error": ""}


def run_point(data: dict, base: Path) -> dict:
    """The figures of one point, or its error (one line) when the combination is not valid.

    The cyclic garbage collector is paused for the whole point, as `simulate()` pauses it for the step:
    parsing and the row make thousands of acyclic objects too, and a collection pass every few hundred
    of them costs a sweep about 8 % (its count carries over, so cycles are still collected after)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return _row(simulate(parse_scenario(data, name="sweep", base=base)))
    except ScenarioError as exc:
        return {"error": str(exc)}
    finally:
        if paused:
            gc.enable()


def largest_fitting(fits: Callable[[int], bool], limit: int = MAX_BATCH_LIMIT) -> int:
    """The largest n in [1, limit] with fits(n), for fits true up to some n and false after; 0 when
    fits(1) is false. Doubles until the first failure, then bisects: about 2 log2(n) calls."""
    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None:
        trial = min(2 * good, limit)
        if trial == good:
            return good  # fits at the limit
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def run_max_batch(data: dict, base: Path, limit: int = MAX_BATCH_LIMIT) -> dict:
    """The row at the largest micro-batch that fits (found by `largest_fitting`), with that micro-batch
    under MICRO_BATCH; when even micro-batch 1 does not fit, None there (no micro-batch fits) beside
    micro-batch 1's figures, which say how far over it is."""
    rows: dict[int, dict] = {}

    def fits(batch: int) -> bool:
        trial = dict(data)
        assign(trial, MICRO_BATCH, batch)
        rows[batch] = row = run_point(trial, base)
        if row["error"] and batch == 1:
            raise ScenarioError(row["error"])  # wrong whatever the batch: the point's error
        return not row["error"] and row["within_budget"]  # fits with the safety margin kept

    try:
        best = largest_fitting(fits, limit)
    except ScenarioError as exc:
        return {MICRO_BATCH: 1, "error": str(exc)}
    return {MICRO_BATCH: best or None} | rows[max(best, 1)]


def _bar(total: int, enabled: bool, initial: int = 0):
    """A tqdm progress bar on stderr with an ETA, or None (not asked for, or too little to show); `initial`:
    the points a resumed sweep found done (the rate and ETA count only those it runs)."""
    if not enabled or total - initial < 2:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="config", file=sys.stderr, leave=False, dynamic_ncols=True)


def sweep_points(datas: list[dict], folder: Path, *, jobs: int | None = None, progress: bool = False,
                 max_batch: bool = False, executor: str = "local", scheduler: str | None = None,
                 runner=None, done: Callable[[list[int], list[dict]], None] | None = None,
                 total: int | None = None) -> list[dict]:
    """One row per scenario data, in order, on `executor` (fsdp_sim/executors.py: `local` = this process
    for jobs=1, else `jobs` processes; `dask` = the cluster at `scheduler`; `dask-local` = a LocalCluster),
    or on an open `runner` (reused across calls, e.g. by a benchmark). `done(indices, rows)`: each finished
    chunk's rows (indices into `datas`) as it finishes; `total`: the whole sweep's points for the progress
    bar, when `datas` is what a resumed sweep has left."""
    work = partial(run_max_batch if max_batch else run_point, base=folder)
    total = len(datas) if total is None else total
    bar = _bar(total, progress, initial=total - len(datas))
    tick = bar.update if bar is not None else (lambda n: None)
    order, groups = _dispatch(datas)
    finished = None if done is None else (lambda at, rows: done([order[j] for j in at], rows))
    try:
        if runner is not None:
            rows = runner.map(work, [datas[i] for i in order], tick, done=finished, groups=groups)
        else:
            with open_runner(executor, jobs=jobs, scheduler=scheduler) as opened:
                rows = opened.map(work, [datas[i] for i in order], tick, done=finished, groups=groups)
    finally:
        if bar is not None:
            bar.close()
    out: list[dict] = [{}] * len(datas)
    for i, row in zip(order, rows):
        out[i] = row
    return out


def dispatch_order(datas: list[dict]) -> list[int]:
    """The points' indices by their settings apart from how many tokens a micro-batch holds, then by those tokens
    (`training.micro_batch` x `training.seq_len`), so that a worker meets one setting's token counts in a row,
    fewest first, in one chunk: each point's graph is then its predecessor's re-sized or re-priced
    (schedule/build.py), and points that split the same tokens otherwise sit side by side and allocate alike,
    so that worker's allocator memo (engine/reserved.py `MEMO`) replays the caching allocator once for them.
    On the 10,000-point llama3-8b grid, in chunks of 64, 235 points build their graph (6,184 in the
    token-count-first order before, which re-priced twins only), and two workers replay 4,174 allocator steps
    of the 4,004 distinct (4,034 before: other settings at one token count often allocate alike, and met in
    one chunk then). The rows keep the sweep's order. The chunks end where a setting's points do, where they
    can (executors.py: the setting is the points' group)."""
    return _dispatch(datas)[0]


def _dispatch(datas: list[dict]) -> tuple[list[int], list[str]]:
    """(`dispatch_order`, each point's group in that order: its settings but its tokens, the chunks' bounds)."""
    keys = [_dispatch_key(data) for data in datas]
    order = sorted(range(len(datas)), key=keys.__getitem__)
    return order, [keys[i][0] for i in order]


def _dispatch_key(data: dict) -> tuple[str, int]:
    """(the point's settings but its tokens per micro-batch, those tokens): `dispatch_order`'s."""
    training = data.get("training")
    if not isinstance(training, dict):
        return (repr(data), 0)
    rest = {**data, "training": {k: v for k, v in training.items() if k not in ("micro_batch", "seq_len")}}
    tokens = training.get("micro_batch", 1), training.get("seq_len", 0)
    product = tokens[0] * tokens[1] if all(isinstance(t, int) for t in tokens) else 0
    return (repr(rest), product)


def with_assignments(base: dict, assignments: Iterable[str]) -> dict:
    """`base` with each `--set KEY=VALUE` applied (`run`'s what-if: one value per key, else a sweep's job)."""
    if not assignments:
        return base
    data = dict(expect_mapping("scenario", base))
    for text in assignments:
        key, values = parse_assignment(text)
        if len(values) != 1:
            raise ScenarioError(f"--set {key}: run takes one value; sweep several with fsdp-sim sweep")
        assign(data, key, values[0])
    return data


def point_data(path: str, assignments: Iterable[str], keys: list[str], row: dict, *, grid: str | None = None,
               axes: list[Axis] | None = None) -> dict:
    """The complete scenario of the sweep point `row` (the one whose swept values it holds), with its
    micro-batch where --max-batch searched it: what `recommend --save` writes, and `run` reproduces."""
    base = read_data(path, "scenario")
    for chosen, data in points(base, search_axes(grid, axes, assignments)):
        if all(chosen.get(k) == row.get(k) for k in keys if k != MICRO_BATCH or k in chosen):
            if row.get(MICRO_BATCH) is not None:
                assign(data, MICRO_BATCH, row[MICRO_BATCH])
            return data
    raise ScenarioError("recommend --save: the recommended row is not among the sweep's points")


def search_axes(grid: str | None, axes: list[Axis] | None, assignments: Iterable[str]) -> list[Axis]:
    """The axes of a sweep: the grid file's (or `axes`), with each `--set` replacing its key's axes."""
    return combine(load_grid(grid) if grid else list(axes or []), list(assignments))


def _heap_frozen(fn: Callable) -> Callable:
    """`fn` with what the process holds at its call frozen (`gc.freeze`) until it returns, unless someone
    froze before: the modules and tables the simulator imported outlive the sweep, so no collection need
    scan them meanwhile, in this process (a full collection over them cost building a 1,000-point sweep's
    points 25 ms) or in the workers forked from it, which inherit the freeze."""
    @wraps(fn)
    def frozen(*args, **kwargs):
        if gc.get_freeze_count():
            return fn(*args, **kwargs)
        gc.freeze()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.unfreeze()
    return frozen


@_heap_frozen
def sweep(path: str, assignments: Iterable[str] = (), *, grid: str | None = None, axes: list[Axis] | None = None,
          jobs: int | None = None, progress: bool = False, max_batch: bool = False, executor: str = "local",
          scheduler: str | None = None, output: str | None = None, resume: bool = False) -> tuple[list[str], list[dict]]:
    """Run every point of the sweep; returns the swept keys and one row per point, in the sweep's order.

    The axes are the grid file's (or `axes`, e.g. recommend's default space), with `--set` assignments
    replacing the axes of their keys. With `max_batch` each row is at its largest fitting micro-batch.
    `executor` and `scheduler` say where the points run (`sweep_points`); the rows are the same.
    `output`: a file the rows are written to as they finish (fsdp_sim/rowfile.py), rewritten in the sweep's
    order at the end; with `resume`, the rows it holds are kept and only the other points run.
    """
    check_executor(executor, scheduler)
    base = read_data(path, "scenario")
    if not isinstance(base, dict):
        raise ScenarioError(f"scenario: {path} must hold a mapping")
    all_axes = search_axes(grid, axes, assignments)
    if not all_axes and not max_batch:
        raise ScenarioError("--set: give at least one KEY=VALUE[,VALUE...] (or --grid FILE) to sweep")
    if max_batch:
        if MICRO_BATCH in columns(all_axes):
            raise ScenarioError(f"--max-batch: searches {MICRO_BATCH} itself; remove it from the grid and --set")
        if isinstance(base.get("model"), dict) and "workload" in base["model"]:
            raise ScenarioError("--max-batch: model.workload fixes the micro-batch (the trace's); nothing to search")
    if resume and not output:
        raise ScenarioError("--resume: give the rows' file with -o FILE (the file an earlier run of this sweep wrote)")
    todo = points(base, all_axes)
    swept = columns(all_axes)
    keys = swept + ([MICRO_BATCH] if max_batch else [])
    # a named choice's keys are not columns: the row shows its name (grid.py)
    rows: list[dict | None] = [None] * len(todo)
    file = RowFile(output, [*keys, *COLUMNS], swept) if output else None
    if file is not None:
        if resume:
            for i, row in file.resume([chosen for chosen, _ in todo]).items():
                rows[i] = row
        else:
            file.start()
    missing = [i for i, row in enumerate(rows) if row is None]

    def finished(at: list[int], results: list[dict]) -> None:
        new, where = [], []
        for j, result in zip(at, results):
            if "unknown key" in result["error"]:  # a misspelt key: the sweep itself is wrong
                raise ScenarioError(result["error"])
            i = missing[j]
            chosen = todo[i][0]
            rows[i] = row = dict.fromkeys(keys) | {k: chosen.get(k) for k in swept} | result
            new.append(row)
            where.append(i)
        if file is not None:
            file.append(where, new)

    folder = Path(path).parent if executor == "local" else Path(path).resolve().parent  # workers elsewhere
    try:
        if missing:  # a resumed sweep may have nothing left (and then starts no cluster)
            sweep_points([todo[i][1] for i in missing], folder, jobs=jobs, progress=progress, max_batch=max_batch,
                         executor=executor, scheduler=scheduler, done=finished, total=len(todo))
    finally:
        if file is not None:
            file.close()  # what finished stays in the file, whatever stopped the sweep
    if file is not None:
        file.finish(rows)
    return keys, rows
