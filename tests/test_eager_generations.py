"""Eager memory-bound kernels per GPU generation: each generation at its own measured fraction of HBM peak
where one was measured, H100's (or the one measured generation's) elsewhere, the gap named.

Figures are recomputed from the sources' raw timings (kernel_data.py cites them), not read back from the
tables: Liger's CSV [C5], pytorch#135397 [E1], pytorch#176223 [E2].
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdp_sim.hardware import kernel_data as kd
from fsdp_sim.hardware.kernels import ComputeOptions, eager_memory, elementwise_time, kernels_time, memory_efficiency
from fsdp_sim.hardware.profiles import load_profile, profile_names
from fsdp_sim.workload.kernels import norm
from fsdp_sim.workload.model import Kernel

MEMORY_KINDS = ("norm", "norm_unfused", "rope", "activation", "cross_entropy", "elementwise")


def test_a100_norm_at_its_own_measured_fraction():
    """nn.LayerNorm fwd fp32 on A100-80GB, 4096 rows (8 ideal bytes a value) [C5]: 0.1218 ms at 4096 wide,
    0.5067 ms at 16384, of 2,039 GB/s; not H100's RMSNorm figure (62 / 54 %)."""
    for width, ms in ((4096, 0.121824), (16384, 0.506688)):
        measured = 8 * 4096 * width / (ms * 1e-3) / 2.039e12
        assert memory_efficiency("norm", (4096, width), 0, False, "sm80") == pytest.approx(measured, abs=5e-4)
    assert eager_memory("norm", "sm80").own
    assert memory_efficiency("norm", (4096, 4096), 0, False, "sm80") < memory_efficiency("norm", (4096, 4096), 0, False, "sm90")


def test_a100_norm_kernel_time_is_its_bytes_at_that_fraction():
    """A fused norm's forward on the a100-80gb profile: ideal bytes / (HBM peak x sustained x A100's fraction)."""
    gpu = load_profile("a100-80gb")
    k = norm("attention_norm", 8192, 4096, 2, fused=True)
    t = kernels_time(gpu, (k,), "forward", "bf16", ComputeOptions()).memory
    frac = memory_efficiency("norm", k.shape, k.bytes, False, "sm80")
    assert t == pytest.approx(k.bytes / (gpu.hbm_bandwidth_Bps * gpu.sustained.memory * frac))


@pytest.mark.parametrize("name", profile_names())
def test_every_profile_has_a_figure_for_every_kind_and_says_whose(name):
    arch = load_profile(name).arch
    for kind in MEMORY_KINDS:
        measured = eager_memory(kind, arch)
        assert measured.source.strip()
        assert all(0 < f <= 1 for _, f in measured.points)
        if not measured.own:  # a fallback names the gap and whose figure stands in
            assert measured.source.startswith(f"gap: no {arch} measurement")
            assert arch not in kd.EAGER_MEMORY[kind]


def test_a_generation_without_data_takes_h100s_figure_and_says_so():
    """L40S (sm89): nothing measured, so H100's norm and activation figures, named as a gap."""
    for kind in ("norm", "activation"):
        fallback = eager_memory(kind, "sm89")
        assert not fallback.own
        assert fallback.points == eager_memory(kind, "sm90").points
        assert "H100" in fallback.source and "gap" in fallback.source
        gpu = load_profile("l40s")
        assert memory_efficiency(kind, (8192, 4096), 0, False, gpu.arch) == memory_efficiency(kind, (8192, 4096), 0, False, "sm90")


def test_a_kind_only_a100_measured_stands_in_for_h100_and_says_a100():
    """Cross-entropy and HF's composite RMSNorm were measured on A100 only: H100 takes A100's, named."""
    for kind in ("cross_entropy", "norm_unfused"):
        on_h100 = eager_memory(kind, "sm90")
        assert not on_h100.own and "A100" in on_h100.source
        assert on_h100.points == eager_memory(kind, "sm80").points


def test_b200_rope_at_its_own_measured_fraction():
    """Eager rotate_half on q and k (4, 2048, 32, 128) bf16, B200: 8.675 ms for 10 iterations [E2]; q and k
    read and written once, of 8.0 TB/s: under half of A100's fraction for the same kernel sequence."""
    measured = 4 * 4 * 2048 * 32 * 128 * 2 / 0.8675e-3 / 8.0e12
    assert memory_efficiency("rope", (8192, 8192), 0, False, "sm100") == pytest.approx(measured, rel=2e-3)
    assert memory_efficiency("rope", (8192, 8192), 0, False, "sm100") < memory_efficiency("rope", (8192, 8192), 0, False, "sm80") / 2


@given(st.floats(min_value=1e5, max_value=1e11))
def test_mi300x_elementwise_is_h100s_at_the_paired_ratio(nbytes):
    """torch.sum of 4.3 GB by the same script: 3,205 GB/s of 5.3 TB/s on MI300X, 3,136 of 3.35 TB/s on H100
    [E1]; MI300X's eager copies and casts reach that ratio of H100's fraction (assumed at every size)."""
    ratio = (3205 / 5.3e12) / (3136 / 3.35e12)
    mi300x = memory_efficiency("elementwise", (), nbytes, False, "gfx942")
    assert mi300x == pytest.approx(ratio * memory_efficiency("elementwise", (), nbytes, False, "sm90"))
    # the plain copies outside kernels (casts, foreach passes) too; torch.compile leaves a plain copy eager
    gpu = load_profile("mi300x")
    assert elementwise_time(gpu, nbytes) == pytest.approx(nbytes / (gpu.memory_Bps * mi300x))
    assert memory_efficiency("elementwise", (), nbytes, True, "gfx942") == mi300x


def test_mi300x_step_pays_more_for_its_copies_than_at_h100s_fraction():
    """The same elementwise kernel on MI300X takes 1 / 0.646 the time H100's fraction of its peak would give."""
    gpu = load_profile("mi300x")
    k = Kernel("attention residual add", "elementwise", bytes=3 * 8192 * 4096 * 2, bwd_bytes=3 * 8192 * 4096 * 2)
    t = kernels_time(gpu, (k,), "forward", "bf16", ComputeOptions()).memory
    at_h100_fraction = k.bytes / (gpu.memory_Bps * memory_efficiency("elementwise", (), k.bytes, False, "sm90"))
    assert t / at_h100_fraction == pytest.approx(1 / kd.MI300X_VS_H100_ELEMENTWISE)
    assert t > at_h100_fraction
