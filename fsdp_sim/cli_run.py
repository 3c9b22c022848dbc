"""The commands on one scenario or model: `run` (simulate, print the summary, write what was asked for),
`trace` (a PyTorch model into a workload file) and `topology` (the cluster as GraphML); and the file
writing every command shares, where an unwritable path becomes one `ScenarioError` line (cli.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from fsdp_sim.errors import ScenarioError


def strict_json(data, **kw) -> str:
    """Strict JSON (no NaN or Infinity, which JSON does not have): a figure that is not finite is refused."""
    try:
        return json.dumps(data, allow_nan=False, **kw)
    except (ValueError, TypeError) as exc:
        raise ScenarioError(f"a result cannot be written as JSON ({exc})") from None


def write_file(path: str, text: str | bytes) -> None:
    try:
        if isinstance(text, bytes):
            Path(path).write_bytes(text)
        else:
            Path(path).write_text(text)
    except OSError as exc:
        raise ScenarioError(f"cannot write {path}: {exc.strerror}") from None


def run_command(args: argparse.Namespace) -> int:
    """`run`: the scenario (with its --set what-ifs), simulated once or per rank; the files asked for; exit 1
    only for --require-fit when the step does not fit."""
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
        write_file(args.json, strict_json(data, indent=2) + "\n")
    if args.trace:
        write_file(args.trace, strict_json(ranks_trace(result) if args.per_rank else chrome_trace(result)))
    if args.timeline_csv:
        write_file(args.timeline_csv, timeline_csv(result))
    if args.memory_snapshot:
        import pickle

        from fsdp_sim.results.memory_viz import memory_snapshot

        write_file(args.memory_snapshot, pickle.dumps(memory_snapshot(result)))
    if args.html:
        from fsdp_sim.results.html import run_report

        write_file(args.html, run_report(result, data))
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


def trace_command(args: argparse.Namespace) -> int:
    from fsdp_sim.torch_tools.trace import trace_factory
    from fsdp_sim.workload.io import workload_to_text

    workload = trace_factory(args.factory, batch=args.batch, seq=args.seq, dtype=args.dtype,
                             block_types=args.block_type, input_shape=args.input_shape, name=args.name)
    write_file(args.output, workload_to_text(workload, as_json=args.output.lower().endswith(".json")))
    if not args.quiet:
        blocks = sum(m.is_block for m in workload.modules)
        flops = sum(m.fwd_flops + m.bwd_flops for m in workload.modules)
        print(f"{workload.name}: {len(workload.modules)} modules ({blocks} blocks), {workload.numel:,} parameters, "
              f"{flops / 1e12:.3g} TFLOP per step -> {args.output}")
    return 0


def topology_command(args: argparse.Namespace) -> int:
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
