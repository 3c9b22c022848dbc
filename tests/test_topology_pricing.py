"""Collectives priced on the cluster graph (hardware/graph_pricing.py): where the fabric is uniform they
keep the closed forms' answers; an oversubscribed core costs only the rings whose hops cross it; a NIC
down reroutes over its node's others and the step slows by the lost share.

Expected figures are typed from the references, never read from the model: 8 HDR NICs of 24 GB/s goodput
a DGX-A100 node = 192 GB/s, its NVLink ring 234.9 GB/s (hardware.md 1.3, 3.3; tests/test_topology.py).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import networkx as nx
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim import simulate as simulate_module
from fsdp_sim.cli import main
from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.collectives import collective_time
from fsdp_sim.hardware.costs import OpCosts
from fsdp_sim.hardware.profiles import Cluster, load_profile
from fsdp_sim.hardware.variation import LinkFault
from fsdp_sim.scenario import load_scenario, parse_scenario
from fsdp_sim.simulate import simulate

GB = 1e9
HDR_GBPS, A100_RING_GBPS = 24.0, 234.9
SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
BIG = 16 * 2**30  # bytes: far past every size curve's last point, so each collective is at its plateau


def _cluster(nodes: int, profile: str = "a100-80gb", **network) -> Cluster:
    gpu = load_profile(profile)
    return Cluster(gpu, nodes, gpu.gpus_per_node, replace(gpu.fabric.network, **network) if network else None)


def _costs(cluster: Cluster, shard: int, replicate: int = 1, **kwargs) -> OpCosts:
    return OpCosts(cluster, shard_size=shard, replicate_size=replicate, compute_dtype="bf16", **kwargs)


def _wire_s(kind: str, nbytes: float, ranks: int, busbw_GBps: float) -> float:
    return nbytes * (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks / (busbw_GBps * GB)


# ---- healthy fabrics: the closed forms' answers ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_a_ring_over_a_rail_fabric_is_priced_at_the_nic_sum(kind):
    """Four DGX-A100 nodes, one shard group of 32: the graph's ring gets 8 x 24 = 192 GB/s, the closed form's
    NIC sum, and the collective's time is the closed form's to the last bit."""
    cluster = _cluster(4)
    graph, closed = _costs(cluster, 32, graph=True), _costs(cluster, 32, graph=False)
    assert graph.graph.busbw_Bps("shard", kind) / GB == pytest.approx(8 * HDR_GBPS, rel=1e-9)
    group = graph.groups["shard"]
    assert collective_time(kind, BIG, group, cluster.fabric, graph.nccl, graph.graph.busbw_Bps("shard", kind)) == \
        pytest.approx(collective_time(kind, BIG, group, cluster.fabric, closed.nccl), rel=1e-12)


def test_the_default_path_prices_by_the_closed_forms_and_builds_no_graph():
    assert _costs(_cluster(4), 32).graph is None
    assert _costs(_cluster(4, oversubscription=2.0), 32).graph is not None
    assert _costs(_cluster(4), 32, link_faults=(LinkFault(1, 2, 0.0),)).graph is not None
    assert _costs(_cluster(4), 32, link_faults=(LinkFault(1, 2, 1.0),)).graph is None  # at full rate: no fault
    assert _costs(_cluster(1, oversubscription=2.0), 8, link_faults=(LinkFault(0, 2, 0.0),)).graph is None  # no NIC used



@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_a_job_on_part_of_each_node_reaches_only_the_nics_beside_its_gpus(gpus):
    """Four DGX-A100 nodes, `gpus` of each node's 8 GPUs in the job: its ring gets the `gpus` NICs beside
    them, gpus x 24 GB/s (the closed form's g/G of the node's 192), not all 8; a NIC beside GPUs the job
    does not run on changes nothing, even down; the job's only NIC down on a node is refused."""
    gpu = load_profile("a100-80gb")
    cluster = Cluster(gpu, 4, gpus)
    graph = _costs(cluster, 4 * gpus, graph=True)
    assert graph.graph.busbw_Bps("shard", "all_gather") / GB == pytest.approx(gpus * HDR_GBPS, rel=1e-9)
    idle = _costs(cluster, 4 * gpus, link_faults=(LinkFault(1, 7, 0.0),))
    assert idle.graph.busbw_Bps("shard", "all_gather") == graph.graph.busbw_Bps("shard", "all_gather")
    if gpus == 1:
        with pytest.raises(ScenarioError, match="variation.links"):
            _costs(cluster, 4, link_faults=(LinkFault(1, 0, 0.0),)).graph.busbw_Bps("shard", "all_gather")

