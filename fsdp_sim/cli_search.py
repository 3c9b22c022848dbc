"""`sweep` and `recommend`: the commands that search many configurations (sweep.py, recommend.py), print
their rows or the recommendation, and draw or write them; Ctrl-C and a lost worker stop them with one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_sim.cli_run import strict_json, write_file
from fsdp_sim.errors import ScenarioError, one_line


MAX_JOBS = 256


def _progress(args: argparse.Namespace) -> bool:
    """A progress bar only for a person watching: not with -q, and only when stderr is a terminal."""
    return not args.quiet and sys.stderr.isatty()


def _check_sweep_args(args: argparse.Namespace) -> None:
    if args.jobs is not None and not 0 < args.jobs <= MAX_JOBS:  # each job is a process, started at once
        raise ScenarioError(f"--jobs: must be a positive integer of at most {MAX_JOBS}, got {args.jobs}")
    from fsdp_sim.executors import check

    check(args.executor, args.scheduler)  # before the default search space is built or anything runs


def _color_keys(args: argparse.Namespace, axes=None) -> list[str]:
    """The keys that colour `--plot` (--color-by, default the first axis's), checked before sweeping."""
    from fsdp_sim.sweep import MICRO_BATCH, search_axes

    searched = search_axes(args.grid, axes, args.set)
    keys = [k for a in searched for k in a.columns] + ([MICRO_BATCH] if args.max_batch else [])  # the rows' columns
    color_by = args.color_by.split(",") if args.color_by else (searched[0].columns if searched else keys[:1])
    for key in color_by:
        if key not in keys:
            raise ScenarioError(f"--color-by: {key!r} is not a swept key, expected one of {keys}")
    return color_by


def _pareto(args: argparse.Namespace, color_by: list[str], rows: list[dict], best: dict | None = None) -> None:
    """`--plot`: the Pareto front of the rows."""
    from fsdp_sim.results.plot import pareto_figure

    fig = pareto_figure(rows, color_by, best=best, title=f"{Path(args.scenario).stem}: {len(rows)} configurations "
                        "(hollow: does not fit)")
    try:
        fig.savefig(args.plot, dpi=120)
    except (OSError, ValueError) as exc:
        raise ScenarioError(f"--plot {args.plot}: {exc}") from None


def _html(args: argparse.Namespace, keys: list[str], rows: list[dict], color_by: list[str], **kw) -> None:
    """`--html`: the sweep's (or recommendation's) report."""
    from fsdp_sim.results.html import sweep_report

    title = f"fsdp-sim {args.command}: {Path(args.scenario).stem}"
    write_file(args.html, sweep_report(title, keys, rows, color_by, **kw))


def _stopped(args: argparse.Namespace, what: str) -> str:
    """The line for a sweep that stopped before its end: where its finished rows are, and how to go on."""
    output = getattr(args, "output", None)
    if output:
        return f"{what}; the finished rows are in {output}: rerun the same command with --resume to compute the rest"
    return what


def _stoppable(rows, args: argparse.Namespace) -> int:
    """A sweep (`sweep`, `recommend`): Ctrl-C exits 130 and a dead worker 1, each with one line (a sweep's
    finished rows are in its -o file already, for --resume)."""
    from fsdp_sim.executors import WorkerLost

    try:
        return rows(args)
    except KeyboardInterrupt:
        print(f"fsdp-sim: {one_line(_stopped(args, 'interrupted'))}", file=sys.stderr)
        return 130
    except WorkerLost as exc:
        print(f"fsdp-sim: error: {one_line(_stopped(args, str(exc)))}", file=sys.stderr)
        return 1


def sweep_command(args: argparse.Namespace) -> int:
    return _stoppable(_sweep_rows, args)


def _sweep_rows(args: argparse.Namespace) -> int:
    from fsdp_sim.results.report import fit_word, fmt_bytes, fmt_time
    from fsdp_sim.sweep import sweep

    _check_sweep_args(args)
    color_by = _color_keys(args) if args.plot or args.html else []
    keys, rows = sweep(args.scenario, args.set, grid=args.grid, jobs=args.jobs, progress=_progress(args),
                       max_batch=args.max_batch, executor=args.executor, scheduler=args.scheduler,
                       output=args.output, resume=args.resume)
    if not args.quiet:
        shown = [{k: "-" if row[k] is None else str(row[k]) for k in keys} for row in rows]
        width = {k: max([20, len(k)] + [len(v[k]) for v in shown]) for k in keys}  # a named choice may be longer
        print("  ".join(f"{k:>{width[k]}}" for k in keys) + f"{'step time':>12}{'tok/s/GPU':>11}{'peak alloc':>12}{'required':>12}  fits")
        for row, values in zip(rows, shown):
            swept = "  ".join(f"{values[k]:>{width[k]}}" for k in keys)
            if row["error"]:
                print(f"{swept}  error: {row['error']}")
            else:
                print(f"{swept}{fmt_time(row['step_time_s']):>12}{row['tokens_per_s_per_gpu']:>11.0f}"
                      f"{fmt_bytes(row['peak_allocated_bytes']):>12}"
                      f"{fmt_bytes(row['required_bytes']):>12}  {fit_word(row)}")
        if args.max_batch:
            for row in rows:
                if not row["error"] and row.get("training.micro_batch") is None:
                    print(_none_fits(row, keys))
    if rows and all(row["error"] for row in rows):
        print(f"fsdp-sim: {one_line('every configuration failed; the first: ' + rows[0]['error'])}", file=sys.stderr)
        return 1
    if args.plot:
        _pareto(args, color_by, rows)
    if args.html:
        _html(args, keys, rows, color_by)
    return 0


def _none_fits(row: dict, keys: list[str]) -> str:
    """--max-batch found no micro-batch within the budget: how far micro-batch 1 is over."""
    from fsdp_sim.results.report import fmt_bytes

    setting = ", ".join(f"{k}={row[k]}" for k in keys if k != "training.micro_batch" and row.get(k) is not None)
    budget = row["required_bytes"] + row["headroom_bytes"]
    return (f"{setting or 'the scenario'}: no micro-batch fits the {fmt_bytes(budget)} budget; micro-batch 1 "
            f"needs {fmt_bytes(row['required_bytes'])}, {fmt_bytes(-row['headroom_bytes'])} over")


def recommend_command(args: argparse.Namespace) -> int:
    return _stoppable(_recommend_rows, args)


def _recommend_rows(args: argparse.Namespace) -> int:
    from fsdp_sim.datafile import read_data
    from fsdp_sim.recommend import default_axes, explain, parse_base, recommend, written_values
    from fsdp_sim.sweep import sweep

    _check_sweep_args(args)
    if args.top < 0:
        raise ScenarioError(f"--top: must be zero or more, got {args.top}")
    axes = written = None
    base, folder = read_data(args.scenario, "scenario"), Path(args.scenario).parent
    if args.global_batch is not None and (args.grid or args.max_batch or args.global_batch < 1):
        raise ScenarioError("--global-batch: a positive number of sequences per step, with the default space "
                            "(not with --grid or --max-batch)")
    if not args.grid:
        scenario = parse_base(base, folder)
        axes = default_axes(base, scenario, micro_batch=not args.max_batch, global_batch=args.global_batch)
        written = written_values(base, scenario, axes)  # the scenario as written is one of the points
    color_by = _color_keys(args, axes) if args.plot or args.html else []
    keys, rows = sweep(args.scenario, args.set, grid=args.grid, axes=axes, jobs=args.jobs,
                       progress=_progress(args), max_batch=args.max_batch, executor=args.executor,
                       scheduler=args.scheduler)
    rec = recommend(rows, keys, top=args.top, written=written)
    if args.json:
        write_file(args.json, strict_json(rec | {"rows": rows}, indent=1) + "\n")
    if args.save and rec["best"] is not None:  # the winner as a complete scenario, which `run` reproduces
        import yaml

        from fsdp_sim.sweep import point_data

        data = point_data(args.scenario, args.set, keys, rec["best"], grid=args.grid, axes=axes)
        write_file(args.save, f"# fsdp-sim recommend {args.scenario}: the recommended configuration\n"
               + yaml.safe_dump(data, sort_keys=False))
    if args.plot and any(not r["error"] for r in rows):
        _pareto(args, color_by, rows, rec["best"])
    if args.html:
        _html(args, keys, rows, color_by, text=explain(rec), best=rec["best"])
    if not args.quiet:
        print(explain(rec))
    if rec["best"] is None:
        if args.quiet:
            return 1
        if rec["limit"] != "memory":  # every point failed: the error says why, no way out to look for
            print(f"fsdp-sim: no configuration fits ({rec['limit']})", file=sys.stderr)
            return 1
        from fsdp_sim.ways_out import first_fitting, ways_out  # nothing in the space fits: does a way outside it?

        way = first_fitting(ways_out(base, folder)) if isinstance(base, dict) else None
        print(f"Outside this space: the scenario with {way['way']} fits ({way['tokens_per_s_per_gpu']:.0f} tokens/s "
              f"per GPU); `fsdp-sim run {args.scenario}` lists every way out" if way else
              "Outside this space: neither checkpointing, CPU offload, LoRA, QLoRA nor more nodes fits either")
        print(f"fsdp-sim: no configuration fits ({rec['limit']})", file=sys.stderr)
        return 1
    return 0
