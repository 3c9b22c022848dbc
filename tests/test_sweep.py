"""`fsdp-sim sweep`: every combination, each equal to its own single run; bad sweeps are one line."""

from __future__ import annotations

import copy
import csv
import json

import pytest
import yaml
from hypothesis import given, settings, strategies as st

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


_TEXT = st.text(st.characters(whitelist_categories=("L", "N", "P", "S"), whitelist_characters=" ", max_codepoint=0xFFFF),
                max_size=8)
_SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | _TEXT
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                       max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.lists(_VALUES, min_size=1, max_size=4))
def test_values_written_as_flow_yaml_come_back_one_each(values):
    """Commas split a sweep's values only outside brackets, braces and quotes: any values written as JSON
    (flow YAML: lists, mappings, quoted strings with commas) and joined by commas come back as written."""
    text = ",".join(json.dumps(v) for v in values)
    assert parse_assignment(f"variation.stragglers={text}") == ("variation.stragglers", values)


@pytest.mark.parametrize("text,values", [
    ("variation.stragglers=[{rank: 17, speed: 0.9}]", [[{"rank": 17, "speed": 0.9}]]),
    ("variation.stragglers=[], [{rank: 17, speed: 0.9}, {rank: 3, speed: 0.8}]",
     [[], [{"rank": 17, "speed": 0.9}, {"rank": 3, "speed": 0.8}]]),
    ("name=it's,a[1],'x, y'", ["it's", "a[1]", "x, y"]),  # YAML's plain scalars: a quote or bracket inside a word
])
def test_a_flow_list_or_mapping_is_one_value(text, values):
    assert parse_assignment(text)[1] == values


@pytest.mark.parametrize("text,words", [
    ("variation.stragglers=[{rank: 17, speed: 0.9}", ["variation.stragglers", "unclosed '['", "expected"]),
    ("variation.stragglers=[{rank: 17, speed: 0.9]}", ["variation.stragglers", "unmatched ']'", "expected"]),
    ("variation.links=[{node: 1, nic: :}]", ["variation.links", "not a YAML value", "flow list or mapping"]),
    ("name='x", ["name", "unclosed quote", "expected"]),
])
def test_bad_flow_values_are_one_line_naming_the_key(text, words):
    with pytest.raises(ScenarioError) as err:
        parse_assignment(text)
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value)


def test_points_are_the_cartesian_product_and_a_preset_takes_overrides():
    grid = points(BASE, [("training.micro_batch", [1, 2, 4]), ("model.layers", [2, 4])])
    assert [chosen for chosen, _ in grid][:2] == [{"training.micro_batch": 1, "model.layers": 2},
                                                  {"training.micro_batch": 1, "model.layers": 4}]
    assert len(grid) == 6 and grid[0][1]["model"] == {"preset": "llama3-8b", "layers": 2}
    assert BASE["model"] == "llama3-8b"  # the base is not modified


def test_points_share_the_sections_they_do_not_set_and_parsing_changes_none():
    """A point copies only the mappings its keys set (`assign`), so its other sections are the base's own
    objects: sound only while parsing and simulating leave their data as it was, which this checks on
    points of every kind of section (a preset model, nested mappings, lists)."""
    base = BASE | {"fsdp": {"wrap": "per_block"}, "variation": {"stragglers": [{"rank": 1, "speed": 0.9}]}}
    grid = points(base, [("training.micro_batch", [1, 2]), ("model.layers", [2]), ("hardware.nodes", [1, 2])])
    snapshot = copy.deepcopy((base, grid))
    assert grid[0][1]["fsdp"] is base["fsdp"] and grid[0][1]["training"] is not base["training"]
    for _, data in grid:
        simulate(parse_scenario(data)).to_dict()
    assert (base, grid) == snapshot


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


TINY = {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}, "training": {"seq_len": 32},
        "hardware": {"profile": "h100-sxm"}}


def test_rows_carry_every_column_in_csv_and_json(tmp_path):
    import json

    from fsdp_sim.sweep import COLUMNS

    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(TINY))
    for name in ("rows.csv", "rows.json"):
        out = tmp_path / name
        assert main(["sweep", str(path), "--set", "training.micro_batch=1,2", "--jobs", "1", "-q", "-o", str(out)]) == 0
        rows = json.loads(out.read_text()) if name.endswith(".json") else list(csv.DictReader(out.open()))
        assert len(rows) == 2 and all(set(COLUMNS) <= set(r) for r in rows)
        assert {"peak_reserved_bytes", "required_bytes", "headroom_bytes", "fits", "mfu", "communication_exposed_s",
                "tokens_per_s_per_gpu"} <= set(COLUMNS)


def test_sweep_and_recommend_plot_the_pareto_front(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(TINY))
    for command in ("sweep", "recommend"):
        out = tmp_path / f"{command}.png"
        argv = [command, str(path), "--set", "training.micro_batch=1,2", "--set", "fsdp.wrap=per_block,whole_model",
                "--jobs", "1", "-q", "--plot", str(out), "--color-by", "fsdp.wrap"]
        assert main(argv) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_progress_bar_only_when_asked_goes_to_stderr_and_counts_resumed_points(capsys):
    """tqdm is a core dependency: asked for (the CLI asks when stderr is a terminal), a sweep of two or more
    points to run gets a bar on stderr; a resumed sweep's bar starts at the points the file held."""
    from fsdp_sim.sweep import _bar

    assert _bar(100, enabled=False) is None
    assert _bar(11, enabled=True, initial=10) is None  # one point left: nothing to watch
    bar = _bar(100, enabled=True, initial=40)
    bar.update(10)
    bar.refresh()
    bar.close()
    out, err = capsys.readouterr()
    assert out == "" and "40/100" in err and "50/100" in err and "config" in err


