"""Quiet mistakes are said, on one line: a field of a Hugging Face config that changes memory or time and
is not modelled (Gemma 2's softcapping under model_type gemma), a sliding window shorter than the sequence,
a sequence past the model's positions. The step is still simulated as asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_sim.cli import main
from fsdp_sim.errors import ScenarioWarning
from fsdp_sim.workload.hf_config import build_from_hf_dict

GEMMA = json.loads((Path(__file__).resolve().parents[1] / "scenarios" / "hf" / "gemma-7b.json").read_text())


def test_gemma_2_fields_under_model_type_gemma_are_named_not_ignored():
    relabelled = GEMMA | {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    with pytest.warns(ScenarioWarning) as caught:
        build_from_hf_dict(relabelled, micro_batch=1, seq_len=4096, act_dtype="bf16")
    said = [str(w.message) for w in caught]
    assert any("attn_logit_softcapping 50.0 is not modelled" in s for s in said)
    assert any("final_logit_softcapping 30.0 is not modelled" in s for s in said)
    assert all("\n" not in s for s in said)


def test_a_plain_config_says_nothing(recwarn):
    build_from_hf_dict(GEMMA, micro_batch=1, seq_len=4096, act_dtype="bf16")
    assert not [w for w in recwarn if issubclass(w.category, ScenarioWarning)]


def test_the_cli_prints_each_warning_as_one_line_and_still_runs(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA | {"sliding_window": 4096}))
    (tmp_path / "s.yaml").write_text("model: {hf_config: config.json}\ntraining: {micro_batch: 1, seq_len: 16384}\n"
                                     "hardware: {profile: h100-sxm, gpus_per_node: 8}\n")
    assert main(["run", str(tmp_path / "s.yaml"), "-q"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("fsdp-sim: warning: hf_config: sliding_window 4096 < training.seq_len 16384") for line in err)
    assert any("max_position_embeddings 8192" in line for line in err)
    assert all(line.startswith("fsdp-sim: warning: ") for line in err)
