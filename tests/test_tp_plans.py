"""`parallelism.tp_plan`: torchtitan's, transformers' (`hf`) and the blocks-only plan. Closed forms from the
styles' source (which collective per Linear and pass, its bytes), the per-rank shards and logits, and two
referees on the CPU: the functional collectives DTensor issues (tp_plan_referee.record_tp_collectives) and
FSDPMemTracker's peak on a (dp 4, tp 2) mesh."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import run, scenario_dict

from fsdp_sim.schedule.tp import TP_GATHER, TP_GROUP
from fsdp_sim.workload.tensor_parallel import TensorParallel, build_tp_transformer
from fsdp_sim.workload.transformer import TransformerDims

SMALL = {"hidden": 64, "layers": 2, "heads": 8, "kv_heads": 4, "vocab": 256, "ffn_hidden": 128}


def _tp_ops(r, phase: str):
    return [(op.kind, op.comm_bytes) for op in r.graph.ops if op.group in (TP_GROUP, TP_GATHER) and op.phase == phase]


def _run(plan: str, *, sp: bool | None = None, model=SMALL, b=2, s=16, k=4, ac="none"):
    data = scenario_dict(model, nodes=2, training={"micro_batch": b, "seq_len": s, "activation_checkpointing": ac})
    data["parallelism"] = {"tp": k, "tp_plan": plan} | ({} if sp is None else {"sequence_parallel": sp})
    return run(data)


@pytest.mark.parametrize("mlp,colwise", [("swiglu", 5), ("gelu", 4)])
@pytest.mark.parametrize("plan", ["hf", "blocks"])
def test_per_linear_plans_all_reduce_each_colwise_input_gradient(plan, mlp, colwise):
    """No PrepareModuleInput: each colwise Linear's `from_local` input has its own backward, so per block one
    all-reduce of 2bsh bytes per colwise Linear in backward (wq wk wv w1 [w3]) and one per rowwise output in
    forward (wo, w2); torchtitan's plan without SP has two and two."""
    b, s, h = 2, 16, 64
    _, r = _run(plan, model=SMALL | {"mlp": mlp})
    blk = lambda phase: [(op.kind, op.comm_bytes) for op in r.graph.ops  # noqa: E731
                         if op.group == TP_GROUP and op.unit == "layers.0" and op.phase == phase]
    assert blk("forward") == [("all_reduce", 2 * b * s * h)] * 2
    assert blk("backward") == [("all_reduce", 2 * b * s * h)] * colwise
    _, t = _run("torchtitan", sp=False, model=SMALL | {"mlp": mlp})
    titan = [op.kind for op in t.graph.ops if op.group == TP_GROUP and op.unit == "layers.0" and op.phase == "backward"]
    assert titan == ["all_reduce"] * 2