@pytest.mark.parametrize("name, fsdp", [
    ("llama3-70b-64xh100", {}), ("llama3-8b-32xh200-hsdp", {}), ("llama3-8b-32xh100-efa-hpz", {}),
    ("llama3-70b-64xh100-tp8", {}), ("mixtral-8x7b-16xh100", {}), ("llama2-7b-16xh100-fsdp1-hsdp-no-sync", {}),
    # shard groups of 32 nodes: their rings and the replicate rings meet on every NIC
    ("llama3-405b-1024xh100", {"sharding_strategy": "HYBRID_SHARD", "shard_size": 256}),
])
def test_healthy_multi_node_scenarios_keep_their_step_on_the_graph(name, fsdp, monkeypatch):
    """Priced on the graph (plateaus and in-flight sharing), the healthy shipped scenarios' steps stay within
    1e-9 of the closed forms' (measured: identical), HSDP at 1,024 GPUs too."""
    data = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())
    data["fsdp"].update(fsdp)
    scenario = parse_scenario(data, name=name, base=SCENARIOS)
    closed = simulate(scenario).step_time_s
    monkeypatch.setattr(simulate_module, "OpCosts", functools.partial(OpCosts, graph=True))
    assert simulate(scenario).step_time_s == pytest.approx(closed, rel=1e-9)


# ---- an oversubscribed core ---------------------------------------------------------------------------
def test_a_2_to_1_spine_halves_cross_spine_bandwidth_when_every_rail_is_busy():
    """HSDP on four DGX-A100 nodes, two a leaf (fat tree, 2:1): the shard groups (two nodes, one leaf) keep
    192 GB/s, where the closed form halved every off-rail ring; the replicate all-reduce pairs node k with
    k + 2, so every hop crosses the spine with every NIC of the leaf busy: 12 GB/s, half the 24 a NIC gives
    at 1:1, and its wire time doubles. On rails (32 nodes a rail leaf) nothing crosses: 2:1 costs nothing."""
    fat = dict(topology="fat_tree", rail_optimized=False, nodes_per_leaf=2)
    blocking = _costs(_cluster(4, oversubscription=2.0, **fat), 16, 2)
    free = _costs(_cluster(4, **fat), 16, 2, graph=True)
    assert blocking.graph.busbw_Bps("replicate", "all_reduce") / GB == pytest.approx(HDR_GBPS / 2)
    assert free.graph.busbw_Bps("replicate", "all_reduce") / GB == pytest.approx(HDR_GBPS)
    assert blocking.graph.busbw_Bps("shard", "all_gather") / GB == pytest.approx(8 * HDR_GBPS)
    wire = _wire_s("all_reduce", BIG, 2, HDR_GBPS)
    slower = (collective_time("all_reduce", BIG, blocking.groups["replicate"], blocking.fabric, blocking.nccl,
                              blocking.graph.busbw_Bps("replicate", "all_reduce"))
              - collective_time("all_reduce", BIG, free.groups["replicate"], free.fabric, free.nccl,
                                free.graph.busbw_Bps("replicate", "all_reduce")))
    assert slower == pytest.approx(wire, rel=1e-9)  # twice the wire time: one more of it
    rails = _costs(_cluster(4, oversubscription=2.0), 16, 2)
    assert rails.graph.busbw_Bps("replicate", "all_reduce") / GB == pytest.approx(HDR_GBPS)


def test_on_rails_a_2_to_1_spine_halves_a_replicate_ring_between_scalable_units():
    """64 DGX-A100 nodes on rails (32 nodes a rail leaf): HSDP's shard groups fill a scalable unit each, so
    each replicate ring's hop goes to the other unit, all 32 nodes' NICs of a rail at once: 24 -> 12 GB/s."""
    costs = _costs(_cluster(64, oversubscription=2.0), 256, 2)
    assert costs.graph.busbw_Bps("replicate", "all_reduce") / GB == pytest.approx(HDR_GBPS / 2)
    assert costs.graph.busbw_Bps("shard", "reduce_scatter") / GB == pytest.approx(8 * HDR_GBPS)


