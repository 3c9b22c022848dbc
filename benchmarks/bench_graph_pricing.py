"""How long pricing collectives on the cluster graph takes as the cluster grows (issue 26's speed: the
graph path was super-linear, 1,024 nodes of H100 21.6 CPU s and 513 MB for the pricing alone).

Llama 3 405B (scenarios/llama3-405b-1024xh100.yaml) on N nodes of 8 H100 with a 2:1 core, so the graph
prices (`graph_pricing.needs_graph`), FULL_SHARD over the world and HYBRID_SHARD over shard groups of 256
(32 nodes, the replicate rings crossing the spines). For each: the pricing alone (the graph built, the
bus bandwidth of every group and kind, one in-flight mix) and a whole `simulate()`, each with the graph
caches emptied, beside the closed forms' `simulate()` (oversubscription 1). CPU seconds of this process.
Run from the tree to time: python benchmarks/bench_graph_pricing.py [NODES,NODES,...]
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import replace
from pathlib import Path

from fsdp_sim.datafile import read_data
from fsdp_sim.hardware import graph_pricing
from fsdp_sim.hardware.costs import OpCosts
from fsdp_sim.hardware.profiles import Cluster, load_profile
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.sweep import assign

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "llama3-405b-1024xh100.yaml"
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
HSDP = {"fsdp.sharding_strategy": "HYBRID_SHARD", "fsdp.shard_size": 256}


def _cold(fn):
    graph_pricing._GRAPHS.clear()
    graph_pricing._PRICINGS.clear()
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def _pricing(nodes: int, shard: int) -> None:
    gpu = load_profile("h100-sxm")
    cluster = Cluster(gpu, nodes, gpu.gpus_per_node, replace(gpu.fabric.network, oversubscription=2.0))
    costs = OpCosts(cluster, shard_size=shard, replicate_size=nodes * gpu.gpus_per_node // shard,
                    compute_dtype="bf16", graph=True)
    priced = [name for name in costs.groups if costs.graph.priced(name)]
    for name in priced:
        for kind in KINDS:
            costs.graph.busbw_Bps(name, kind)
    costs.graph.slowdowns(tuple((name, kind) for name, kind in zip(priced, ("all_gather", "all_reduce"))))


def _scenario(base: dict, row: dict):
    data = copy.deepcopy(base)
    for key, value in row.items():
        assign(data, key, value)
    return parse_scenario(data, name=SCENARIO.stem, base=SCENARIO.parent)


def main(argv: list[str]) -> None:
    node_counts = [int(n) for n in argv[0].split(",")] if argv else [64, 128, 512, 1024]
    base = read_data(SCENARIO, "scenario")
    print(f"{'nodes':>6} {'layout':<8} {'pricing':>9} {'simulate, graph':>16} {'closed forms':>13}  (CPU s)")
    for nodes in node_counts:
        for layout, sets in (("FSDP", {}), ("HSDP 256", HSDP)):
            shard = nodes * 8 if not sets else 256
            if nodes * 8 < shard * 2 and sets:
                continue
            _, pricing = _cold(lambda: _pricing(nodes, shard))
            row = {"hardware.nodes": nodes, **sets}
            graph = _scenario(base, row | {"hardware.network.oversubscription": 2})
            closed = _scenario(base, row)
            _, on_graph = _cold(lambda: simulate(graph))
            _, on_closed = _cold(lambda: simulate(closed))
            print(f"{nodes:>6} {layout:<8} {pricing:>9.3f} {on_graph:>16.3f} {on_closed:>13.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
