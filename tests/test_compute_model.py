"""The kernel cost model against the measurements it is built from, and the direction of every effect.

Closed forms where they exist: a GEMM at a shape XLA measured runs at the measured rate (scaled by the
profile's MAMF); TF32 moves an fp32 GEMM by the profile's tf32/fp32 ratio; attention at a tabulated
sequence length runs at the tabulated throughput; an eager memory-bound kernel at its measured fraction of
HBM bandwidth.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from fsdp_sim.hardware import kernel_data as kd
from fsdp_sim.hardware.kernels import (ComputeOptions, attention_tflops, gemm_shape_factor, gemm_time, kernels_time,
                                       memory_efficiency, select_sdpa_backend)
from fsdp_sim.hardware.profiles import load_profile
from fsdp_sim.workload.kernels import block_kernels
from fsdp_sim.workload.model import Kernel
from fsdp_sim.workload.presets import PRESETS

# the components at the rates their benchmarks measured (tests/test_sustained.py: a long step's derating)
H100, A100 = load_profile("h100-sxm").at_benchmark_rates(), load_profile("a100-80gb").at_benchmark_rates()


@pytest.mark.parametrize("row", kd.H100_GEMM_TABLE)
def test_gemm_at_a_measured_shape_runs_at_the_measured_rate(row):
    """On H100 the shape factor is the table's own value relative to its best (waves cancel on 132 SMs)."""
    m, n, k, bf16, _ = row
    assert gemm_shape_factor(m, n, k, 132, 2) == pytest.approx(bf16 / max(r[3] for r in kd.H100_GEMM_TABLE))


def test_small_and_narrow_gemms_are_slower_per_flop():
    big = 2 * 8192 * 4096 * 4096 / gemm_time(H100, 8192, 4096, 4096, "bf16")
    assert 2 * 256 * 4096 * 4096 / gemm_time(H100, 256, 4096, 4096, "bf16") < 0.6 * big  # small M
    assert 2 * 8192 * 512 * 4096 / gemm_time(H100, 8192, 512, 4096, "bf16") < big  # narrow GQA k/v projection
    assert 2 * 4096 * 4096 * 256 / gemm_time(H100, 4096, 4096, 256, "bf16") < 0.6 * big  # short K
    # a dimension off the 128-byte grid loses tensor-core efficiency [C1]
    assert gemm_time(H100, 8192, 10922, 4096, "bf16") / 10922 > 1.3 * gemm_time(H100, 8192, 10944, 4096, "bf16") / 10944


def test_large_gemm_reaches_the_profiles_mamf():
    rate = 2 * 16384 * 4096 * 4096 / gemm_time(H100, 16384, 4096, 4096, "bf16")
    assert rate == pytest.approx(H100.flops("bf16") * H100.matmul_efficiency * 793.1 / 808.7, rel=1e-3)


@pytest.mark.parametrize("profile", ["a100-80gb", "h100-sxm"])
def test_tf32_moves_an_fp32_gemm_by_the_profiles_ratio(profile):
    """fp32 matmuls run at the fp32 rate unless TF32 is allowed (PyTorch's default is off)."""
    gpu = load_profile(profile)
    off, on = gemm_time(gpu, 8192, 8192, 8192, "fp32"), gemm_time(gpu, 8192, 8192, 8192, "fp32", allow_tf32=True)
    expected = gpu.flops("tf32") * kd.TF32_EFFICIENCY[gpu.arch] / (gpu.flops("fp32") * kd.FP32_EFFICIENCY)
    assert off / on == pytest.approx(expected)


def test_a100_fp32_matches_pytorchs_tf32_example():
    """PyTorch's docs (cuda.rst): 10240^3 fp32 matmul on GA100, 0.11 s without TF32, 0.016 s with it [C6]."""
    assert gemm_time(A100, 10240, 10240, 10240, "fp32") == pytest.approx(0.11, rel=0.05)
    assert gemm_time(A100, 10240, 10240, 10240, "fp32", allow_tf32=True) == pytest.approx(0.016, rel=0.05)


