"""NCCL's ring laid on the cluster graph (`topology.py`): the paths its traffic takes and how much of it.

What NCCL does, and so what `ring_paths` lays. A ring enters and leaves each node once ("Ring Allreduce
requires data to go through each GPU and enter/exit the node once", nccl#687 [C30]), and NCCL runs one
ring per channel, its channels spread over all the node's NICs ("data can flow from the NIC to the
nearest GPU, go through all the other GPUs through NVLink, then exit from the last GPU, back to the NIC",
nccl#412 [C30]). So on each node a ring's traffic is split evenly over the NICs it uses, one channel a
NIC; a channel enters through its NIC at the GPU beside it, visits the group's other GPUs over the
scale-up links and leaves through the same NIC, the last GPU handing its data over NVLink to the NIC's
GPU (PXN [C30]), so that hop stays on the NIC's rail: on a rail-optimised fabric NIC j of one node sends
to NIC j of the next (component-timing 6.4). Each scale-up link then carries the whole ring once per
direction, and each NIC 1 / (its node's NICs) of it: the NIC-sum rule of `collectives.plateau_busbw_Bps`.

Which NICs a group uses: those beside its GPUs that are up (a group of g of a node's G GPUs thus uses
g / G of the NICs, as `_nic_busbw` counts); if none is up, every NIC of the node that is (PXN relays over
the scale-up links). A NIC at 0 B/s is down and gets no channel; one that is merely slow keeps its even
share (NCCL does not weigh channels by speed), so the ring moves at its slowest hop. Between two nodes
the channels pair NICs of one index first (one rail); what one side cannot pair (a NIC down) is spread
over the other side's remaining NICs in proportion, crossing the spines (ECMP: evenly over them).

Inside a node: through the switch (NVSwitch, PCIe) a send is one path GPU -> switch -> GPU. On a full
mesh (xGMI) RCCL lays several rings so each GPU's sends use its links to all the group's other GPUs: a
send is spread evenly over them, which is what makes a ring of g GPUs reach (g - 1) / (G - 1) of the
node's plateau [S8].

A path's `share` is the fraction of the ring's per-hop traffic it carries: at bus bandwidth B a path
moves share x B bytes/s over each of its links (nccl-tests' busbw is each ring hop's bytes per second
[S1]). `ring_loads` sums the shares on each link, scaling those inside a node by the kind's wire cost.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: networkx takes ~0.2 s to import, and most steps never build a graph
    import networkx as nx

from fsdp_sim.hardware.collectives import ProcessGroup
from fsdp_sim.hardware.fabric import KINDS
from fsdp_sim.hardware.topology import HUB_KIND, SCALE_UP_EDGES, SPINES, gpu_name, nic_name

Edge = tuple[str, str]


@dataclass(frozen=True, slots=True)
class RingPath:
    """Graph nodes a part of the ring's traffic goes through, and that part (a fraction of the whole)."""

    nodes: tuple[str, ...]
    share: float


def ring_paths(graph: nx.DiGraph, gpus: Sequence[str], *, spines: bool = True,
               memo: dict | None = None) -> tuple[RingPath, ...]:
    """The paths of one NCCL ring over `gpus` (GPU names, rank order; a node's GPUs are visited together,
    in the order its first one appears). A ring of one GPU has none. `spines=False`: a hop between leaves
    goes through `SPINES`, one stand-in for the whole spine layer, rather than over each spine (see
    `SPINES`; only where `uniform_spines` holds). `memo`: what each NIC is (`_nic`), kept by a caller that
    lays many rings on one graph it does not change."""
    memo = {} if memo is None else memo
    nodes = _by_node(graph, gpus)
    if len(nodes) == 1:
        k, members = nodes[0]
        hub = _hub(graph, k)
        return tuple(p for a, b in zip(members, members[1:] + members[:1]) if a != b
                     for p in _send(hub, a, b, members, 1.0))
    channels = {k: _channels(graph, k, members, memo) for k, members in nodes}
    paths: list[RingPath] = []
    for k, members in nodes:
        paths += _through_node(graph, _hub(graph, k), k, members, channels[k], memo)
    between: dict[tuple[str, str], list[str]] = {}  # by (leaf, leaf): the spines between, found once
    for (k, _), (nxt, _) in zip(nodes, nodes[1:] + nodes[:1]):
        for i, j, share in _pair(channels[k], channels[nxt]):
            a, b = nic_name(k, i), nic_name(nxt, j)
            paths += [RingPath(path, share * part) for path, part in _route(graph, a, b, between, spines, memo)]
    return tuple(paths)


def wire_cost(graph: nx.DiGraph, kind: str) -> float:
    """Link time per byte of `kind` inside a node, against the best ring: R / its own plateau (>= 1). The
    scale-up links run at the best of the profile's ring plateaus; a kind measured lower (H100 all-gather
    350 GB/s against all-reduce's 370 [S20e, C29]) spends more link time per byte."""
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r} is not one of {KINDS}")
    return graph.graph["scale_up_Bps"] / graph.graph[f"{kind}_busbw_Bps"]


