"""The cluster as a graph: GPUs, each node's scale-up domain, its NICs, leaf and spine switches.

Why a graph when `collectives.py` has closed forms: the closed forms price one collective on a uniform
cluster. A graph says what they cannot: which physical links two collectives in flight share, what one
NIC down or slow does to a ring (`rings.py`), and where oversubscription bites (a ring in node order
crosses a leaf's uplinks once per leaf, not once per hop). `link_sharing.py` divides the links.

A directed graph (`networkx.DiGraph`), one edge per direction: every link here is full duplex, and a
ring sends one way on each hop, so a NIC that receives from the previous node and sends to the next
carries each on its own direction. An undirected edge would count both against one capacity and halve
every multi-node ring.

Nodes (attribute `kind`): `gpu` ("n{k}/gpu{i}"), the node's scale-up switch `nvswitch` or `pcie_switch`
("n{k}/nvswitch", "n{k}/pcie_switch"; an xGMI mesh has none, its GPUs are joined pairwise), `nic`
("n{k}/nic{j}"), `leaf` ("leaf{l}") and `spine` ("spine{s}"). GPUs and NICs carry `node` and `index`.

Edges carry `kind`, `bandwidth_Bps` (one direction) and `latency_s`, all from the profile's fabric:
- scale-up (`nvlink`, `xgmi`, `pcie`): a GPU's ring bandwidth R inside the node, the best of the profile's
  three ring plateaus (nccl-tests busbw [S1]); a kind whose plateau is lower moves its bytes at R / P
  wire cost (`rings.wire_cost`). A mesh link is R / (G - 1) of the profile's G-GPU node, so a ring over
  g GPUs that spreads its sends over its g - 1 links gets R (g - 1) / (G - 1) [S8] (`Fabric.scale_up_share`);
- `nic_attach` (GPU to its NIC over PCIe) and `nic_uplink` (NIC to leaf): one NIC's goodput, line rate x
  efficiency (`fabric.network`); the attachment never binds before the NIC itself and is there to say
  which GPU a NIC sits beside (PXN relays from the others over the scale-up links [C30]). A job on g of
  the profile's G GPUs a node reaches only the NICs beside its g GPUs (`job_nic_homes`), g/G of the
  node's NICs as the closed forms count them (`collectives._nic_busbw`); the others are drawn, unattached;
- `spine` (leaf to spine): a leaf's downlink goodput / `oversubscription`, split over the spines.
Latencies sit on the edge leaving the sender, so a path's `latency_s` sums to NCCL's per-hop figure:
the ring hop latency on a GPU's scale-up uplink, the NET hop latency on a NIC's uplink, 0 elsewhere (the
tuner charges one NET latency per inter-node step whatever the switches between [C27]).

Layouts. `rail_optimized`: NIC i of every node on the leaf of rail i, one leaf per rail per scalable unit
of `nodes_per_leaf` nodes, spines above. `fat_tree`: all of a node's NICs on its group's leaf,
`nodes_per_leaf` nodes a leaf, spines above. The topology defaults to the fabric's `rail_optimized` flag.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a graph is built: networkx takes ~0.2 s to import, and most steps build none
    import networkx as nx

from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.hardware.fabric import KINDS, LAYOUTS, SCALE_UP_LINKS
from fsdp_sim.hardware.profiles import Cluster
from fsdp_sim.hardware.variation import LinkFault

TOPOLOGIES = LAYOUTS
# A leaf switch's node-facing ports: a DGX SuperPOD scalable unit is 32 nodes, one leaf per rail, and four
# SUs (128 nodes) take 32 leaves and 16 spines with 1024 node-leaf cables (NVIDIA DGX SuperPOD B200
# reference architecture, docs.nvidia.com/dgx-superpod/reference-architecture-scalable-infrastructure-b200,
# "Larger DGX SuperPOD component counts"). Rail-optimised: 32 nodes a rail leaf; fat tree: 32 NIC ports.
LEAF_DOWNLINKS = 32
SPINES_PER_LEAF = 0.5  # the same table: 16 leaves / 8 spines (2 SUs), 32 / 16 (4 SUs)
SCALE_UP_EDGES = frozenset(SCALE_UP_LINKS.values())  # edge kinds of links inside a node
# The spine layer as one vertex. A hop between leaves is spread evenly over every spine (ECMP), so where
# each leaf has links of one capacity c to all S spines and back (`rings.uniform_spines`: `build_topology`'s
# fabric, whatever NIC is faulted) each of them carries 1/S of the leaf's cross-leaf traffic at 1/S of
# its S c: the same load / capacity as one link of S c carrying it all, in every sharing rule. Pricing
# through it lays one path a hop where the spines lay S, and the graph has a link a leaf where the spines
# have S (S = half the leaves: 128 spines and 65,536 leaf-spine links at 1,024 H100 nodes, 4 million at
# 8,192): both stay linear in the cluster's size.
SPINES = "spine*"
HUB_KIND = {"nvswitch": "nvswitch", "pcie": "pcie_switch"}  # fabric.scale_up -> its switch; a mesh has none


def gpu_name(node: int, index: int) -> str:
    return f"n{node}/gpu{index}"


def nic_name(node: int, index: int) -> str:
    return f"n{node}/nic{index}"


def nic_goodput_Bps(cluster: Cluster) -> float:
    """One NIC's goodput, B/s: line rate (Gb/s) x achievable efficiency (hardware.md 1.3 [S20b, S20c])."""
    net = cluster.fabric.network
    return net.nic_gbps * 1e9 / 8 * net.nic_efficiency


