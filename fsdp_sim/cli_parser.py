"""The command line's grammar: every subcommand, its options and help, and which command function runs it.
Scripts call these names (tests/test_cli.py freezes them); usage errors are one line, exit 2, like bad input.
"""

from __future__ import annotations

import argparse

from fsdp_sim.cli_run import run_command, topology_command, trace_command
from fsdp_sim.cli_search import recommend_command, sweep_command
from fsdp_sim.errors import one_line


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
    run.set_defaults(func=run_command)
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
    sweep.set_defaults(func=sweep_command)
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
    rec.set_defaults(func=recommend_command)
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
    trace.set_defaults(func=trace_command)
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
    topo.set_defaults(func=topology_command)
    return parser
