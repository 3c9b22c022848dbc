"""The collective cost model against NCCL's tuner, nccl-tests' measurements and the NIC-sum rule.

Expected numbers come from the references, typed in here, never from the model: component-timing 6.2's
tuner latency table (NCCL 2.27.3, Simple protocol, Intel host, 8 GPUs per node), hardware.md 3.3's measured
busbw curves (8xA100 ring all-reduce, 8xH200 NVLS all-reduce, 8xH200 all-gather / reduce-scatter at
16 GiB), the NIC goodputs of hardware.md 1.3 (HDR 24 of 25 GB/s, NDR 46-48 of 50) and AWS p4d's 4x 100G EFA.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.cli import main
from fsdp_sim.datafile import read_data
from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.collectives import (ProcessGroup, algorithm, busbw_Bps, collective_time, link_loads,
                                           links_crossed, plateau_busbw_Bps, shared_slowdown, tuner_latency_s)
from fsdp_sim.hardware.costs import OpCosts
from fsdp_sim.hardware.profiles import REPO_PROFILES, Cluster, load_profile, parse_profile, profile_names
from fsdp_sim.scenario import parse_scenario

MiB, GiB = 2**20, 2**30
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
H100, A100, H200 = (load_profile(n).fabric for n in ("h100-sxm", "a100-80gb", "h200"))
SIZES = [32 * 2**10, 256 * 2**10, MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB,
         512 * MiB, GiB, 4 * GiB, 16 * GiB]  # hardware.md 3.3's size columns (32K ... 16G)
A100_RING_AR_GBPS = [1.3, 7.5, 18.0, 72.3, 109.9, 106.2, 138.5, 171.5, 176.9, 194.1, 222.7, 229.0, 233.9, 234.9]
H200_NVLS_AR_GBPS = [1.4, 11.7, 39.9, 107.2, 155.5, 219.9, 275.8, 346.5, 401.9, 436.2, 450.3, 463.6, 473.1, 482.3]


# ---- NCCL's tuner latency ------------------------------------------------------------------------
@pytest.mark.parametrize("ranks, nodes, ag_us, ar_us", [
    (8, 1, 32.2, 56.0), (16, 2, 70.0, 131.6), (32, 4, 145.6, 283), (64, 8, 296.8, 585), (128, 16, 599, 1190),
    (256, 32, 1204, 2400), (1024, 128, 4833, 9657),
])
def test_tuner_latency_matches_component_timing_table(ranks, nodes, ag_us, ar_us):
    """AG/RS ring Simple and AR ring Simple (2.27 column, without the plateau factor), 8 GPUs per node."""
    for kind in ("all_gather", "reduce_scatter"):
        assert tuner_latency_s(kind, "ring", ranks, nodes, H100) * 1e6 == pytest.approx(ag_us, abs=0.6)
    assert tuner_latency_s("all_reduce", "ring", ranks, nodes, H100) * 1e6 == pytest.approx(ar_us, abs=0.6)


def test_latency_grows_linearly_in_ranks_across_nodes():
    """Each added 8-GPU node adds 7 NVLink hops (3.4 us) and one network hop (14 us) to an all-gather: 37.8 us,
    and a collective's time at a fixed size grows by exactly that latency."""
    lat = [tuner_latency_s("all_gather", "ring", 8 * k, k, H100) for k in range(2, 130)]
    assert all(b - a == pytest.approx(7 * 3.4e-6 + 14e-6, rel=1e-9) for a, b in zip(lat, lat[1:]))
    s = 64 * GiB  # beyond the measured curve: the bytes take the plateau rate, the rest is latency
    group = {k: ProcessGroup(8 * k, k) for k in (16, 32, 128)}
    t = {k: collective_time("all_gather", s, g, H100) for k, g in group.items()}
    wire = {k: s * (g.ranks - 1) / g.ranks / 350e9 for k, g in group.items()}  # NVLink-bound, 350 GB/s
    for k in (32, 128):
        assert t[k] - t[16] == pytest.approx(wire[k] - wire[16] + (k - 16) * 37.8e-6, rel=1e-9)