@pytest.mark.parametrize("vocab", [256, 250])
def test_hf_head_gathers_the_logits_padded_to_k_shards(vocab):
    """colwise_rep: the logits' Shard(-1) -> Replicate all-gather moves b s k ceil(V/k) elements (DTensor pads
    an uneven shard), at an all-gather's ring factor; backward one all-reduce of the head's input gradient.
    The blocks plan moves nothing at the head, and neither plan has loss parallel's all-reduces."""
    b, s, h, k = 2, 16, 64, 4
    _, r = _run("hf", model=SMALL | {"vocab": vocab})
    head = [(op.kind, op.comm_bytes, op.group) for op in r.graph.ops if op.unit == "root" and op.group in (TP_GROUP, TP_GATHER)]
    assert head == [("all_gather", b * s * k * -(-vocab // k) * 2, TP_GATHER), ("all_reduce", b * s * h * 2, TP_GROUP)]
    _, r = _run("blocks", model=SMALL | {"vocab": vocab})
    assert not [op for op in r.graph.ops if op.unit in ("root", "") and op.group in (TP_GROUP, TP_GATHER)
                and op.phase != "optimizer"]  # clip_grad_norm_'s total-norm all-reduce aside


def test_per_rank_shards_and_logits():
    """torchtitan: embedding and head 1/k of the vocabulary, logits 1/k (loss parallel); hf: embedding whole,
    head 1/k, logits whole after the gather (the loss over all of V); blocks: both whole. Blocks 1/k everywhere."""
    d = TransformerDims(**SMALL)
    k, b, s = 4, 2, 16
    tok = b * s
    for plan, emb_rows, head_rows, loss_v in (("torchtitan", 64, 64, 64), ("hf", 256, 64, 256), ("blocks", 256, 256, 256)):
        wl = build_tp_transformer(d, TensorParallel(k, plan == "torchtitan", plan), micro_batch=b, seq_len=s,
                                  act_dtype="bf16", name="x")
        shapes = {p.name: p.shape for m in wl.modules for p in m.params}
        assert shapes["tok_embeddings.weight"] == (emb_rows, 64)
        assert shapes["output.weight"] == (head_rows, 64)
        assert shapes["layers.0.attention.wq.weight"] == (64 // k, 64)
        assert shapes["layers.0.feed_forward.w2.weight"] == (64, 128 // k)
        mods = {m.kind: m for m in wl.modules}
        assert mods["loss"].saved_bytes == tok * loss_v * 4 + 4  # log_softmax's fp32 output
        assert mods["head"].output_bytes == tok * loss_v * 2


@pytest.mark.parametrize("plan", ["hf", "blocks"])
def test_full_checkpoint_recompute_reruns_wo_all_reduce(plan):
    """A full checkpoint's recompute re-runs forward up to w2's input: wo's output all-reduce again, not w2's."""
    _, r = _run(plan, ac="full")
    rec = [op.kind for op in r.graph.ops if op.group == TP_GROUP and op.unit == "layers.0" and "recompute" in op.name]
    assert rec == ["all_reduce"]


# ---- referees on the CPU ----------------------------------------------------------------------------------
@pytest.mark.parametrize("plan,sp", [("torchtitan", True), ("torchtitan", False), ("hf", False), ("blocks", False)])
def test_collectives_agree_with_dtensor(plan, sp):
    """The TP collectives fsdp-sim schedules, by kind and bytes, forward and backward, are those DTensor
    issues for the same bf16 model and plan on a fake process group of 4 ranks (loss parallel's three fp32
    all-reduces included)."""
    pytest.importorskip("torch")
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig
    from fsdp_sim.torch_tools.tp_plan_referee import record_tp_collectives

    cfg = ReferenceConfig(**SMALL)
    theirs = record_tp_collectives(cfg, plan, tp=4, batch=2, seq=16, sequence_parallel=sp)
    _, r = _run(plan, sp=sp)
    assert Counter(_tp_ops(r, "forward")) == Counter(theirs["forward"])
    # without FSDP the norms' Partial gradients stay Partial: FSDP2's post-backward redistributes them (below)
    partial = Counter((op.kind, op.comm_bytes) for op in r.graph.ops if "Partial -> Replicate" in op.name)
    assert Counter(_tp_ops(r, "backward")) - partial == Counter(theirs["backward"])


@pytest.mark.parametrize("sp", [True, False])
def test_tp_collectives_under_fsdp2_agree_with_dtensor(sp):
    """Two steps of torchtitan's plan under FSDP2 on a (dp 2, tp 4) mesh of fake ranks: every functional
    collective DTensor issues, FSDP2's post-backward redistribution of the SequenceParallel norms' Partial
    gradients (`_get_grad_inner_tensor`: one all-reduce of each norm weight's bf16 gradient) among them, is
    one fsdp-sim schedules on the TP group, by kind and bytes (twice its one step). Without sequence parallel
    the norms are not DTensors: none."""
    pytest.importorskip("torch")
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig
    from fsdp_sim.torch_tools.tp_plan_referee import record_tp_fsdp_collectives

    # one sequence of 16 tokens: loss parallel's fp32 all-reduces (64 B) differ from a norm gradient's (2h = 128 B)
    theirs = record_tp_fsdp_collectives(ReferenceConfig(**SMALL), tp=4, dp=2, sequence_parallel=sp, batch=1, seq=16)
    data = scenario_dict(SMALL, nodes=1, training={"micro_batch": 1, "seq_len": 16, "max_norm": None})
    data["hardware"]["gpus_per_node"] = 8
    data["parallelism"] = {"tp": 4, "sequence_parallel": sp}
    data["fsdp"]["mixed_precision"] = {"param_dtype": "bf16", "reduce_dtype": "fp32"}
    _, r = run(data)
    ours = Counter((op.kind, op.comm_bytes) for op in r.graph.ops if op.group == TP_GROUP)
    assert Counter({key: 2 * n for key, n in ours.items()}) == theirs
    norms = sum(n for (kind, nbytes), n in theirs.items() if kind == "all_reduce" and nbytes == 2 * SMALL["hidden"])
    assert norms == (2 * (2 * SMALL["layers"] + 1) if sp else 0)  # two a block and the final norm, each step


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("plan", ["hf", "blocks"])
def test_tp2_fsdp4_peak_agrees_with_fsdp_mem_tracker(plan, ac):
    """The tracker's peak (fake tensors, rank 0 of a (dp 4, tp 2) mesh, the plan's whole logits and loss)
    against fsdp-sim's, within 1 %; the sharded parameters (a whole embedding, an hf head of V/2 rows)
    exactly."""
    pytest.importorskip("torch")
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig
    from fsdp_sim.torch_tools.referee import simulate_reference
    from fsdp_sim.torch_tools.tp_plan_referee import run_plan_fsdp_mem_tracker

    cfg = ReferenceConfig(hidden=256, layers=2, heads=8, kv_heads=4, ffn_hidden=512, vocab=512)
    tracker = run_plan_fsdp_mem_tracker(cfg, plan, tp=2, dp=4, batch=2, seq=128, activation_checkpointing=ac)
    ours = simulate_reference(cfg, world_size=8, batch=2, seq=128, activation_checkpointing=ac,
                              sections={"parallelism": {"tp": 2, "tp_plan": plan}})
    assert ours["peak_by_category"]["Sharded Param"] == tracker["peak_by_category"]["Sharded Param"]
    assert ours["peak_bytes"] == pytest.approx(tracker["peak_bytes"], rel=0.01)
