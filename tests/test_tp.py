"""Tensor parallel with FSDP (a 2-D mesh): Korthikanti et al.'s activation factors, the 1/k weights, the TP
collectives per block in closed form, the data-parallel mesh FSDP runs on, and the refusals."""

from __future__ import annotations

import pytest
from conftest import run, scenario_dict
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.tp import TP_GROUP, dp_process_groups
from fsdp_sim.workload.tensor_parallel import TensorParallel, build_tp_transformer
from fsdp_sim.workload.transformer import TransformerDims, build_transformer

# the paper's GPT block: LayerNorm, a 4h GELU MLP, explicit attention scores with dropout (test_oracles.py)
KORTHIKANTI = {"attention": "eager", "dropout": True, "mlp": "gelu", "norm": "layernorm"}
SMALL = {"hidden": 64, "layers": 2, "heads": 8, "kv_heads": 4, "vocab": 256, "ffn_hidden": 128}
COLWISE = ("wq", "wk", "wv", "w1", "w3")
ROWWISE = ("wo", "w2")


def _block(b: int, s: int, h: int, a: int, t: int, sp: bool):
    d = TransformerDims(hidden=h, layers=1, heads=a, vocab=128, **KORTHIKANTI)
    wl = build_tp_transformer(d, TensorParallel(t, sp), micro_batch=b, seq_len=s, act_dtype="bf16", name="gpt")
    return next(m for m in wl.modules if m.is_block)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("b,s,h,a", [(1, 64, 64, 8), (2, 128, 256, 8), (1, 2048, 4096, 32)])
