"""Workloads made once and shared by a sweep's points, each what working it out afresh gives: a Hugging Face
config's workload (by the config's text) and a tensor-parallel rank's (by its dimensions), as
`build_transformer`'s are; LoRA, QLoRA and frozen workloads (`model.lora` / `model.frozen`), plain training's
input casts and FSDP1's autograd view, remembered per workload (`workload.model.derived`); and the weight a
kernel's layer owns, found through a per-module index."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.workload import model
from fsdp_sim.workload.frozen import linear_weights, weight_index

PART = st.sampled_from(["layers", "0", "1", "attention", "wq", "wk", "mlp", "w1", "lora_A", "lora_B", "x", ""])
NAME = st.lists(PART, min_size=1, max_size=5).map(".".join).flatmap(
    lambda stem: st.sampled_from([stem + ".weight", stem + ".bias", stem, stem + ".weight.absmax"]))


@settings(max_examples=300, deadline=None)
@given(names=st.lists(NAME, max_size=12), layer=st.lists(PART, min_size=1, max_size=3).map(".".join),
       op=st.sampled_from(["", ": mm", " : addmm"]))
def test_a_kernels_weight_is_its_layers_weight_by_name(names, layer, op):
    """`<...>.<layer>.weight`, the layer being the kernel's name before any `:` (dotted as `fsdp-sim trace`
    names one), in the module's order: the definition, checked name by name."""
    expected = [n for n in names if n == f"{layer}.weight" or n.endswith(f".{layer}.weight")]
    assert linear_weights(layer + op, weight_index(names)) == expected


