"""Grid files: lists, ranges and named choices become axes; `--set` combines; bad grids are one line, exit 2."""

from __future__ import annotations

import pytest
import yaml

from fsdp_sim.cli import main
from fsdp_sim.errors import ScenarioError
from fsdp_sim.grid import Axis, columns, combinations, combine, parse_grid
from fsdp_sim.sweep import points, sweep

TINY = {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}, "training": {"seq_len": 32},
        "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": 8}}


def _values(grid: dict) -> dict:
    return {a.name: [o[a.name] for o in a.options] for a in parse_grid(grid)}


def test_lists_ranges_values_and_scalars():
    assert _values({"training.micro_batch": {"start": 1, "stop": 8, "step": 1}}) == {"training.micro_batch": list(range(1, 9))}
    assert _values({"training.micro_batch": {"start": 2, "stop": 9, "step": 3}}) == {"training.micro_batch": [2, 5, 8]}
    assert _values({"training.seq_len": {"start": 1024, "stop": 8192, "factor": 2}}) == {
        "training.seq_len": [1024, 2048, 4096, 8192]}
    assert _values({"report.safety_margin": {"start": 0.05, "stop": 0.2, "step": 0.05}}) == {
        "report.safety_margin": [0.05, 0.1, 0.15, 0.2]}
    assert _values({"fsdp.backward_prefetch": [True, False], "training.activation_checkpointing": {"values": ["none", "full"]},
                    "fsdp.wrap": "whole_model"}) == {"fsdp.backward_prefetch": [True, False],
                                                     "training.activation_checkpointing": ["none", "full"],
                                                     "fsdp.wrap": ["whole_model"]}
    assert _values({"model": ["llama3-8b", "llama2-7b"]}) == {"model": ["llama3-8b", "llama2-7b"]}  # a section key


def test_named_choice_sets_keys_together_and_rows_leave_the_rest_empty():
    axes = parse_grid({"wrap": [{"fsdp.wrap": "per_block"}, {"fsdp.wrap": "every_k_blocks", "fsdp.blocks_per_unit": 2}],
                       "training.micro_batch": [1, 2]})
    assert columns(axes) == ["fsdp.wrap", "fsdp.blocks_per_unit", "training.micro_batch"]
    combos = combinations(axes)
    assert combos == [{"fsdp.wrap": "per_block", "training.micro_batch": 1},
                      {"fsdp.wrap": "per_block", "training.micro_batch": 2},
                      {"fsdp.wrap": "every_k_blocks", "fsdp.blocks_per_unit": 2, "training.micro_batch": 1},
                      {"fsdp.wrap": "every_k_blocks", "fsdp.blocks_per_unit": 2, "training.micro_batch": 2}]
    data = points(TINY, axes)[2][1]
    assert data["fsdp"] == {"wrap": "every_k_blocks", "blocks_per_unit": 2} and data["training"]["micro_batch"] == 1


def test_set_replaces_the_grid_axes_of_its_key():
    axes = parse_grid({"wrap": [{"fsdp.wrap": "per_block"}, {"fsdp.wrap": "every_k_blocks", "fsdp.blocks_per_unit": 2}],
                       "training.micro_batch": [1, 2]})
    out = combine(axes, ["training.micro_batch=4,8", "fsdp.wrap=whole_model"])
    assert [(a.name, len(a.options)) for a in out] == [("training.micro_batch", 2), ("fsdp.wrap", 1)]
    assert combine([Axis.of("a.b", [1])], []) == [Axis.of("a.b", [1])]


BAD_GRIDS = {  # grid file content: words the one error line must name
    "not a mapping": ("[1, 2]", ["grid", "mapping"]),
    "empty list": ("training.micro_batch: []", ["training.micro_batch", "no values"]),
    "stop below start": ("training.micro_batch: {start: 8, stop: 1}", ["training.micro_batch", "below"]),
    "unknown range key": ("training.micro_batch: {start: 1, stopp: 8}", ["training.micro_batch.stopp", "unknown key"]),
    "zero step": ("training.micro_batch: {start: 1, stop: 8, step: 0}", ["step", "positive"]),
    "text bound": ("training.micro_batch: {start: one, stop: 8}", ["start", "number", "one"]),
    "step and factor": ("training.micro_batch: {start: 1, stop: 8, step: 1, factor: 2}", ["step or factor"]),
    "not a dotted key": ("'fsdp..wrap': [per_block]", ["fsdp..wrap", "dotted"]),
    "named choice of scalars": ("wrap: [per_block, whole_model]", ["wrap", "mappings"]),
    "key set twice": ("fsdp.wrap: [per_block]\nw: [{fsdp.wrap: whole_model}]", ["fsdp.wrap", "both"]),
    "too many points": ("a.b: {start: 1, stop: 2000}\nc.d: {start: 1, stop: 2000}", ["points", "more than"]),
    "invalid YAML": ("training.micro_batch: [1, 2\n", ["YAML"]),
    "misspelt scenario key": ("fsdp.wrapp: [per_block]", ["fsdp.wrapp", "unknown key"]),
}


@pytest.mark.parametrize("case", sorted(BAD_GRIDS))
def test_bad_grid_is_one_line_and_exit_2(case, tmp_path, capsys):
    text, words = BAD_GRIDS[case]
    scenario, grid = tmp_path / "s.yaml", tmp_path / "grid.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    grid.write_text(text)
    assert main(["sweep", str(scenario), "--grid", str(grid), "--jobs", "1", "-q"]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdp-sim: error: ") and out == "", err
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_missing_grid_file(tmp_path, capsys):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    assert main(["sweep", str(scenario), "--grid", str(tmp_path / "nowhere.yaml"), "-q"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "nowhere.yaml" in err


def test_grid_and_set_sweep_every_combination(tmp_path):
    scenario, grid = tmp_path / "s.yaml", tmp_path / "grid.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    grid.write_text("training.micro_batch: {start: 1, stop: 3}\n")
    keys, rows = sweep(str(scenario), ["fsdp.backward_prefetch=true,false"], grid=str(grid), jobs=1)
    assert keys == ["training.micro_batch", "fsdp.backward_prefetch"] and len(rows) == 6
    assert [(r["training.micro_batch"], r["fsdp.backward_prefetch"]) for r in rows][:2] == [(1, True), (1, False)]
    assert all(r["error"] == "" and r["tokens_per_step"] == 32 * 8 * r["training.micro_batch"] for r in rows)


def test_no_axes_is_bad_input(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(TINY))
    with pytest.raises(ScenarioError, match="--grid"):
        sweep(str(scenario), [])
