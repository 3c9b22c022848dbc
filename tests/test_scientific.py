"""Numbers in e-notation (`1e8`, which PyYAML reads as a string) are numbers where a key wants one."""

from __future__ import annotations

import pytest
import yaml

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.scientific import from_scientific

BASE = "hardware: {profile: h100-sxm}\ntraining: {seq_len: 2.56e2}\n"


def test_exact_integers_and_floats():
    assert yaml.safe_load("x: 1e8")["x"] == "1e8"  # why this exists
    assert from_scientific("1e8", int) == 100_000_000 and isinstance(from_scientific("1e8", int), int)
    assert from_scientific("2.5e3", int) == 2500 and from_scientific("-3E+2", int) == -300
    assert from_scientific("1e-5", float) == 1e-5 and from_scientific("1e8", float) == 1e8
    assert from_scientific("12345678901234567891e0", int) == 12345678901234567891  # exact, not through a float
    for inexact in ("1.5e0", "1e-3", "1e2000"):
        assert from_scientific(inexact, int) == inexact  # left for the type check to refuse
    assert from_scientific("per_block", int) == "per_block" and from_scientific("1e8", str) == "1e8"


def test_scenario_keys_take_them():
    data = yaml.safe_load(BASE + "model: {hidden: 2.56e2, layers: 2, heads: 4, vocab: 1e3}\n"
                                 "fsdp: {wrap: size_based, min_params: 1e4}\nreport: {safety_margin: 1e-1}\n")
    scenario = parse_scenario(data)
    assert scenario.workload.tokens == 256 and scenario.safety_margin == pytest.approx(0.1)
    with pytest.raises(ScenarioError, match=r"fsdp.min_params: expected an integer, got '1.5e0'"):
        parse_scenario(yaml.safe_load(BASE + "model: gpt2\nfsdp: {wrap: size_based, min_params: 1.5e0}\n"))
