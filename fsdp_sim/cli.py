"""`fsdp-sim run SCENARIO [--set KEY=VALUE ...] [--json F] [--trace F] [--timeline-csv F] [--memory-snapshot F]
[--plot F] [--html F] [--require-fit] [--per-rank [--trace-ranks R,R,...]]`;
`fsdp-sim sweep SCENARIO [--grid GRID] [--set KEY=V1,V2 ...] [-o rows.csv|.json|.jsonl [--resume]] [--plot F]`;
`fsdp-sim recommend SCENARIO [--grid GRID] [--max-batch] [--global-batch N] [--json F] [--save F.yaml] [--plot F]`
(both `[--html F] [--executor local|dask|dask-local] [--scheduler ADDRESS]`);
`fsdp-sim trace package.module:factory --batch B --seq S -o workload.yaml`;
`fsdp-sim topology SCENARIO -o cluster.graphml [--topology rail_optimized|fat_tree] [--spines N]`; `fsdp-sim --version`.

Argument parsing, file writing and error messages; nothing else. Bad input (`ScenarioError`) becomes one
line on stderr and exit code 2; a result a script should stop on (a step that does not fit under
`--require-fit`, a sweep whose every point failed, a recommendation with nothing that fits) exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import replace
from pathlib import Path

from fsdp_sim.errors import ScenarioError, ScenarioWarning, one_line


MAX_JOBS = 256


def _json(data, **kw) -> str:
    """Strict JSON (no NaN or Infinity, which JSON does not have): a figure that is not finite is refused."""
    try:
        return json.dumps(data, allow_nan=False, **kw)
    except (ValueError, TypeError) as exc:
        raise ScenarioError(f"a result cannot be written as JSON ({exc})") from None


def _write(path: str, text: str | bytes) -> None:
    try:
        if isinstance(text, bytes):
            Path(path).write_bytes(text)
        else:
            Path(path).write_text(text)
    except OSError as exc:
        raise ScenarioError(f"cannot write {path}: {exc.strerror}") from None


def _run(args: argparse.Namespace) -> int:
    from fsdp_sim.results.export import chrome_trace, ranks_trace, timeline_csv
    from fsdp_sim.results.report import summary
    from fsdp_sim.simulate import simulate, simulate_ranks
    from fsdp_sim.datafile import read_data
    from fsdp_sim.scenario import parse_scenario
    from fsdp_sim.sweep import with_assignments

    path = Path(args.scenario)
    raw = with_assignments(read_data(path, "scenario"), args.set)  # --set: a what-if without a new file
    scenario = parse_scenario(raw, name=path.stem, base=path.parent)
    if args.safety_margin is not None:
        if not 0 <= args.safety_margin < 1:
            raise ScenarioError(f"--safety-margin: {args.safety_margin} must be in [0, 1)")
        scenario = replace(scenario, safety_margin=args.safety_margin)
    if args.trace_ranks is not None and not (args.per_rank and args.trace):
        raise ScenarioError("--trace-ranks: only with --per-rank and --trace")
    # the traced ranks' every op is kept only for a trace (None: simulate_ranks picks them)
    result = (simulate_ranks(scenario, traced=args.trace_ranks if args.trace else ()) if args.per_rank
              else simulate(scenario))
    data = result.to_dict()
    if not data["memory"]["within_budget"] and not args.quiet:  # DOES NOT FIT leads somewhere (ways_out.py)
        from fsdp_sim.ways_out import ways_out

        if args.safety_margin is not None:
            raw = raw | {"report": {**(raw.get("report") or {}), "safety_margin": args.safety_margin}}
        data["ways_out"] = ways_out(raw, path.parent)
    if args.json:
        _write(args.json, _json(data, indent=2) + "\n")
    if args.trace:
        _write(args.trace, _json(ranks_trace(result) if args.per_rank else chrome_trace(result)))
    if args.timeline_csv:
        _write(args.timeline_csv, timeline_csv(result))
    if args.memory_snapshot:
        import pickle

        from fsdp_sim.results.memory_viz import memory_snapshot

        _write(args.memory_snapshot, pickle.dumps(memory_snapshot(result)))
    if args.html:
        from fsdp_sim.results.html import run_report

        _write(args.html, run_report(result, data))
    if args.plot:
        from fsdp_sim.results.plot import step_figure

        try:
            step_figure(result).savefig(args.plot, dpi=120)
        except (OSError, ValueError) as exc:
            raise ScenarioError(f"--plot {args.plot}: {exc}") from None
    if not args.quiet:
        print(summary(data))
        if "ways_out" in data:
            from fsdp_sim.ways_out import ways_out_lines

            print("\n".join(ways_out_lines(data["ways_out"])))
    if args.require_fit and not data["memory"]["within_budget"]:  # a CI gate keeps the safety margin
        from fsdp_sim.results.report import fmt_bytes

        if not args.quiet:
            what = "fits only inside the safety margin" if data["memory"]["fits"] else "does not fit"
            print(f"fsdp-sim: {what}: required {fmt_bytes(data['memory']['required_bytes'])} > budget "
                  f"{fmt_bytes(data['memory']['budget_bytes'])} (--require-fit)", file=sys.stderr)
        return 1
    return 0


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(sorted({int(r) for r in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated rank numbers, e.g. 0,17,1023") from None
    return ranks


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated integers, e.g. 8,3,224,224") from None


def _trace(args: argparse.Namespace) -> int:
    from fsdp_sim.torch_tools.trace import trace_factory
    from fsdp_sim.workload.io import workload_to_text

    workload = trace_factory(args.factory, batch=args.batch, seq=args.seq, dtype=args.dtype,
                             block_types=args.block_type, input_shape=args.input_shape, name=args.name)
    _write(args.output, workload_to_text(workload, as_json=args.output.lower().endswith(".json")))
    if not args.quiet:
        blocks = sum(m.is_block for m in workload.modules)
        flops = sum(m.fwd_flops + m.bwd_flops for m in workload.modules)
        print(f"{workload.name}: {len(workload.modules)} modules ({blocks} blocks), {workload.numel:,} parameters, "
              f"{flops / 1e12:.3g} TFLOP per step -> {args.output}")
    return 0


def _topology(args: argparse.Namespace) -> int:
    """The scenario's cluster as a graph (GPUs, scale-up switch, NICs, leaves, spines) in GraphML."""
    import networkx as nx

    from fsdp_sim.hardware.topology import build_topology, describe, with_faults
    from fsdp_sim.scenario import load_scenario

    for flag, value in (("--spines", args.spines), ("--nodes-per-leaf", args.nodes_per_leaf)):
        if value is not None and value < 1:
            raise ScenarioError(f"{flag}: must be a positive integer, got {value}")
    scenario = load_scenario(args.scenario)
    graph = build_topology(scenario.cluster, topology=args.topology, spines=args.spines,
                           nodes_per_leaf=args.nodes_per_leaf)
    graph = with_faults(graph, scenario.link_faults, scenario.cluster)  # variation.links: NICs slow or down
    try:
        nx.write_graphml(graph, args.output)
    except OSError as exc:
        raise ScenarioError(f"cannot write {args.output}: {exc.strerror}") from None
    if not args.quiet:
        print(f"{args.output}: {describe(graph)}")
    return 0


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
    _write(args.html, sweep_report(title, keys, rows, color_by, **kw))


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


