"""Workload files: save/load round trip and strict validation (no torch needed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.workload import TransformerDims, build_transformer
from fsdp_sim.workload.io import load_workload, save_workload, workload_from_dict

DIMS = TransformerDims(hidden=64, layers=3, heads=4, kv_heads=2, vocab=256, tie_embeddings=True)


def _workload():
    wl = build_transformer(DIMS, micro_batch=2, seq_len=16, act_dtype="bf16", name="tiny")
    modules = list(wl.modules)
    modules[1] = replace(modules[1], fwd_time_s=1.5e-4, bwd_time_s=3e-4)
    return replace(wl, modules=tuple(modules), meta={"source": "test", "notes": ["a", "b"]})


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_round_trip(tmp_path, suffix):
    wl = _workload()
    path = tmp_path / f"w{suffix}"
    save_workload(wl, path)
    back = load_workload(path)
    assert back == wl
    assert back.modules[-2].tied_params == ("tok_embeddings.weight",)
    shapes = {q.name: q.shape for q in back.modules[1].params}
    assert shapes["layers.0.attention.wq.weight"] == (64, 64) and shapes["layers.0.attention.wk.weight"] == (32, 64)
    assert back.modules[2].fwd_time_s is None and back.modules[1].fwd_time_s == 1.5e-4


def test_yaml_is_readable(tmp_path):
    path = tmp_path / "w.yaml"
    save_workload(_workload(), path)
    text = path.read_text()
    assert "- {name: layers.0.attention.wq.weight, shape: [64, 64], dtype: fp32, trainable: true}" in text


def _data():
    return yaml.safe_load(yaml.safe_dump(_workload().to_dict()))


def _error(data) -> str:
    with pytest.raises(ScenarioError) as info:
        workload_from_dict(data)
    return str(info.value)


def test_minimal_file_takes_defaults():
    module = {"name": "a", "kind": "linear", "params": [{"name": "a.w", "shape": [4, 2]}]}
    wl = workload_from_dict({"name": "w", "modules": [module]})
    assert wl.modules[0].params[0].dtype == "fp32" and wl.modules[0].saves_input and wl.numel == 8


@pytest.mark.parametrize("edit, where", [
    (lambda d: d["modules"][3].__setitem__("saved_bytes", -1), "modules[3].saved_bytes"),
    (lambda d: d["modules"][3].__setitem__("saved_bytes", 1.5), "modules[3].saved_bytes"),
    (lambda d: d["modules"][3].__setitem__("saved_bytes", True), "modules[3].saved_bytes"),
    (lambda d: d["modules"][1].__setitem__("fwd_flops", "lots"), "modules[1].fwd_flops"),
    (lambda d: d["modules"][1].__setitem__("fwd_flops", float("nan")), "modules[1].fwd_flops"),
    (lambda d: d["modules"][1].__setitem__("bwd_time_s", -1.0), "modules[1].bwd_time_s"),
    (lambda d: d["modules"][1].__setitem__("is_block", "yes"), "modules[1].is_block"),
    (lambda d: d["modules"][1].__setitem__("colour", "red"), "modules[1].colour: unknown key"),
    (lambda d: d["modules"][2].pop("name"), "modules[2].name: missing"),
    (lambda d: d["modules"][2].pop("kind"), "modules[2].kind: missing"),
    (lambda d: d["modules"][1]["params"][0].pop("shape"), "modules[1].params[0].shape: missing"),
    (lambda d: d["modules"][1]["params"][2].__setitem__("shape", [64, -2]), "modules[1].params[2].shape"),
    (lambda d: d["modules"][1]["params"][2].__setitem__("dtype", "fp64"), "modules[1].params[2].dtype"),
    (lambda d: d["modules"][1]["params"][2].__setitem__("extra", 1), "modules[1].params[2].extra: unknown key"),
    (lambda d: d["modules"][1].__setitem__("params", {"a": 1}), "modules[1].params"),
    (lambda d: d.__setitem__("activation_dtype", "int4"), "activation_dtype"),
    (lambda d: d.__setitem__("input_bytes", -5), "input_bytes"),
    (lambda d: d.__setitem__("meta", [1]), "meta"),
    (lambda d: d.__setitem__("modules", []), "modules"),
    (lambda d: d.pop("name"), "name: missing"),
    (lambda d: d.__setitem__("version", 2), "version: unknown key"),
    (lambda d: d["modules"][2].__setitem__("name", "layers.0"), "modules[2].name: 'layers.0' is used"),
    (lambda d: d["modules"][2]["params"][0].__setitem__("name", "tok_embeddings.weight"), "modules[2].params[0].name"),
    (lambda d: d["modules"][-2].__setitem__("tied_params", ["nope.weight"]), "tied_params: 'nope.weight'"),
])
def test_strict_validation_names_the_key(edit, where):
    data = _data()
    edit(data)
    assert where in _error(data)


def test_not_a_mapping():
    assert "expected a mapping" in _error([1, 2])
    assert "modules[0]: expected a mapping" in _error({"name": "w", "modules": [3]})


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ScenarioError, match="not found"):
        load_workload(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ScenarioError, match="model.workload: .*bad.yaml is not valid YAML"):
        load_workload(bad)
    neg = tmp_path / "neg.yaml"
    data = _data()
    data["modules"][3]["saved_bytes"] = -1
    neg.write_text(yaml.safe_dump(data))
    with pytest.raises(ScenarioError, match=r"neg.yaml: modules\[3\].saved_bytes"):
        load_workload(neg)


def test_saved_workload_simulates_from_a_scenario(tmp_path):
    wl = build_transformer(DIMS, micro_batch=2, seq_len=16, act_dtype="bf16", name="tiny")
    save_workload(wl, tmp_path / "w.yaml")
    from_file = parse_scenario({"model": {"workload": "w.yaml"}, "hardware": {"profile": "h100-sxm"}}, base=tmp_path)
    from_dims = parse_scenario({"model": {"hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "vocab": 256,
                                          "tie_embeddings": True},
                                "training": {"micro_batch": 2, "seq_len": 16}, "hardware": {"profile": "h100-sxm"}})
    a, b = simulate(from_file).to_dict(), simulate(from_dims).to_dict()
    assert a["peak"] == b["peak"] and a["step_time_s"] == b["step_time_s"] and a["memory"] == b["memory"]


def test_a_traced_workload_fixes_the_batch_shape(tmp_path):
    """The trace was made for one batch shape: a scenario may not ask for another."""
    save_workload(build_transformer(TransformerDims(hidden=64, layers=1, heads=4, vocab=128), micro_batch=1, seq_len=8,
                                    act_dtype="bf16", name="w"), tmp_path / "w.yaml")
    with pytest.raises(ScenarioError, match="training.seq_len: not allowed with model.workload"):
        parse_scenario({"model": {"workload": "w.yaml"}, "training": {"seq_len": 16},
                        "hardware": {"profile": "h100-sxm"}}, base=tmp_path)