def test_sweep_max_batch_searches_the_micro_batch(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(TINY | {"hardware": {"profile": "rtx-4090", "gpus_per_node": 2},
                                           "training": {"seq_len": 8192}}))
    keys, rows = sweep(str(path), ["training.activation_checkpointing=none"], max_batch=True, jobs=1)
    assert keys == ["training.activation_checkpointing", "training.micro_batch"]
    assert rows[0]["fits"] and rows[0]["training.micro_batch"] > 1


def test_prices_shared_between_points_give_each_point_its_own_cold_row(tmp_path):
    """A sweep's process prices each op content once (`hardware/compute.py` keeps the table between steps) and
    builds each workload once (`build_transformer` is cached): every figure of every row, first pass and
    second, equals that point's step simulated from an empty table and a fresh workload."""
    from fsdp_sim.hardware import compute
    from fsdp_sim.sweep import _row, sweep_points
    from fsdp_sim.workload.transformer import build_transformer

    base = BASE | {"model": {"preset": "llama3-8b", "layers": 4}}
    axes = [("training.micro_batch", [1, 2]), ("fsdp.wrap", ["per_block", "whole_model"]),
            ("training.activation_checkpointing", ["none", "full"]), ("fsdp.mixed_precision.reduce_dtype", ["fp32", "bf16"])]
    datas = [data for _, data in points(base, axes)]
    compute._SHARED.clear()
    rows = sweep_points(datas + datas, tmp_path, jobs=1)  # the second pass finds every price in the table
    assert compute._SHARED and not any(row["error"] for row in rows)
    for data, first, second in zip(datas, rows, rows[len(datas):]):
        compute._SHARED.clear()
        build_transformer.cache_clear()
        cold = _row(simulate(parse_scenario(data, name="sweep", base=tmp_path)))
        assert first == cold and second == cold


@pytest.mark.parametrize("micro_batch", [2, 7])
def test_allocator_retries_in_a_row_are_the_steady_step_of_the_replay_under_the_gpu_limit(micro_batch):
    """llama3-8b at 1024 tokens, per-block SHARD_GRAD_OP, reduce bf16, on 8 H100: at micro-batch 7 the
    unconstrained reserved passes what the GPU leaves the allocator, and the step fits only by releasing
    the cache and retrying every step; at 2 nothing is refused. The row says what `run` says."""
    from fsdp_sim.sweep import run_point
    data = {"model": "llama3-8b", "training": {"seq_len": 1024, "micro_batch": micro_batch, "activation_checkpointing": "none"},
            "hardware": {"profile": "h100-sxm", "gpus_per_node": 8},
            "fsdp": {"wrap": "per_block", "sharding_strategy": "SHARD_GRAD_OP", "reshard_after_forward": False,
                     "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"}}}
    row = run_point(data, None)
    allocator = simulate(parse_scenario(data)).to_dict()["allocator"]
    assert row["fits"] and row["allocator_retries_per_step"] == allocator["retries_per_step"]
    assert (row["allocator_retries_per_step"] > 0) == (micro_batch == 7)
    assert (row["peak_reserved_bytes"] > allocator["limit_bytes"]) == (micro_batch == 7)


def test_points_that_split_their_tokens_alike_are_dispatched_together_and_rows_keep_the_sweeps_order(tmp_path):
    """`sweep_points` hands the workers the points in `dispatch_order`: those that differ only in how a
    micro-batch's tokens are split (2 x 1024 and 1 x 2048) side by side, so one worker's allocator memo
    serves both; the rows come back in the sweep's order, each its own point's."""
    from fsdp_sim.sweep import dispatch_order, run_point, sweep_points

    grid = points(BASE, [("training.micro_batch", [1, 2]), ("training.seq_len", [1024, 2048]),
                         ("fsdp.wrap", ["per_block", "whole_model"])])
    datas = [data for _, data in grid]
    position = {i: j for j, i in enumerate(dispatch_order(datas))}
    assert sorted(position.values()) == list(range(len(datas)))
    for wrap in ("per_block", "whole_model"):
        twins = [i for i, d in enumerate(datas) if d["fsdp"]["wrap"] == wrap
                 and d["training"]["micro_batch"] * d["training"]["seq_len"] == 2048]
        assert len(twins) == 2 and abs(position[twins[0]] - position[twins[1]]) == 1
    rows = sweep_points(datas, tmp_path, jobs=2)
    assert rows == [run_point(data, tmp_path) for data in datas]


def test_a_sweep_freezes_the_heap_only_while_it_runs_and_leaves_a_callers_freeze(tmp_path, monkeypatch):
    import gc

    import fsdp_sim.sweep as sweep_module

    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(BASE))
    seen = []
    run = sweep_module.run_point
    monkeypatch.setattr(sweep_module, "run_point", lambda data, base: seen.append(gc.get_freeze_count()) or run(data, base))
    assert gc.get_freeze_count() == 0
    sweep(str(path), ["training.micro_batch=1,2"], jobs=1)
    assert seen and min(seen) > 0 and gc.get_freeze_count() == 0
    gc.freeze()  # a caller's own freeze stays (its count falls only as frozen objects are freed)
    try:
        sweep(str(path), ["training.micro_batch=1"], jobs=1)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
