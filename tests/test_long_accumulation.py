"""Gradient accumulation: a step of more than three micro-batches is priced from two and three of them
(results/folded.py): the middle micro-batches are alike. The folded step gives what simulating every
micro-batch gives (`_simulate` below plays them all)."""

from __future__ import annotations

import pytest

import fsdp_sim.scenario as scenario_module
from fsdp_sim.results.folded import FoldedResult
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import _simulate, simulate

MODEL = {"hidden": 512, "layers": 4, "heads": 8, "vocab": 2000}


def _data(accumulation: int, **fsdp) -> dict:
    return {"model": MODEL, "training": {"micro_batch": 2, "seq_len": 512, "grad_accumulation": accumulation},
            "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": 8}, "fsdp": fsdp}


@pytest.mark.parametrize("fsdp", [{}, {"requires_gradient_sync": False}])
def test_a_folded_step_gives_what_every_micro_batch_simulated_gives(fsdp):
    exact = _simulate(parse_scenario(_data(8, **fsdp))).to_dict()  # every micro-batch played
    result = simulate(parse_scenario(_data(8, **fsdp)))
    assert isinstance(result, FoldedResult)
    folded = result.to_dict()
    assert folded["step_time_s"] == pytest.approx(exact["step_time_s"], rel=1e-6)
    assert folded["throughput"] == pytest.approx(exact["throughput"], rel=1e-3)
    assert folded["throughput"]["tokens_per_step"] == exact["throughput"]["tokens_per_step"]
    assert folded["peak"]["allocated_bytes"] == exact["peak"]["allocated_bytes"]
    assert folded["memory"]["required_bytes"] == exact["memory"]["required_bytes"]
    assert folded["fsdp"]["grad_accumulation"] == 8
    for key in ("busy_s", "mfu"):
        assert folded["compute"][key] == pytest.approx(exact["compute"][key], rel=1e-3)
    for key in ("matmul_s", "attention_s", "memory_bound_s"):
        assert folded["compute"]["breakdown"][key] == pytest.approx(exact["compute"]["breakdown"][key], rel=1e-6)
    for key in ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes"):
        assert folded["communication"][key] == pytest.approx(exact["communication"][key], rel=1e-6)
    assert folded["communication"]["total_s"] == pytest.approx(exact["communication"]["total_s"], rel=1e-3)


def test_64_micro_batches_of_an_80_layer_model_run():
    """Refused before (84 modules x 64 micro-batches past 5,000 module passes); priced from three now."""
    data = {"model": "llama3-70b", "training": {"micro_batch": 1, "seq_len": 2048, "grad_accumulation": 64,
                                                 "activation_checkpointing": "full"},
            "hardware": {"profile": "h100-sxm", "nodes": 8, "gpus_per_node": 8}}
    sc = parse_scenario(data)
    assert scenario_module.folds(64)
    d = simulate(sc).to_dict()
    three = simulate(parse_scenario(data | {"training": data["training"] | {"grad_accumulation": 3}})).to_dict()
    assert d["throughput"]["tokens_per_step"] == 64 * 2048 * 64
    assert d["step_time_s"] > 15 * three["step_time_s"]
    assert d["compute"]["folded"]["micro_batches_simulated"] == 3
    assert d["peak"]["allocated_bytes"] == three["peak"]["allocated_bytes"]
