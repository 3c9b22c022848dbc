"""The cluster as a graph: NCCL's rings laid on it give the closed forms where those are right, and say
what they cannot (a NIC down, a slow NIC, an oversubscribed spine, links shared by collectives in flight).

Expected figures are typed from the references, never taken from the model: NIC goodputs of hardware.md
1.3 (HDR 24 of 25 GB/s: 8 x 24 = 192, DGX-A100's measured all-reduce busbw [S20a]; NDR 47 of 50 on H100;
B200 over 8x 400G EFA 381.8 GB/s [S8] = 8 x 47.75), the ring plateaus of hardware.md 3.3 (8xA100 234.9,
8xH100 all-gather 350 / all-reduce 370 [S20e, C29], 8xB200 682, MI300X 312.9 with a ring of g GPUs using
g - 1 of 7 links), and the DGX SuperPOD table (4 SUs, 128 nodes: 32 leaves, 16 spines).
"""

from __future__ import annotations

import time
from dataclasses import replace

import networkx as nx
import pytest
import yaml

from fsdp_sim.cli import main
from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.collectives import ProcessGroup, link_loads, plateau_busbw_Bps, shared_slowdown
from fsdp_sim.hardware.link_sharing import InFlight, in_flight, share_links, spmd_busbw_Bps
from fsdp_sim.hardware.profiles import Cluster, load_profile
from fsdp_sim.hardware.rings import ring_loads, ring_paths
from fsdp_sim.hardware.topology import build_topology, with_bandwidth

GB = 1e9
NIC_SUM_GBPS = {"a100-80gb": 192.0, "b200": 382.0, "h100-sxm": 376.0}  # 8 NICs x goodput per node
RING_GBPS = {"a100-80gb": {"all_gather": 234.9, "reduce_scatter": 234.9, "all_reduce": 234.9},
             "b200": {"all_gather": 682.0, "reduce_scatter": 682.0, "all_reduce": 682.0},
             "h100-sxm": {"all_gather": 350.0, "reduce_scatter": 360.0, "all_reduce": 370.0}}


def _cluster(profile: str, nodes: int, **network) -> Cluster:
    gpu = load_profile(profile)
    return Cluster(gpu, nodes, gpu.gpus_per_node, replace(gpu.fabric.network, **network) if network else None)


def _ring(nodes, gpus=range(8)) -> list[str]:
    return [f"n{k}/gpu{i}" for k in nodes for i in gpus]


def _alone_GBps(graph, kind: str, gpus: list[str]) -> float:
    return share_links(graph, [in_flight(graph, kind, 1.0, gpus)]).busbw_Bps[0] / GB


# ---- the graph ------------------------------------------------------------------------------------
def test_graph_holds_nodes_nics_rails_and_the_profiles_figures():
    graph = build_topology(_cluster("h100-sxm", 2))
    kinds = nx.get_node_attributes(graph, "kind")
    count = {k: sum(v == k for v in kinds.values()) for k in ("gpu", "nvswitch", "nic", "leaf", "spine")}
    assert count == {"gpu": 16, "nvswitch": 2, "nic": 16, "leaf": 8, "spine": 4}  # one leaf per rail
    assert graph.edges["n0/gpu3", "n0/nvswitch"]["bandwidth_Bps"] == pytest.approx(370 * GB)  # best ring plateau
    assert graph.edges["n0/gpu3", "n0/nvswitch"]["latency_s"] == pytest.approx(3.4e-6)  # NVLink ring hop
    uplink = graph.edges["n1/nic5", "leaf5"]
    assert (uplink["kind"], uplink["bandwidth_Bps"], uplink["latency_s"]) == ("nic_uplink", pytest.approx(47 * GB),
                                                                            pytest.approx(14e-6))
    assert graph.has_edge("n0/gpu5", "n0/nic5") and not graph.has_edge("n0/gpu4", "n0/nic5")  # NIC beside its GPU
    # a NIC-to-NIC path sums to one NET hop, a GPU-to-GPU one to one NVLink hop
    assert nx.path_weight(graph, ["n0/nic2", "leaf2", "n1/nic2"], "latency_s") == pytest.approx(14e-6)
    assert nx.path_weight(graph, ["n0/gpu0", "n0/nvswitch", "n0/gpu1"], "latency_s") == pytest.approx(3.4e-6)
    fat = build_topology(_cluster("a100-80gb", 8, oversubscription=2.0), topology="fat_tree", nodes_per_leaf=4)
    assert {v for u, v in fat.out_edges(["n0/nic0", "n0/nic7"]) if v.startswith("leaf")} == {"leaf0"}
    assert fat.edges["n5/nic3", "leaf1"]["kind"] == "nic_uplink"
    # leaf uplinks: 4 nodes x 8 NICs x 24 GB/s down, halved, over the one spine of two leaves
    assert fat.edges["leaf1", "spine0"]["bandwidth_Bps"] == pytest.approx(4 * 8 * 24 * GB / 2)