@pytest.mark.parametrize("version, arch, backend", [
    ("2.13", "sm90", "cudnn"), ("2.13", "sm80", "flash"), ("2.8", "sm90", "flash"), ("2.5.1", "sm90", "flash"),
    ("2.5.0", "sm90", "cudnn"), ("2.9", "sm100", "cudnn"), ("2.1", "sm90", "flash1"), ("2.0.1", "sm80", "flash1"),
    ("2.2", "sm80", "flash"), ("2.10", "sm90", "flash"), ("2.11", "sm90", "cudnn"),
])
def test_sdpa_backend_follows_the_torch_version(version, arch, backend):
    options = ComputeOptions(torch_version=tuple(int(p) for p in version.split(".")))
    assert select_sdpa_backend(arch, options) == backend


def test_attention_runs_at_the_tabulated_throughput():
    """FA2 on A100, causal d128 at 8k: 182 TFLOPS fwd+bwd [C9]; on H100 FA2 fwd 333, fwd+bwd 308 [C9]."""
    assert attention_tflops(A100, "flash", 128, 8192, True) == pytest.approx((182e12, 182e12))
    fwd, bwd = attention_tflops(H100, "flash", 128, 8192, True)
    assert fwd == pytest.approx(333e12)
    assert 3.5 / (1 / fwd + 2.5 / bwd) == pytest.approx(308e12)  # the fwd+bwd figure is reproduced
    assert attention_tflops(H100, "cudnn", 128, 8192, False) == pytest.approx((600e12, 518e12))


def test_flashattention_1_runs_at_its_bars_of_the_same_figures():
    """FA1 fwd+bwd [C9]: A100 causal d128 at 8k 80 TFLOPS, non-causal d64 at 2k 104; H100 non-causal d128
    at 4k 131, and causal (no bar) at the A100's causal / non-causal ratio: 131 x 76 / 80 at 4k."""
    assert attention_tflops(A100, "flash1", 128, 8192, True) == pytest.approx((80e12, 80e12))
    assert attention_tflops(A100, "flash1", 64, 2048, False) == pytest.approx((104e12, 104e12))
    assert attention_tflops(H100, "flash1", 128, 4096, False) == pytest.approx((131e12, 131e12))
    assert attention_tflops(H100, "flash1", 128, 4096, True)[0] == pytest.approx(131e12 * 76 / 80)
    # FlashAttention-2 is about twice as fast, as PyTorch 2.2's release says of its SDPA [F7]
    assert 1.8 < attention_tflops(A100, "flash", 128, 8192, True)[0] / attention_tflops(A100, "flash1", 128, 8192, True)[0] < 2.6


def test_causal_attention_does_half_the_work_in_kernel_time():
    causal = Kernel("a", "attention", (1, 32, 8192, 128), causal=True)
    full = Kernel("a", "attention", (1, 32, 8192, 128), causal=False)
    t_causal = kernels_time(H100, (causal,), "forward", "bf16", ComputeOptions()).attention
    t_full = kernels_time(H100, (full,), "forward", "bf16", ComputeOptions()).attention
    assert 0.5 < t_causal / t_full < 0.75  # half the FLOPs, at a somewhat lower throughput


def test_attention_backward_is_2_5x_its_forward_flops():
    k = Kernel("a", "attention", (2, 16, 4096, 128), causal=True)
    assert k.bwd_flops == 2.5 * k.fwd_flops


def test_memory_bound_kernels_at_their_measured_efficiency():
    """On H100 (sm90), the generation the eager figures were measured on (tests/test_eager_generations.py
    holds the others)."""
    assert memory_efficiency("norm", (8192, 4096), 0, fused=False, arch="sm90") == pytest.approx(0.62)
    assert memory_efficiency("activation", (8192, 32768), 0, fused=False, arch="sm90") == pytest.approx(0.32)
    assert memory_efficiency("elementwise", (), 63e6, fused=False, arch="sm90") == pytest.approx(0.58)
    # fused, by row width: torch.compile RMSNorm 2,300 / 1,800 / 1,500 GB/s of 3,350 at 4K / 16K / 131K [C17],
    # Liger SwiGLU 83 % at ffn 4096 and 91 % at 32768 [C5]
    assert [memory_efficiency("norm", (32768, w), 0, fused=True, arch="sm90") for w in (4096, 16384, 131072)] == \
        pytest.approx([0.69, 0.537, 0.448])
    assert [memory_efficiency("activation", (8192, w), 0, fused=True, arch="sm90") for w in (4096, 32768)] == \
        pytest.approx([0.83, 0.91])
    # torch.compile's fused kernels reach more of HBM, on every generation
    for arch in ("sm80", "sm90", "sm100", "gfx942", "sm89"):
        for kind in ("norm", "norm_unfused", "rope", "activation", "cross_entropy"):
            assert memory_efficiency(kind, (8192, 4096), 1e8, fused=True, arch=arch) > \
                memory_efficiency(kind, (8192, 4096), 1e8, fused=False, arch=arch)


