"""`gemm_shape_factor` reads the table's per-shape corrections worked out once (`_table_points`): to the last
bit what working each of them out at every call gave, on any shape, SM count and item size."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.hardware import kernel_data as kd
from fsdp_sim.hardware.kernels import _physical, gemm_shape_factor


def _per_call(m: int, n: int, k: int, sms: int, itemsize: int) -> float:
    """The factor as it was computed before the table's corrections were kept: every row's correction at
    every call (the reference the kept table must reproduce exactly)."""
    best = max(row[3] for row in kd.H100_GEMM_TABLE)
    x = [math.log2(max(v, 1)) for v in (m, n, k)]
    num = den = 0.0
    for row in kd.H100_GEMM_TABLE:
        ratio = row[3] / best / _physical(*row[:3], kd.H100_GEMM_SMS)
        dist2 = sum((xi - math.log2(r)) ** 2 for xi, r in zip(x, row[:3]))
        if dist2 < 1e-12:
            num, den = ratio, 1.0
            break
        w = 1.0 / dist2 ** 2
        num, den = num + w * ratio, den + w
    factor = _physical(m, n, k, sms) * num / den
    align = kd.ALIGN_BYTES // itemsize
    if n % align or k % align:
        factor *= kd.MISALIGNED_GEMM_FACTOR
    return min(1.0, factor)


dims = st.one_of(st.integers(1, 1 << 20), st.sampled_from([1, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]))


@settings(max_examples=400, deadline=None)
@given(dims, dims, dims, st.sampled_from([78, 108, 114, 132, 148, 304]), st.sampled_from([1, 2, 4]))
def test_the_kept_corrections_give_the_per_call_factor(m, n, k, sms, itemsize):
    assert gemm_shape_factor.__wrapped__(m, n, k, sms, itemsize) == _per_call(m, n, k, sms, itemsize)


def test_every_measured_shape_is_its_own_point():
    for m, n, k, *_ in kd.H100_GEMM_TABLE:
        assert gemm_shape_factor.__wrapped__(m, n, k, kd.H100_GEMM_SMS, 2) == _per_call(m, n, k, kd.H100_GEMM_SMS, 2)