def _sweep(args: argparse.Namespace) -> int:
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


def _recommend(args: argparse.Namespace) -> int:
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
        _write(args.json, _json(rec | {"rows": rows}, indent=1) + "\n")
    if args.save and rec["best"] is not None:  # the winner as a complete scenario, which `run` reproduces
        import yaml

        from fsdp_sim.sweep import point_data

        data = point_data(args.scenario, args.set, keys, rec["best"], grid=args.grid, axes=axes)
        _write(args.save, f"# fsdp-sim recommend {args.scenario}: the recommended configuration\n"
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


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as the same single line as every other bad input."""

    def error(self, message: str):
        self.exit(2, f"fsdp-sim: error: {one_line(f'{message} (see {self.prog} --help)')}\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fsdp-sim")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from fsdp_sim import __version__

        return __version__


def _search_options(p: argparse.ArgumentParser) -> None:
    """The options sweep and recommend share: what to search, how, and the Pareto plot."""
    p.add_argument("--grid", metavar="GRID.yaml", help="axes from a file: dotted keys to lists or ranges "
                                                       "{start, stop, step} (see fsdp_sim/grid.py)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2",
                   help="a dotted scenario key and its values, e.g. training.micro_batch=1,2,4 (repeatable; "
                        "replaces the grid's axis for KEY)")
    p.add_argument("--max-batch", action="store_true",
                   help="for each configuration, the largest training.micro_batch that fits (by bisection)")
    p.add_argument("--jobs", type=int, help="worker processes (default: one per CPU); with dask-local, its workers")
    p.add_argument("--executor", default="local", choices=("local", "dask", "dask-local"),
                   help="where the points run: local processes (default), the Dask cluster at --scheduler, or a "
                        "Dask LocalCluster on this machine (needs the dask extra)")
    p.add_argument("--scheduler", metavar="ADDRESS", help="the Dask scheduler, e.g. tcp://host:8786 (--executor dask)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the Pareto front: tokens/s per GPU against required "
                                                      "memory (needs matplotlib)")
    p.add_argument("--color-by", metavar="KEY[,KEY]", help="the swept keys that colour the plot (default: the first "
                                                         "axis's)")
    p.add_argument("--html", metavar="FILE.html", help="write a self-contained HTML report: the Pareto front and "
                                                        "a sortable table of every configuration")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fsdp-sim", description="Simulate one PyTorch FSDP training step.")
    parser.add_argument("--version", action="version", version=f"fsdp-sim {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate a scenario file and print the summary")
    run.add_argument("scenario", help="path to a scenario YAML file")
    run.add_argument("--json", metavar="FILE", help="write the full result as JSON")
    run.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    run.add_argument("--timeline-csv", metavar="FILE", help="write the memory timeline as CSV")
    run.add_argument("--memory-snapshot", metavar="FILE.pickle",
                     help="write the memory timeline as a torch.cuda.memory._snapshot() pickle (open in "
                          "pytorch.org/memory_viz)")
    run.add_argument("--plot", metavar="FILE.png", help="draw memory by category and the streams (needs matplotlib)")
    run.add_argument("--html", metavar="FILE.html", help="write a self-contained HTML report: summary, interactive "
                                                          "memory timeline, streams, breakdown")
    run.add_argument("--safety-margin", type=float, metavar="FRACTION", help="memory kept free (default: scenario, 0.10)")
    run.add_argument("--require-fit", action="store_true", help="exit 1 when the step does not fit (for CI)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="change one scenario key for this run (repeatable), e.g. training.micro_batch=4; a YAML "
                          "value, a list or mapping too: 'variation.stragglers=[{rank: 17, speed: 0.9}]'")
    run.add_argument("--per-rank", action="store_true",
                     help="play every rank at its own speed (variation: spread, seed, stragglers, nodes); the step is "
                          "the slowest rank's, and the JSON says per rank what it waited and who held the step back")
    run.add_argument("--trace-ranks", type=_ranks, metavar="R,R,...",
                     help="with --per-rank --trace: the ranks the trace shows (default: all of up to 16; else rank 0, "
                          "the slowest, the fastest and the costliest)")
    run.add_argument("-q", "--quiet", action="store_true", help="print nothing; write only the files asked for")
    run.set_defaults(func=_run)
    sweep = sub.add_parser("sweep", help="simulate every combination of a few scenario keys, in parallel",
                           description="Simulate the cartesian product of a grid file's and the --set values over "
                                       "a base scenario. Exit 1 when every point failed.")
    sweep.add_argument("scenario", help="path to the base scenario YAML file")
    _search_options(sweep)
    sweep.add_argument("-o", "--output", metavar="FILE",
                       help="write every row as it finishes: CSV, or JSON for .json, JSON lines for .jsonl")
    sweep.add_argument("--resume", action="store_true",
                       help="keep the rows the -o file holds from an earlier run of the same sweep and compute "
                            "only the other points")
    sweep.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    sweep.set_defaults(func=_sweep)
    rec = sub.add_parser("recommend", help="the fastest configuration that fits, why, and the runners-up",
                         description="Sweep a grid (default: wrap, prefetch, sharding, checkpointing, micro-batch) "
                                     "and pick the most tokens/s per GPU whose required memory fits the budget. "
                                     "Exit 1 when nothing fits.")
    rec.add_argument("scenario", help="path to the base scenario YAML file")
    _search_options(rec)
    rec.add_argument("--top", type=int, default=3, metavar="N", help="runners-up to show (default 3)")
    rec.add_argument("--json", metavar="FILE", help="write the recommendation and every row as JSON")
    rec.add_argument("--global-batch", type=int, metavar="N",
                     help="keep N sequences per optimizer step: trade micro-batch for gradient accumulation and "
                          "node count (x1/8 to x8), never the hyperparameters")
    rec.add_argument("--save", metavar="FILE.yaml", help="write the recommended configuration as a complete "
                                                         "scenario, which `fsdp-sim run` reproduces")
    rec.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    rec.set_defaults(func=_recommend)
    trace = sub.add_parser("trace", help="trace a PyTorch model (fake tensors, CPU) into a workload file",
                           description="Run one forward and backward of factory()'s model on fake tensors and write "
                                       "its workload (reference it from a scenario as model: {workload: FILE}).")
    trace.add_argument("factory", help="package.module:factory; factory() returns an nn.Module or (module, loss_fn)")
    trace.add_argument("--batch", type=int, help="micro-batch size of the token-id input")
    trace.add_argument("--seq", type=int, help="sequence length of the token-id input")
    trace.add_argument("--input-shape", type=_shape, metavar="D0,D1,...",
                       help="shape of the one input, for a model that does not start with an nn.Embedding "
                            "(a float tensor in --dtype); replaces --batch/--seq")
    trace.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                       help="compute dtype (FSDP's param_dtype; default bf16)")
    trace.add_argument("--block-type", action="append", metavar="CLASS",
                       help="class name of the blocks (repeatable; default: the layers of the largest nn.ModuleList)")
    trace.add_argument("--name", help="workload name (default: the model's class name)")
    trace.add_argument("-o", "--output", required=True, metavar="FILE", help="workload file to write (.yaml or .json)")
    trace.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    trace.set_defaults(func=_trace)
    topo = sub.add_parser("topology", help="write the scenario's cluster as a graph (GraphML) for other tools",
                          description="GPUs, each node's scale-up switch, NICs, leaf and spine switches, with "
                                      "each link's kind, bandwidth_Bps and latency_s from the hardware profile.")
    topo.add_argument("scenario", help="path to a scenario YAML file")
    topo.add_argument("-o", "--output", required=True, metavar="FILE.graphml", help="GraphML file to write")
    topo.add_argument("--topology", choices=("rail_optimized", "fat_tree"),
                      help="NIC i of every node on rail i's leaf, or each node's NICs on its group's leaf "
                           "(default: the scenario's hardware.network.topology, else its rail_optimized)")
    topo.add_argument("--spines", type=int, metavar="N",
                      help="spine switches (default: hardware.network.spines, else half the leaves)")
    topo.add_argument("--nodes-per-leaf", type=int, metavar="N",
                      help="nodes under one leaf (default: hardware.network.nodes_per_leaf, else 32 a rail "
                           "leaf; 32 NIC ports a fat-tree leaf)")
    topo.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    topo.set_defaults(func=_topology)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A ScenarioWarning is one line, `fsdp-sim: warning: ...`; any other warning as Python shows it."""
    if issubclass(category, ScenarioWarning):
        print(f"fsdp-sim: warning: {message}", file=sys.stderr)
    else:
        _PYTHON_SHOWWARNING(message, category, filename, lineno, file, line)


_PYTHON_SHOWWARNING = warnings.showwarning


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("default", ScenarioWarning)  # each once per process, not once per sweep point
        warnings.showwarning = _show_warning
        try:
            return args.func(args)
        except ScenarioError as exc:
            print(f"fsdp-sim: error: {exc}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    sys.exit(main())
