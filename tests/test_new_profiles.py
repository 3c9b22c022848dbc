"""The fine-tuning GPUs' profiles (issue 23): RTX 3090, RTX A5000, RTX 6000 Ada, A10G (AWS g5), L4 (AWS g6).
Each describes its part and node as its sources say (hardware_profiles/README.md, keys [P1]-[P10])."""

from __future__ import annotations

import pytest

from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.profiles import load_profile
from fsdp_sim.workload.float8 import parse_float8

NEW = {"rtx-3090": ("sm86", 82, 24576), "rtx-a5000": ("sm86", 64, 24564), "rtx-6000-ada": ("sm89", 142, 49140),
       "a10g": ("sm86", 80, 23028), "l4": ("sm89", 58, 23034)}  # arch, SMs, nvidia-smi MiB [P4, P5, S34]


@pytest.mark.parametrize("name", sorted(NEW))
def test_each_profile_describes_its_part_on_a_pcie_node(name):
    gpu = load_profile(name)
    arch, sms, mib = NEW[name]
    assert (gpu.arch, gpu.sm_count, gpu.memory_bytes) == (arch, sms, mib * 2**20)
    assert gpu.fabric.scale_up == "pcie" and gpu.fabric.nvls is None
    assert gpu.host is not None and gpu.host.link == "pcie_gen4_x16"
    # fp8 tensor cores from Ada (sm89) on; Ampere GA102 (sm86) has none, so compute.float8 is refused there
    assert ("fp8" in gpu.peak_flops) == (arch == "sm89")
    if arch == "sm86":
        with pytest.raises(ScenarioError, match="no fp8 tensor cores"):
            parse_float8({"enabled": True}, gpu)
    assert 0 < gpu.matmul_efficiency <= 1 and 0 < gpu.sustained.compute <= 1 and gpu.sustained.memory == 1.0


def test_geforce_rate_parts_accumulate_fp32_at_half_the_fp16_rate():
    """RTX 3090 [S27] and A10G (derived, and measured 69.47 bf16 / 34.71 tf32 [P7]): TF32 is half of bf16,
    as on the full-rate professional parts; bf16 is 512 FLOP/clk/SM, not 1024."""
    for name, clock_mhz in (("rtx-3090", 1695), ("a10g", 1710)):
        gpu = load_profile(name)
        assert gpu.flops("tf32") == pytest.approx(gpu.flops("bf16") / 2, rel=0.01)
        assert gpu.flops("bf16") == pytest.approx(gpu.sm_count * 512 * clock_mhz * 1e6, rel=0.01)
    for name, clock_mhz in (("rtx-a5000", 1695), ("rtx-6000-ada", 2505), ("l4", 2040)):
        gpu = load_profile(name)
        assert gpu.flops("bf16") == pytest.approx(gpu.sm_count * 1024 * clock_mhz * 1e6, rel=0.01)


def test_the_3090_derating_is_its_settled_clock_over_the_clock_of_its_capped_benchmark_rate():
    """1642 MHz settled under GEMM load [I11] / 1695 MHz, where the capped 1.0 x 71 TFLOPS holds: the
    sustained GEMM rate is the short torch.mm's 76.5 TFLOPS [I6] at the settled clock (76.5 x 1642 / 1831)."""
    gpu = load_profile("rtx-3090")
    assert gpu.matmul_efficiency == 1.0
    sustained = gpu.flops("bf16") * gpu.matmul_efficiency * gpu.sustained.compute
    assert sustained == pytest.approx(76.5e12 * 1642 / (1.08 * 1695), rel=0.01)


def test_the_cloud_nodes_have_one_100g_nic():
    """g5.48xlarge / g6.48xlarge: 8 GPUs, 100 Gbps, 768 GiB, AMD EPYC host (2 us NCCL net overhead) [P8]."""
    for name in ("a10g", "l4"):
        gpu = load_profile(name)
        net = gpu.fabric.network
        assert (gpu.gpus_per_node, net.nics_per_node, net.nic_gbps, net.host_overhead_s) == (8, 1, 100, 2e-6)
        assert gpu.host.memory_bytes == 768 * 2**30
