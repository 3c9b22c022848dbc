"""What a build computes once and shares between alike units and blocks is what each would get alone: the
unit shards shared by units of the same parameter shapes (param_dtypes.py `unit_shards`) and the checkpoint
plans shared by blocks of one kernels tuple (checkpointing.py `_by_kernels`), over every shipped scenario
and random setups, in every checkpointing mode."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import pytest
from conftest import scenario_dicts
from hypothesis import HealthCheck, given, settings

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import load_scenario, parse_scenario
from fsdp_sim.schedule import param_dtypes
from fsdp_sim.workload import checkpointing

SCENARIOS = sorted(p for p in (Path(__file__).parents[1] / "scenarios").glob("*.yaml") if not p.name.endswith(".grid.yaml"))


def _shards_alone(scenario) -> None:
    """Each unit's shards, looked up with the cache empty and filled by the other units, equal its own
    computation."""
    param_dtypes._UNIT_SHARDS.clear()
    s = scenario.settings
    for u in scenario.units:
        assert param_dtypes.unit_shards(u, s) == param_dtypes._unit_shards(u, s), u.name


def _plans_alone(workload, mode: str, every: int) -> dict:
    """Each checkpointed block's plan made for it alone: `_plans` with `_by_kernels` sharing nothing, as
    `_plans` made them before it shared them."""
    with patch.object(checkpointing, "_by_kernels", lambda blocks, plan: {m.name: plan(m) for m in blocks}):
        return checkpointing._plans(workload, mode, every)


def _check_plans(workload) -> None:
    for mode, every in (("none", 1), ("full", 1), ("selective_layer", 2), ("selective_layer", 3), ("selective_op", 1)):
        if mode == "selective_op" and any(not m.kernels or any(k.kind == "gemm" and not k.aten_op for k in m.kernels)
                                          for m in workload.modules if m.is_block and m.records_graph):
            with pytest.raises(ScenarioError):  # blocks without the ATen ops the policy keys on
                checkpointing._plans(workload, mode, every)
            continue
        alone = _plans_alone(workload, mode, every)
        shared = checkpointing._plans(workload, mode, every)
        assert list(shared.items()) == list(alone.items()), mode  # the same plans, in the same order


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_shared_shards_and_plans_equal_each_alone(path):
    scenario = load_scenario(path)
    _shards_alone(scenario)
    _check_plans(scenario.workload)


def test_alike_units_share_one_computation():
    """Llama 3 70B's 80 blocks are one entry: the root and the blocks, two computations."""
    scenario = load_scenario(Path(__file__).parents[1] / "scenarios" / "llama3-70b-64xh100.yaml")
    param_dtypes._UNIT_SHARDS.clear()
    for u in scenario.units:
        param_dtypes.unit_shards(u, scenario.settings)
    assert len(scenario.units) == 81 and len(param_dtypes._UNIT_SHARDS) == 2
    plans = checkpointing._plans(scenario.workload, "full", 1)
    assert len(plans) == 80 and len({id(ck) for ck in plans.values()}) == 1


def test_units_of_other_dtypes_or_trainability_do_not_share():
    """The key holds each parameter's dtype and trainability, not only its shape."""
    scenario = load_scenario(Path(__file__).parents[1] / "scenarios" / "llama3-8b-8xh100.yaml")
    u, s = scenario.units[1], scenario.settings
    frozen = replace(u, params=tuple(replace(p, trainable=False, dtype="bf16") for p in u.params))
    param_dtypes._UNIT_SHARDS.clear()
    assert param_dtypes.unit_shards(u, s) == param_dtypes._unit_shards(u, s)
    assert param_dtypes.unit_shards(frozen, s) == param_dtypes._unit_shards(frozen, s)
    assert param_dtypes.unit_shards(frozen, s) != param_dtypes.unit_shards(u, s)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario_dicts())
def test_random_setups_share_as_each_alone(data):
    scenario = parse_scenario(data)
    _shards_alone(scenario)
    _check_plans(scenario.workload)
