"""One GPU without FSDP (`fsdp.version: none`): plain PyTorch training under autocast."""

from __future__ import annotations

import pytest

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.ops import COLLECTIVES
from fsdp_sim.schedule.plain import autocast_params
from fsdp_sim.simulate import simulate

MODEL = {"hidden": 256, "layers": 2, "heads": 4, "vocab": 1000, "ffn_hidden": 512}


def _scenario(fsdp=None, training=None, gpus=1):
    return parse_scenario({"model": MODEL, "training": {"micro_batch": 2, "seq_len": 64} | (training or {}),
                           "hardware": {"profile": "h100-sxm", "gpus_per_node": gpus},
                           "fsdp": {"version": "none"} if fsdp is None else fsdp})


def test_plain_step_has_no_collectives_and_no_nccl():
    result = simulate(_scenario())
    assert not [op for op in result.graph.ops if op.kind in COLLECTIVES]
    summary = result.to_dict()
    assert summary["memory"]["overheads_bytes"]["nccl"] == 0
    assert summary["communication"]["total_s"] == 0


def test_persistent_state_is_whole_fp32_params_and_two_adam_states():
    sc = _scenario()
    result = simulate(sc)
    numel = sc.workload.numel
    persistent = {}
    for buf in result.graph.persistent:
        persistent[buf.category] = persistent.get(buf.category, 0) + buf.nbytes
    assert persistent == {"sharded_params": 4 * numel, "optimizer_states": 2 * 4 * numel}


def test_autocast_copies_live_from_forward_to_their_backward():
    """At the end of the forward every GEMM weight (and bias) has its bf16 copy alive, and nothing else
    of the parameters: embeddings and norms are used in fp32."""
    sc = _scenario()
    result = simulate(sc)
    ops = result.graph.ops
    last_forward = max(op.id for op in ops if op.phase == "forward")
    live = {}
    for op in ops[: last_forward + 1]:
        if op.buffer is not None and op.buffer.category == "unsharded_params" and op.kind in ("alloc", "free"):
            live[op.buffer.id] = op.buffer.nbytes if op.kind == "alloc" else 0
    by_name = {p.name: p for p in sc.workload.params}
    expected = sum(2 * p.numel for m in sc.workload.modules for p in autocast_params(m, by_name, sc.settings))
    assert sum(live.values()) == expected
    assert 0 < expected < 2 * sc.workload.numel  # the embedding and norms are not cast


def test_fp32_grads_are_made_once_and_live_until_zero_grad():
    """`.grad` in the parameter's fp32, one per trainable parameter, made in the first micro-batch's
    backward and added into by the next, freed after the optimizer step."""
    sc = _scenario(training={"grad_accumulation": 3})
    ops = simulate(sc).graph.ops
    grads = [op for op in ops if op.buffer is not None and op.buffer.category == "sharded_grads"]
    made = [op for op in grads if op.kind == "alloc"]
    assert sum(op.buffer.nbytes for op in made) == 4 * sc.workload.numel
    assert {op.phase for op in made} == {"backward #1"}
    assert {op.phase for op in grads if op.kind == "free"} == {"optimizer"}


def test_pure_fp32_has_no_autocast_copies():
    sc = _scenario(fsdp={"version": "none", "mixed_precision": {"param_dtype": "fp32"}})
    result = simulate(sc)
    assert not [b for b in result.graph.buffers if b.category == "unsharded_params"]


def test_plain_is_cheaper_than_fsdp2_on_one_gpu():
    """FSDP2 on one rank still all-gathers (a copy) and holds NCCL buffers; plain training does neither."""
    plain = simulate(_scenario()).to_dict()["memory"]
    fsdp2 = simulate(_scenario(fsdp={})).to_dict()["memory"]
    assert plain["required_bytes"] < fsdp2["required_bytes"]


def test_plain_needs_one_gpu():
    with pytest.raises(ScenarioError, match="fsdp.version"):
        _scenario(gpus=2)


