"""The collective cost model against NCCL's own tuner and nccl-tests' definitions.

hardware.md §3.2 tabulates the latency floors NCCL's tuner (src/graph/tuning.cc) predicts for ring
collectives with the Simple protocol over NVLink (intra hop 3.4 us) and the network (14 us per hop),
base 8.4 us; §3.1 defines bus bandwidth: an all-gather of S gathered bytes over n ranks moves
S (n-1)/n per rank, an all-reduce twice that.
"""

from __future__ import annotations

import pytest

from fsdp_sim.hardware.collectives import CollectiveCost, all_gather_time, all_reduce_time, reduce_scatter_time
from fsdp_sim.hardware.profiles import Link, load_profile

NVLINK = Link(bandwidth_Bps=360e9, hop_latency_s=3.4e-6)
NET = Link(bandwidth_Bps=46e9, hop_latency_s=14e-6)


@pytest.mark.parametrize("ranks, nodes, ag_us, ar_us", [
    (8, 1, 32.2, 56.0), (16, 2, 70.0, 131.6), (32, 4, 145.6, 282.8), (64, 8, 296.8, 585.2),
    (256, 32, 1204, 2400), (1024, 128, 4833, 9657),
])
def test_ring_latency_floors_match_the_nccl_tuner_table(ranks, nodes, ag_us, ar_us):
    """Ring AG / AR, Simple protocol: hardware.md's table (without the 1.4x plateau factor)."""
    group = CollectiveCost(ranks, nodes, NVLINK, NET)
    assert all_gather_time(0, group) * 1e6 == pytest.approx(ag_us, abs=0.6)
    assert all_reduce_time(0, group) * 1e6 == pytest.approx(ar_us, rel=0.002)


def test_bandwidth_term_is_the_nccl_tests_bus_bandwidth_definition():
    """busbw = algbw * (n-1)/n for AG/RS and * 2(n-1)/n for AR, so t = S * factor / busbw + latency."""
    s = 8 * 2**30
    one_node, two_nodes = CollectiveCost(8, 1, NVLINK, NET), CollectiveCost(16, 2, NVLINK, NET)
    assert all_gather_time(s, one_node) - all_gather_time(0, one_node) == pytest.approx(s * 7 / 8 / 360e9)
    assert reduce_scatter_time(s, one_node) == all_gather_time(s, one_node)
    assert all_reduce_time(s, one_node) - all_reduce_time(0, one_node) == pytest.approx(2 * s * 7 / 8 / 360e9)
    # across nodes the per-GPU NIC is the ring's bottleneck
    assert all_gather_time(s, two_nodes) - all_gather_time(0, two_nodes) == pytest.approx(s * 15 / 16 / 46e9)


def test_a_group_of_one_costs_nothing():
    assert all_gather_time(1e9, CollectiveCost(1, 1, NVLINK, NET)) == 0.0
    assert all_reduce_time(1e9, CollectiveCost(1, 1, NVLINK, NET)) == 0.0


def test_shipped_h100_profile_gives_the_8_gpu_floor():
    gpu = load_profile("h100-sxm")
    group = CollectiveCost(8, 1, gpu.intra_node, gpu.inter_node)
    assert all_gather_time(0, group) * 1e6 == pytest.approx(32.2, abs=0.05)