def test_the_1024_gpu_graph_builds_in_well_under_a_second():
    start = time.perf_counter()
    graph = build_topology(_cluster("h100-sxm", 128))
    elapsed = time.perf_counter() - start
    kinds = list(nx.get_node_attributes(graph, "kind").values())
    assert (kinds.count("gpu"), kinds.count("nic"), kinds.count("leaf"), kinds.count("spine")) == (1024, 1024, 32, 16)
    assert elapsed < 0.5, f"{elapsed:.3f} s"


def test_bad_topology_input_is_one_line_naming_the_key():
    cluster = _cluster("h100-sxm", 2)
    with pytest.raises(ScenarioError, match=r"^topology: 'torus' is not one of"):
        build_topology(cluster, topology="torus")
    with pytest.raises(ScenarioError, match=r"^spines: must be a positive integer, got 0"):
        build_topology(cluster, spines=0)
    with pytest.raises(ScenarioError, match=r"^nodes_per_leaf: must be"):
        build_topology(cluster, nodes_per_leaf=True)


# ---- one ring alone -------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", sorted(NIC_SUM_GBPS))
@pytest.mark.parametrize("nodes", [2, 3, 16, 64])
@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_a_ring_over_a_rail_fabric_gives_the_closed_forms_nic_sum(profile, nodes, kind):
    """min(the node's ring plateau, its NIC sum): A100 and B200 are NIC-bound, H100's NVLink ring binds
    first (350 / 360 / 370 under 8 x 47 = 376)."""
    cluster = _cluster(profile, nodes)
    graph = build_topology(cluster)
    expected = min(RING_GBPS[profile][kind], NIC_SUM_GBPS[profile])
    got = _alone_GBps(graph, kind, _ring(range(nodes)))
    assert got == pytest.approx(expected, rel=1e-3)
    assert got * GB == pytest.approx(plateau_busbw_Bps(kind, ProcessGroup(8 * nodes, nodes), cluster.fabric), rel=1e-12)


def test_a_ring_crosses_each_node_once_one_channel_per_nic_on_its_rail():
    graph = build_topology(_cluster("h100-sxm", 4))
    loads = ring_loads(graph, ring_paths(graph, _ring(range(4))), "all_reduce")
    for k in range(4):
        into = sum(loads.get((f"n{k}/nic{j}", f"n{k}/gpu{j}"), 0.0) for j in range(8))
        out = sum(loads.get((f"n{k}/gpu{j}", f"n{k}/nic{j}"), 0.0) for j in range(8))
        assert into == pytest.approx(1.0) and out == pytest.approx(1.0)  # the whole ring, once each way
        assert all(loads[f"n{k}/nic{j}", f"leaf{j}"] == pytest.approx(1 / 8) for j in range(8))
        assert all(loads[f"n{k}/gpu{i}", f"n{k}/nvswitch"] == pytest.approx(1.0) for i in range(8))
    assert not any(v.startswith("spine") for edge in loads for v in edge)  # rails: no hop leaves its leaf


