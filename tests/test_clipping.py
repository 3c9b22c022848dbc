"""What a step does besides the model: `clip_grad_norm_` before the optimizer step (`schedule/clipping.py`)
in each runtime, the launches of its foreach passes, and the step's start from a drained queue, each against
its source."""

from __future__ import annotations

import random

import pytest
from conftest import run, scenario_dict

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.clipping import NORM_PARTIAL_LAUNCHES, foreach_norm_launches
from fsdp_sim.schedule.optimizers import FOREACH_MAX_CHUNKS, FOREACH_MAX_TENSORS, multi_tensor_apply_launches

MODEL = {"hidden": 256, "layers": 2, "heads": 4, "vocab": 1000}


# ---- clip_grad_norm_ ------------------------------------------------------------------------------------
def _clip_ops(r):
    return [op for op in r.graph.ops if "clip_grad_norm_" in op.name]


def _timed(ops):
    return [op for op in ops if op.kind not in ("alloc", "free")]


def test_fsdp2_clips_with_two_foreach_passes_and_one_all_reduce_of_the_shard_group():
    sc, r = run(scenario_dict(MODEL, gpus_per_node=4))
    ops = _timed(_clip_ops(r))
    shards = [n for u in sc.units for p in u.params for n in [p.padded_shard_numel(4)]]
    grad_bytes = 4 * sum(shards)  # fp32 sharded gradients
    norm, total, ar, coef, mul = ops
    assert norm.name.startswith("clip_grad_norm_ _foreach_norm") and norm.hbm_bytes == grad_bytes + 4 * len(shards)
    assert mul.name.startswith("clip_grad_norm_ _foreach_mul_") and mul.hbm_bytes == 2 * grad_bytes
    assert (ar.kind, ar.group, ar.comm_bytes) == ("all_reduce", "shard", 4)
    assert coef.launches == 4 + NORM_PARTIAL_LAUNCHES and norm.launches == foreach_norm_launches(shards)
    # after the last gradient reduction, before the optimizer step, all on the compute stream
    step = next(op for op in r.graph.ops if op.name == "adamw.step")
    last_rs = max(r.timing.end[op.id] for op in r.graph.ops if op.kind == "reduce_scatter")
    assert r.timing.start[norm.id] >= last_rs and r.timing.start[step.id] >= r.timing.end[mul.id]
    assert {op.stream for op in ops} == {"compute"}


def test_foreach_mul_is_in_place_and_the_norms_are_a_scalar_per_gradient():
    sc, r = run(scenario_dict(MODEL, gpus_per_node=4))
    allocs = [op for op in _clip_ops(r) if op.kind == "alloc"]
    n = sum(len(u.params) for u in sc.units)
    assert [op.buffer.nbytes for op in allocs][0] == 4 * n
    assert sum(op.buffer.nbytes for op in allocs) < 64 << 10  # the partial sums too: tiny
    ops = r.graph.ops
    mul = next(op for op in ops if "_foreach_mul_" in op.name)
    step = next(op for op in ops if op.name == "adamw.step")
    assert not [op for op in ops[mul.id:step.id] if op.kind == "alloc" and "clip" in op.name]


def test_max_norm_null_removes_the_clip_and_shortens_the_step():
    on = run(scenario_dict(MODEL, gpus_per_node=4))[1]
    off = run(scenario_dict(MODEL, gpus_per_node=4, training={"micro_batch": 1, "seq_len": 16, "max_norm": None}))[1]
    assert _clip_ops(on) and not _clip_ops(off)
    assert not [op for op in off.graph.ops if op.phase == "optimizer" and op.kind == "all_reduce"]
    assert off.step_time_s < on.step_time_s


def test_hsdp_all_reduces_the_norm_over_the_shard_group_only():
    """The gradients are (Replicate, Shard(0)): the norm is partial only over the shard dimension."""
    _, r = run(scenario_dict(MODEL, nodes=2, gpus_per_node=4, fsdp={"sharding_strategy": "HYBRID_SHARD"}))
    assert [op.group for op in _clip_ops(r) if op.kind == "all_reduce"] == ["shard"]


def test_tensor_parallel_adds_the_tp_groups_all_reduce():
    data = scenario_dict({"hidden": 256, "layers": 2, "heads": 8, "vocab": 1024}, nodes=2, gpus_per_node=4)
    data["parallelism"] = {"tp": 2}
    _, r = run(data)
    ops = _timed(_clip_ops(r))
    assert [op.group for op in ops if op.kind == "all_reduce"] == ["shard", "tp"]
    coef = next(op for op in ops if op.name.endswith("clip coefficient"))
    assert coef.launches == 4 + 2 * NORM_PARTIAL_LAUNCHES


def test_plain_training_clips_without_any_collective():
    data = scenario_dict(MODEL, gpus_per_node=1, fsdp={"version": "none"})
    _, r = run(data)
    ops = _timed(_clip_ops(r))
    assert [op.name.split(" (")[0] for op in ops] == ["clip_grad_norm_ _foreach_norm", "clip_grad_norm_ total norm",
                                                       "clip_grad_norm_ clip coefficient", "clip_grad_norm_ _foreach_mul_"]
    assert not [op for op in r.graph.ops if op.kind in ("all_reduce", "all_gather", "reduce_scatter")]