def test_amd_host_and_plateau_factor_follow_the_tuner():
    """DGX A100's AMD host: multi-node intra hops cost max(3.4, 3 x 2) = 6 us; a multi-node ring all-reduce
    of a large message pays 1.4x latency once bytes / (channels x ranks) >= 64."""
    assert tuner_latency_s("all_gather", "ring", 16, 2, A100) * 1e6 == pytest.approx(8.4 + 14 * 6 + 14)
    small = tuner_latency_s("all_reduce", "ring", 16, 2, H100, nbytes=64 * 24 * 16 - 1)
    large = tuner_latency_s("all_reduce", "ring", 16, 2, H100, nbytes=64 * 24 * 16)
    assert small * 1e6 == pytest.approx(131.6) and large == pytest.approx(1.4 * small)
    assert tuner_latency_s("all_reduce", "ring", 8, 1, H100, nbytes=GiB) * 1e6 == pytest.approx(56.0)  # one node: none


# ---- measured curves reproduced at their own configuration ---------------------------------------
@pytest.mark.parametrize("profile, measured", [("a100-80gb", A100_RING_AR_GBPS), ("h200", H200_NVLS_AR_GBPS)])
def test_busbw_reproduces_measured_all_reduce_curves(profile, measured):
    """8 GPUs on one node: 8xA100 ring (no NVLS on A100), 8xH200 NVLS. The only departures are where a
    larger message was measured finishing sooner than a smaller one (A100 4M, H200 256K, < 5 %)."""
    fabric = load_profile(profile).fabric
    group = ProcessGroup(8, 1)
    assert algorithm("all_reduce", group, fabric) == ("ring" if profile == "a100-80gb" else "nvls")
    model = [busbw_Bps("all_reduce", s, group, fabric) / 1e9 for s in SIZES]
    assert model == pytest.approx(measured, rel=0.05)
    assert sum(m == pytest.approx(g, rel=1e-6) for m, g in zip(model, measured)) == len(SIZES) - 1


def test_busbw_reproduces_the_4_node_b200_curve():
    """4x8 B200 over 8x400G EFA, all-reduce via torch [S8], on the b200 profile (NIC-bound ring)."""
    sizes = [MiB, 4 * MiB, 16 * MiB, 64 * MiB, 128 * MiB, 256 * MiB, 512 * MiB, GiB, 4 * GiB, 16 * GiB]
    measured = [5.4, 18.9, 64.4, 156.7, 197.9, 229.1, 326.9, 362.0, 377.3, 381.8]
    b200 = load_profile("b200").fabric
    model = [busbw_Bps("all_reduce", s, ProcessGroup(32, 4), b200) / 1e9 for s in sizes]
    assert model == pytest.approx(measured, rel=0.002)


def test_h200_all_gather_and_reduce_scatter_reach_their_measured_plateau():
    """8xH200 nccl-tests at 16 GiB, Ring: all-gather 361.4, reduce-scatter 362.9 GB/s [S8]."""
    group = ProcessGroup(8, 1)
    assert busbw_Bps("all_gather", 16 * GiB, group, H200) / 1e9 == pytest.approx(361.4, rel=0.005)
    assert busbw_Bps("reduce_scatter", 16 * GiB, group, H200) / 1e9 == pytest.approx(362.9, rel=0.005)


def test_xgmi_mesh_ring_uses_only_the_links_among_its_gpus():
    """MI300X: 312.9 GB/s with 8 GPUs, 47.7 with 2 [S8]; the model's 2-GPU plateau is 312.9 / 7."""
    mi300x = load_profile("mi300x").fabric
    two = plateau_busbw_Bps("all_reduce", ProcessGroup(2, 1), mi300x)
    assert two == pytest.approx(312.9e9 / 7) and two == pytest.approx(47.7e9, rel=0.07)
    assert plateau_busbw_Bps("all_reduce", ProcessGroup(8, 1), mi300x) == pytest.approx(312.9e9)


# ---- algorithm choice ----------------------------------------------------------------------------
def test_nvls_only_for_all_reduce_above_4_gpus_of_one_nvls_node():
    assert [algorithm("all_reduce", ProcessGroup(n, 1), H200) for n in (2, 4, 5, 8)] == ["ring", "ring", "nvls", "nvls"]
    assert algorithm("all_reduce", ProcessGroup(16, 2), H200) == "ring"
    assert algorithm("all_gather", ProcessGroup(8, 1), H200) == "ring"
    assert algorithm("all_reduce", ProcessGroup(8, 1), A100) == "ring"  # A100 has no NVLS
    assert plateau_busbw_Bps("all_reduce", ProcessGroup(8, 1), H200) == pytest.approx(482.3e9)
    assert plateau_busbw_Bps("all_reduce", ProcessGroup(4, 1), H200) == pytest.approx(367.2e9)


