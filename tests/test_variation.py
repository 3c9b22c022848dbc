"""The cost of scale in the default mode (hardware/variation.py): a synchronous step runs at its slowest
rank's pace, and the slowest of N GPUs whose rates spread normally is expected at 1 - k_N sigma."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fsdp_sim.hardware.profiles import load_profile
from fsdp_sim.hardware.variation import expected_max_of_normals, paced_profile, slowest_rank_factor


@pytest.mark.parametrize("n, closed_form", [
    (1, 0.0), (2, 1 / math.sqrt(math.pi)), (3, 3 / (2 * math.sqrt(math.pi))),
    # n = 4: (3 / sqrt(pi)) (1/2 + arcsin(1/3) / pi), the order-statistics closed form (Bose and Gupta 1959)
    (4, 3 / math.sqrt(math.pi) * (1 / 2 + math.asin(1 / 3) / math.pi)),
])
def test_the_expected_slowest_matches_the_order_statistics_closed_form(n, closed_form):
    assert expected_max_of_normals(n) == pytest.approx(closed_form, abs=1e-6)


@pytest.mark.parametrize("n", [8, 64, 1024])
def test_the_expected_slowest_matches_draws(n):
    draws = np.random.default_rng(0).standard_normal((4000, n)).max(axis=1)
    assert expected_max_of_normals(n) == pytest.approx(draws.mean(), abs=4 * draws.std() / math.sqrt(len(draws)))


def test_the_slowest_rank_factor_grows_with_scale_and_spread():
    factors = [slowest_rank_factor(n, 0.026) for n in (1, 8, 64, 1024)]
    assert factors[0] == 1.0 and factors == sorted(factors) and factors[-1] < 1.1
    assert slowest_rank_factor(64, 0.0) == 1.0
    assert slowest_rank_factor(8, 0.05) == pytest.approx(1 / (1 - 0.05 * expected_max_of_normals(8)))


def test_the_paced_profile_slows_only_compute_bound_kernels_and_is_one_object():
    gpu = load_profile("h100-sxm")
    paced = paced_profile(gpu, 1.05)
    assert paced is paced_profile(gpu, 1.05) and paced_profile(gpu, 1.0) is gpu
    assert paced.sustained.compute == pytest.approx(gpu.sustained.compute / 1.05)
    assert paced.sustained.memory == gpu.sustained.memory


def _run(gpus: int, spread=None):
    from fsdp_sim.scenario import parse_scenario
    from fsdp_sim.simulate import simulate

    data = {"model": "llama3-8b", "training": {"micro_batch": 1, "seq_len": 4096},
            "hardware": {"profile": "h100-sxm", "nodes": max(1, gpus // 8), "gpus_per_node": min(gpus, 8)}}
    if spread is not None:
        data["variation"] = {"gpu_speed_spread": spread}
    return simulate(parse_scenario(data)).to_dict()


def test_the_default_mode_carries_the_cost_of_scale():
    """From 8 to 128 GPUs tokens/s per GPU fares worse under the default spread than with every GPU alike
    (spread 0: the slowest rank is the mean one); compute-bound time grows by exactly the slowest-rank factor."""
    small, large = _run(8), _run(128)
    alike = _run(128, spread=0.0)
    tps = "tokens_per_s_per_gpu"
    scaled = large["throughput"][tps] / small["throughput"][tps]
    assert scaled < alike["throughput"][tps] / _run(8, spread=0.0)["throughput"][tps]
    assert alike["hardware"]["slowest_rank_factor"] == 1.0
    factor = large["hardware"]["slowest_rank_factor"]
    assert factor == pytest.approx(slowest_rank_factor(128, 0.026))
    for part in ("matmul_s", "attention_s"):
        assert large["compute"]["breakdown"][part] == pytest.approx(alike["compute"]["breakdown"][part] * factor)
    assert large["compute"]["breakdown"]["memory_bound_s"] == pytest.approx(alike["compute"]["breakdown"]["memory_bound_s"])
    assert _run(1)["hardware"]["slowest_rank_factor"] == 1.0  # one GPU waits for nobody


def test_a_bad_spread_is_one_line():
    from fsdp_sim.errors import ScenarioError

    with pytest.raises(ScenarioError, match="variation.gpu_speed_spread"):
        _run(8, spread=-0.1)
    with pytest.raises(ScenarioError, match="variation.gpu_speed_spread"):
        _run(8, spread=0.5)



def test_the_largest_spread_on_the_largest_mesh_still_runs():
    """MAX_SPREAD keeps the slowest rank's rate positive on the largest world a scenario admits."""
    from fsdp_sim.hardware.variation import MAX_SPREAD
    from fsdp_sim.scenario import MAX_GPUS_PER_NODE, MAX_NODES

    factor = slowest_rank_factor(MAX_NODES * MAX_GPUS_PER_NODE, MAX_SPREAD)
    assert 1 < factor < 10


@pytest.mark.parametrize("n", [2, 3, 8, 9, 64, 65, 100, 512, 1000, 1024, 4096, 8191, 65536])
def test_the_power_worked_out_above_its_underflow_is_the_whole_grids(n):
    """`expected_max_of_normals` skips the powers of Phi that underflow to 0: to the last bit what the
    integrand with the power over the whole grid gives."""
    from fsdp_sim.hardware.variation import _normal_grid
    x, phi, cdf, _, _ = _normal_grid()
    y = x * n * phi * cdf ** (n - 1)
    whole = float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2)
    expected_max_of_normals.cache_clear()
    assert expected_max_of_normals(n) == whole
