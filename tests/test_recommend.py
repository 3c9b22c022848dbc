"""`fsdp-sim recommend`: a toy grid whose winner can be read off its rows, the reasons, the default
search space, and `--max-batch` by bisection."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from fsdp_sim.cli import main
from fsdp_sim.recommend import default_axes, explain, parse_base, recommend
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.sweep import largest_fitting, sweep

# Activations dominate this model's memory: required ~ 1.5 GiB + 0.8 GiB per sequence without activation
# checkpointing, ~ 0.16 GiB per sequence with it. A 75 % margin leaves a 6.0 GiB budget of the 4090's 24 GiB.
TOY = {"model": {"hidden": 512, "layers": 8, "heads": 8, "vocab": 1024}, "training": {"seq_len": 4096},
       "hardware": {"profile": "rtx-4090", "nodes": 1, "gpus_per_node": 2}, "report": {"safety_margin": 0.75}}
GRID = {"training.micro_batch": [1, 2, 4, 8], "training.activation_checkpointing": ["none", "full"]}


def _files(tmp_path, scenario=TOY, grid=GRID):
    s, g = tmp_path / "toy.yaml", tmp_path / "grid.yaml"
    s.write_text(yaml.safe_dump(scenario))
    g.write_text(yaml.safe_dump(grid, sort_keys=False))
    return str(s), str(g)


def _row(tps, required, fits=True, step=1.0, exposed=0.0, cpu=0.0, retries=0, **keys):
    return {**keys, "tokens_per_s_per_gpu": tps, "required_bytes": required, "headroom_bytes": 100 - required,
            "fits": fits, "within_budget": fits, "step_time_s": step, "communication_exposed_s": exposed, "cpu_bound_s": cpu, "mfu": 0.5,
            "allocator_retries_per_step": retries, "error": ""}


def test_toy_grid_winner_is_the_fastest_fitting_row(tmp_path, capsys):
    """Read the rows: without checkpointing, 8 sequences need ~8 GiB (over the 6 GiB budget) and 4 need ~4.8;
    checkpointing fits all but is ~20 % slower. So 4 sequences without checkpointing win, held back by memory."""
    scenario, grid = _files(tmp_path)
    out = tmp_path / "rec.json"
    assert main(["recommend", scenario, "--grid", grid, "--jobs", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rec = json.loads(out.read_text())
    rows = rec["rows"]
    assert len(rows) == 8 and all(r["error"] == "" for r in rows)
    fitting = [r for r in rows if r["within_budget"]]
    assert rec["best"] == max(fitting, key=lambda r: r["tokens_per_s_per_gpu"])
    best = rec["best"]
    assert (best["training.micro_batch"], best["training.activation_checkpointing"]) == (4, "none")
    assert rec["limit"] == "memory" and rec["reason"].startswith("memory: the next faster (training.micro_batch=8)")
    nxt = rec["next_faster"]
    assert not nxt["within_budget"] and nxt["tokens_per_s_per_gpu"] > best["tokens_per_s_per_gpu"]
    assert rec["counts"] == {"configurations": 8, "fits": 7, "margin": 1, "no": 0, "errors": 0}  # 8 runs, past the budget
    assert "8 configurations: 7 fit, 1 only inside the safety margin, 0 do not" in text
    assert [(r["row"]["training.micro_batch"], r["row"]["training.activation_checkpointing"])
            for r in rec["runners_up"]] == [(2, "none"), (1, "none"), (8, "full")]
    assert all(r["tokens_per_s_change"] < 0 for r in rec["runners_up"])
    assert "Recommended  training.micro_batch=4, training.activation_checkpointing=none" in text and "GiB" in text


def test_fastest_of_all_is_limited_by_what_its_step_spends():
    keys = ["k"]
    rows = [_row(10, 10, k=1), _row(20, 20, step=1.0, exposed=0.3, cpu=0.1, k=2)]
    assert recommend(rows, keys)["limit"] == "exposed_communication"
    rows[1]["cpu_bound_s"] = 0.4
    rec = recommend(rows, keys)
    assert rec["limit"] == "cpu_bound" and "CPU" in rec["reason"] and rec["best"]["k"] == 2
    rows[1].update(cpu_bound_s=0.01, communication_exposed_s=0.01)
    assert recommend(rows, keys)["limit"] == "compute"


def test_next_faster_is_the_nearest_setting_and_runners_up_skip_equal_figures():
    keys = ["a", "b"]
    rows = [_row(10, 50, a=1, b=1), _row(10, 50, a=1, b=2),  # the same figures under two names
            _row(9, 30, a=2, b=1), _row(30, 200, fits=False, a=3, b=3), _row(12, 120, fits=False, a=2, b=2),
            _row(11, 110, fits=False, a=1, b=3), {"a": 9, "b": 9, "error": "bad"}]
    rec = recommend(rows, keys)
    assert rec["best"] == rows[0] and rec["next_faster"] == rows[5]  # one setting away, not the least faster
    assert [r["row"] for r in rec["runners_up"]] == [rows[2]]
    assert rec["runners_up"][0]["differs"] == {"a": 2} and rec["runners_up"][0]["required_change_bytes"] == -20
    assert rec["counts"] == {"configurations": 7, "fits": 3, "margin": 0, "no": 3, "errors": 1}
    rows[3]["fits"] = True  # runs, but inside the safety margin (not within the budget)
    assert recommend(rows, keys)["counts"] | {"configurations": 7} == {"configurations": 7, "fits": 3, "margin": 1,
                                                                        "no": 2, "errors": 1}
    assert "7 configurations: 3 fit, 1 only inside the safety margin, 2 do not, 1 failed" in explain(recommend(rows, keys))
    assert "b=3" in rec["reason"] and "1 failed" in explain(rec)


def test_a_best_that_fits_only_by_allocator_retries_names_the_fastest_without():
    """The step time does not price num_alloc_retries (each a synchronize and cudaFree): the fastest
    configuration that needs none is named beside a best that needs them."""
    keys = ["k"]
    rows = [_row(30, 90, retries=2, k=1), _row(25, 95, retries=1, k=2), _row(20, 60, k=3), _row(10, 40, k=4)]
    rec = recommend(rows, keys)
    assert rec["best"] == rows[0] and rec["without_retries"]["row"] == rows[2]
    assert rec["without_retries"]["differs"] == {"k": 3} and rec["without_retries"]["required_change_bytes"] == -30
    text = explain(rec)
    assert "retries, 2 times a step" in text and "Without retries   -33.3 % tokens/s" in text and "k=3" in text
    assert recommend(rows[2:], keys)["without_retries"] is None  # a best without retries needs no other
    assert "Without retries  no configuration fits" in explain(recommend(rows[:2], keys))


def test_nothing_fits_and_every_error():
    rec = recommend([_row(10, 150, fits=False, k=1), _row(5, 120, fits=False, k=2)], ["k"])
    assert rec["best"] is None and rec["limit"] == "memory" and "k=2" in rec["reason"]
    assert explain(rec).startswith("No configuration fits.")
    assert recommend([{"k": 1, "error": "boom"}], ["k"])["limit"] == "errors"


def test_default_search_space_uses_the_keys_that_exist(tmp_path):
    one_node = default_axes(TOY, parse_base(TOY, tmp_path))
    assert [a.name for a in one_node] == ["wrap", "fsdp.backward_prefetch", "sharding",
                                          "training.activation_checkpointing", "allocator.expandable_segments",
                                          "training.micro_batch"]
    assert [o.get("fsdp.blocks_per_unit") for o in one_node[0].options] == [None, 2, 4, None]
    assert [o["fsdp.sharding_strategy"] for o in one_node[2].options] == ["FULL_SHARD", "SHARD_GRAD_OP"]
    two = TOY | {"hardware": {"profile": "h100-sxm", "nodes": 2}}
    two_nodes = default_axes(two, parse_base(two, tmp_path), micro_batch=False)
    hybrid = [o for o in two_nodes[2].options if "HYBRID" in o["fsdp.sharding_strategy"]]
    assert len(hybrid) == 2 and all(o["fsdp.shard_size"] == 8 for o in hybrid)
    assert "training.micro_batch" not in [a.name for a in two_nodes]
    for axis in one_node[:5]:  # every default option is a valid scenario
        for option in axis.options:
            data = yaml.safe_load(yaml.safe_dump(TOY))
            for key, value in option.items():
                section, leaf = key.split(".")
                data.setdefault(section, {})[leaf] = value
            parse_scenario(data)


def test_recommend_default_space_end_to_end(tmp_path, capsys):
    small = TOY | {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}, "training": {"seq_len": 64}}
    scenario, _ = _files(tmp_path, small)
    assert main(["recommend", scenario, "--jobs", "2", "--top", "1"]) == 0
    text = capsys.readouterr().out
    # two blocks: wrap per_block or whole_model (every_k_blocks needs more blocks than k), x 2 prefetch
    # x 2 sharding x 2 checkpointing x 2 allocator settings x 4 micro-batches
    assert "Recommended" in text and "128 configurations: 128 fit, 0 do not" in text
    assert text.count("\n  ") == 2  # the figures line and one runner-up


# ---- the largest micro-batch that fits -------------------------------------------------------------
@pytest.mark.parametrize("boundary", [1, 2, 3, 5, 37, 64, 100, 1000, 4095])
def test_bisection_finds_the_boundary_in_logarithmic_calls(boundary):
    calls = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= boundary  # closed form: everything up to the boundary fits

    assert largest_fitting(fits, limit=4096) == boundary
    assert len(calls) <= 2 * math.ceil(math.log2(boundary + 1)) + 1, calls
    assert len(set(calls)) == len(calls)  # never asks twice


def test_bisection_edges():
    assert largest_fitting(lambda n: False) == 0
    assert largest_fitting(lambda n: True, limit=100) == 100
    assert largest_fitting(lambda n: n <= 99, limit=100) == 99


def test_max_batch_rows_are_at_the_true_boundary(tmp_path):
    """Each row's micro-batch fits the budget and one more sequence does not (checked by single runs)."""
    scenario, _ = _files(tmp_path)
    keys, rows = sweep(scenario, ["training.activation_checkpointing=none,full"], max_batch=True, jobs=2)
    assert keys == ["training.activation_checkpointing", "training.micro_batch"]
    for row in rows:
        batch = row["training.micro_batch"]
        assert row["within_budget"] and batch > 1

        def fits(b: int) -> bool:
            data = yaml.safe_load(yaml.safe_dump(TOY))
            data["training"].update(micro_batch=b, activation_checkpointing=row["training.activation_checkpointing"])
            return simulate(parse_scenario(data)).to_dict()["memory"]["within_budget"]

        assert fits(batch) and not fits(batch + 1)
    assert rows[0]["training.micro_batch"] < rows[1]["training.micro_batch"]  # checkpointing fits more


