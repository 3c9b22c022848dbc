"""Kernels at the rates a GPU sustains through a long training step (profiles.Sustained, in-situ.md): every
compute-bound kernel (GEMM, attention) runs at the profile's compute derating of its benchmark rate, every
memory-bound one at its memory derating, and the derating is the settled / benchmark clock ratio where the
profile states both clocks and no throughput figure of its own."""

from __future__ import annotations

import copy

import pytest

from fsdp_sim.datafile import read_data
from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.kernels import ComputeOptions, attention_tflops, gemm_time, kernels_time
from fsdp_sim.hardware.profiles import REPO_PROFILES, load_profile, parse_profile, profile_names
from fsdp_sim.workload.kernels import block_kernels
from fsdp_sim.workload.presets import PRESETS

PROFILES = profile_names()
# parts whose derating is a measured throughput, not the clock ratio (B200: TFLOPS -15 % while the clock
# fell 19 % [I10]), or whose benchmark already ran at the power cap (the 500 W H100)
THROUGHPUT_SOURCED = {"b200"}


@pytest.mark.parametrize("name", PROFILES)
def test_compute_bound_kernels_run_at_the_sustained_fraction_of_their_benchmark(name):
    gpu = load_profile(name)
    bench, derate = gpu.at_benchmark_rates(), gpu.sustained.compute
    assert 0 < derate <= 1
    for m, n, k in ((8192, 4096, 4096), (256, 4096, 4096), (16384, 14336, 4096)):
        assert gemm_time(gpu, m, n, k, "bf16") == pytest.approx(gemm_time(bench, m, n, k, "bf16") / derate)
    for backend in ("flash", "cudnn", "eager"):
        sustained, benchmark = attention_tflops(gpu, backend, 128, 8192, True), attention_tflops(bench, backend, 128, 8192, True)
        assert sustained == pytest.approx((benchmark[0] * derate, benchmark[1] * derate))


@pytest.mark.parametrize("name", PROFILES)
def test_a_block_slows_by_each_kernel_class_derating(name):
    """A Llama 3 8B block: matmul and attention time by 1/compute derating, memory-bound by 1/memory's."""
    gpu = load_profile(name)
    ks = block_kernels(PRESETS["llama3-8b"], 1, 8192, 2, causal=True)
    for kernel_pass in ("forward", "backward"):
        long, short = (kernels_time(g, ks, kernel_pass, "bf16", ComputeOptions()) for g in (gpu, gpu.at_benchmark_rates()))
        assert long.matmul == pytest.approx(short.matmul / gpu.sustained.compute)
        assert long.attention == pytest.approx(short.attention / gpu.sustained.compute)
        assert long.memory == pytest.approx(short.memory / gpu.sustained.memory)
        assert long.launches == short.launches


@pytest.mark.parametrize("name", [n for n in PROFILES if n not in THROUGHPUT_SOURCED])
def test_the_derating_is_the_clock_ratio_where_both_clocks_are_stated(name):
    s = load_profile(name).sustained
    if s.sm_clock_mhz is None or s.benchmark_clock_mhz is None:
        pytest.skip(f"{name}: a clock is not sourced (a gap its profile names)")
    assert s.compute == pytest.approx(s.sm_clock_mhz / s.benchmark_clock_mhz, abs=5e-4)


def test_power_limits_order_the_hopper_parts():
    """The same die at 700 W settles below its boost clock; at 500 W its own (already capped) benchmark
    rate is what it sustains, which is below the 700 W part's sustained rate."""
    h100, capped = load_profile("h100-sxm"), load_profile("h100-sxm-96gb")
    assert h100.sustained.compute < 1 and capped.sustained.compute == 1
    assert gemm_time(capped, 8192, 8192, 8192, "bf16") > gemm_time(h100, 8192, 8192, 8192, "bf16")
    assert load_profile("a100-80gb").sustained.compute == pytest.approx(1305 / 1410, abs=1e-4)  # [I2]


def test_the_96gb_h100_has_its_hbm2e_bandwidth():
    """"96GB HBM2e with 2.4 TB/sec" on torchtitan's Grand Teton hosts [I8] (not the PCIe part's 2.0)."""
    assert load_profile("h100-sxm-96gb").hbm_bandwidth_Bps == 2.4e12


@pytest.mark.parametrize("key, value, message", [
    ("compute_derate", 1.5, "sustained: compute_derate must be a number in"),
    ("memory_derate", "fast", "sustained: memory_derate must be a number in"),
    ("sm_clock_mhz", -1, "sustained: sm_clock_mhz must be a number in"),
    ("source", "", "sustained.source: expected one printable line"),
    ("turbo", 1, "turbo: unknown key"),
])
def test_a_bad_sustained_section_is_one_line_naming_the_key(key, value, message):
    data = read_data(REPO_PROFILES / "h100-sxm.yaml", "hardware.profile")
    bad = copy.deepcopy(data)
    bad["sustained"][key] = value
    with pytest.raises(ScenarioError, match=message):
        parse_profile(bad, "h100-sxm.yaml")
    del bad["sustained"]
    with pytest.raises(ScenarioError, match="sustained"):
        parse_profile(bad, "h100-sxm.yaml")
