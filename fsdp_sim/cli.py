"""`fsdp-sim run SCENARIO [--set KEY=VALUE ...] [--json F] [--trace F] [--timeline-csv F] [--memory-snapshot F]
[--plot F] [--html F] [--require-fit] [--per-rank [--trace-ranks R,R,...]]`;
`fsdp-sim sweep SCENARIO [--grid GRID] [--set KEY=V1,V2 ...] [-o rows.csv|.json|.jsonl [--resume]] [--plot F]`;
`fsdp-sim recommend SCENARIO [--grid GRID] [--max-batch] [--global-batch N] [--json F] [--save F.yaml] [--plot F]`
(both `[--html F] [--executor local|dask|dask-local] [--scheduler ADDRESS]`);
`fsdp-sim trace package.module:factory --batch B --seq S -o workload.yaml`;
`fsdp-sim topology SCENARIO -o cluster.graphml [--topology rail_optimized|fat_tree] [--spines N]`; `fsdp-sim --version`.

The entry point: the grammar is cli_parser.py's, the commands cli_run.py's (run, trace, topology) and
cli_search.py's (sweep, recommend); here only warnings and errors become lines and exit codes. Bad input (`ScenarioError`) becomes one
line on stderr and exit code 2; a result a script should stop on (a step that does not fit under
`--require-fit`, a sweep whose every point failed, a recommendation with nothing that fits) exits 1.
"""

from __future__ import annotations

import sys
import warnings

from fsdp_sim.cli_parser import build_parser
from fsdp_sim.errors import ScenarioError, ScenarioWarning

__all__ = ["build_parser", "main"]


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