def path_loads(paths: Iterable[RingPath]) -> dict[Edge, float]:
    """Each link's share of the paths' traffic, every link at wire cost 1 (the best kind's, `wire_cost`)."""
    loads: dict[Edge, float] = defaultdict(float)
    for path in paths:
        nodes, share = path.nodes, path.share
        for edge in zip(nodes, nodes[1:]):
            loads[edge] += share
    return loads


def ring_loads(graph: nx.DiGraph, paths: Sequence[RingPath], kind: str) -> dict[Edge, float]:
    """Each link's share of the ring's traffic: at bus bandwidth B the link carries load x B bytes/s."""
    loads = path_loads(paths)
    cost = wire_cost(graph, kind)
    edges = graph.edges
    return {e: load * cost if edges[e]["kind"] in SCALE_UP_EDGES else load for e, load in loads.items()}


def alone_busbw_Bps(capacity: Mapping[Edge, float], loads: Mapping[Edge, float]) -> float:
    """The bus bandwidth a ring reaches with the links to itself: its tightest link's capacity / load
    (`capacity`: each link's bytes/s, the graph's `bandwidth_Bps`)."""
    return min((capacity[e] / load for e, load in loads.items() if load > 0), default=math.inf)


def group_layouts(graph: nx.DiGraph, group: ProcessGroup, *, node_stride: int = 1) -> list[list[str]]:
    """Every process group of `group`'s shape, as FSDP runs them all at once (SPMD): ranks_per_node
    consecutive GPUs on each of `nodes` nodes `node_stride` apart (1: consecutive nodes, a shard group;
    HSDP's replicate group over shard groups of s nodes: stride s), until the cluster is covered."""
    nodes, gpn = graph.graph["nodes"], graph.graph["gpus_per_node"]
    per_node = group.ranks // group.nodes
    span = group.nodes * node_stride
    if group.ranks % group.nodes or gpn % per_node or nodes % span:
        raise ValueError(f"{group} with node stride {node_stride} does not tile {nodes} nodes of {gpn} GPUs")
    layouts = []
    for start in range(0, nodes, span):
        for offset in range(node_stride):
            members = [start + offset + t * node_stride for t in range(group.nodes)]
            for first in range(0, gpn, per_node):
                layouts.append([gpu_name(k, first + i) for k in members for i in range(per_node)])
    return layouts


# ---- laying one ring ------------------------------------------------------------------------------
def _by_node(graph: nx.DiGraph, gpus: Sequence[str]) -> list[tuple[int, list[str]]]:
    by_node: dict[int, list[str]] = {}
    for gpu in gpus:
        data = graph.nodes.get(gpu)
        if data is None or data.get("kind") != "gpu":
            raise ValueError(f"{gpu!r} is not a GPU of the graph")
        by_node.setdefault(data["node"], []).append(gpu)
    if len(set(gpus)) != len(gpus):
        raise ValueError("a ring visits each GPU once")
    return list(by_node.items())


def _hub(graph: nx.DiGraph, node: int) -> str | None:
    hub = f"n{node}/{HUB_KIND.get(graph.graph['scale_up'], '')}"
    return hub if hub in graph else None


def _send(hub: str | None, a: str, b: str, members: list[str], share: float) -> list[RingPath]:
    """GPU a's send to GPU b of the same node: through the switch; on a mesh, a ring hop is spread over
    a's links to the group's other GPUs, a relay to or from a GPU outside the group goes direct."""
    if hub is not None:
        return [RingPath((a, hub, b), share)]
    if a in members and b in members:
        others = [m for m in members if m != a]
        return [RingPath((a, m), share / len(others)) for m in others]
    return [RingPath((a, b), share)]


def _nic(graph: nx.DiGraph, nic: str, memo: dict) -> tuple[list[str], bool, str]:
    """The GPUs a NIC sits beside, whether it is up (every link of it carries traffic) and its leaf, read
    from the graph once per `memo`."""
    found = memo.get(nic)
    if found is None:  # by the links' kinds (`topology.py`): one pass over the NIC's few links each way
        into, out = graph.pred[nic].items(), graph.succ[nic].items()
        found = memo[nic] = ([u for u, d in into if d["kind"] == "nic_attach"],
                             all(d["bandwidth_Bps"] > 0 for _, d in into) and all(d["bandwidth_Bps"] > 0 for _, d in out),
                             next(v for v, d in out if d["kind"] == "nic_uplink"))
    return found