def test_collectives_in_flight_share_the_links_they_really_cross():
    """The replicate all-reduce (12 GB/s alone, held by the 2:1 spine) beside the shard reduce-scatter (192,
    all eight NICs of a node): they meet only on the NICs, each asked 12 + 192 / 8 = 36 of its 24 GB/s, so
    both run 1.5 times slower (the closed forms' rule on the links really crossed; their per-rank NIC
    share, halved by 2:1 for both, said 2.0). Two all-reduces on the spine: 24 of 12 asked, half each."""
    fat = _cluster(4, oversubscription=2.0, topology="fat_tree", rail_optimized=False, nodes_per_leaf=2)
    costs = _costs(fat, 16, 2)
    ar, rs = ("replicate", "all_reduce"), ("shard", "reduce_scatter")
    assert costs.graph.slowdowns((ar, rs)) == pytest.approx((1.5, 1.5))
    assert costs.graph.slowdowns((ar, ar)) == pytest.approx((2.0, 2.0))
    assert costs.graph.slowdowns((rs,)) == pytest.approx((1.0,))  # its SPMD siblings are in its own rate


# ---- a NIC down or slow -------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 7), st.sampled_from([0.0, 0.25, 0.5, 0.9])),
                max_size=6, unique_by=lambda t: t[:2]))
def test_a_faulted_ring_runs_at_its_slowest_node(faults):
    """NCCL gives a node's up NICs equal channels, so node k moves n_up x (its slowest up NIC's rate); the
    ring runs at min(the NVLink ring 234.9, that over every node). A node keeps one NIC up."""
    faults = [f for f in faults if sum(1 for g in faults if g[0] == f[0] and g[2] == 0) < 8]
    link_faults = tuple(LinkFault(*f) for f in sorted(faults))
    costs = _costs(_cluster(4), 32, link_faults=link_faults, graph=True)
    bound = A100_RING_GBPS
    for k in range(4):
        rate = {j: HDR_GBPS for j in range(8)} | {j: HDR_GBPS * b for n, j, b in faults if n == k}
        up = [r for r in rate.values() if r > 0]
        bound = min(bound, len(up) * min(up))
    assert costs.graph.busbw_Bps("shard", "all_gather") / GB == pytest.approx(bound, rel=1e-9)


def _comm_bound(tmp_path, variation=None):
    """Four DGX-A100 nodes, wide layers, 8 tokens a GPU: the step is mostly all-gathers and reduce-scatters."""
    data = {"model": {"hidden": 8192, "layers": 4, "heads": 64, "vocab": 256},
            "training": {"seq_len": 8, "micro_batch": 1}, "hardware": {"profile": "a100-80gb", "nodes": 4},
            "variation": {"gpu_speed_spread": 0.0, **(variation or {})}}
    return parse_scenario(data, base=tmp_path)


def test_a_nic_down_slows_a_comm_bound_step_by_the_lost_share(tmp_path):
    """One of node 2's eight NICs down: NCCL spreads its channels over the other seven (PXN), the ring runs
    at 7 x 24 = 168 of 192 GB/s. Each collective then takes what S x 8/7 took before (the same wire time
    through the same size curve and latency), and a step that is mostly communication takes about 8/7 as
    long: 1.116 measured, the rest of the step (the all-gathers' copy-out, the optimizer) being HBM-bound
    work no NIC changes. A NIC at half rate keeps its channels, so the whole ring runs at 96 GB/s."""
    healthy, down = _comm_bound(tmp_path), _comm_bound(tmp_path, {"links": [{"node": 2, "nic": 3, "bandwidth": 0}]})
    costs_healthy, costs_down = simulate_module.op_costs(healthy), simulate_module.op_costs(down)
    assert costs_down.graph.busbw_Bps("shard", "all_gather") / GB == pytest.approx(7 * HDR_GBPS)
    group = costs_healthy.groups["shard"]
    ops = [o for o in simulate(healthy).graph.ops if o.kind in ("all_gather", "reduce_scatter") and o.comm_bytes > 2**20]
    assert ops
    for op in ops:
        assert costs_down.duration(op) == pytest.approx(
            collective_time(op.kind, op.comm_bytes * 8 / 7, group, healthy.cluster.fabric, costs_healthy.nccl), rel=1e-9)
    before, after = simulate(healthy).step_time_s, simulate(down).step_time_s
    assert 1.0 < after / before <= 8 / 7 and after / before == pytest.approx(8 / 7, rel=0.03)
    half = simulate(_comm_bound(tmp_path, {"links": [{"node": 2, "nic": 3, "bandwidth": 0.5}]})).step_time_s
    assert simulate_module.op_costs(_comm_bound(tmp_path, {"links": [{"node": 2, "nic": 3, "bandwidth": 0.5}]})) \
        .graph.busbw_Bps("shard", "reduce_scatter") / GB == pytest.approx(4 * HDR_GBPS)
    assert half / before == pytest.approx(2.0, rel=0.1)