# ---- the NIC-sum rule across nodes ---------------------------------------------------------------
def test_inter_node_all_gather_equals_the_nic_sum_closed_form():
    """Large all-gather across DGX A100 nodes: busbw = 8 NICs x 200 Gb/s x 0.96 = 192 GB/s (the NVIDIA-measured
    DGX-A100 figure [S20a]), below the 234.9 GB/s NVLink ring, so t = S (n-1)/n / 192e9, plus on 128 nodes
    the tuner latency beyond the 4-node measurement's."""
    nic_sum = 8 * 200e9 / 8 * 0.96
    s = 64 * GiB
    assert collective_time("all_gather", s, ProcessGroup(16, 2), A100) == pytest.approx(s * 15 / 16 / nic_sum, rel=1e-12)
    latency = 8.4e-6 + (1023 - 127) * 6e-6 + 127 * 14e-6  # AMD host: intra hops 6 us across nodes
    expected = s * 1023 / 1024 / nic_sum + latency - 395.9e-6  # minus the curve's own (4x8, x1.4) latency
    assert collective_time("all_gather", s, ProcessGroup(1024, 128), A100) == pytest.approx(expected, rel=1e-9)
    # H100: 8 x 47 = 376 GB/s of NICs, above the 350 GB/s NVLink all-gather ring: NVLink is the bottleneck;
    # B200's 682 GB/s ring is NIC-bound at 8 x 400G x 0.955 = 382 GB/s (4x8 B200 measured 381.8 [S8])
    assert plateau_busbw_Bps("all_gather", ProcessGroup(16, 2), H100) == pytest.approx(350e9)
    b200 = load_profile("b200").fabric
    assert plateau_busbw_Bps("all_reduce", ProcessGroup(16, 2), b200) == pytest.approx(8 * 50e9 * 0.955)
    assert busbw_Bps("all_reduce", 16 * GiB, ProcessGroup(32, 4), b200) / 1e9 == pytest.approx(381.8, rel=0.001)


def test_a_group_with_one_gpu_per_node_gets_its_share_of_the_nics():
    """HSDP's replicate group, one GPU per node: the node's 8 such groups run at once, 1/8 of the NICs each."""
    assert plateau_busbw_Bps("all_reduce", ProcessGroup(4, 4), A100) == pytest.approx(192e9 / 8)
    assert plateau_busbw_Bps("all_reduce", ProcessGroup(8, 2), A100) == pytest.approx(192e9 / 2)


def _cluster(network: dict | None = None) -> Cluster:
    hardware = {"profile": "a100-80gb", "nodes": 2} | ({"network": network} if network is not None else {})
    return parse_scenario({"model": "gpt2", "training": {"seq_len": 1024}, "hardware": hardware}).cluster


P4D = {"nics_per_node": 4, "nic_gbps": 100, "nic_efficiency": 0.969}  # AWS p4d: 4x 100G EFA, 96.9 % [S8]


def test_network_override_scales_inter_node_time_by_the_nic_ratio():
    dgx, p4d = _cluster(), _cluster(P4D)
    assert dgx.fabric == load_profile("a100-80gb").fabric and dgx.network is None
    assert p4d.fabric.network.node_goodput_Bps == pytest.approx(4 * 12.5e9 * 0.969)
    assert p4d.fabric.ring == dgx.fabric.ring  # only the NICs change
    s, group = 64 * GiB, ProcessGroup(16, 2)
    ratio = collective_time("all_gather", s, group, p4d.fabric) / collective_time("all_gather", s, group, dgx.fabric)
    assert ratio == pytest.approx(192e9 / (4 * 12.5e9 * 0.969), rel=1e-12)
    one_node = ProcessGroup(8, 1)
    assert collective_time("all_gather", s, one_node, p4d.fabric) == collective_time("all_gather", s, one_node, dgx.fabric)
    blocking = _cluster({"rail_optimized": False, "oversubscription": 2.0}).fabric.network
    assert blocking.node_goodput_Bps == pytest.approx(192e9 / 2)


