"""CPUOffloadPolicy with gradient accumulation, as torch 2.13's foreach_reduce runs it (`_fsdp_collectives.py`):
once a gradient exists the D2H copy is blocking and the CPU add runs on the autograd thread, so the next
kernels are issued only after it; and no sharded gradient stays on the GPU, so none is reported there."""

from __future__ import annotations

from conftest import scenario_dict
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate

MODEL = {"hidden": 512, "layers": 4, "heads": 8, "vocab": 2000}


def _run(accumulation: int):
    sc = parse_scenario(scenario_dict(MODEL, fsdp={"offload_policy": "CPUOffloadPolicy"},
                                      training={"micro_batch": 2, "seq_len": 256, "grad_accumulation": accumulation}))
    return simulate(sc)


def test_an_accumulating_gradient_blocks_the_issue_thread_until_its_cpu_add_ends():
    result = _run(2)
    ops, timing = result.graph.ops, result.timing
    adds = [op for op in ops if op.name.endswith("accumulate sharded grads on the CPU")]
    assert adds  # the second micro-batch adds into the first's host gradients
    for add in adds:
        later = [op for op in ops[add.id + 1:] if getattr(op, "cpu_wait", -1) == add.id]
        assert later, add.name  # the next op issued waits the add
        nxt = later[0]
        assert timing.issued[nxt.id] >= timing.end[add.id] - 1e-12
    # the first micro-batch's copies stay non-blocking: nothing waits them on the CPU
    first = {op.id for op in ops if op.name.endswith("sharded grads D2H") and op.phase == "backward #1"}
    assert first and not any(getattr(op, "cpu_wait", -1) in first for op in ops)


def test_offloaded_sharded_gradients_are_not_reported_on_the_gpu():
    for accumulation in (1, 2):
        d = _run(accumulation).to_dict()
        assert "sharded_grads" not in d["memory"]["persistent_bytes"]
        assert d["host"]["by_category_per_rank"]["sharded_grads"] > 0


def test_the_optimizer_states_on_the_host_are_pageable():
    """torch.optim's states are `zeros_like` of the pinned shards, which does not pin: the host section says
    how much of a rank's host memory is pinned (shards, gradients, save_on_cpu copies) beside the total."""
    h = _run(1).to_dict()["host"]
    parts = h["by_category_per_rank"]
    assert h["pinned_per_rank_bytes"] == h["per_rank_bytes"] - parts["optimizer_states"] - parts.get("optimizer_temporaries", 0)
    assert 0 < h["pinned_per_rank_bytes"] < h["per_rank_bytes"]
    sc = parse_scenario(scenario_dict(MODEL, training={"micro_batch": 2, "seq_len": 256, "activation_offload": True}))
    only_activations = simulate(sc).to_dict()["host"]
    assert only_activations["pinned_per_rank_bytes"] == only_activations["per_rank_bytes"]  # save_on_cpu pins