def test_tensor_parallel_activations_match_korthikanti(b, s, h, a, t):
    """Table 2, tensor parallel: sbh(10 + 24/t + 5as/(ht)) per layer (the block's saves and its 2sbh input),
    plus 16bs of fp32 LayerNorm statistics that the paper omits, whole on every rank."""
    blk = _block(b, s, h, a, t, sp=False)
    paper = 10 * s * b * h + 24 * s * b * h // t + 5 * a * s * s * b // t
    assert blk.saved_bytes + 2 * s * b * h == paper + 16 * b * s


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("b,s,h,a", [(1, 64, 64, 8), (2, 128, 256, 8), (1, 2048, 4096, 32)])
def test_sequence_parallel_activations_match_korthikanti_plus_gathered_inputs(b, s, h, a, t):
    """Table 2, tensor + sequence parallel: sbh(34/t + 5as/(ht)), the statistics 1/t too, plus what PyTorch
    keeps that Megatron does not: the colwise Linears save their all-gathered (whole) input, the attention's
    and the MLP's, 2sbh each instead of 2sbh/t."""
    blk = _block(b, s, h, a, t, sp=True)
    paper = 34 * s * b * h // t + 5 * a * s * s * b // t
    gathered = 2 * (2 * s * b * h - 2 * s * b * h // t)
    assert blk.saved_bytes + 2 * s * b * h // t == paper + 16 * b * s // t + gathered
    assert blk.output_bytes == 2 * s * b * h // t


@settings(max_examples=30, deadline=None)
@given(t=st.sampled_from([2, 4, 8]), heads=st.sampled_from([8, 16]), ffn=st.sampled_from([64, 96, 256]),
       vocab=st.integers(9, 300), sp=st.booleans(), tie=st.booleans())
def test_tp_shards_each_linear_by_exactly_k(t, heads, ffn, vocab, sp, tie):
    """Colwise weights keep 1/k of their rows, rowwise 1/k of their columns, the vocabulary 1/k of its rows
    (ceil, as torch.chunk), norms stay whole."""
    d = TransformerDims(hidden=64, layers=2, heads=heads, kv_heads=8, ffn_hidden=ffn, vocab=vocab, tie_embeddings=tie)
    full = {p.name: p.shape for p in build_transformer(d, micro_batch=1, seq_len=16, act_dtype="bf16", name="m").params}
    wl = build_tp_transformer(d, TensorParallel(t, sp), micro_batch=1, seq_len=16, act_dtype="bf16", name="m")
    local = {p.name: p.shape for p in wl.params}
    assert local.keys() == full.keys()
    for name, shape in full.items():
        leaf = name.split(".")[-2]
        if leaf in COLWISE:
            assert local[name][0] * t == shape[0] and local[name][1] == shape[1]
        elif leaf in ROWWISE:
            assert local[name][1] * t == shape[1] and local[name][0] == shape[0]
        elif leaf in ("tok_embeddings", "output"):
            assert local[name] == (-(-vocab // t), 64)
        else:
            assert local[name] == shape


def _tp_ops(graph, layer: str, phase: str):
    return [op for op in graph.ops if op.group == TP_GROUP and op.unit == layer and op.phase == phase]


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("sp", [True, False])
def test_tp_collectives_per_block(sp, ac):
    """Per block, on the compute stream: with SP an all-gather before wq and w1 and a reduce-scatter after wo
    and w2 (backward: the duals); without SP an all-reduce after wo and w2 in forward and of the input
    gradients of wq and w1 in backward. Each moves the (b, s, h) activation: 2bsh bytes. A full checkpoint's
    recompute re-runs forward's up to w2 (early stop)."""
    b, s, h = 2, 16, 64
    data = scenario_dict(SMALL, nodes=2, training={"micro_batch": b, "seq_len": s, "activation_checkpointing": ac})
    data["parallelism"] = {"tp": 4, "sequence_parallel": sp}
    sc, r = run(data)
    fwd = [op.kind for op in _tp_ops(r.graph, "layers.0", "forward") if "forward" in op.name]
    bwd = [op.kind for op in _tp_ops(r.graph, "layers.0", "backward") if "backward" in op.name]
    recompute = [op.kind for op in _tp_ops(r.graph, "layers.0", "backward") if "recompute" in op.name]
    if sp:
        assert fwd == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
        assert bwd == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    else:
        assert fwd == ["all_reduce", "all_reduce"]
        assert bwd == ["all_reduce", "all_reduce"]
    assert recompute == (fwd[:3] if sp else fwd[:1]) if ac == "full" else recompute == []
    ops = _tp_ops(r.graph, "layers.0", "forward") + _tp_ops(r.graph, "layers.0", "backward")
    ops = [op for op in ops if "Partial -> Replicate" not in op.name]  # the norms' gradients (below)
    assert all(op.comm_bytes == 2 * b * s * h and op.stream == "compute" for op in ops)


@pytest.mark.parametrize("sp, accumulation", [(True, 1), (True, 3), (False, 1)])
def test_sequence_parallel_norm_grads_are_all_reduced_in_post_backward(sp, accumulation):
    """torchtitan's SequenceParallel norms keep Replicate weights that read Shard(1) inputs, so their gradients
    are Partial; FSDP2's post-backward reads each through `_get_grad_inner_tensor`, which redistributes it to
    Replicate: one TP all-reduce of each norm weight's gradient (bf16, h elements) on the compute stream, in
    the backward that reduce-scatters (accumulated without sync, it waits for that one), before the unit's
    reduce-scatter; none without sequence parallel (the norms are not DTensors there)."""
    b, s, h = 2, 16, 64
    data = scenario_dict(SMALL, nodes=2, training={"micro_batch": b, "seq_len": s, "grad_accumulation": accumulation})
    data["parallelism"] = {"tp": 4, "sequence_parallel": sp}
    data["fsdp"]["mixed_precision"] = {"param_dtype": "bf16", "reduce_dtype": "fp32"}
    if accumulation > 1:
        data["fsdp"]["requires_gradient_sync"] = False
    sc, r = run(data)
    ops = [op for op in r.graph.ops if op.group == TP_GROUP and "Partial -> Replicate" in op.name]
    norms = [p for p in sc.workload.params if p.name.endswith("norm.weight")]
    if not sp:
        assert ops == []
        return
    assert sorted(op.name.split(" ")[0] for op in ops) == sorted(p.name for p in norms)
    reduce_bytes = 4 if accumulation > 1 else 2  # accumulated in reduce_dtype fp32 until the syncing backward
    assert all(op.kind == "all_reduce" and op.stream == "compute" and op.comm_bytes == reduce_bytes * h for op in ops)
    last = f"backward #{accumulation}" if accumulation > 1 else "backward"
    assert {op.phase for op in ops} == {last}
    for op in ops:  # before its unit's reduce-scatter
        rs = next(o for o in r.graph.ops if o.kind == "reduce_scatter" and o.group != TP_GROUP
                  and o.unit == op.unit and o.phase == op.phase)
        assert op.id < rs.id


@pytest.mark.parametrize("sp", [True, False])
def test_float8_tp_all_gathers_move_one_byte_and_each_sharded_cast_all_reduces_its_amax(sp):
    """torchao's Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput (torchtitan's plan with
    float8): a block input is cast before its all-gather and a rowwise output's gradient before its backward
    all-gather, so those move bsh bytes (fp8); reduce-scatters and all-reduces move 2bsh (bf16). Each cast of a
    TP-sharded tensor all-reduces one fp32 amax first: forward the inputs of wq and w1 (with SP) and of wo and
    w2; backward the output gradients of the five colwise Linears, and of wo and w2 with SP."""
    b, s, h = 2, 16, 256  # every block Linear's features multiples of 16 under TP 4: all are Float8Linears
    data = scenario_dict(SMALL | {"hidden": h, "ffn_hidden": 512}, nodes=2, training={"micro_batch": b, "seq_len": s})
    data["hardware"]["profile"] = "h100-sxm"
    data["parallelism"] = {"tp": 4, "sequence_parallel": sp}
    data["compute"] = {"float8": {"enabled": True, "fsdp_float8_all_gather": True}}
    _, r = run(data)
    fwd = [(op.kind, op.comm_bytes) for op in _tp_ops(r.graph, "layers.0", "forward")]
    bwd = [(op.kind, op.comm_bytes) for op in _tp_ops(r.graph, "layers.0", "backward") if "Partial" not in op.name]
    amax, fp8, bf16 = ("all_reduce", 4), b * s * h, 2 * b * s * h
    # without the float8 all-gather each of the 7 Float8Linears casts its TP-sharded bf16 weight in forward
    # and again in backward (torchao float8_linear.py): one more amax all-reduce per Linear and pass
    data["compute"]["float8"]["fsdp_float8_all_gather"] = False
    _, bf16_weights = run(data)
    for phase, ours in (("forward", fwd), ("backward", bwd)):
        theirs = [(op.kind, op.comm_bytes) for op in _tp_ops(bf16_weights.graph, "layers.0", phase) if "Partial" not in op.name]
        assert theirs.count(amax) == ours.count(amax) + 7
        assert [x for x in theirs if x != amax] == [x for x in ours if x != amax]
    if sp:
        assert fwd == [amax, ("all_gather", fp8), amax, ("reduce_scatter", bf16)] * 2
        # backward, w2 first: amax and fp8 all-gather of its gradient, w3, w1 (then its input gradient's
        # reduce-scatter), wo likewise, wv, wk, wq
        assert bwd == [amax, ("all_gather", fp8), amax, amax, ("reduce_scatter", bf16),
                       amax, ("all_gather", fp8), amax, amax, amax, ("reduce_scatter", bf16)]
    else:
        assert fwd == [amax, ("all_reduce", bf16)] * 2
        assert bwd == [amax, amax, ("all_reduce", bf16), amax, amax, amax, ("all_reduce", bf16)]


def test_float8_tp_casts_the_module_input_once_on_the_sequence_shard():
    """Under TP, PrepareFloat8ModuleInput casts the attention's and the MLP's input once (on 1/k of the tokens
    with sequence parallel) and wk / wv / w3 read that cast; a Linear whose input arrived in float8 does not
    cast it again in backward. So per block the forward input casts read and write 5 bytes an element of
    2 x (tokens / k) x h (wq, w1) plus wo's and w2's sharded inputs, where without TP each Linear casts its own."""
    from fsdp_sim.workload.float8 import AMAX_AND_CAST_BYTES, Float8, float8_workload
    h, ffn, k, tok = 256, 512, 4, 2 * 16  # every block Linear's features multiples of 16 under TP 4
    d = TransformerDims(hidden=h, layers=1, heads=8, kv_heads=4, vocab=256, ffn_hidden=ffn)
    wl = build_tp_transformer(d, TensorParallel(k, True), micro_batch=2, seq_len=16, act_dtype="bf16", name="x")
    f8, _ = float8_workload(wl, Float8(enabled=True, fsdp_float8_all_gather=True))
    casts = {kn.name: kn for m in f8.modules if m.is_block for kn in m.kernels if kn.name.startswith("float8 casts")}
    rows = {"wq": tok // k, "w1": tok // k, "wk": 0, "wv": 0, "w3": 0, "wo": tok, "w2": tok}
    width = {"wo": h // k, "w2": ffn // k}  # rowwise: the sharded input features
    for name, r_ in rows.items():
        assert casts[f"float8 casts ({name})"].bytes == r_ * width.get(name, h) * AMAX_AND_CAST_BYTES, name
    one, _ = float8_workload(build_transformer(d, micro_batch=2, seq_len=16, act_dtype="bf16", name="x"),
                             Float8(enabled=True, fsdp_float8_all_gather=True))
    single = {kn.name: kn for m in one.modules if m.is_block for kn in m.kernels if kn.name.startswith("float8 casts")}
    assert single["float8 casts (wk)"].bytes == tok * h * AMAX_AND_CAST_BYTES  # without TP each casts its own
    # backward: its output gradient cast and the three column-major copies, but no re-cast of the input
    # (without TP the saved input is high precision and is cast again)
    n = h // k  # wq's local output features under TP
    assert casts["float8 casts (wq)"].bwd_bytes == tok * n * AMAX_AND_CAST_BYTES + (n * h + tok * n + tok * h) * 2
    assert single["float8 casts (wq)"].bwd_bytes == (tok * h + tok * h) * AMAX_AND_CAST_BYTES + (h * h + 2 * tok * h) * 2


def test_fsdp_runs_on_the_data_parallel_mesh():
    """FULL_SHARD over world / k ranks; each block's all-gather moves its TP-local weights, padded."""
    data = scenario_dict(SMALL, nodes=2)
    data["parallelism"] = {"tp": 4}
    sc, r = run(data)
    assert sc.settings.shard_size == 4 and sc.settings.replicate_size == 1
    unit = next(u for u in sc.units if u.name == "layers.0")
    ag = next(op for op in r.graph.ops if op.kind == "all_gather" and op.unit == "layers.0" and op.group == "shard")
    assert ag.comm_bytes == sum(p.padded_shard_numel(4) for p in unit.params) * 4 * 2


def test_tp_lowers_activation_memory_and_adds_tp_time():
    """Direction: the same step with TP 4 keeps fewer activation bytes per rank than without."""
    base = scenario_dict(SMALL, training={"micro_batch": 2, "seq_len": 64})
    with_tp = dict(base, parallelism={"tp": 4})
    _, r0 = run(base)
    _, r1 = run(with_tp)
    act = lambda r: r.memory.levels[:, 5].max()  # noqa: E731  CATEGORIES index of activations
    assert act(r1) < act(r0)
    assert any(op.group == TP_GROUP for op in r1.graph.ops) and not any(op.group == TP_GROUP for op in r0.graph.ops)


def test_mesh_layout_tp_innermost():
    """64 GPUs as 8 nodes x 8, TP 8: a TP group is one node, a DP shard group of 8 one GPU on each node."""
    groups = dp_process_groups(8, 8, 1, 8, 8)
    assert (groups["tp"].ranks, groups["tp"].nodes) == (8, 1)
    assert (groups["shard"].ranks, groups["shard"].nodes) == (8, 8)
    groups = dp_process_groups(2, 4, 2, 2, 8)  # HSDP: a shard group of 4 DP ranks fills its node
    assert (groups["shard"].nodes, groups["replicate"].nodes) == (1, 2)


@pytest.mark.parametrize("parallelism,message", [
    ({"tp": 3}, "parallelism.tp: 3 must divide hardware.gpus_per_node 8"),
    ({"tp": 16}, "parallelism.tp: 16 is past the limit of 8"),
    ({"tp": 2, "pp": 2}, "parallelism.pp: unknown key"),
    ({"tp": 8}, "parallelism.tp: 8 does not divide model.kv_heads 4"),
    ({"tp": 2, "sequence_parallel": "yes"}, "parallelism.sequence_parallel: expected true or false"),
    ({"tp": 2, "tp_plan": "megatron"}, "parallelism.tp_plan: expected one of ['torchtitan', 'hf', 'blocks']"),
    ({"tp": 2, "tp_plan": "hf", "sequence_parallel": True}, "parallelism.sequence_parallel: true needs tp_plan torchtitan"),
])
def test_refusals(parallelism, message):
    data = scenario_dict(SMALL)
    data["parallelism"] = parallelism
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("tp,message", [
    (2, "fsdp.shard_size: 3 does not divide the data-parallel size 4 (1 nodes x 8 GPUs / tp 2)"),
    (1, "fsdp.shard_size: 3 does not divide the world size 8 (1 nodes x 8 GPUs)"),
])
def test_shard_size_refusal_names_the_data_parallel_size(tp, message):
    """Under TP, FSDP shards over the GPUs / tp: the refusal names that size, not the GPU count as a world."""
    data = scenario_dict(SMALL, nodes=1, gpus_per_node=8, fsdp={"shard_size": 3})
    data["parallelism"] = {"tp": tp}
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data)
    assert str(err.value) == message


# ---- referee: FSDPMemTracker on the CPU, TP 2 x FSDP 4 on a 2-D mesh (torchtitan's plan) ----------------
@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("sp", [True, False])
def test_tp2_fsdp4_peak_agrees_with_fsdp_mem_tracker(ac, sp):
    """The tracker's peak (iteration 1, fake tensors, rank 0 of a (dp 4, tp 2) mesh, with and without sequence
    parallel, loss parallel) against fsdp-sim's for the same job, within 2 %; the sharded parameters exactly.
    Without sequence parallel the norms run on every row while the MLP is 1/2 wide: the peak is the CPU's
    composite RMSNorm backward (its fp32 tensors, `transformer.norm_transients`), which was missing (-3.7 %)."""
    pytest.importorskip("torch")
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig
    from fsdp_sim.torch_tools.referee import simulate_reference
    from fsdp_sim.torch_tools.tp_referee import run_tp_fsdp_mem_tracker

    cfg = ReferenceConfig(hidden=256, layers=2, heads=8, kv_heads=4, ffn_hidden=512, vocab=512)
    tracker = run_tp_fsdp_mem_tracker(cfg, tp=2, dp=4, batch=2, seq=128, activation_checkpointing=ac,
                                      sequence_parallel=sp)
    ours = simulate_reference(cfg, world_size=8, batch=2, seq=128, activation_checkpointing=ac,
                              sections={"parallelism": {"tp": 2, "sequence_parallel": sp}})
    assert ours["peak_by_category"]["Sharded Param"] == tracker["peak_by_category"]["Sharded Param"]
    assert ours["peak_bytes"] == pytest.approx(tracker["peak_bytes"], rel=0.02)
