"""The optimizer step's state, temporaries, traffic and launches per implementation, in closed form from
torch 2.13's `torch/optim` (see `fsdp_sim/schedule/optimizers.py`), and what they do to a simulated step."""

from __future__ import annotations

import pytest
from conftest import run, scenario_dict

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.optimizers import FOREACH_ELEMENTS_PER_LAUNCH, step_cost

SHARDS = [1000, 4000, 250]


def test_foreach_adamw_allocates_one_shard_sized_sqrt_and_makes_eight_passes():
    c = step_cost("adamw", "foreach", True, SHARDS)
    assert (c.states, c.temp_bytes, c.traffic_bytes, c.launches) == (2, 4 * 5250, 80 * 5250, 8)


def test_for_loop_adam_holds_two_copies_of_the_largest_shard_and_launches_per_parameter():
    c = step_cost("adam", "for_loop", True, SHARDS)
    assert (c.temp_bytes, c.traffic_bytes, c.launches) == (2 * 4 * 4000, 72 * 5250, 7 * 3)


def test_fused_adamw_has_no_temporaries_and_one_pass():
    c = step_cost("adamw", "fused", True, SHARDS + [FOREACH_ELEMENTS_PER_LAUNCH])
    assert (c.temp_bytes, c.traffic_bytes, c.launches) == (0, 28 * (5250 + FOREACH_ELEMENTS_PER_LAUNCH), 2)


def test_sgd_without_momentum_keeps_no_state():
    assert step_cost("sgd", "foreach", False, SHARDS).states == 0
    c = step_cost("sgd", "foreach", True, SHARDS)
    assert (c.states, c.temp_bytes, c.traffic_bytes) == (1, 0, 32 * 5250)
    assert step_cost("sgd", "foreach", False, SHARDS).traffic_bytes == 12 * 5250


def _optimizer_peak(impl: str, optimizer: str = "adamw") -> tuple[int, int]:
    """A small batch, so the optimizer step sets the peak (as the referee's optimizer-peak case)."""
    data = scenario_dict({"hidden": 256, "layers": 4, "heads": 8, "vocab": 1000}, gpus_per_node=2,
                         training={"micro_batch": 1, "seq_len": 16, "optimizer": optimizer, "optimizer_impl": impl})
    _, r = run(data)
    return r.peak()["allocated_bytes"], sum(b.nbytes for b in r.graph.persistent if b.category == "optimizer_states")


def test_the_implementation_moves_the_optimizer_peak_not_the_state():
    foreach, for_loop, fused = (_optimizer_peak(impl) for impl in ("foreach", "for_loop", "fused"))
    assert foreach[1] == for_loop[1] == fused[1]
    assert fused[0] <= for_loop[0] < foreach[0]


def test_sgd_momentum_is_one_state_and_without_none():
    base = {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 100}, "hardware": {"profile": "h100-sxm", "gpus_per_node": 2}}
    with_m = run(base | {"training": {"optimizer": "sgd"}})[1]
    without = run(base | {"training": {"optimizer": "sgd", "momentum": False}})[1]
    states = [sum(b.nbytes for b in r.graph.persistent if b.category == "optimizer_states") for r in (with_m, without)]
    assert states[0] > 0 and states[1] == 0


@pytest.mark.parametrize("training, key", [
    ({"optimizer": "sgd", "optimizer_impl": "fused"}, "training.optimizer_impl"),
    ({"optimizer": "adamw", "momentum": False}, "training.momentum"),
    ({"optimizer_impl": "apex"}, "training.optimizer_impl"),
])
def test_impossible_optimizer_settings_are_one_line(training, key):
    with pytest.raises(ScenarioError, match=key):
        parse_scenario({"model": "gpt2", "training": training, "hardware": {"profile": "h100-sxm"}})
