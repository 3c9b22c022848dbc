"""Techniques are parts the step is given (schedule/techniques.py), not base classes of the step: the
parts a step holds follow its settings, one line each, and no runtime inherits a technique."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from fsdp_sim.scenario import load_scenario
from fsdp_sim.schedule import float8, offload, tp
from fsdp_sim.schedule.autograd import AutogradStep
from fsdp_sim.schedule.build import BUILDERS
from fsdp_sim.schedule.fsdp1 import FSDP1Runtime
from fsdp_sim.schedule.fsdp2 import FSDP2Runtime
from fsdp_sim.schedule.plain import PlainRuntime

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
RUNTIMES = {0: PlainRuntime, 1: FSDP1Runtime, 2: FSDP2Runtime}


@pytest.mark.parametrize("name, expected", [
    ("llama3-8b-8xh100.yaml", []),
    ("llama3-70b-64xh100-tp8.yaml", ["tensor_parallel"]),
    ("llama2-70b-8xa100-80gb-cpu-offload.yaml", ["cpu_offload"]),
    ("llama3-8b-8xh100-activation-offload.yaml", ["activation_offload"]),
    ("llama3-8b-8xh100-fp8.yaml", ["float8_all_gather"]),
])
def test_a_step_holds_the_parts_its_settings_name(name, expected):
    sc = load_scenario(SCENARIOS / name)
    step = RUNTIMES[sc.settings.version](sc.workload, sc.units, sc.settings)
    assert step.techniques.names() == expected


def test_no_runtime_inherits_a_technique():
    """Every class a runtime derives from is the step, the walk or a runtime's own half (its reduction);
    none is defined in a technique's module."""
    technique_modules = {m.__name__ for m in (float8, offload, tp)}
    for runtime in (*RUNTIMES.values(), AutogradStep):
        bases = {cls.__module__ for cls in inspect.getmro(runtime)}
        assert not bases & technique_modules, runtime
    assert set(BUILDERS) == set(RUNTIMES)