@pytest.mark.parametrize("profile, shape, stride, expected_GBps", [
    ("a100-80gb", (16, 4), 1, 96.0), ("a100-80gb", (4, 4), 1, 24.0), ("a100-80gb", (2, 2), 2, 24.0),
    ("h100-sxm", (8, 4), 1, 94.0), ("b200", (16, 2), 1, 382.0), ("a100-80gb", (4, 1), 1, 234.9),
    ("mi300x", (16, 4), 1, 312.9 * 3 / 7), ("mi300x", (8, 1), 1, 312.9), ("mi300x", (2, 1), 1, 312.9 / 7),
])
def test_groups_of_one_shape_running_together_share_the_nics_as_the_closed_form_counts(profile, shape, stride,
                                                                                         expected_GBps):
    """g of a node's G GPUs get g / G of its NICs while the other G / g groups run too (SPMD); on a mesh a
    ring of g GPUs uses g - 1 of the 7 links."""
    cluster = _cluster(profile, 4)
    graph, group = build_topology(cluster), ProcessGroup(*shape)
    got = spmd_busbw_Bps(graph, "all_gather", group, node_stride=stride)
    assert got / GB == pytest.approx(expected_GBps, rel=1e-3)
    assert got == pytest.approx(plateau_busbw_Bps("all_gather", group, cluster.fabric), rel=1e-12)


def test_a_group_alone_uses_only_the_nics_beside_its_gpus():
    """One GPU a node (HSDP's replicate group) alone: its own NIC, 47 GB/s on H100, not the node's 376; the
    closed form's 376 / 8 counts the seven sibling groups that SPMD runs beside it. Four GPUs a node: 4 NICs."""
    graph = build_topology(_cluster("h100-sxm", 4))
    assert _alone_GBps(graph, "all_gather", _ring(range(4), [3])) == pytest.approx(47.0)
    assert _alone_GBps(graph, "all_gather", _ring(range(4), range(4, 8))) == pytest.approx(4 * 47.0)


# ---- what the closed forms cannot say ---------------------------------------------------------------
def test_an_oversubscribed_spine_halves_a_ring_only_where_its_hops_cross_it():
    """Fat tree, 2:1, two leaves of two 8xA100 nodes. Every hop crossing (nodes 0, 2, 1, 3): each leaf's
    uplinks carry two nodes' NIC traffic at half their downlinks' capacity -> 96 = the closed form's
    192 / 2. Under one leaf: 192. In node order only one hop a leaf crosses, so 2:1 costs nothing and 4:1
    halves it. On a rail fabric the ring never leaves its rail: 192 at 2:1, as the closed form says."""
    fat = build_topology(_cluster("a100-80gb", 4, rail_optimized=False, oversubscription=2.0),
                         topology="fat_tree", nodes_per_leaf=2)
    assert _alone_GBps(fat, "all_reduce", _ring([0, 2, 1, 3])) == pytest.approx(96.0)
    assert _alone_GBps(fat, "all_reduce", _ring([0, 1])) == pytest.approx(192.0)
    assert _alone_GBps(fat, "all_reduce", _ring([2, 3])) == pytest.approx(192.0)
    assert _alone_GBps(fat, "all_reduce", _ring([0, 1, 2, 3])) == pytest.approx(192.0)
    fat4 = build_topology(_cluster("a100-80gb", 4, rail_optimized=False, oversubscription=4.0),
                          topology="fat_tree", nodes_per_leaf=2)
    assert _alone_GBps(fat4, "all_reduce", _ring([0, 1, 2, 3])) == pytest.approx(96.0)
    rails = build_topology(_cluster("a100-80gb", 4, oversubscription=2.0))
    assert _alone_GBps(rails, "all_reduce", _ring([0, 2, 1, 3])) == pytest.approx(192.0)