def nic_homes(gpus: int, nics: int) -> list[list[int]]:
    """The GPUs each NIC sits beside: one NIC per GPU on DGX-class nodes [S8], several NICs a GPU when a node
    has more (AWS p5: 32 EFA for 8 GPUs), one NIC for several GPUs when fewer (p4d: 4 for 8)."""
    if nics >= gpus:
        return [[j * gpus // nics] for j in range(nics)]
    return [[i for i in range(gpus) if i * nics // gpus == j] for j in range(nics)]


def job_nic_homes(node_gpus: int, job_gpus: int, nics: int) -> list[list[int]]:
    """`nic_homes` of the profile's `node_gpus`-GPU node, keeping the job's first `job_gpus` GPUs: a NIC beside
    GPUs the job does not run on has no home (no rank there to send through it, nor to relay for PXN)."""
    return [[i for i in home if i < job_gpus] for home in nic_homes(max(node_gpus, job_gpus), nics)]


def build_topology(cluster: Cluster, *, topology: str | None = None, spines: int | None = None,
                   nodes_per_leaf: int | None = None, one_spine: bool = False) -> nx.DiGraph:
    """The cluster's graph (see the module docstring); each argument given overrides `hardware.network`'s
    key of that name. `spines`: default half the leaves (at least one);
    with traffic spread evenly over the spines (ECMP) their number changes no capacity, only the picture.
    `nodes_per_leaf`: default `LEAF_DOWNLINKS` nodes a rail leaf, `LEAF_DOWNLINKS` NICs a fat-tree leaf.
    `one_spine`: the spine layer as the one vertex `SPINES`, each leaf's links to it its uplinks together
    (the graph collectives are priced on, `graph_pricing.cluster_graph`; `graph.graph["spines"]` still
    says how many there are)."""
    fabric, net = cluster.fabric, cluster.fabric.network
    topology = _given(topology, net.topology) or ("rail_optimized" if net.rail_optimized else "fat_tree")
    spines, nodes_per_leaf = _given(spines, net.spines), _given(nodes_per_leaf, net.nodes_per_leaf)
    if topology not in TOPOLOGIES:
        raise ScenarioError(f"topology: {show(topology)} is not one of {list(TOPOLOGIES)}")
    for key, value in (("spines", spines), ("nodes_per_leaf", nodes_per_leaf)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ScenarioError(f"{key}: must be a positive integer, got {show(value)}")
    nodes, gpn, nics = cluster.nodes, cluster.gpus_per_node, net.nics_per_node
    ring = {kind: fabric.ring.busbw_Bps(kind) for kind in KINDS}
    scale_up_Bps = max(ring.values())
    import networkx as nx

    graph = nx.DiGraph(topology=topology, profile=cluster.gpu.name, scale_up=fabric.scale_up, nodes=nodes,
                       gpus_per_node=gpn, nics_per_node=nics, scale_up_Bps=scale_up_Bps,
                       **{f"{kind}_busbw_Bps": bw for kind, bw in ring.items()})
    link, hop = fabric.scale_up_link, fabric.ring.hop_latency_s
    nic_Bps, homes = nic_goodput_Bps(cluster), job_nic_homes(fabric.gpus_per_node, gpn, nics)
    for k in range(nodes):
        gpus = [gpu_name(k, i) for i in range(gpn)]
        graph.add_nodes_from((g, {"kind": "gpu", "node": k, "index": i}) for i, g in enumerate(gpus))
        if fabric.scale_up == "xgmi_mesh":  # every pair joined: a link is 1 / (G - 1) of the node's ring
            per_link = scale_up_Bps / max(fabric.gpus_per_node - 1, 1)
            graph.add_edges_from((a, b, {"kind": link, "bandwidth_Bps": per_link, "latency_s": hop})
                                 for a in gpus for b in gpus if a != b)
        elif gpn > 1:
            hub = f"n{k}/{HUB_KIND[fabric.scale_up]}"
            graph.add_node(hub, kind=HUB_KIND[fabric.scale_up], node=k)
            for g in gpus:
                graph.add_edge(g, hub, kind=link, bandwidth_Bps=scale_up_Bps, latency_s=hop)
                graph.add_edge(hub, g, kind=link, bandwidth_Bps=scale_up_Bps, latency_s=0.0)
        for j, home in enumerate(homes):
            nic = nic_name(k, j)
            graph.add_node(nic, kind="nic", node=k, index=j)
            for i in home:
                graph.add_edge(gpus[i], nic, kind="nic_attach", bandwidth_Bps=nic_Bps, latency_s=0.0)
                graph.add_edge(nic, gpus[i], kind="nic_attach", bandwidth_Bps=nic_Bps, latency_s=0.0)
    if topology == "rail_optimized":
        per_leaf = nodes_per_leaf or LEAF_DOWNLINKS
        units = -(-nodes // per_leaf)
        leaf_of = {(k, j): f"leaf{(k // per_leaf) * nics + j}" for k in range(nodes) for j in range(nics)}
        leaves = units * nics
    else:
        per_leaf = nodes_per_leaf or max(1, LEAF_DOWNLINKS // nics)
        leaf_of = {(k, j): f"leaf{k // per_leaf}" for k in range(nodes) for j in range(nics)}
        leaves = -(-nodes // per_leaf)
    down: dict[str, float] = {}
    for (k, j), leaf in leaf_of.items():
        if leaf not in graph:
            graph.add_node(leaf, kind="leaf", index=int(leaf[4:]))
        nic = nic_name(k, j)
        graph.add_edge(nic, leaf, kind="nic_uplink", bandwidth_Bps=nic_Bps, latency_s=net.hop_latency_s)
        graph.add_edge(leaf, nic, kind="nic_uplink", bandwidth_Bps=nic_Bps, latency_s=0.0)
        down[leaf] = down.get(leaf, 0.0) + nic_Bps
    spines = spines or max(1, math.floor(leaves * SPINES_PER_LEAF))
    # the layout as laid, defaults resolved: what the JSON says collectives were priced on (graph_pricing.facts)
    graph.graph.update(nodes_per_leaf=per_leaf, spines=spines, oversubscription=net.oversubscription)
    for s in range(1 if one_spine else spines):
        spine = SPINES if one_spine else f"spine{s}"
        graph.add_node(spine, kind="spine", index=s)
        for leaf, down_Bps in down.items():
            up = down_Bps / net.oversubscription / (1 if one_spine else spines)
            graph.add_edge(leaf, spine, kind="spine", bandwidth_Bps=up, latency_s=0.0)
            graph.add_edge(spine, leaf, kind="spine", bandwidth_Bps=up, latency_s=0.0)
    return graph


def with_bandwidth(graph: nx.DiGraph, node: str, bandwidth_Bps: float) -> nx.DiGraph:
    """A copy of `graph` where every link of `node` (both directions) runs at `bandwidth_Bps`: 0 for a NIC
    or switch that is down, a fraction of its rate for one that trained at a lower speed."""
    if node not in graph:
        raise ValueError(f"{node!r} is not in the graph")
    if not bandwidth_Bps >= 0:
        raise ValueError(f"bandwidth_Bps must be >= 0, got {bandwidth_Bps!r}")
    out = graph.copy()
    for u, v in [*out.out_edges(node), *out.in_edges(node)]:
        out.edges[u, v]["bandwidth_Bps"] = float(bandwidth_Bps)
    return out


def _given(argument, scenario):
    return scenario if argument is None else argument


def with_faults(graph: nx.DiGraph, faults: Sequence[LinkFault], cluster: Cluster) -> nx.DiGraph:
    """`graph` with `variation.links` applied: each NIC's links at its fraction of the NIC's goodput (0: down),
    the NIC marked with `bandwidth_fraction` (a GraphML attribute a user's tools can find). One copy for all."""
    if not faults:
        return graph
    out, nic_Bps = graph.copy(), nic_goodput_Bps(cluster)
    for fault in faults:
        nic = nic_name(fault.node, fault.nic)
        if nic not in out:
            raise ValueError(f"{nic!r} is not in the graph")
        out.nodes[nic]["bandwidth_fraction"] = fault.bandwidth
        for u, v in [*out.out_edges(nic), *out.in_edges(nic)]:
            out.edges[u, v]["bandwidth_Bps"] = fault.bandwidth * nic_Bps
    return out


def describe(graph: nx.DiGraph) -> str:
    """One line: what the graph holds, for the CLI."""
    kinds: dict[str, int] = {}
    for _, kind in graph.nodes(data="kind"):
        kinds[kind] = kinds.get(kind, 0) + 1
    g = graph.graph
    return (f"{kinds.get('gpu', 0)} GPUs on {g['nodes']} nodes ({g['profile']}, {g['scale_up']}), "
            f"{kinds.get('nic', 0)} NICs, {kinds.get('leaf', 0)} leaves, {kinds.get('spine', 0)} spines "
            f"({g['topology']}); {graph.number_of_nodes()} vertices, {graph.number_of_edges()} directed links"
            f"{_faults(graph)}")


def _faults(graph: nx.DiGraph) -> str:
    marked = [(v, f) for v, f in graph.nodes(data="bandwidth_fraction") if f is not None]
    if not marked:
        return ""
    down = sum(1 for _, f in marked if f == 0)
    return f"; {down} NIC{'s' if down != 1 else ''} down, {len(marked) - down} slow (variation.links)"