LORA = {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"], "dropout": 0.05}
QLORA = {"rank": 16, "alpha": 16, "targets": "all-linear", "quantize": "nf4"}
TINY = {"hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 1000}


def _data(model_keys: dict, fsdp: dict, gpus: int = 4) -> dict:
    return {"model": TINY | model_keys, "training": {"micro_batch": 2, "seq_len": 64},
            "hardware": {"profile": "h100-sxm", "gpus_per_node": gpus}, "fsdp": fsdp}


CASES = {
    "fsdp2 lora": _data({"lora": LORA}, {}),
    "fsdp2 qlora": _data({"lora": QLORA}, {}),
    "fsdp2 frozen": _data({"frozen": ["tok_embeddings", "layers.0"]}, {}),
    "fsdp1 lora, use_orig_params": _data({"lora": LORA, "frozen_dtype": "fp32"}, {"version": 1, "use_orig_params": True}),
    "fsdp1 qlora, bf16 storage, use_orig_params": {
        **_data({"lora": QLORA | {"quant_storage": "bf16"}, "frozen_dtype": "bf16"}, {"version": 1, "use_orig_params": True}),
        "training": {"micro_batch": 2, "seq_len": 64, "param_storage_dtype": "bf16"}},
    "plain qlora, fp32 adapters": {**_data({"lora": QLORA}, {"version": "none"}, gpus=1),
                                   "training": {"micro_batch": 2, "seq_len": 64, "param_storage_dtype": "fp32"}},
}


@pytest.mark.parametrize("case", CASES)
def test_a_remembered_adaptation_is_the_one_worked_out_afresh(case):
    """The second point of a workload reuses the first's adapted workload (the same object) and gives the
    same result, figure for figure, as a process that remembers nothing."""
    data = CASES[case]
    model._BY_WORKLOAD.clear()
    first = parse_scenario(copy.deepcopy(data))
    fresh = simulate(first).to_dict()
    second = parse_scenario(copy.deepcopy(data))
    assert second.workload is first.workload
    assert simulate(second).to_dict() == fresh
    remembered = {key[0] for _, found in model._BY_WORKLOAD.values() for key in found if isinstance(key, tuple)}
    assert "adapted" in remembered
    if "fsdp1" in case:
        assert "autograd view" in remembered  # a FlatParameter mixes adapters and frozen bases: views get gradients
    if "plain" in case:
        assert "peft input casts" in remembered
    model._BY_WORKLOAD.clear()
    again = parse_scenario(copy.deepcopy(data))
    assert again.workload is not first.workload and again.workload == first.workload
    assert simulate(again).to_dict() == fresh


def test_adaptations_of_one_workload_are_kept_apart():
    """LoRA and QLoRA of the same built workload are two entries: the second is not handed the first's."""
    model._BY_WORKLOAD.clear()
    lora = parse_scenario(_data({"lora": LORA}, {})).workload
    qlora = parse_scenario(_data({"lora": QLORA}, {})).workload
    assert lora is not qlora and lora != qlora
    assert any(p.dtype == "uint8" for p in qlora.params) and not any(p.dtype == "uint8" for p in lora.params)


HF = Path(__file__).parents[1] / "scenarios" / "hf"


def _hf_scenario(config: Path, micro_batch: int = 1) -> dict:
    return {"model": {"hf_config": str(config)}, "training": {"micro_batch": micro_batch, "seq_len": 256},
            "hardware": {"profile": "h100-sxm", "gpus_per_node": 8}}


def test_a_hugging_face_config_is_built_once_per_text_and_arguments(tmp_path):
    """The same config and batch: the same workload object; another batch, or the file rewritten with other
    text, a workload of its own, equal to one built afresh."""
    config = tmp_path / "config.json"
    data = json.loads((HF / "mixtral-8x7b.json").read_text())
    config.write_text(json.dumps(data))
    first = parse_scenario(_hf_scenario(config)).workload
    assert parse_scenario(_hf_scenario(config)).workload is first
    assert parse_scenario(_hf_scenario(config, micro_batch=2)).workload is not first
    config.write_text(json.dumps(data | {"num_hidden_layers": 2}))
    smaller = parse_scenario(_hf_scenario(config)).workload
    assert sum(m.is_block for m in smaller.modules) == 2 < sum(m.is_block for m in first.modules)
    from fsdp_sim.workload.hf_config import _built
    _built.cache_clear()
    assert parse_scenario(_hf_scenario(config)).workload == smaller


def test_a_tensor_parallel_rank_s_workload_is_built_once():
    data = {"model": "llama3-8b", "training": {"micro_batch": 1, "seq_len": 512},
            "hardware": {"profile": "h100-sxm", "gpus_per_node": 8}, "parallelism": {"tp": 2}}
    first = parse_scenario(copy.deepcopy(data))
    assert parse_scenario(copy.deepcopy(data)).workload is first.workload
    from fsdp_sim.workload.tensor_parallel import build_tp_transformer
    build_tp_transformer.cache_clear()
    again = parse_scenario(copy.deepcopy(data))
    assert again.workload is not first.workload and again.workload == first.workload
    assert simulate(again).to_dict() == simulate(first).to_dict()


@pytest.mark.parametrize("case", CASES)
def test_alike_blocks_share_one_kernel_tuple_after_every_transformation(case):
    """Pricing and checkpoint plans find a module's kernels by the tuple's identity first: LoRA, QLoRA and
    freezing (and the views the runtimes take of them: FSDP1's autograd view, plain training's input casts)
    leave every set of equal tuples one object, as the builders make them."""
    from fsdp_sim.workload.lora import autograd_view, peft_input_casts

    workload = parse_scenario(copy.deepcopy(CASES[case])).workload
    trained = frozenset(p.name for p in workload.params if p.trainable)
    views = [workload, peft_input_casts(workload, 4), autograd_view(workload, trained | {workload.params[1].name})]
    for wl in views:
        blocks = [m.kernels for m in wl.modules if m.is_block]
        assert len({id(k) for k in blocks}) == len(set(blocks)) < len(blocks)


@pytest.mark.parametrize("name", ["llama3-8b-8xh100-compile", "llama3-8b-8xh100-fp8", "llama3-8b-8xh100-liger-loss"])
def test_compiled_float8_and_loss_workloads_are_made_once_per_workload(name):
    """Inductor's blocks (`compute.torch_compile`), torchao's Float8Linears (`compute.float8`) and a head and
    loss other than torch's (`training.loss`) are made once for a workload: the second point shares them, a
    process that remembers nothing gives the same figures."""
    from fsdp_sim.datafile import read_data

    data = read_data(Path(__file__).parents[1] / "scenarios" / f"{name}.yaml", "scenario")
    model._BY_WORKLOAD.clear()
    first = parse_scenario(copy.deepcopy(data))
    assert parse_scenario(copy.deepcopy(data)).workload is first.workload
    model._BY_WORKLOAD.clear()
    again = parse_scenario(copy.deepcopy(data))
    assert again.workload is not first.workload and again.workload == first.workload
    assert again.settings.float8_weights == first.settings.float8_weights
    assert bool(first.settings.float8_weights) == name.endswith("fp8")
    assert simulate(again).to_dict() == simulate(first).to_dict()
