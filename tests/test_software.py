"""One knob, `compute.torch_version`, decides the software stack a run assumes (hardware/software.py): the
NCCL its wheels pin, the RMSNorm kernel, the SDPA backend; and the results say which."""

from __future__ import annotations

import pytest

from fsdp_sim.hardware.collectives import ProcessGroup, tuner_latency_s
from fsdp_sim.hardware.profiles import load_profile
from fsdp_sim.hardware.software import NVLS_BUFFERS_BEFORE_2_21, NVLS_BUFFERS_HOPPER, nccl_version, rms_norm_kernel
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate


@pytest.mark.parametrize("torch, nccl", [
    ((2, 2), (2, 20, 5)), ((2, 4), (2, 20, 5)), ((2, 5, 1), (2, 21, 5)), ((2, 6), (2, 21, 5)), ((2, 7), (2, 26, 2)),
    ((2, 8), (2, 27, 3)), ((2, 9), (2, 27, 5)), ((2, 10), (2, 27, 5)), ((2, 11), (2, 28, 9)), ((2, 13), (2, 28, 9)),
])
def test_each_torch_release_ships_its_nccl(torch, nccl):
    assert nccl_version(torch) == nccl


def test_rms_norm_is_one_kernel_from_torch_2_9():
    assert [rms_norm_kernel(v) for v in ((2, 4), (2, 8), (2, 9), (2, 13))] == ["composite", "composite", "fused", "fused"]


def _run(version: str, **model):
    data = {"model": {"preset": "llama3-8b", **model}, "training": {"micro_batch": 1, "seq_len": 4096},
            "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": 8}, "compute": {"torch_version": version}}
    return simulate(parse_scenario(data)).to_dict()


def test_a_release_before_the_fused_kernel_runs_its_norms_as_eager_ops():
    """torch 2.8's nn.RMSNorm is a composite: more memory-bound time and more saved bytes, the same matmuls;
    `model.norm_impl` still overrides the release's default."""
    old, new = _run("2.8"), _run("2.9")
    assert old["software"]["norm"] == "composite of eager ops" and new["software"]["norm"] == "one fused kernel"
    assert old["compute"]["breakdown"]["memory_bound_s"] > 1.2 * new["compute"]["breakdown"]["memory_bound_s"]
    assert old["compute"]["breakdown"]["matmul_s"] == pytest.approx(new["compute"]["breakdown"]["matmul_s"])
    assert old["peak"]["allocated_bytes"] > new["peak"]["allocated_bytes"]
    overridden = _run("2.8", norm_impl="fused")  # 2.8's SDPA backend (FA2, not 2.9's cuDNN), 2.9's norms
    assert overridden["compute"]["breakdown"]["memory_bound_s"] == pytest.approx(new["compute"]["breakdown"]["memory_bound_s"])


def test_the_results_say_which_stack_the_run_assumes():
    sw = _run("2.6")["software"]
    assert sw == {"torch": "2.6", "nccl": "2.21.5", "sdpa_backend": "flash", "norm": "composite of eager ops",
                  "torch_compile": False}
    assert _run("2.13")["software"]["sdpa_backend"] == "cudnn"  # cuDNN first on Hopper from 2.11 (kernels.py)


def test_nccl_2_20_holds_nvls_buffers_of_2_25_gib_on_hopper():
    """NCCL <= 2.20 sizes NVLS buffers at 2.25 GiB per GPU (hardware.md 5.2), 256 MiB from 2.21."""
    old, new = _run("2.4"), _run("2.5")
    grown = old["memory"]["overheads_bytes"]["nccl"] - new["memory"]["overheads_bytes"]["nccl"]
    groups = new["memory"]["overheads_bytes"]["nccl"] // load_profile("h100-sxm").nccl_bytes
    assert groups >= 1 and grown == groups * (NVLS_BUFFERS_BEFORE_2_21 - NVLS_BUFFERS_HOPPER)


def test_the_ring_all_reduce_counts_two_more_network_steps_before_nccl_2_26():
    """NCCL 2.21.5's tuner: 2 x nNodes network steps; 2.26 and later 2 x (nNodes - 1) (component-timing 6.2)."""
    fabric = load_profile("h100-sxm").fabric
    g = ProcessGroup(32, 4)
    old = tuner_latency_s("all_reduce", "ring", g.ranks, g.nodes, fabric, nccl=(2, 21, 5))
    new = tuner_latency_s("all_reduce", "ring", g.ranks, g.nodes, fabric, nccl=(2, 27, 3))
    intra = max(fabric.ring.hop_latency_s, 3 * fabric.network.host_overhead_s)
    assert old - new == pytest.approx(2 * (fabric.network.hop_latency_s - intra))
    assert tuner_latency_s("all_gather", "ring", 32, 4, fabric, nccl=(2, 21, 5)) == \
        tuner_latency_s("all_gather", "ring", 32, 4, fabric, nccl=(2, 27, 3))
