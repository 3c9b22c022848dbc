"""Graph pricing at scale (hardware/graph_pricing.py): the fast path -- the spine layer as one stand-in
(`topology.SPINES`) and every group of a shape priced from the rings' summed link loads -- gives the answers
of the exact one, every ring laid over every spine and the links divided by `link_sharing.share_links`
(max-min among a shape's groups, the proportional rule between shapes), on random small fabrics."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.hardware.collectives import ProcessGroup
from fsdp_sim.hardware.graph_pricing import GraphPricing, cluster_graph, node_stride
from fsdp_sim.hardware.link_sharing import in_flight, share_links
from fsdp_sim.hardware.profiles import Cluster, load_profile
from fsdp_sim.hardware.rings import group_layouts, uniform_spines
from fsdp_sim.hardware.topology import SPINES, build_topology, with_bandwidth, with_faults
from fsdp_sim.hardware.variation import LinkFault

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _exact_busbw(graph, name, group, kind):
    """Every group of the shape on its own ring over every spine, max-min fair: the slowest's bus bandwidth."""
    layouts = group_layouts(graph, group, node_stride=node_stride(name, group, graph.graph["nodes"]))
    return min(share_links(graph, [in_flight(graph, kind, 1.0, gpus) for gpus in layouts]).busbw_Bps)


def _exact_slowdowns(graph, groups, entries):
    """The proportional rule over every ring of every entry, each asking at its shape's rate alone."""
    flights, owner, alone = [], [], []
    for i, (name, kind) in enumerate(entries):
        group = groups[name]
        layouts = group_layouts(graph, group, node_stride=node_stride(name, group, graph.graph["nodes"]))
        flights += [in_flight(graph, kind, 1.0, gpus) for gpus in layouts]
        owner += [i] * len(layouts)
        alone += [_exact_busbw(graph, name, group, kind)] * len(layouts)
    shared = share_links(graph, flights, rule="proportional", alone_Bps=alone).busbw_Bps
    worst = [math.inf] * len(entries)
    for i, bw in zip(owner, shared):
        worst[i] = min(worst[i], bw)
    return [1.0 if math.isinf(a) else max(1.0, a / w) if w > 0 else math.inf
            for a, w in zip((_exact_busbw(graph, n, groups[n], k) for n, k in entries), worst)]


@st.composite
def fabrics(draw):
    gpu = load_profile(draw(st.sampled_from(["a100-80gb", "mi300x", "l40s", "a10g"])))
    nodes, gpn = draw(st.integers(2, 8)), draw(st.sampled_from([1, 2, 4, 8]))
    network = replace(gpu.fabric.network, topology=draw(st.sampled_from(["rail_optimized", "fat_tree"])),
                      nodes_per_leaf=draw(st.integers(1, 4)), spines=draw(st.none() | st.integers(1, 3)),
                      oversubscription=draw(st.sampled_from([1.0, 1.5, 2.0, 4.0])))
    cluster = Cluster(gpu, nodes, gpn, network)
    nics = network.nics_per_node
    faults = draw(st.lists(st.tuples(st.integers(0, nodes - 1), st.integers(1, max(1, nics - 1)),
                                     st.sampled_from([0.0, 0.3, 0.5])), max_size=4, unique_by=lambda f: f[:2]))
    faults = tuple(LinkFault(*f) for f in sorted(faults) if f[1] < nics)  # NIC 0 (beside GPU 0) stays up
    world = nodes * gpn
    shard = draw(st.sampled_from([s for s in range(1, world + 1) if world % s == 0]))
    groups = {"shard": ProcessGroup(shard, -(-shard // gpn)),
              "replicate": ProcessGroup(world // shard, world // shard if shard >= gpn else nodes)}
    return cluster, faults, groups


@settings(max_examples=80, deadline=None)
@given(fabrics(), st.booleans(), st.data())
def test_the_fast_path_prices_as_every_ring_over_every_spine(fabric, slow_spine, data):
    """Every spine drawn (`build_topology`): priced through the stand-in, and with every spine laid; and
    on the graph the pricing builds, the spine layer one vertex (`cluster_graph`)."""
    cluster, faults, groups = fabric
    graph = with_faults(build_topology(cluster), faults, cluster)
    ways = [GraphPricing(graph, groups), GraphPricing(graph, groups, spines=True)]
    if slow_spine:  # a spine link unlike the others: no stand-in, every spine laid
        graph = with_bandwidth(graph, "spine0", data.draw(st.sampled_from([1e9, 5e9])))
        assert uniform_spines(graph) is None or sum(k == "spine" for _, k in graph.nodes(data="kind")) == 1
        ways = [GraphPricing(graph, groups)]
    else:
        ways.append(GraphPricing(cluster_graph(cluster, faults), groups))
    priced = [name for name in groups if ways[0].priced(name)]
    for name in priced:
        for kind in KINDS:
            exact = _exact_busbw(graph, name, groups[name], kind)
            assert [way.busbw_Bps(name, kind) for way in ways] == pytest.approx([exact] * len(ways), rel=1e-9)
    if priced:
        entries = tuple(data.draw(st.lists(st.tuples(st.sampled_from(priced), st.sampled_from(KINDS)),
                                           min_size=1, max_size=3)))
        exact = _exact_slowdowns(graph, groups, entries)
        for way in ways:
            assert way.slowdowns(entries) == pytest.approx(exact, rel=1e-9)


def test_the_stand_in_carries_each_leafs_uplinks_together():
    """4 DGX-A100 nodes, 2 a fat-tree leaf, 2:1: each leaf's 16 NICs x 24 GB/s halved = 192 GB/s over its
    uplinks to the one spine; 3 spines split it three ways and the stand-in sums them back."""
    gpu = load_profile("a100-80gb")
    for spines in (1, 3):
        network = replace(gpu.fabric.network, topology="fat_tree", nodes_per_leaf=2, spines=spines,
                          oversubscription=2.0)
        cluster = Cluster(gpu, 4, 8, network)
        capacity = uniform_spines(build_topology(cluster))
        assert capacity[("leaf0", SPINES)] == pytest.approx(2 * 8 * 24e9 / 2)
        assert capacity[(SPINES, "leaf1")] == pytest.approx(2 * 8 * 24e9 / 2)
        one = cluster_graph(cluster)  # what the pricing builds: the layer one vertex, the count kept
        assert one.edges["leaf0", SPINES]["bandwidth_Bps"] == pytest.approx(2 * 8 * 24e9 / 2)
        assert (sum(k == "spine" for _, k in one.nodes(data="kind")), one.graph["spines"]) == (1, spines)