@pytest.mark.parametrize("profile, before, after", [
    ("a100-80gb", 192.0, 192.0 * 7 / 8), ("b200", 382.0, 382.0 * 7 / 8),
    ("h100-sxm", 370.0, 7 * 47.0),  # NVLink-bound at 370 before, 7 NICs x 47 = 329 after
])
def test_a_nic_down_reroutes_over_the_nodes_other_nics(profile, before, after):
    graph = build_topology(_cluster(profile, 4))
    down = with_bandwidth(graph, "n1/nic7", 0.0)
    gpus = _ring(range(4))
    assert _alone_GBps(graph, "all_reduce", gpus) == pytest.approx(before)
    assert _alone_GBps(down, "all_reduce", gpus) == pytest.approx(after)
    paths = ring_paths(down, gpus)
    assert not any("n1/nic7" in p.nodes for p in paths)
    # rail 7's traffic reaches node 1's other NICs over the spines; other nodes still use their NIC 7
    assert any(p.nodes[:3] == ("n0/nic7", "leaf7", "spine0") for p in paths)
    assert any("n2/nic7" in p.nodes for p in paths)


def test_a_slow_nic_drags_the_whole_ring_to_its_pace():
    """NCCL gives every NIC the same share of channels, so a NIC at half speed halves the ring (96 of
    192), where rerouting would have lost only 1/16."""
    graph = build_topology(_cluster("a100-80gb", 4))
    slow = with_bandwidth(graph, "n2/nic3", 12 * GB)
    assert _alone_GBps(slow, "all_gather", _ring(range(4))) == pytest.approx(96.0)


# ---- collectives in flight ------------------------------------------------------------------------
def test_two_collectives_on_one_link_agree_with_shared_slowdown():
    """Two multi-node all-reduces (16 ranks, 2 nodes of 8xA100) both NIC-bound: each at half, 2.0 under
    either rule, as `shared_slowdown` says. With the links to itself the ring uses NVLink at 192 / 234.9
    and the NICs at 1.0, as `link_loads` says. Beside an intra-node all-gather (8 ranks), sharing NVLink:
    the proportional rule gives `shared_slowdown`'s 1 + 192 / 234.9 for both; max-min gives both 117.45
    GB/s (234.9 / 2), so the all-reduce slows 192 / 117.45 and the all-gather 2.0."""
    fabric = load_profile("a100-80gb").fabric
    graph = build_topology(_cluster("a100-80gb", 2))
    ar = in_flight(graph, "all_reduce", 2**30, _ring([0, 1]))
    ag = in_flight(graph, "all_gather", 2**30, _ring([0]))
    loads = link_loads("all_reduce", ProcessGroup(16, 2), fabric)
    intra = link_loads("all_gather", ProcessGroup(8, 1), fabric)
    for rule in ("max_min", "proportional"):
        assert share_links(graph, [ar, ar], rule=rule).slowdown == pytest.approx(shared_slowdown([loads, loads]))
        assert share_links(graph, [ar, ar], rule=rule).slowdown == pytest.approx((2.0, 2.0))
    alone = share_links(graph, [ar])
    worst = {kind: max(u for e, u in alone.utilisation.items() if graph.edges[e]["kind"] == kind)
             for kind in ("nvlink", "nic_uplink")}
    assert worst == {"nvlink": pytest.approx(loads["nvlink"]), "nic_uplink": pytest.approx(loads["nic"])}
    assert worst["nvlink"] == pytest.approx(192 / 234.9)
    proportional = share_links(graph, [ar, ag], rule="proportional")
    assert proportional.slowdown == pytest.approx(shared_slowdown([loads, intra]))
    assert proportional.slowdown == pytest.approx((1 + 192 / 234.9,) * 2)
    fair = share_links(graph, [ar, ag])
    assert [b / GB for b in fair.busbw_Bps] == pytest.approx([117.45, 117.45])
    assert fair.slowdown == pytest.approx((192 / 117.45, 2.0))
    assert fair.wire_s([ar, ag]) == pytest.approx((2**30 * 2 * 15 / 16 / 117.45e9, 2**30 * 7 / 8 / 117.45e9))


