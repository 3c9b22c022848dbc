"""DOES NOT FIT leads somewhere: `run` simulates the usual ways out on the same model (ways_out.py) and
prints each with its required memory and tokens/s; `recommend` says when a way outside its space fits."""

from __future__ import annotations

import json

import yaml

from fsdp_sim.cli import main
from fsdp_sim import ways_out as ways_out_module
from fsdp_sim.ways_out import first_fitting, ways_out

# ~1.5 GiB + 0.8 GiB per sequence without checkpointing, ~0.16 GiB with it; a 6 GiB budget (tests/test_recommend.py)
TOY = {"model": {"hidden": 512, "layers": 8, "heads": 8, "vocab": 1024}, "training": {"seq_len": 4096, "micro_batch": 8},
       "hardware": {"profile": "rtx-4090", "nodes": 1, "gpus_per_node": 2}, "report": {"safety_margin": 0.75}}


def test_each_way_is_the_scenario_with_that_change(tmp_path):
    rows = ways_out(TOY, tmp_path)
    ways = [r["way"] for r in rows]
    assert ways[:3] == ["activation_checkpointing: selective_op", "activation_checkpointing: full",
                        "CPU offload (CPUOffloadPolicy)"]
    assert any(w.startswith("LoRA") for w in ways) and any(w.startswith("QLoRA") for w in ways)
    assert rows[1]["within_budget"] and not rows[2]["within_budget"]  # checkpointing fits; offload alone does not
    assert first_fitting(rows)["way"] == "activation_checkpointing: selective_op"
    assert rows[-1].get("none") or "nodes instead of" in rows[-1]["way"]


def test_run_prints_the_ways_out_when_the_step_does_not_fit(tmp_path, capsys):
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(TOY))
    out = tmp_path / "out.json"
    assert main(["run", str(path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Ways out" in text and "activation_checkpointing: full" in text and "tokens/s per GPU" in text
    data = json.loads(out.read_text())
    assert [r["way"] for r in data["ways_out"]][:2] == ["activation_checkpointing: selective_op",
                                                         "activation_checkpointing: full"]
    fits = TOY | {"training": {"seq_len": 4096, "micro_batch": 1}}
    path.write_text(yaml.safe_dump(fits))
    assert main(["run", str(path), "--json", str(out)]) == 0
    assert "Ways out" not in capsys.readouterr().out and "ways_out" not in json.loads(out.read_text())


def test_recommend_says_when_a_way_outside_its_space_fits(tmp_path, capsys):
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(TOY))
    assert main(["recommend", str(path), "--set", "training.activation_checkpointing=none",
                 "--set", "training.micro_batch=8", "--set", "fsdp.wrap=per_block", "--jobs", "1"]) == 1
    out = capsys.readouterr().out
    assert "No configuration fits" in out and "Outside this space: the scenario with activation_checkpointing" in out


def test_a_way_out_is_a_change_not_what_the_scenario_already_does(tmp_path):
    offloaded = TOY | {"fsdp": {"offload_policy": "CPUOffloadPolicy"}}
    assert not [r for r in ways_out(offloaded, tmp_path) if "CPU offload" in r["way"]]


def test_more_nodes_stop_when_a_doubling_leaves_the_memory_where_it_was(tmp_path, monkeypatch):
    """HYBRID_SHARD over shard groups of one node: more nodes add replicas and shrink no rank, so the search
    stops at the second doubling (4 nodes need what 2 do) where it went on to 1,024x the nodes."""
    hsdp = TOY | {"fsdp": {"sharding_strategy": "HYBRID_SHARD", "shard_size": 2}}
    tried, run_point = [], ways_out_module.run_point

    def counted(data, base):
        tried.append(data["hardware"]["nodes"])
        return run_point(data, base)

    monkeypatch.setattr(ways_out_module, "run_point", counted)
    rows = ways_out(hsdp, tmp_path)
    assert [n for n in tried if n > 1] == [2, 4]
    assert rows[-1]["none"] and rows[-1]["way"].endswith("(4 nodes need no less a GPU than 2: memory stops shrinking)")
