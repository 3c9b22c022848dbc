"""CPU offload (FSDP2 `CPUOffloadPolicy(pin_memory=True)`) and activation offload (`save_on_cpu`).

Exact: the bytes that leave the GPU are the sharded parameters, sharded gradients and optimizer states the
same run holds on the GPU without offload; H2D bytes = each all-gather's shard; D2H bytes = one sharded
gradient per unit; save_on_cpu's host peak is what leaves the GPU's activations at the end of forward.
Direction: offload lengthens the step and lowers the GPU peak. Link sharing: GPUs behind one link split it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.host_link import (D2H, H2D, TORCH_CPU_OPTIMIZER_BYTES_PER_S, HostLink, copy_time,
                                         cpu_optimizer_time)
from fsdp_sim.schedule.ops import CATEGORIES
from fsdp_sim.schedule.optimizers import step_cost
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 1003}
BASE = {"model": TINY, "training": {"micro_batch": 2, "seq_len": 32},
        "hardware": {"profile": "a100-80gb", "gpus_per_node": 8},
        "fsdp": {"mixed_precision": {"reduce_dtype": "fp32"}}}


def _run(**changes):
    data = copy.deepcopy(BASE)
    for section, values in changes.items():
        data[section] = data.get(section, {}) | values
    return simulate(parse_scenario(data, name="offload"))


def _persistent(result) -> dict:
    out = {}
    for b in result.memory.persistent:
        out[b.category] = out.get(b.category, 0) + b.nbytes
    return out


def _level(result, category: str):
    return result.memory.levels[:, CATEGORIES.index(category)]


def test_cpu_offload_moves_exactly_the_sharded_state_to_the_host():
    on_gpu, offloaded = _run(), _run(fsdp={"offload_policy": "CPUOffloadPolicy"})
    gpu_state = _persistent(on_gpu)
    host = offloaded.graph.host.persistent
    assert host["sharded_params"] == gpu_state["sharded_params"]
    assert host["optimizer_states"] == gpu_state["optimizer_states"]
    assert host["sharded_grads"] == int(_level(on_gpu, "sharded_grads").max())
    # closed forms: padded fp32 shards; AdamW's two fp32 states per element; one fp32 gradient per element
    s = offloaded.scenario.settings
    numel = sum(u.shard_numel(s.shard_size) for u in offloaded.scenario.units)
    assert (host["sharded_params"], host["optimizer_states"], host["sharded_grads"]) == (4 * numel, 8 * numel, 4 * numel)
    # and nothing of it stays on the GPU
    assert not {"sharded_params", "optimizer_states"} & set(_persistent(offloaded))
    # a sharded gradient lives on the GPU only from its reduce-scatter to its D2H copy: one unit's at a time
    largest = max(u.shard_numel(s.shard_size) * 4 for u in offloaded.scenario.units)
    assert _level(offloaded, "sharded_grads").max() == largest and _level(offloaded, "sharded_grads")[-1] == 0


def test_host_link_bytes_are_shard_bytes_times_all_gathers():
    result = _run(fsdp={"offload_policy": "CPUOffloadPolicy"})
    s, units = result.scenario.settings, {u.name: u for u in result.scenario.units}
    gathers = [op for op in result.graph.ops if op.kind == "all_gather"]
    expected_h2d = sum(units[op.unit].shard_numel(s.shard_size) * 4 for op in gathers)
    host = result.to_dict()["host"]
    assert host["h2d_bytes_per_rank"] == expected_h2d
    assert host["d2h_bytes_per_rank"] == sum(u.shard_numel(s.shard_size) * 4 for u in units.values())
    # every all-gather's shard: the root once (kept after forward), the other units twice (forward, backward)
    assert len(gathers) == 2 * len(units) - 1


def test_offload_lengthens_the_step_and_lowers_the_gpu_peak():
    on_gpu, offloaded = _run(), _run(fsdp={"offload_policy": "CPUOffloadPolicy"})
    assert offloaded.step_time_s > on_gpu.step_time_s
    assert offloaded.peak()["allocated_bytes"] < on_gpu.peak()["allocated_bytes"]
    assert offloaded.to_dict()["memory"]["required_bytes"] < on_gpu.to_dict()["memory"]["required_bytes"]


def test_the_optimizer_steps_on_the_cpu_at_torch_cpu_adam_speed():
    result = _run(fsdp={"offload_policy": "CPUOffloadPolicy"})
    (step,) = [op for op in result.graph.ops if op.stream == "host" and op.name.startswith("adamw.step")]
    s = result.scenario.settings
    shards = [p.padded_shard_numel(s.shard_size) for u in result.scenario.units for p in u.params]
    traffic = step_cost("adamw", "for_loop", True, shards, 4).traffic_bytes
    assert step.comm_bytes == traffic
    duration = result.timing.end[step.id] - result.timing.start[step.id]
    assert duration == pytest.approx(traffic * 8 / TORCH_CPU_OPTIMIZER_BYTES_PER_S, rel=1e-12)
    # it starts once the last gradient has reached the host (grad_offload_event.synchronize)
    last_d2h = max(result.timing.end[op.id] for op in result.graph.ops if op.group == D2H)
    assert result.timing.start[step.id] >= last_d2h
    assert result.step_time_s == result.timing.end[step.id]
    assert not [op for op in result.graph.ops if op.name == "adamw.step"]  # no GPU step
    host = result.to_dict()["host"]
    # beside it on the CPU only clip_grad_norm_'s norm and multiply (schedule/clipping.py)
    cpu = [op for op in result.graph.ops if op.group == "cpu"]
    assert [op.name.split(" ")[:2] for op in cpu] == [["clip_grad_norm_", "norms"], ["clip_grad_norm_", "grad.mul_"],
                                                      ["adamw.step", "on"]]
    assert host["cpu_s"] == pytest.approx(sum(result.timing.end[op.id] - result.timing.start[op.id] for op in cpu))
    assert host["compute_stream_copies_s"] == 0.0


def test_gpus_behind_one_link_split_it():
    link = HostLink("pcie_gen4_x16", 26.2e9, 26.3e9, 8, 1 << 41)
    alone = HostLink("pcie_gen4_x16", 26.2e9, 26.3e9, 1, 1 << 41)
    n = 3 << 30
    assert copy_time(n, H2D, alone, 8) == n / 26.2e9
    assert copy_time(n, H2D, link, 8) == 8 * copy_time(n, H2D, alone, 8)
    assert copy_time(n, D2H, link, 8) == 8 * n / 26.3e9
    assert copy_time(n, H2D, link, 2) == 2 * n / 26.2e9  # a node of 2 GPUs: only they share it
    assert cpu_optimizer_time(1e9, 8) == 8 * cpu_optimizer_time(1e9, 1)


def test_the_a100_node_shares_each_pcie_switch_between_two_gpus():
    result = _run(fsdp={"offload_policy": "CPUOffloadPolicy"})
    op = next(op for op in result.graph.ops if op.group == H2D)
    host = result.scenario.cluster.gpu.host
    assert host.gpus_per_link == 2
    assert result.alone_duration(op) == 2 * op.comm_bytes / host.h2d_Bps


def _end_of_forward(result) -> int:
    return max(i + 1 for i, (op, _, _) in enumerate(result.memory.events) if op.phase == "forward")


def test_activation_offload_frees_the_saved_activations_on_the_gpu():
    on_gpu, offloaded = _run(), _run(training={"activation_offload": True})
    host = offloaded.graph.host
    moved = sum(op.comm_bytes for op in offloaded.graph.ops if op.group == D2H)
    weights = sum(op.comm_bytes for op in offloaded.graph.ops if op.group == D2H and " weights " in op.name)
    assert host.activations_peak == moved > weights > 0
    assert host.activations == 0  # all back by the end of backward
    before = _level(on_gpu, "activations")[_end_of_forward(on_gpu)]
    after = _level(offloaded, "activations")[_end_of_forward(offloaded)]
    assert after == before - (host.activations_peak - weights)  # the weights stay where FSDP keeps them
    assert offloaded.peak()["allocated_bytes"] < on_gpu.peak()["allocated_bytes"]
    assert offloaded.step_time_s > on_gpu.step_time_s  # the copies run on the compute stream
    copies = [op for op in offloaded.graph.ops if op.group in (D2H, H2D)]
    assert {op.stream for op in copies} == {"compute"}  # save_on_cpu copies on the current stream
    assert offloaded.to_dict()["host"]["compute_stream_copies_s"] == pytest.approx(
        sum(offloaded.timing.end[op.id] - offloaded.timing.start[op.id] for op in copies), rel=1e-12)
    # what goes to the host comes back
    assert sum(op.comm_bytes for op in offloaded.graph.ops if op.group == H2D) == moved


def test_host_memory_per_node_and_whether_it_fits():
    result = _run(fsdp={"offload_policy": "CPUOffloadPolicy"}, training={"activation_offload": True})
    host = result.to_dict()["host"]
    state = result.graph.host
    assert host["per_rank_bytes"] == sum(state.persistent.values()) + max(state.activations_peak, state.optimizer_temp)
    assert host["per_node_bytes"] == 8 * host["per_rank_bytes"]
    assert host["capacity_bytes"] == 2 << 40 and host["fits"]
    tight = _run(fsdp={"offload_policy": "CPUOffloadPolicy"}, hardware={"host_memory_gb": 0.001})
    assert tight.to_dict()["host"]["capacity_bytes"] == int(0.001 * (1 << 30))
    assert not tight.to_dict()["host"]["fits"]
    assert "host" not in _run().to_dict()  # nothing offloaded: no host section


@settings(max_examples=15, deadline=None)
@given(layers=st.integers(1, 4), gpus=st.sampled_from([2, 4, 8]), ac=st.booleans(), act=st.booleans(),
       accumulation=st.integers(1, 2), reshard=st.sampled_from([True, False, 2]))
def test_offloaded_steps_leak_nothing_on_the_gpu_or_the_host(layers, gpus, ac, act, accumulation, reshard):
    result = _run(model={"layers": layers}, hardware={"gpus_per_node": gpus},
                  training={"activation_checkpointing": "full" if ac else "none", "activation_offload": act,
                            "grad_accumulation": accumulation},
                  fsdp={"offload_policy": "CPUOffloadPolicy", "reshard_after_forward": reshard if gpus > 2 else True})
    assert {b.id for b in result.memory.live_at_end} == {b.id for b in result.memory.persistent}
    assert (result.memory.levels >= 0).all()
    host = result.graph.host
    assert host.activations == 0
    assert host.persistent["sharded_grads"] == host.persistent["sharded_params"]  # all trainable, fp32


@pytest.mark.parametrize("fsdp, training, hardware, message", [
    ({"offload_policy": "cpu"}, {}, {}, "fsdp.offload_policy"),
    ({"offload_policy": "CPUOffloadPolicy", "offload_pin_memory": False}, {}, {}, "fsdp.offload_pin_memory"),
    ({"offload_pin_memory": True}, {}, {}, "fsdp.offload_pin_memory"),
    ({}, {"activation_offload": "yes"}, {}, "training.activation_offload"),
    ({}, {}, {"host_memory_gb": -1}, "hardware.host_memory_gb"),
    ({"offload_policy": "CPUOffloadPolicy", "sharding_strategy": "NO_SHARD"}, {}, {}, "fsdp.offload_policy"),
    ({"version": 1, "offload_policy": "CPUOffloadPolicy"}, {}, {}, "fsdp.offload_policy: fully_shard's argument"),
])
def test_bad_offload_keys_name_the_key(fsdp, training, hardware, message):
    data = copy.deepcopy(BASE)
    data["fsdp"] |= fsdp
    data["training"] |= training
    data["hardware"] |= hardware
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(data)


def test_a_profile_without_a_host_section_refuses_offload_but_runs_without(tmp_path):
    text = (ROOT / "hardware_profiles" / "a100-80gb.yaml").read_text()
    (tmp_path / "nohost.yaml").write_text(text[:text.index("\nhost:")] + "\n")
    data = copy.deepcopy(BASE)
    data["hardware"]["profile"] = str(tmp_path / "nohost.yaml")
    assert parse_scenario(data).cluster.gpu.host is None
    data["training"]["activation_offload"] = True
    with pytest.raises(ScenarioError, match="hardware.profile: a100-80gb has no host: section"):
        parse_scenario(data)


def test_save_on_cpu_packs_every_weight_autograd_saves():
    """save_on_cpu's pack hook sees parameters too (torch/autograd/graph.py, saved_tensors_hooks): every
    block's and the head's GEMM weights and the norms' weights go D2H in forward as the unsharded bf16
    parameters, not the embedding's (its backward saves the indices); each comes back H2D as a new GPU copy
    alive during its module's backward only, beside FSDP's re-gathered parameters."""
    result = _run(training={"activation_offload": True})
    sc = result.scenario
    expected = sum(2 * p.numel for m in sc.workload.modules if m.kind != "embedding" for p in m.params)
    ops = result.graph.ops
    d2h = [op for op in ops if op.group == D2H and " weights " in op.name]
    h2d = [op for op in ops if op.group == H2D and " weights " in op.name]
    assert sum(op.comm_bytes for op in d2h) == sum(op.comm_bytes for op in h2d) == expected
    assert {op.phase for op in d2h} == {"forward"} and {op.phase for op in h2d} == {"backward"}
    copies = [op for op in ops if op.kind == "alloc" and "(save_on_cpu)" in op.name]
    assert sum(op.buffer.nbytes for op in copies) == expected
    frees = {op.buffer.id: op.id for op in ops if op.kind == "free" and op.buffer is not None}
    for op in copies:  # freed in the same module's backward
        assert ops[frees[op.buffer.id]].unit == op.unit and ops[frees[op.buffer.id]].phase == "backward"


def test_save_on_cpu_packs_nothing_inside_a_checkpoint():
    """A non-reentrant checkpoint's own saved-tensor hooks are the innermost: its forward packs nothing, not
    its input either (the recompute closure holds it) -- under full checkpointing only the modules outside
    the blocks copy."""
    result = _run(training={"activation_offload": True, "activation_checkpointing": "full"})
    units = {op.unit for op in result.graph.ops if op.group == D2H}
    blocks = {m.name for m in result.scenario.workload.modules if m.is_block}
    assert units and not units & blocks