def test_plain_refuses_fsdp_keys():
    with pytest.raises(ScenarioError, match="fsdp.reshard_after_forward"):
        _scenario(fsdp={"version": "none", "reshard_after_forward": False})


def test_lora_on_one_gpu_casts_only_the_fp32_adapters():
    """A bf16 frozen base is already in autocast's dtype: only the trainable fp32 adapters get copies, and
    only they have `.grad` and optimizer states."""
    sc = parse_scenario({"model": MODEL | {"lora": {"rank": 4, "targets": "all-linear"}},
                         "training": {"micro_batch": 2, "seq_len": 64},
                         "hardware": {"profile": "h100-sxm", "gpus_per_node": 1}, "fsdp": {"version": "none"}})
    result = simulate(sc)
    by_name = {p.name: p for p in sc.workload.params}
    cast = {p.name for m in sc.workload.modules for p in autocast_params(m, by_name, sc.settings)}
    trainable = {p.name for p in sc.workload.params if p.trainable}
    assert cast == {n for n in trainable if len(by_name[n].shape) >= 2}
    grads = sum(b.nbytes for b in result.graph.buffers if b.category == "sharded_grads")
    assert grads == 4 * sum(by_name[n].numel for n in trainable)


def test_adamw8bit_states_on_one_gpu_and_adafactor_refused():
    """torchao's AdamW8bit keeps its 1-byte states (+ block scales) for the large tensors without FSDP too;
    Adafactor's single-GPU step is not modelled, and says so in one line at parse time."""
    eight = simulate(_scenario(training={"optimizer": "adamw8bit"}))
    adam = simulate(_scenario())
    states = [sum(b.nbytes for b in r.graph.persistent if b.category == "optimizer_states") for r in (eight, adam)]
    assert 0 < states[0] < states[1] / 3
    with pytest.raises(ScenarioError, match="training.optimizer: adafactor"):
        _scenario(training={"optimizer": "adafactor"})


def _live_by_category(ops, upto: int) -> dict[str, int]:
    live = {}
    for op in ops[: upto + 1]:
        if op.buffer is not None and op.kind in ("alloc", "free"):
            live[op.buffer.id] = (op.buffer.category, op.buffer.nbytes if op.kind == "alloc" else 0)
    out = {}
    for category, nbytes in live.values():
        out[category] = out.get(category, 0) + nbytes
    return out


def test_checkpointed_casts_stay_in_autocasts_cache_until_the_forward_ends():
    """Non-reentrant checkpointing saves nothing in forward, but autocast's cache keeps every cast until the
    outermost region exits (autocast_mode.py: clear_autocast_cache once the nesting reaches 0): at the end
    of the forward (the loss included) every GEMM weight's copy is alive, as without checkpointing; the
    recompute casts again, and each copy is gone after its module's backward."""
    sc = _scenario(training={"activation_checkpointing": "full"})
    ops = simulate(sc).graph.ops
    by_name = {p.name: p for p in sc.workload.params}
    expected = sum(2 * p.numel for m in sc.workload.modules for p in autocast_params(m, by_name, sc.settings))
    last_compute = max(op.id for op in ops if op.phase == "forward" and op.kind == "compute")
    assert _live_by_category(ops, last_compute)["unsharded_params"] == expected
    last_forward = max(op.id for op in ops if op.phase == "forward")
    assert _live_by_category(ops, last_forward).get("unsharded_params", 0) < expected  # the region exited
    assert _live_by_category(ops, len(ops) - 1).get("unsharded_params", 0) == 0


