"""Gradient accumulation as FSDP2 runs it (torch 2.13 `_fsdp_param_group.post_backward`, `foreach_reduce`).

With gradient sync every micro-batch reduce-scatters and adds into the sharded gradients, which then
live from the first micro-batch to the optimizer step. With `set_requires_gradient_sync(False)` the
micro-batches before the last keep unsharded gradients, upcast to reduce_dtype
(`to_accumulated_grad_if_needed`), and only the last reduce-scatters them.
"""

from __future__ import annotations

from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.ops import CATEGORIES
from fsdp_sim.simulate import simulate

MODEL = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 512, "mlp": "gelu"}
CAT = {c: i for i, c in enumerate(CATEGORIES)}


def _run(sync: bool, n: int = 3):
    sc = parse_scenario({"model": MODEL, "training": {"micro_batch": 2, "seq_len": 32, "grad_accumulation": n},
                         "hardware": {"profile": "h100-sxm", "gpus_per_node": 4},
                         "fsdp": {"requires_gradient_sync": sync,
                                  "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}})
    return sc, simulate(sc)


def _level_when(result, category: str, phase: str) -> float:
    """The category's level just before the first event of `phase`."""
    row = next(i for i, (op, _, _) in enumerate(result.memory.events, 1) if op.phase == phase)
    return result.memory.levels[row - 1, CAT[category]]


def test_with_sync_every_micro_batch_reduces_and_keeps_sharded_grads():
    sc, r = _run(sync=True)
    trainable_shard = sum(u.shard_numel(4, trainable_only=True) for u in sc.units)
    reductions = [op for op in r.graph.ops if op.kind == "reduce_scatter"]
    assert len(reductions) == 3 * len(sc.units)
    for phase in ("forward #2", "forward #3"):
        assert _level_when(r, "sharded_grads", phase) == trainable_shard * 4
        assert _level_when(r, "unsharded_grads", phase) == 0


def test_without_sync_unsharded_fp32_grads_accumulate_until_the_last_micro_batch():
    sc, r = _run(sync=False)
    params = sum(u.numel for u in sc.units)
    reductions = [op for op in r.graph.ops if op.kind == "reduce_scatter"]
    assert len(reductions) == len(sc.units) and all(op.phase == "backward #3" for op in reductions)
    for phase in ("forward #2", "forward #3"):
        assert _level_when(r, "unsharded_grads", phase) == params * 4  # upcast to reduce_dtype
        assert _level_when(r, "sharded_grads", phase) == 0
    assert r.peak()["allocated_bytes"] > _run(sync=True)[1].peak()["allocated_bytes"]


def test_accumulation_multiplies_compute_and_keeps_persistent_state():
    _, one = _run(sync=True, n=1)
    _, three = _run(sync=True, n=3)
    assert three.compute()["model_flops"] == 3 * one.compute()["model_flops"]
    assert three.step_time_s > 2.5 * one.step_time_s
    assert {b.id for b in three.memory.live_at_end} == {b.id for b in three.memory.persistent}