def test_max_batch_refuses_a_micro_batch_axis(tmp_path, capsys):
    scenario, grid = _files(tmp_path)
    assert main(["recommend", scenario, "--grid", grid, "--max-batch", "-q"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--max-batch" in err


def test_every_default_axis_offers_the_scenario_as_written(tmp_path):
    """A scenario whose wrap, prefetch, strategy, checkpointing, allocator and micro-batch are none of the
    defaults' still has its own row among the points, which `written_values` names."""
    from fsdp_sim.recommend import written_values
    from fsdp_sim.sweep import points

    base = TOY | {"fsdp": {"wrap": "size_based", "min_params": 2_000_000, "backward_prefetch": 2,
                           "reshard_after_forward": 1},
                  "training": {"seq_len": 512, "micro_batch": 3, "activation_checkpointing": "selective_op"},
                  "allocator": {"expandable_segments": True}}
    scenario = parse_base(base, tmp_path)
    axes = default_axes(base, scenario)
    written = written_values(base, scenario, axes)
    assert written["fsdp.wrap"] == "size_based" and written["fsdp.min_params"] == 2_000_000
    assert written["fsdp.backward_prefetch"] == 2 and written["training.micro_batch"] == 3
    assert written["training.activation_checkpointing"] == "selective_op"
    assert written["fsdp.reshard_after_forward"] is False  # 1 is false, as parse_scenario reads it
    chosen = [c for c, _ in points(base, axes)]
    flat = [{k: c.get(k) for k in written} for c in chosen]
    assert flat.count(written) == 1


def test_recommend_says_what_the_winner_changes_from_the_scenario_as_written(tmp_path, capsys):
    scenario = TOY | {"training": {"seq_len": 4096, "micro_batch": 8}}  # as written: does not fit the budget
    path, _ = _files(tmp_path, scenario=scenario)
    out = tmp_path / "rec.json"
    assert main(["recommend", path, "--jobs", "1", "--json", str(out), "--top", "0"]) == 0
    text = capsys.readouterr().out
    rec = json.loads(out.read_text())
    mine = rec["as_written"]
    assert mine["training.micro_batch"] == 8 and mine["fsdp.wrap"] == "per_block" and not mine["within_budget"]
    assert rec["change"]["differs"] and rec["change"]["row"] == rec["best"]
    assert "Changed      from the scenario as written (no" in text or "Changed      from the scenario as written (margin" in text
    # a scenario that is itself the best is named so
    rows = [_row(10, 10, k=1), _row(5, 5, k=2)]
    rec = recommend(rows, ["k"], written={"k": 1})
    assert rec["as_written"] is rows[0] and rec["change"] is None
    assert explain(rec).startswith("Recommended  the scenario as written: k=1")


def test_max_batch_says_none_fits_and_how_far_micro_batch_1_is_over(tmp_path, capsys):
    """Nothing fits the budget: the row's micro-batch is None (not 1), with micro-batch 1's figures, and the
    table is followed by how far micro-batch 1 is over."""
    scenario = TOY | {"report": {"safety_margin": 0.99}}  # a 0.24 GiB budget: not even one sequence
    path, _ = _files(tmp_path, scenario=scenario)
    keys, rows = sweep(path, ["training.activation_checkpointing=none,full"], max_batch=True, jobs=1)
    assert [r["training.micro_batch"] for r in rows] == [None, None]
    assert all(r["headroom_bytes"] < 0 and not r["within_budget"] for r in rows)
    assert main(["sweep", path, "--set", "training.activation_checkpointing=none,full", "--max-batch", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "training.activation_checkpointing=none: no micro-batch fits the" in out and "micro-batch 1 needs" in out


def test_run_set_is_a_what_if_without_a_new_file(tmp_path, capsys):
    """`run --set KEY=VALUE` (the sweep's syntax, one value a key) gives what a file with that value gives."""
    path, _ = _files(tmp_path)
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(TOY | {"training": {"seq_len": 4096, "micro_batch": 2,
                                                         "activation_checkpointing": "full"}}))
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["run", path, "--set", "training.micro_batch=2", "--set", "training.activation_checkpointing=full",
                 "--json", str(a), "-q"]) == 0
    assert main(["run", str(edited), "--json", str(b), "-q"]) == 0
    one, two = json.loads(a.read_text()), json.loads(b.read_text())
    assert one | {"scenario": ""} == two | {"scenario": ""}
    assert main(["run", path, "--set", "training.micro_batch=1,2"]) == 2
    assert "run takes one value" in capsys.readouterr().err


def test_run_set_on_a_scenario_that_is_no_mapping_is_one_line(tmp_path, capsys):
    """A scenario file holding a list: --set has no section to write into; one line and exit 2, as without it."""
    path = tmp_path / "list.yaml"
    path.write_text("[]\n")
    assert main(["run", str(path), "--set", "model.dropout=true"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "fsdp-sim: error: scenario: expected a mapping, got list"


@pytest.mark.parametrize("grid", [False, True])
def test_recommend_save_writes_the_winner_which_run_reproduces(tmp_path, grid):
    path, grid_file = _files(tmp_path)
    rec_json, saved, ran = tmp_path / "rec.json", tmp_path / "best.yaml", tmp_path / "run.json"
    args = ["recommend", path, "--jobs", "1", "--json", str(rec_json), "--save", str(saved), "-q"]
    assert main(args + (["--grid", grid_file] if grid else ["--set", "training.micro_batch=1,2,4"])) == 0
    best = json.loads(rec_json.read_text())["best"]
    assert main(["run", str(saved), "--json", str(ran), "-q"]) == 0
    result = json.loads(ran.read_text())
    assert result["step_time_s"] == best["step_time_s"]
    assert result["memory"]["required_bytes"] == best["required_bytes"]
    assert result["throughput"]["tokens_per_s_per_gpu"] == best["tokens_per_s_per_gpu"]


def test_a_fixed_global_batch_trades_micro_batch_for_accumulation_and_gpus(tmp_path, capsys):
    """--global-batch N: every point runs exactly N sequences per step (micro-batch x accumulation x data-parallel
    ranks), over node counts around the scenario's; the hyperparameters never change."""
    from fsdp_sim.recommend import batch_axis, written_values
    from fsdp_sim.sweep import points

    base = TOY | {"training": {"seq_len": 1024, "micro_batch": 2, "grad_accumulation": 4}}  # 2 x 4 x 2 GPUs = 16
    scenario = parse_base(base, tmp_path)
    axes = default_axes(base, scenario, global_batch=16)
    batch = axes[-1]
    assert batch.name == "batch" and len(batch.options) > 3
    for option in batch.options:
        ranks = option["hardware.nodes"] * 2
        assert option["training.micro_batch"] * option["training.grad_accumulation"] * ranks == 16
    assert {o["hardware.nodes"] for o in batch.options} > {1}
    written = written_values(base, scenario, axes)
    assert [c for c, _ in points(base, axes) if {k: c.get(k) for k in written} == written]  # as written: a point
    with pytest.raises(Exception, match="--global-batch 7"):
        batch_axis(base, parse_scenario(base, base=tmp_path), 7)
    path, grid = _files(tmp_path)
    assert main(["recommend", path, "--grid", grid, "--global-batch", "16"]) == 2
    assert "--global-batch" in capsys.readouterr().err


def test_global_batch_refuses_a_traced_workload_in_one_line(capsys):
    assert main(["recommend", "scenarios/tinyllama-1b-traced-8xa100-40gb.yaml", "--global-batch", "64"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--global-batch: a traced workload fixed its micro-batch" in err