def test_a_later_micro_batch_adds_through_a_fp32_temporary_of_each_cast_weight():
    """ToCopyBackward returns a new fp32 tensor: AccumulateGrad steals it as `.grad` in the first
    micro-batch (accumulate_grad.h Case 1.1) and adds it in place later (Case 2.3), so each later micro-batch
    has one fp32 temporary per cast weight; an embedding's or a norm's gradient is fp32 already (no cast)."""
    sc = _scenario(training={"grad_accumulation": 3})
    ops = simulate(sc).graph.ops
    by_name = {p.name: p for p in sc.workload.params}
    cast = [p for m in sc.workload.modules for p in autocast_params(m, by_name, sc.settings)]
    temps = [op for op in ops if op.kind == "alloc" and "(ToCopyBackward)" in op.name]
    assert sorted(op.buffer.nbytes for op in temps) == sorted(4 * p.numel for p in cast for _ in range(2))
    assert {op.phase for op in temps} == {"backward #2", "backward #3"}
    uncast = [p for p in sc.workload.params if p.trainable and p not in cast]
    assert uncast  # the embedding and the norms: their gradients are allocated in fp32, never in bf16
    bf16 = {op.name for op in ops if op.kind == "alloc" and op.name.endswith("unsharded grad")
            and op.buffer.nbytes == 2 * by_name[op.name.removesuffix(" unsharded grad")].numel}
    assert bf16 == {f"{p.name} unsharded grad" for p in cast}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_peft_casts_a_bf16_input_to_its_fp32_adapters(dropout):
    """peft's `lora.Linear.forward` runs `x = self._cast_input_dtype(x, lora_A.weight.dtype)`: on a bf16 base
    with fp32 adapters under autocast, an fp32 copy of each adapted Linear's input, cast back by lora_A's
    autocast and saved there. Per adapted Linear of n = tokens x in-features: the cast kernels each way;
    without dropout lora_A saves its own bf16 copy (2n bytes) where it shared the base's input, and an input
    only the frozen base layers read is then not kept; with dropout the dropout's saved output is that copy
    (the same bytes) and the dropout runs in fp32. None under FSDP2's bf16 MixedPrecisionPolicy (the adapters
    are cast to bf16 before peft reads their dtype) nor when the adapters are stored in bf16."""
    from fsdp_sim.workload.lora import LORA_A, PEFT_INPUT_CAST, autograd_view

    lora = {"rank": 4, "targets": "all-linear", "dropout": dropout}
    data = {"model": MODEL | {"lora": lora}, "training": {"micro_batch": 2, "seq_len": 64},
            "hardware": {"profile": "h100-sxm", "gpus_per_node": 1}, "fsdp": {"version": "none"}}
    sc = parse_scenario(data)
    graph = simulate(sc).graph
    block = next(m for m in sc.workload.modules if m.is_block)
    adapters = {k.name[:-len(LORA_A)]: k.shape for k in block.kernels if k.name.endswith(LORA_A)}
    casts = [op for op in graph.ops if op.kind == "compute" and op.name == f"{block.name} forward"]
    kernels = {k.name for k in casts[0].kernels}
    assert {name + PEFT_INPUT_CAST for name in adapters} <= kernels  # one per adapted Linear
    # the saved bytes the plain step allocates for the block against the workload as parsed
    saved = next(op.buffer.nbytes for op in graph.ops if op.kind == "alloc" and op.name == f"{block.name} saved activations")
    copies = sum(tok * fan_in * 2 for tok, _, fan_in in adapters.values())
    if dropout:
        assert saved == block.saved_bytes
    else:
        unkept = autograd_view(sc.workload, frozenset(p.name for p in sc.workload.params if p.trainable), frozenset())
        assert saved == next(m for m in unkept.modules if m.name == block.name).saved_bytes + copies
        assert saved < block.saved_bytes + copies  # the norm outputs only frozen bases read are dropped
    for other in ({"version": 2, "mixed_precision": {"param_dtype": "bf16"}}, {"version": "none", "mixed_precision": {"param_dtype": "bf16"}}):
        changed = dict(data, fsdp=other)
        if other["version"] == "none":
            changed["training"] = dict(data["training"], param_storage_dtype="bf16")
        ops = simulate(parse_scenario(changed)).graph.ops
        assert not any(PEFT_INPUT_CAST in k.name for op in ops if op.kind == "compute" for k in op.kernels)