def _channels(graph: nx.DiGraph, node: int, members: list[str], memo: dict) -> dict[int, float]:
    """NIC index -> the share of the ring's traffic entering and leaving the node through it."""
    nics = [(j, _nic(graph, nic_name(node, j), memo)) for j in range(graph.graph["nics_per_node"])]
    up = [j for j, (attached, alive, _) in nics if attached and alive]  # beside a GPU of the job
    ours = set(members)
    own = [j for j, (attached, alive, _) in nics if alive and not ours.isdisjoint(attached)]
    use = own or up
    if not use:
        raise ValueError(f"node {node}: every NIC beside its GPUs is down, the ring cannot leave it")
    return dict.fromkeys(use, 1.0 / len(use))


def _through_node(graph: nx.DiGraph, hub: str | None, node: int, members: list[str], channels: dict[int, float],
                  memo: dict) -> list[RingPath]:
    """Each channel: in through its NIC at the GPU beside it, round the group's GPUs, out the same NIC.

    A channel entering at member s sends along every cyclic pair of the members but the one into s
    (members[s - 1] -> members[s]), so each pair's sends are summed over the channels: one path a pair,
    not one a pair and channel (a node of G GPUs and G NICs: 2G paths, not G^2)."""
    paths: list[RingPath] = []
    sends: dict[tuple[str, str], float] = defaultdict(float)  # GPU to GPU, over the channels
    total = 0.0
    for j, share in channels.items():
        nic = nic_name(node, j)
        attached = _nic(graph, nic, memo)[0]
        beside = [m for m in members if m in attached]
        entry = beside[0] if beside else members[0]
        home = entry if beside else attached[0]  # the GPU beside the NIC: a relay when not in the group
        start = members.index(entry)
        last = members[start - 1]  # the channel's round ends where it would close the ring
        paths.append(RingPath((nic, home), share))
        if home != entry:
            sends[home, entry] += share
        total += share
        sends[last, entry] -= share  # the one pair of the round it does not send along
        if last in attached:
            paths.append(RingPath((last, nic), share))
        else:
            sends[last, home] += share
            paths.append(RingPath((home, nic), share))
    if len(members) > 1:
        for a, b in zip(members, members[1:] + members[:1]):
            sends[a, b] += total
    for (a, b), share in sends.items():
        if a != b and share > 1e-12:
            paths += _send(hub, a, b, members, share)
    return paths


def _pair(out: dict[int, float], into: dict[int, float]) -> list[tuple[int, int, float]]:
    """NIC index pairs from one node to the next with their shares: one rail first, the rest spread."""
    pairs, rest_out, rest_in = [], dict(out), dict(into)
    for j in out.keys() & into.keys():
        w = min(out[j], into[j])
        pairs.append((j, j, w))
        rest_out[j] -= w
        rest_in[j] -= w
    total = sum(rest_out.values())
    if total > 1e-12:
        pairs += [(i, j, a * b / total) for i, a in rest_out.items() if a > 1e-12
                  for j, b in rest_in.items() if b > 1e-12]
    return sorted(pairs)


def _route(graph: nx.DiGraph, a: str, b: str, cache: dict, spines: bool,
           memo: dict) -> list[tuple[tuple[str, ...], float]]:
    """NIC a to NIC b: under one leaf, or up to every spine that reaches b's leaf and down (ECMP); through
    the stand-in `SPINES` when `spines` is False."""
    up, down = _nic(graph, a, memo)[2], _nic(graph, b, memo)[2]
    if up == down:
        return [((a, up, b), 1.0)]
    if not spines:
        return [((a, up, SPINES, down, b), 1.0)]
    spines = cache.get((up, down))
    if spines is None:
        edges = graph.edges
        spines = cache[up, down] = [s for s in graph.successors(up) if graph.nodes[s]["kind"] == "spine"
                                    and graph.has_edge(s, down) and edges[up, s]["bandwidth_Bps"] > 0
                                    and edges[s, down]["bandwidth_Bps"] > 0]
        if not spines:
            raise ValueError(f"no spine joins {up} and {down}")
    return [((a, up, s, down, b), 1.0 / len(spines)) for s in spines]


def uniform_spines(graph: nx.DiGraph) -> dict[Edge, float] | None:
    """The capacities of the links to and from `SPINES` ((leaf, SPINES): the leaf's uplinks together,
    (SPINES, leaf): its downlinks), or None where the stand-in would not be exact: a leaf not joined to
    every spine both ways, or its links to them of unequal or zero capacity."""
    kinds = graph.nodes(data="kind")
    spines = {v for v, kind in kinds if kind == "spine"}
    capacity: dict[Edge, float] = {}
    for leaf in (v for v, kind in kinds if kind == "leaf"):
        for links, key in ((graph.succ[leaf], (leaf, SPINES)), (graph.pred[leaf], (SPINES, leaf))):
            caps = [d["bandwidth_Bps"] for v, d in links.items() if v in spines]
            if len(caps) != len(spines) or not caps or min(caps) != max(caps) or not caps[0] > 0:
                return None
            capacity[key] = sum(caps)
    return capacity
