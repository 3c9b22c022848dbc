"""The loss kernels of `training.loss` (`workload/loss.py`): each one's saved, transient and gradient bytes
in closed form from its source, the order they put the peak in, and the tracker where they run on the CPU."""

from __future__ import annotations

import pytest
from conftest import run, scenario_dict
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.workload.loss import apply_loss, liger_chunk_rows, seq_chunks
from fsdp_sim.workload.transformer import TransformerDims, build_transformer

B, S, H, V, P = 2, 64, 128, 5000, 2
T = B * S


def _head_and_loss(loss: str):
    d = TransformerDims(hidden=H, layers=2, heads=4, ffn_hidden=352, vocab=V)
    wl = apply_loss(build_transformer(d, micro_batch=B, seq_len=S, act_dtype="bf16", name="t"), loss, batch=B, seq=S)
    return wl.modules[-2], wl.modules[-1]


def test_seq_chunks_are_tensor_splits():
    torch = pytest.importorskip("torch")
    for seq in (1, 7, 8, 100, 2048, 8191):
        assert seq_chunks(seq) == [c.shape[1] for c in torch.empty(1, seq).tensor_split(8, dim=1)]


def test_liger_chunk_is_the_power_of_two_that_bounds_the_logits_to_the_hidden_states():
    """Liger's own example: BT = 4096 x 4, V = 32000, H = 4096 -> inc_factor 8, chunk_size 2048."""
    assert liger_chunk_rows(4096 * 4, 4096, 32000) == 2048
    assert liger_chunk_rows(100, 4096, 1000) == 100  # one chunk covers BT, never more than BT


def test_torch_keeps_fp32_log_softmax_and_two_fp32_gradients():
    _, loss = _head_and_loss("torch")
    assert (loss.saved_bytes, loss.fwd_temp_bytes, loss.bwd_temp_bytes) == (4 * T * V + 4, 4 * T * V, 8 * T * V)


def test_bf16_logits_is_the_same_ops_in_the_compute_dtype():
    _, loss = _head_and_loss("bf16_logits")
    assert (loss.saved_bytes, loss.fwd_temp_bytes, loss.bwd_temp_bytes) == (P * T * V + 4, 0, 2 * P * T * V)


def test_chunked_upcasts_one_chunk_at_a_time_but_saves_every_chunks_log_softmax():
    head, loss = _head_and_loss("chunked")
    chunk = B * (S // 8) * V * 4
    assert (loss.saved_bytes, loss.fwd_temp_bytes, loss.bwd_temp_bytes) == (4 * T * V + 8 * 4, chunk, 2 * chunk)
    assert [k.shape for k in head.kernels] == [(B * S // 8, V, H)] * 8
    assert head.output_bytes == P * T * V and head.bwd_temp_bytes == 3 * V * H * P


def test_flash_attn_saves_the_logits_and_writes_one_gradient():
    head, loss = _head_and_loss("flash_attn")
    assert loss.saves_input and head.output_bytes == P * T * V
    assert (loss.saved_bytes, loss.fwd_temp_bytes, loss.bwd_temp_bytes) == (4 * T, 2 * 4 * T, 0)


def test_liger_never_materialises_the_logits_and_does_its_gradients_in_forward():
    head, loss = _head_and_loss("liger_fused_linear")
    rows = liger_chunk_rows(T, H, V)
    assert head.saved_bytes == (T + V) * H * P  # grad_input and grad_weight, handed out in backward
    assert head.fwd_temp_bytes == rows * V * P + T * 4 + T and head.output_bytes == 4
    assert head.fwd_flops == 3 * 2 * T * H * V and head.bwd_flops == 0
    assert loss.saved_bytes == loss.fwd_temp_bytes == loss.bwd_temp_bytes == 0


def _peak(loss: str) -> int:
    data = scenario_dict({"hidden": 256, "layers": 2, "heads": 4, "ffn_hidden": 704, "vocab": 128256},
                         gpus_per_node=4, training={"micro_batch": 2, "seq_len": 1024, "loss": loss})
    return run(data)[1].peak()["allocated_bytes"]


def test_at_a_large_vocabulary_the_loss_kernels_lower_the_peak_in_order():
    peaks = {loss: _peak(loss) for loss in ("torch", "chunked", "bf16_logits", "flash_attn", "liger_fused_linear")}
    assert peaks["torch"] > peaks["chunked"] and peaks["torch"] > peaks["bf16_logits"]
    assert peaks["bf16_logits"] > peaks["flash_attn"] > peaks["liger_fused_linear"]


@pytest.mark.parametrize("training, message", [
    ({"loss": "fused", "seq_len": 128}, "training.loss"),
    ({"loss": 3, "seq_len": 128}, "training.loss: expected a string"),
])
def test_bad_loss_keys_are_one_line(training, message):
    with pytest.raises(ScenarioError, match=message):
        parse_scenario({"model": "gpt2", "training": training, "hardware": {"profile": "h100-sxm"}})


def test_a_workload_without_a_decoder_head_refuses_another_loss():
    from dataclasses import replace

    d = TransformerDims(hidden=H, layers=2, heads=4, ffn_hidden=352, vocab=V)
    wl = build_transformer(d, micro_batch=B, seq_len=S, act_dtype="bf16", name="t")
    headless = replace(wl, modules=wl.modules[:-2] + wl.modules[-1:])
    with pytest.raises(ScenarioError, match="training.loss: chunked replaces a decoder's output head"):
        apply_loss(headless, "chunked", batch=B, seq=S)


@pytest.mark.parametrize("case_id", ["loss-chunked", "loss-chunked-seq-100", "loss-bf16-logits"])
def test_cpu_loss_kernels_agree_with_fsdp_mem_tracker(case_id):
    """torchtune's chunked output and loss, and cross-entropy without the upcast, on the ReferenceTransformer
    under FSDPMemTracker: the peak within 2 %."""
    pytest.importorskip("torch")
    from fsdp_sim.torch_tools.technique_referee import relative_errors

    errors = relative_errors(case_id)
    assert all(abs(e) <= 0.02 for e in errors.values()), errors


@settings(max_examples=25, deadline=None)
@given(loss=st.sampled_from(["torch", "bf16_logits", "chunked", "flash_attn", "liger_fused_linear"]),
       ac=st.sampled_from(["none", "full", "selective_layer", "selective_op"]), seq=st.integers(1, 70),
       tied=st.booleans(), accumulation=st.integers(1, 2), fp32=st.booleans())
def test_every_loss_and_checkpoint_mode_leaks_nothing(loss, ac, seq, tied, accumulation, fp32):
    """Whatever the loss kernel and checkpointing, the step ends with exactly its persistent state and no
    level goes below it (the ledger itself refuses a double free or a negative level)."""
    training = {"micro_batch": 2, "seq_len": seq, "loss": loss, "activation_checkpointing": ac,
                "grad_accumulation": accumulation} | ({"ac_every": 2} if ac == "selective_layer" else {})
    data = scenario_dict({"hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 300,
                          "tie_embeddings": tied}, gpus_per_node=2, training=training,
                         fsdp={"mixed_precision": {"param_dtype": "fp32" if fp32 else "bf16"}})
    r = run(data)[1]
    persistent = {b.id for b in r.graph.persistent}
    assert {b.id for b in r.memory.live_at_end} == persistent
    assert (r.memory.total >= sum(b.nbytes for b in r.graph.persistent)).all()
