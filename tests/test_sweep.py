"""`fsdp-sim sweep`: every combination, each equal to its own single run; bad sweeps are one line."""

from __future__ import annotations

import csv

import pytest
import yaml

from fsdp_sim.cli import main
from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.sweep import parse_assignment, points, sweep

BASE = {"model": "llama3-8b", "training": {"seq_len": 1024}, "hardware": {"profile": "h100-sxm"}}


def test_assignments_parse_as_yaml_scalars():
    assert parse_assignment("training.micro_batch=1,2") == ("training.micro_batch", [1, 2])
    assert parse_assignment("fsdp.backward_prefetch=true,false") == ("fsdp.backward_prefetch", [True, False])
    with pytest.raises(ScenarioError, match="KEY=VALUE"):
        parse_assignment("fsdp.wrap")


def test_points_are_the_cartesian_product_and_a_preset_takes_overrides():
    grid = points(BASE, [("training.micro_batch", [1, 2, 4]), ("model.layers", [2, 4])])
    assert [chosen for chosen, _ in grid][:2] == [{"training.micro_batch": 1, "model.layers": 2},
                                                  {"training.micro_batch": 1, "model.layers": 4}]
    assert len(grid) == 6 and grid[0][1]["model"] == {"preset": "llama3-8b", "layers": 2}
    assert BASE["model"] == "llama3-8b"  # the base is not modified


def test_each_row_equals_its_own_run(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(BASE))
    keys, rows = sweep(str(path), ["training.micro_batch=1,2", "fsdp.shard_size=3,8"], jobs=2)
    assert keys == ["training.micro_batch", "fsdp.shard_size"] and len(rows) == 4
    for row in rows:
        if row["fsdp.shard_size"] == 3:
            assert "does not divide" in row["error"]
            continue
        data = BASE | {"training": {"seq_len": 1024, "micro_batch": row["training.micro_batch"]},
                       "fsdp": {"shard_size": 8}}
        alone = simulate(parse_scenario(data)).to_dict()
        assert row["peak_allocated_bytes"] == alone["peak"]["allocated_bytes"]
        assert row["step_time_s"] == alone["step_time_s"] and row["error"] == ""


def test_cli_writes_csv_and_refuses_unknown_keys(tmp_path, capsys):
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(BASE))
    out = tmp_path / "rows.csv"
    assert main(["sweep", str(path), "--set", "fsdp.wrap=per_block,whole_model", "--jobs", "1", "-q", "-o", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["fsdp.wrap"] for r in rows] == ["per_block", "whole_model"] and all(r["step_time_s"] for r in rows)
    assert main(["sweep", str(path), "--set", "fsdp.wrapp=per_block", "--jobs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fsdp.wrapp" in err[0]
