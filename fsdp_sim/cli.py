"""`fsdp-sim run SCENARIO [--json F] [--trace F] [--timeline-csv F]`.

Argument parsing, file writing and error messages; nothing else. Bad input (`ScenarioError`) becomes one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from fsdp_sim.errors import ScenarioError


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise ScenarioError(f"cannot write {path}: {exc.strerror}") from None


def _run(args: argparse.Namespace) -> int:
    from fsdp_sim.results.export import chrome_trace, timeline_csv
    from fsdp_sim.results.report import summary
    from fsdp_sim.scenario import load_scenario
    from fsdp_sim.simulate import simulate

    scenario = load_scenario(args.scenario)
    if args.safety_margin is not None:
        if not 0 <= args.safety_margin < 1:
            raise ScenarioError(f"--safety-margin: {args.safety_margin} must be in [0, 1)")
        scenario = replace(scenario, safety_margin=args.safety_margin)
    result = simulate(scenario)
    data = result.to_dict()
    if args.json:
        _write(args.json, json.dumps(data, indent=2) + "\n")
    if args.trace:
        _write(args.trace, json.dumps(chrome_trace(result)))
    if args.timeline_csv:
        _write(args.timeline_csv, timeline_csv(result))
    if not args.quiet:
        print(summary(data))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-sim", description="Simulate one PyTorch FSDP training step.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate a scenario file and print the summary")
    run.add_argument("scenario", help="path to a scenario YAML file")
    run.add_argument("--json", metavar="FILE", help="write the full result as JSON")
    run.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace (open in ui.perfetto.dev)")
    run.add_argument("--timeline-csv", metavar="FILE", help="write the memory timeline as CSV")
    run.add_argument("--safety-margin", type=float, metavar="FRACTION", help="memory kept free (default: scenario, 0.10)")
    run.add_argument("-q", "--quiet", action="store_true", help="print nothing; write only the files asked for")
    run.set_defaults(func=_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ScenarioError as exc:
        print(f"fsdp-sim: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
