"""Collectives priced on the cluster graph: the bus bandwidth NCCL's rings get on the real links, and what
collectives in flight cost each other on the links they really cross.

Why a second pricing beside `collectives.py`'s closed forms. The closed forms are right on a uniform,
non-blocking fabric: there a ring's bus bandwidth is min(scale-up ring plateau, the group's share of the
node's NIC sum), and the graph gives exactly that (tests/test_topology.py, every profile and group shape).
They cannot say what a NIC down or slow does (`variation.links`: the ring reroutes over the node's other
NICs, PXN, and the slowest node paces it), nor where oversubscription bites: the closed form divides every
off-rail ring by the core's oversubscription, where a ring in node order crosses a leaf's uplinks with one
node's traffic (a 2:1 core is then no limit) and a ring whose every hop changes leaf (HSDP's replicate
group over shard groups as large as a leaf, a job scattered over leaves) has every NIC of the leaf asking
the uplinks at once, which halves it at 2:1. So the graph prices the collectives exactly when the fabric
departs from uniform (`needs_graph`: oversubscription above 1, or a NIC fault), and the closed forms,
which agree with it elsewhere, keep the default path free of its cost.

How links are shared. Among the groups of one shape (SPMD) max-min fair: alike rings on alike links get
alike shares. Among collectives of different shapes in flight, the closed forms' proportional rule
(`collectives.shared_slowdown`) on the links really crossed: each asks for its SPMD rate, a link asked L
times its capacity slows everything crossing it L times, a collective is slowed by its most asked link.
Max-min in bus-bandwidth units would be wrong there: a shard ring puts 1/8 of its rate on each NIC, a
replicate ring all of its own on one, so equal bus bandwidths would starve the shard ring to an eighth of
the NIC, where a NIC serving its flows in turn gives each flow its half. Where the graph's links are the
closed forms' per-rank links (a uniform non-blocking fabric) the two give the same slowdowns.

What is computed, once. The graph for a (profile's fabric, nodes, GPUs a node, faults) is built once per
process (`_GRAPHS`); each process group's SPMD layouts (every group of its shape runs the collective at
once, `rings.group_layouts`) are laid once and their rings' link loads summed; the bus bandwidth of
each (group, kind) is the slowest layout's with the links shared among all of them (max-min fair, as
`link_sharing.share_links` divides them), and the slowdown of each set of collectives in flight (a tuple
of (group, kind)) is found once and remembered: the engine meets only a handful of such sets in a step.
Both read only the summed loads (`GraphPricing.busbw_Bps`, `slowdowns` say why that is exact), so the
pricing is linear in the cluster's size: one pass over its rings, one over the links they cross (a
hop between leaves crosses `topology.SPINES`, the spine layer as one vertex, not each spine).

Known limits: rings only (no Tree, PAT, NVLS across nodes); an NVLS all-reduce inside a node is shared
with the others as the ring it would otherwise run; a group whose shape does not tile the cluster is
priced by the closed forms.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: networkx takes ~0.2 s to import, and most steps never build a graph
    import networkx as nx

from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.collectives import ProcessGroup
from fsdp_sim.hardware.profiles import Cluster
from fsdp_sim.hardware.rings import Edge, alone_busbw_Bps, group_layouts, path_loads, ring_paths, uniform_spines, wire_cost
from fsdp_sim.hardware.topology import SCALE_UP_EDGES, build_topology, with_faults
from fsdp_sim.hardware.variation import LinkFault

Entry = tuple[str, str]  # (process group name, collective kind)
_GRAPHS: dict[tuple, nx.DiGraph] = {}
_PRICINGS: dict[tuple, GraphPricing] = {}
# graphs kept per process: a sweep over faults or fabrics meets each point's once, and a 1,024-GPU graph
# with its rings' loads is some MB, so the oldest goes when a ninth arrives
_KEPT = 8


def _remember(memo: dict, key, value):
    if len(memo) >= _KEPT:
        del memo[next(iter(memo))]
    memo[key] = value
    return value


def needs_graph(cluster: Cluster, faults: Sequence[LinkFault]) -> bool:
    """Whether the closed forms cannot price this cluster: it spans nodes and has a blocking core, or a NIC
    not at its full rate (one node's collectives never reach its NICs)."""
    return cluster.nodes > 1 and (cluster.fabric.network.oversubscription > 1.0
                                  or any(f.bandwidth < 1.0 for f in faults))


def cluster_graph(cluster: Cluster, faults: Sequence[LinkFault] = ()) -> nx.DiGraph:
    """The cluster's graph with its faults applied, built once per (fabric, nodes, GPUs a node, faults); its
    spine layer is the one vertex `topology.SPINES` (the same prices, a link a leaf rather than a link a
    leaf and spine: `fsdp-sim topology` writes every spine)."""
    key = (cluster.gpu.name, cluster.fabric, cluster.nodes, cluster.gpus_per_node, tuple(faults))
    graph = _GRAPHS.get(key)
    if graph is None:
        graph = _remember(_GRAPHS, key, with_faults(build_topology(cluster, one_spine=True), faults, cluster))
    return graph


def node_stride(name: str, group: ProcessGroup, nodes: int) -> int:
    """How many nodes apart a group's consecutive nodes are: a replicate group's members sit one shard group
    apart (node-major mesh, `costs.OpCosts`), every other group is consecutive ranks."""
    if name == "replicate" and group.nodes < nodes and nodes % group.nodes == 0:
        return nodes // group.nodes
    return 1


def graph_pricing(cluster: Cluster, faults: Sequence[LinkFault], groups: Mapping[str, ProcessGroup]) -> GraphPricing:
    """The pricing of `groups` on `cluster`'s graph, one per (graph, groups) in the process."""
    key = (cluster.gpu.name, cluster.fabric, cluster.nodes, cluster.gpus_per_node, tuple(faults),
           tuple(sorted(groups.items())))
    pricing = _PRICINGS.get(key)
    if pricing is None:
        pricing = _remember(_PRICINGS, key, GraphPricing(cluster_graph(cluster, faults), groups))
    return pricing


class GraphPricing:
    """Bus bandwidths and in-flight slowdowns of named process groups' collectives on one graph."""

    def __init__(self, graph: nx.DiGraph, groups: Mapping[str, ProcessGroup], *, spines: bool = False) -> None:
        """`spines`: lay each hop between leaves over every spine, as `rings.ring_paths` does by default,
        even where the spine layer's stand-in gives the same answers (`topology.SPINES`) in far less time."""
        self.graph = graph
        self.groups = dict(groups)
        stand_in = None if spines else uniform_spines(graph)
        self._spines = stand_in is None
        self._capacity = _Capacity(graph, stand_in or {})  # each crossed link's read once, shared often
        self._nics: dict = {}  # `rings.ring_paths`' memo: each NIC read from the graph once for all rings
        self._scale_up: dict[str, set[Edge]] = {}  # by group: the links inside a node its rings cross
        nodes = graph.graph["nodes"]
        self._layouts: dict[str, list[list[str]] | None] = {}
        for name, group in self.groups.items():
            try:
                self._layouts[name] = group_layouts(graph, group, node_stride=node_stride(name, group, nodes))
            except ValueError:  # a shape that does not tile the cluster: the closed forms price it
                self._layouts[name] = None
        self._summed: dict[str, dict[Edge, float]] = {}
        self._loads: dict[Entry, dict[Edge, float]] = {}
        self._alone: dict[Entry, float] = {}
        self._shared: dict[tuple[Entry, ...], tuple[float, ...] | None] = {}

    def facts(self) -> dict:
        """What the JSON's `hardware.collective_pricing` says: priced on the topology graph, because of what
        (`oversubscription` above 1, `nic_faults`: a NIC below its rate; none when a caller asked for the graph),
        the switches' layout as laid, and the process groups the graph prices (the others: closed forms)."""
        g = self.graph.graph
        faulted = any(f is not None and f < 1.0 for _, f in self.graph.nodes(data="bandwidth_fraction"))
        because = ["oversubscription"] * (g["oversubscription"] > 1.0) + ["nic_faults"] * faulted
        return {"priced_on": "topology graph", "because": because, "topology": g["topology"],
                "nodes_per_leaf": g["nodes_per_leaf"], "spines": g["spines"], "oversubscription": g["oversubscription"],
                "groups": sorted(name for name in self.groups if self.priced(name))}

    def priced(self, name: str) -> bool:
        """Whether the graph prices this group (it spans nodes and tiles the cluster)."""
        return self.groups[name].nodes > 1 and self._layouts.get(name) is not None

    def loads(self, entry: Entry) -> dict[Edge, float]:
        """Each link's load when every group of the entry's shape runs its collective (SPMD): the rings'
        loads summed; at bus bandwidth B each ring puts load x B bytes/s on the link."""
        loads = self._loads.get(entry)
        if loads is None:
            name, kind = entry
            summed = self._summed.get(name)
            if summed is None:  # the paths are the kind's own but for the scale-up links' wire cost: laid once
                try:
                    summed = self._summed[name] = path_loads(
                        p for gpus in self._layouts[name]
                        for p in ring_paths(self.graph, gpus, spines=self._spines, memo=self._nics))
                except ValueError as exc:  # a node of fewer GPUs than NICs: its GPUs' own NICs all down
                    raise ScenarioError(f"variation.links: {exc}") from None
                links = self._capacity.links
                self._scale_up[name] = {(u, v) for u, v in summed if links.get(u, {}).get(v, {}).get("kind") in SCALE_UP_EDGES}
            cost, up = wire_cost(self.graph, kind), self._scale_up[name]
            loads = self._loads[entry] = {e: load * cost if e in up else load for e, load in summed.items()}
        return loads

    def busbw_Bps(self, name: str, kind: str) -> float:
        """Large-message bus bandwidth of `kind` on group `name` while every group of its shape runs it.

        That is the slowest group's share under max-min fairness (`link_sharing.share_links`), and the
        slowest's is the first level of the progressive filling: every ring rises at one pace until the
        first link fills, min over links of capacity / the rings' summed load, and the rings crossing it
        stop there while the others rise further. So the links' summed loads (`loads`) give it without
        the filling, in one pass over the links, however many groups the shape has."""
        entry = (name, kind)
        bw = self._alone.get(entry)
        if bw is None:
            bw = self._alone[entry] = alone_busbw_Bps(self._capacity, self.loads(entry))
        return bw

    def slowdowns(self, entries: tuple[Entry, ...]) -> tuple[float, ...] | None:
        """How much slower each collective in flight runs than alone (>= 1), every group of each shape
        running it (SPMD); None when one of the groups is not laid on the graph.

        The proportional rule (`link_sharing`): each ring asks every link it crosses for its load x its
        shape's rate alone, a link asked L times its capacity slows the rings crossing it L times, and a
        ring is slowed by its most asked link. Every ring of a shape asks at the shape's one rate, so a
        link is asked the shapes' summed loads (`loads`) x their rates, and the shape's slowest ring is the
        one on its most asked link: the links its rings cross, taken together."""
        if entries in self._shared:
            return self._shared[entries]
        if any(self._layouts.get(name) is None for name, _ in entries):
            self._shared[entries] = None
            return None
        alone = [self.busbw_Bps(*entry) for entry in entries]
        asked: dict[Edge, float] = defaultdict(float)
        for entry, bw in zip(entries, alone):
            if math.isfinite(bw):  # one that crosses no link asks none
                for e, load in self.loads(entry).items():
                    asked[e] += load * bw
        capacity, out = self._capacity, []
        for entry, bw in zip(entries, alone):
            over = max((asked[e] / capacity[e] for e in self.loads(entry) if capacity[e] > 0), default=1.0)
            out.append(1.0 if math.isinf(bw) else max(1.0, over) if bw > 0 else math.inf)
        self._shared[entries] = out = tuple(out)
        return out
        return out


class _Capacity(dict):
    """Each link's bandwidth_Bps, read from the graph the first time a ring's load asks for it (a cluster's
    graph has every leaf joined to every spine, links the stand-in's rings never cross); the stand-in's given."""

    def __init__(self, graph: nx.DiGraph, given: Mapping[Edge, float]) -> None:
        super().__init__(given)
        self.links = dict(graph.adjacency())  # vertex -> {its successor: the link's attributes}

    def __missing__(self, edge: Edge) -> float:
        u, v = edge
        bw = self[edge] = self.links[u][v]["bandwidth_Bps"]
        return bw