# ---- the scenario keys --------------------------------------------------------------------------------
def _scenario(tmp_path, hardware: dict, variation: dict | None = None) -> Path:
    path = tmp_path / "s.yaml"
    data = {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}, "training": {"seq_len": 32},
            "hardware": hardware}
    path.write_text(yaml.safe_dump(data | ({"variation": variation} if variation else {})))
    return path


def test_network_topology_keys_reach_the_graph(tmp_path):
    sc = load_scenario(_scenario(tmp_path, {"profile": "a100-80gb", "nodes": 4, "network": {
        "topology": "fat_tree", "spines": 3, "nodes_per_leaf": 2, "oversubscription": 2}}))
    net = sc.cluster.fabric.network
    assert (net.topology, net.rail_optimized, net.spines, net.nodes_per_leaf) == ("fat_tree", False, 3, 2)


@pytest.mark.parametrize("network, variation, message", [
    ({"topology": "torus"}, None, "hardware.network.topology: 'torus' is not one of ['rail_optimized', 'fat_tree']"),
    ({"topology": "fat_tree", "rail_optimized": True}, None, "hardware.network.topology: fat_tree contradicts"),
    ({"spines": 0}, None, "hardware.network.spines: must be positive, got 0"),
    ({}, {"links": {"node": 0}}, "variation.links: expected a list"),
    ({}, {"links": [{"node": 4, "nic": 0, "bandwidth": 0}]}, "variation.links[0].node: 4 is not in [0, 3]"),
    ({}, {"links": [{"node": 0, "nic": 8, "bandwidth": 0}]}, "variation.links[0].nic: 8 is not in [0, 7]"),
    ({}, {"links": [{"node": 0, "nic": 1, "bandwidth": 1.5}]}, "variation.links[0].bandwidth: 1.5 is past"),
    ({}, {"links": [{"node": 0, "nic": 1, "bandwidth": -0.1}]}, "variation.links[0].bandwidth: -0.1 must be in [0, 1]"),
    ({}, {"links": [{"node": 0, "nic": 1}]}, "variation.links[0].bandwidth: missing"),
    ({}, {"links": [{"node": 0, "nic": 1, "bandwidth": 0, "speed": 1}]}, "variation.links[0].speed: unknown key"),
    ({}, {"links": [{"node": 1, "nic": 1, "bandwidth": 0}, {"node": 1, "nic": 1, "bandwidth": 0.5}]},
     "variation.links[1]: node 1 NIC 1 is listed twice"),
    ({}, {"links": [{"node": 2, "nic": j, "bandwidth": 0} for j in range(8)]}, "every NIC of node 2 is down"),
])
def test_bad_network_or_links_is_one_line_exit_2(tmp_path, capsys, network, variation, message):
    path = _scenario(tmp_path, {"profile": "a100-80gb", "nodes": 4, "network": network}, variation)
    with pytest.raises(ScenarioError) as error:
        load_scenario(path)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert main(["run", str(path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_topology_command_marks_the_faulted_nics(tmp_path, capsys):
    path = _scenario(tmp_path, {"profile": "h100-sxm", "nodes": 2},
                     {"links": [{"node": 1, "nic": 3, "bandwidth": 0}, {"node": 0, "nic": 5, "bandwidth": 0.5}]})
    out = tmp_path / "cluster.graphml"
    assert main(["topology", str(path), "-o", str(out)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("; 1 NIC down, 1 slow (variation.links)")
    graph = nx.read_graphml(out)
    assert graph.nodes["n1/nic3"]["bandwidth_fraction"] == 0.0 and graph.nodes["n0/nic5"]["bandwidth_fraction"] == 0.5
    assert "bandwidth_fraction" not in graph.nodes["n0/nic3"]
    assert graph.edges["n1/nic3", "leaf3"]["bandwidth_Bps"] == 0.0
    assert graph.edges["n0/nic5", "leaf5"]["bandwidth_Bps"] == pytest.approx(47 * GB / 2)  # NDR 47 GB/s, halved