def test_swiglu_recompute_stops_before_w2():
    """Non-reentrant checkpointing stops at the block's last saved tensor: w2 is not recomputed."""
    ks = block_kernels(PRESETS["llama3-8b"], 1, 4096, 2, causal=True)
    opts = ComputeOptions()
    fwd, rec = kernels_time(H100, ks, "forward", "bf16", opts), kernels_time(H100, ks, "recompute", "bf16", opts)
    w2 = gemm_time(H100, 4096, 4096, 14336, "bf16")
    assert fwd.matmul - rec.matmul == pytest.approx(w2)
    assert rec.launches < fwd.launches


def test_torch_compile_cuts_launches_and_memory_time():
    ks = block_kernels(PRESETS["llama3-8b"], 1, 2048, 2, causal=True)
    eager = kernels_time(H100, ks, "forward", "bf16", ComputeOptions())
    compiled = kernels_time(H100, ks, "forward", "bf16", ComputeOptions(torch_compile=True))
    assert compiled.launches < eager.launches and compiled.memory < eager.memory
    assert compiled.matmul == eager.matmul and compiled.attention == eager.attention


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 1 << 17), n=st.integers(1, 1 << 17), k=st.integers(1, 1 << 17),
       profile=st.sampled_from(["a100-80gb", "h100-sxm", "b200", "l40s", "mi300x", "rtx-4090"]))
def test_no_gemm_beats_the_peak(m, n, k, profile):
    """The time model never runs a matmul faster than its dtype's peak (so MFU cannot pass 1)."""
    gpu = load_profile(profile)
    assert 2 * m * n * k / gemm_time(gpu, m, n, k, "bf16") <= gpu.flops("bf16") * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(s=st.integers(64, 1 << 16), d=st.sampled_from([32, 64, 80, 96, 128, 256]), causal=st.booleans(),
       backend=st.sampled_from(["flash", "flash1", "cudnn"]),
       profile=st.sampled_from(["a100-80gb", "h100-sxm", "h100-sxm-96gb", "b200", "mi300x", "l40s"]))
def test_no_attention_kernel_beats_the_gpus_own_gemms(s, d, causal, backend, profile):
    """Attention's FLOPs are matmuls on the same tensor cores: at most the GPU's large-GEMM rate (MI300X's
    GEMMs reach 51 % of its peak, where A100's table attention reaches 65 % of A100's)."""
    gpu = load_profile(profile)
    fwd, bwd = attention_tflops(gpu, backend, d, s, causal)
    ceiling = gpu.flops("bf16") * gpu.matmul_efficiency
    assert 0 < fwd <= ceiling * (1 + 1e-12) and 0 < bwd <= ceiling * (1 + 1e-12)


def test_a_parts_own_fp8_gemm_measurement_is_its_fp8_rate():
    """The 500 W H100 96GB: FBGEMM's fp8 GEMM at 8192^3 ran 1125 TFLOPS [C4], not the 700 W part's 70.9 % of
    1,979; H200 its MAMF 1,453.4 [S7]; H100 SXM the architecture's 70.9 %."""
    from fsdp_sim.hardware.kernels import gemm_rate
    assert gemm_rate(load_profile("h100-sxm-96gb").at_benchmark_rates(), "fp8", False) == pytest.approx(1978.9e12 * 0.5685)
    assert gemm_rate(load_profile("h200").at_benchmark_rates(), "fp8", False) == pytest.approx(1978.9e12 * 0.7345)
    assert gemm_rate(H100, "fp8", False) == pytest.approx(1402.6e12)