def test_fsdp1_launches_a_norm_and_a_multiply_per_flat_gradient_and_all_reduces_once():
    _, r = run(scenario_dict(MODEL, gpus_per_node=4, fsdp={"version": 1}))
    ops = _timed([op for op in r.graph.ops if "clip_grad_norm_" in op.name])
    n = sum(1 for op in r.graph.ops if op.kind == "reduce_scatter")  # one flat gradient per unit
    assert [op.launches for op in ops if "per gradient" in op.name] == [n, n]
    assert [op.group for op in ops if op.kind == "all_reduce"] == ["shard"]
    # NO_SHARD: FSDP.clip_grad_norm_ hands over to torch's, on replicated gradients: no all-reduce
    _, r = run(scenario_dict(MODEL, gpus_per_node=4, fsdp={"version": 1, "sharding_strategy": "NO_SHARD"}))
    assert _clip_ops(r) and not [op for op in _clip_ops(r) if op.kind == "all_reduce"]


def test_under_cpu_offload_the_clip_runs_on_the_host():
    fsdp2 = run(scenario_dict(MODEL, gpus_per_node=4, fsdp={"offload_policy": "CPUOffloadPolicy"}))[1]
    ops = _timed(_clip_ops(fsdp2))
    assert [(op.stream, op.group) for op in ops] == [("host", "cpu"), ("host", "cpu")]
    assert ops[1].comm_bytes == 2 * ops[0].comm_bytes  # read the gradients, then read and write them
    fsdp1 = run(scenario_dict(MODEL, gpus_per_node=4, fsdp={"version": 1, "cpu_offload": True}))[1]
    ops = _timed(_clip_ops(fsdp1))
    assert [op.kind for op in ops] == ["compute", "all_reduce", "compute"]  # FSDP1's NCCL all-reduce between
    assert fsdp1.timing.start[ops[2].id] >= fsdp1.timing.end[ops[1].id]


@pytest.mark.parametrize("value, message", [("1", "expected a number"), (0, "must be positive"),
                                            (-1.0, "must be positive"), (True, "expected a number")])
def test_max_norm_must_be_a_positive_number_or_null(value, message):
    with pytest.raises(ScenarioError, match=f"training.max_norm: {message}"):
        parse_scenario(scenario_dict(MODEL, training={"max_norm": value}))


def test_max_norm_defaults_to_torchtitans_one():
    assert parse_scenario(scenario_dict(MODEL)).settings.max_norm == 1.0
    assert parse_scenario(scenario_dict(MODEL, training={"max_norm": None})).settings.max_norm is None
    assert parse_scenario(scenario_dict(MODEL, training={"max_norm": 0.5})).settings.max_norm == 0.5


# ---- multi_tensor_apply's launches ----------------------------------------------------------------------
def _launches_as_the_loop_counts(numels, depth=1):
    """multi_tensor_apply's host loop (MultiTensorApply.cuh), line by line."""
    launches = loc_block = loc_tensor = 0
    for n in numels:
        if n == 0:
            continue
        loc_tensor += 1
        chunks = -(-n // 65536)
        for chunk in range(chunks):
            loc_block += 1
            tensors_full = loc_tensor == FOREACH_MAX_TENSORS[depth - 1] and chunk == chunks - 1
            if tensors_full or loc_block == FOREACH_MAX_CHUNKS:
                launches += 1
                loc_block = 0
                loc_tensor = 0 if chunk == chunks - 1 else 1
    return launches + (loc_block != 0)


def test_multi_tensor_apply_launches_at_the_loops_edges():
    assert multi_tensor_apply_launches([4] * 770) == 1 and multi_tensor_apply_launches([4] * 771) == 2
    assert multi_tensor_apply_launches([FOREACH_MAX_CHUNKS * 65536 + 1]) == 2
    assert multi_tensor_apply_launches([0, 0]) == 0


def _random_lists(count=300):
    rng = random.Random(0)
    for _ in range(count):
        numels = [rng.choice([0, 1, 4096, 65536, 65537, 10**6, 5 * 10**7, 2 * 10**8]) for _ in range(rng.randint(1, 2000))]
        yield numels, rng.randint(1, 5)


@pytest.mark.parametrize("part", range(4))  # the same 300 lists in 4 parts: the workers share the reference's 8-16 s
def test_multi_tensor_apply_launches_follow_its_loop(part):
    for i, (numels, depth) in enumerate(_random_lists()):
        if i % 4 == part:
            assert multi_tensor_apply_launches(numels, depth) == _launches_as_the_loop_counts(numels, depth), (numels, depth)


# ---- the step's start ---------------------------------------------------------------------------------------
def test_the_step_starts_from_a_drained_queue():
    """torchtitan copies the batch and the token count `.to(device)` at the top of every step, blocking
    (ATen `copy_kernel_cuda`: `memcpy_and_sync`): the previous step's kernels have all run and the GPU waits
    for the first launch of this one. The simulated step starts there: nothing runs before its issue."""
    _, r = run(scenario_dict(MODEL, gpus_per_node=4))
    timed = [op for op in r.graph.ops if op.kind not in ("alloc", "free")]
    first = min(timed, key=lambda op: r.timing.start[op.id])
    assert r.timing.start[first.id] >= r.timing.issued[first.id] > 0.0