def test_max_min_hands_on_what_proportional_sharing_leaves_idle():
    """A crosses x and w; B only x; D and E only w (every link 1 B/s). w holds A to 1/3. Proportional:
    x is asked 2, so B runs at 1/2 and x idles a sixth; max-min: B takes the 2/3 A leaves on x."""
    graph = nx.DiGraph()
    graph.add_edges_from([("a", "x"), ("b", "w")], bandwidth_Bps=1.0)
    x, w = ("a", "x"), ("b", "w")
    flights = [InFlight("all_gather", 1.0, 2, {x: 1.0, w: 1.0}), InFlight("all_gather", 1.0, 2, {x: 1.0}),
               InFlight("all_gather", 1.0, 2, {w: 1.0}), InFlight("all_gather", 1.0, 2, {w: 1.0})]
    proportional = share_links(graph, flights, rule="proportional")
    assert proportional.busbw_Bps == pytest.approx((1 / 3, 1 / 2, 1 / 3, 1 / 3))
    assert proportional.utilisation[x] == pytest.approx(5 / 6)
    fair = share_links(graph, flights)
    assert fair.busbw_Bps == pytest.approx((1 / 3, 2 / 3, 1 / 3, 1 / 3))
    assert fair.utilisation == {x: pytest.approx(1.0), w: pytest.approx(1.0)}
    assert fair.bottleneck == (w, x, w, w)


# ---- the command line -----------------------------------------------------------------------------
def _scenario(tmp_path, hardware: dict) -> str:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256},
                                    "training": {"seq_len": 32}, "hardware": hardware}))
    return str(path)


def test_topology_command_writes_graphml_with_kinds_bandwidths_and_latencies(tmp_path, capsys):
    scenario = _scenario(tmp_path, {"profile": "h100-sxm", "nodes": 2})
    out = tmp_path / "cluster.graphml"
    assert main(["topology", scenario, "-o", str(out)]) == 0
    assert "16 GPUs on 2 nodes" in capsys.readouterr().out
    graph = nx.read_graphml(out)
    assert graph.is_directed() and graph.nodes["n1/nic3"] == {"kind": "nic", "node": 1, "index": 3}
    edge = graph.edges["n1/nic3", "leaf3"]
    assert edge == {"kind": "nic_uplink", "bandwidth_Bps": pytest.approx(47 * GB), "latency_s": pytest.approx(14e-6)}
    assert main(["topology", scenario, "-o", str(out), "--topology", "fat_tree", "--spines", "3", "-q"]) == 0
    assert capsys.readouterr().out == ""
    kinds = list(nx.get_node_attributes(nx.read_graphml(out), "kind").values())
    assert (kinds.count("leaf"), kinds.count("spine")) == (1, 3)  # 2 nodes x 8 NICs under one 32-port leaf


@pytest.mark.parametrize("args, message", [
    (["--spines", "0"], "--spines: must be a positive integer, got 0"),
    (["--nodes-per-leaf", "-2"], "--nodes-per-leaf: must be a positive integer, got -2"),
    (["--topology", "torus"], "argument --topology: invalid choice"),
])
def test_topology_command_bad_input_is_one_line_exit_2(tmp_path, capsys, args, message):
    scenario = _scenario(tmp_path, {"profile": "h100-sxm", "nodes": 2})
    assert _exit_code(["topology", scenario, "-o", str(tmp_path / "g.graphml"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_topology_command_bad_scenario_or_output_is_one_line_exit_2(tmp_path, capsys):
    bad = _scenario(tmp_path, {"profile": "h100-sxm", "nodes": 0})
    assert main(["topology", bad, "-o", str(tmp_path / "g.graphml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hardware" in err and "nodes" in err
    good = _scenario(tmp_path, {"profile": "h100-sxm"})
    assert main(["topology", good, "-o", str(tmp_path / "missing" / "g.graphml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err


def _exit_code(argv: list[str]) -> int:
    """main's return code, or argparse's exit code for a usage error."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code