@pytest.mark.parametrize("network, words", [
    ({"nics": 4}, ["hardware.network.nics", "unknown key"]),
    ({"nic_efficiency": 1.5}, ["hardware.network.nic_efficiency", "1.5"]),
    ({"rail_optimized": "yes"}, ["hardware.network.rail_optimized", "yes"]),
    ({"nics_per_node": 2.5}, ["hardware.network.nics_per_node", "2.5"]),
    ({"oversubscription": 0.5}, ["hardware.network.oversubscription", "0.5"]),
    ([4, 100], ["hardware.network", "mapping"]),
])
def test_bad_network_override_is_one_line_naming_the_key(network, words, tmp_path, capsys):
    with pytest.raises(ScenarioError) as err:
        _cluster(network)
    assert all(w in str(err.value) for w in words)
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps({"model": "gpt2", "training": {"seq_len": 1024},
                                "hardware": {"profile": "a100-80gb", "network": network}}))
    assert main(["run", str(path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ---- HSDP groups on their own links, and links shared in flight ----------------------------------
def test_op_costs_lay_out_shard_and_replicate_groups():
    """2 nodes x 8: HSDP shard groups are one node, replicate groups one GPU per node; a shard group of 4
    leaves 2 replicas per node."""
    cluster = Cluster(load_profile("h100-sxm"), 2, 8)
    costs = OpCosts(cluster, shard_size=8, replicate_size=2, compute_dtype="bf16")
    assert costs.groups == {"shard": ProcessGroup(8, 1), "replicate": ProcessGroup(2, 2)}
    assert links_crossed(costs.groups["shard"], H100) == {"nvlink"}
    assert links_crossed(costs.groups["replicate"], H100) == {"nic"}
    costs = OpCosts(cluster, shard_size=4, replicate_size=4, compute_dtype="bf16")
    assert costs.groups["replicate"] == ProcessGroup(4, 2)
    assert links_crossed(costs.groups["replicate"], H100) == {"nvlink", "nic"}
    assert links_crossed(ProcessGroup(16, 2), H100) == {"nvlink", "nic"}
    assert links_crossed(ProcessGroup(1, 1), H100) == frozenset()
    assert links_crossed(ProcessGroup(8, 1), load_profile("mi300x").fabric) == {"xgmi"}
    assert links_crossed(ProcessGroup(8, 1), load_profile("l40s").fabric) == {"pcie"}


def test_a_shared_link_halves_the_rate_of_two_collectives_on_it():
    assert shared_slowdown([{"nic"}, {"nic"}]) == (2.0, 2.0)
    assert shared_slowdown([{"nvlink"}, {"nic"}]) == (1.0, 1.0)
    assert shared_slowdown([{"nvlink", "nic"}, {"nic"}, {"nvlink"}]) == (2.0, 2.0, 2.0)
    assert shared_slowdown([{"nic"}]) == (1.0,) and shared_slowdown([]) == ()
    # two multi-node all-reduces of different process groups, both NIC-bound: each at half rate
    loads = link_loads("all_reduce", ProcessGroup(16, 2), A100)
    assert loads == {"nic": pytest.approx(1.0), "nvlink": pytest.approx(192 / 234.9)}
    assert shared_slowdown([loads, loads]) == (pytest.approx(2.0), pytest.approx(2.0))
    # an intra-node all-gather beside it shares only NVLink, where the two together ask 1 + 0.82
    intra = link_loads("all_gather", ProcessGroup(8, 1), A100)
    assert intra == {"nvlink": pytest.approx(1.0)}
    assert shared_slowdown([loads, intra]) == (pytest.approx(1 + 192 / 234.9),) * 2
    assert link_loads("all_gather", ProcessGroup(1, 1), A100) == {}


def test_a_group_of_one_or_no_bytes_costs_nothing():
    for kind in KINDS:
        assert collective_time(kind, 1e9, ProcessGroup(1, 1), H100) == 0.0
        assert collective_time(kind, 0, ProcessGroup(8, 1), H100) == 0.0
    with pytest.raises(ValueError):
        collective_time("broadcast", 1e6, ProcessGroup(8, 1), H100)
    with pytest.raises(ValueError):
        ProcessGroup(4, 8)


# ---- invariants ----------------------------------------------------------------------------------
_FABRICS = {name: load_profile(name).fabric for name in profile_names()}
_groups = st.tuples(st.integers(1, 8), st.integers(1, 64)).map(lambda t: ProcessGroup(t[0] * t[1], t[1]) if t[0] * t[1] > 1 else ProcessGroup(2, 1))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(_FABRICS)), st.sampled_from(KINDS), _groups,
       st.floats(1.0, 2**36), st.floats(1.0, 4.0))
def test_time_grows_with_bytes_and_busbw_never_exceeds_the_plateau(profile, kind, group, nbytes, grow):
    fabric = _FABRICS[profile]
    t, t_more = collective_time(kind, nbytes, group, fabric), collective_time(kind, nbytes * grow, group, fabric)
    assert 0 < t <= t_more * (1 + 1e-12)
    assert busbw_Bps(kind, nbytes, group, fabric) <= plateau_busbw_Bps(kind, group, fabric) * (1 + 1e-12)


# ---- profiles ------------------------------------------------------------------------------------
def test_profiles_describe_their_node():
    arch = {name: (p.arch, p.sm_count) for name in profile_names() for p in [load_profile(name)]}
    assert arch == {"a100-40gb": ("sm80", 108), "a100-80gb": ("sm80", 108), "h100-sxm": ("sm90", 132),
                    "h100-sxm-96gb": ("sm90", 132), "h200": ("sm90", 132), "b200": ("sm100", 148),
                    "l40s": ("sm89", 142), "rtx-4090": ("sm89", 128), "mi300x": ("gfx942", 304),
                    # the GPUs people fine-tune on: GA102 (sm86) and Ada (sm89) PCIe parts
                    "rtx-3090": ("sm86", 82), "rtx-a5000": ("sm86", 64), "a10g": ("sm86", 80),
                    "rtx-6000-ada": ("sm89", 142), "l4": ("sm89", 58)}
    nvls = {name for name, f in _FABRICS.items() if f.nvls is not None}
    assert nvls == {"h100-sxm", "h100-sxm-96gb", "h200", "b200"}  # Hopper / Blackwell NVSwitch only
    goodput = {name: f.network.node_goodput_Bps / 1e9 for name, f in _FABRICS.items()}
    assert goodput["a100-80gb"] == pytest.approx(192)  # DGX-A100 8x HDR [S20a]
    for name in ("h100-sxm", "h200", "b200", "mi300x"):
        assert 8 * 46 <= goodput[name] <= 8 * 48  # 8x NDR 400G at 46-48 GB/s each [S20c]
    for name in ("l40s", "rtx-4090", "rtx-3090", "rtx-a5000", "a10g", "rtx-6000-ada", "l4"):
        assert _FABRICS[name].scale_up == "pcie"


def test_h100_96gb_is_the_500w_part_on_a_dgx_h100_fabric():
    gpu = load_profile("h100-sxm-96gb")
    assert gpu.matmul_efficiency == pytest.approx(585.2 / 989.4, abs=1e-4)  # FBGEMM 500 W bf16 GEMM [C4]
    assert gpu.fabric == H100 and gpu.memory_bytes > load_profile("h100-sxm").memory_bytes


def test_profile_loader_names_a_bad_fabric_key():
    data = read_data(REPO_PROFILES / "h200.yaml", "profile")
    data["fabric"]["network"]["nic_gbs"] = data["fabric"]["network"].pop("nic_gbps")
    with pytest.raises(ScenarioError, match=r"fabric\.network\.nic_gbs: unknown key"):
        parse_profile(data, "h200.yaml")
    data = read_data(REPO_PROFILES / "h200.yaml", "profile")
    data["fabric"]["nvls"]["size_curve"]["busbw_GBps"][-1] = 1.0
    with pytest.raises(ScenarioError, match=r"fabric\.nvls\.size_curve\.busbw_GBps: the largest size"):
        parse_profile(data, "h200.yaml")


@pytest.mark.parametrize("eff", [5e-324, 1e-4, 0.0, 1.5, True, "0.5"])
def test_profile_loader_refuses_a_matmul_efficiency_no_gpu_has(eff):
    """Below 0.1 % of peak (a denormal from the fuzzer deadlocked the engine: times stop being finite)."""
    data = read_data(REPO_PROFILES / "a100-80gb.yaml", "profile")
    data["matmul_efficiency"] = eff
    with pytest.raises(ScenarioError, match=r"matmul_efficiency must be a number in \[0.001, 1\]"):
        parse_profile(data, "a100-80gb.yaml")


def test_profile_loader_checks_an_fp8_matmul_efficiency():
    data = read_data(REPO_PROFILES / "h200.yaml", "profile")
    data["fp8_matmul_efficiency"] = 1.5
    with pytest.raises(ScenarioError, match=r"fp8_matmul_efficiency must be a number in \[0.001, 1\]"):
        parse_profile(data, "h200.yaml")
    data = read_data(REPO_PROFILES / "a100-80gb.yaml", "profile")  # no fp8 tensor cores
    data["fp8_matmul_efficiency"] = 0.5
    with pytest.raises(ScenarioError, match=r"fp8_matmul_efficiency needs an fp8 entry in peak_flops"):
        parse_profile(data, "a100-80gb.yaml")
