"""`gemm_shape_factor` reads the table's per-shape corrections worked out once (`_table_points`): their
weighted sums at any shape (`_weighted_corrections`, which it multiplies by its physical term) are to the last
bit what working each correction out at every call gave."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.hardware import kernel_data as kd
from fsdp_sim.hardware.kernels import _physical, _weighted_corrections


def _per_call(m: int, n: int, k: int) -> tuple[float, float]:
    """The weighted corrections as they were computed before the table's corrections were kept: every
    row's correction at every call (the reference the kept table must reproduce exactly)."""
    best = max(row[3] for row in kd.H100_GEMM_TABLE)
    x = [math.log2(max(v, 1)) for v in (m, n, k)]
    num = den = 0.0
    for row in kd.H100_GEMM_TABLE:
        ratio = row[3] / best / _physical(*row[:3], kd.H100_GEMM_SMS)
        dist2 = sum((xi - math.log2(r)) ** 2 for xi, r in zip(x, row[:3]))
        if dist2 < 1e-12:
            return ratio, 1.0
        w = 1.0 / dist2 ** 2
        num, den = num + w * ratio, den + w
    return num, den


dims = st.one_of(st.integers(1, 1 << 20), st.sampled_from([1, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]))


@settings(max_examples=400, deadline=None)
@given(dims, dims, dims)
def test_the_kept_corrections_give_the_per_call_weighting(m, n, k):
    assert _weighted_corrections(m, n, k) == _per_call(m, n, k)


def test_every_measured_shape_is_its_own_point():
    for m, n, k, *_ in kd.H100_GEMM_TABLE:
        assert _weighted_corrections(m, n, k) == _per_call(m, n, k)
