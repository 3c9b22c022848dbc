"""Frozen parameters (`model.frozen`), the parameter storage dtype (`training.param_storage_dtype`) and
DeepSpeed's words (`fsdp.zero_stage`): what a frozen parameter no longer costs, mixed-dtype all-gathers as
FSDP2 sizes them, optimizer states in the parameters' dtype, and referee cases against FSDPMemTracker."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from fsdp_sim.errors import ScenarioError
from fsdp_sim.results.report import summary
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate

TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 1000}


def _run(model: dict, *, fsdp: dict | None = None, world: int = 4, **training):
    data = {"model": model, "training": {"micro_batch": 1, "seq_len": 64} | training,
            "hardware": {"profile": "h100-sxm", "gpus_per_node": world}, "fsdp": {"wrap": "torchtitan"} | (fsdp or {})}
    return simulate(parse_scenario(data))


def _buffers(result, unit: str, category: str) -> list:
    bufs = [op.buffer for op in result.graph.ops if op.kind == "alloc" and op.buffer.unit == unit]
    return [b for b in bufs + list(result.graph.persistent) if b.category == category and b.unit == unit]


def test_frozen_embedding_has_no_gradient_state_or_reduce_scatter():
    """torchtitan's wrapping gives the embedding its own unit: frozen, it keeps only its bf16 shard."""
    world = 4
    trained, frozen = _run(TINY), _run(TINY | {"frozen": ["tok_embeddings"]})
    unit = "tok_embeddings"
    assert _buffers(trained, unit, "optimizer_states") and not _buffers(frozen, unit, "optimizer_states")
    assert not _buffers(frozen, unit, "unsharded_grads") and not _buffers(frozen, unit, "sharded_grads")
    assert not [op for op in frozen.graph.ops if op.kind == "reduce_scatter" and op.unit == unit]
    assert [op for op in trained.graph.ops if op.kind == "reduce_scatter" and op.unit == unit]
    (sharded,) = _buffers(frozen, unit, "sharded_params")
    assert sharded.nbytes == TINY["vocab"] * TINY["hidden"] * 2 // world  # bf16, its own dtype
    (fp32,) = _buffers(_run(TINY | {"frozen": ["tok_embeddings"], "frozen_dtype": "fp32"}), unit, "sharded_params")
    assert fp32.nbytes == 2 * sharded.nbytes
    counts = frozen.to_dict()["model"]
    assert counts["frozen_params"] == TINY["vocab"] * TINY["hidden"]
    assert counts["trainable_params"] == frozen.scenario.workload.numel - counts["frozen_params"]


def test_a_mixed_dtype_unit_all_gathers_the_sum_of_its_bytes():
    """No MixedPrecisionPolicy dtype (`param_dtype: null`, fp32 compute): a frozen bf16 weight beside fp32
    ones is gathered as stored, the buffer one uint8 view of all inputs (`_get_all_gather_input_metadatas`),
    no cast copy-in. An explicit fp32 policy casts the bf16 weight up (`init_dtype_attrs` compares dtypes,
    not sizes): everything gathered in fp32, the frozen weight through the copy-in temporary."""
    world = 4
    r = _run(TINY | {"frozen": ["layers.0.attention.wq"]}, fsdp={"mixed_precision": {"param_dtype": None}}, world=world)
    unit = next(u for u in r.scenario.units if u.name == "layers.0")
    expected = sum(p.padded_shard_numel(world) * (2 if not p.trainable else 4) for p in unit.params) * world
    gather = next(op for op in r.graph.ops if op.kind == "all_gather" and op.unit == "layers.0")
    assert gather.comm_bytes == expected
    assert not [b for b in _buffers(r, "layers.0", "temporaries") if "copy-in cast" in b.name]
    r = _run(TINY | {"frozen": ["layers.0.attention.wq"]}, fsdp={"mixed_precision": {"param_dtype": "fp32"}}, world=world)
    gather = next(op for op in r.graph.ops if op.kind == "all_gather" and op.unit == "layers.0")
    assert gather.comm_bytes == sum(p.padded_shard_numel(world) * 4 for p in unit.params) * world
    (cast,) = [b for b in _buffers(r, "layers.0", "temporaries") if "copy-in cast" in b.name][:1]
    assert cast.nbytes == sum(p.padded_shard_numel(world) * 4 for p in unit.params if not p.trainable)
    # with a bf16 policy the frozen bf16 weight is not cast; the fp32 ones are, through the flat temporary
    r = _run(TINY | {"frozen": ["layers.0.attention.wq"]}, world=world)
    (cast,) = [b for b in _buffers(r, "layers.0", "temporaries") if "copy-in cast" in b.name][:1]
    assert cast.nbytes == sum(p.padded_shard_numel(world) * 2 for p in unit.params if p.trainable)


def test_a_frozen_linear_runs_no_weight_gradient_and_keeps_no_input():
    wl = parse_scenario({"model": TINY | {"frozen": ["layers.*.feed_forward.w2"]},
                         "hardware": {"profile": "h100-sxm"}}).workload
    base = parse_scenario({"model": TINY, "hardware": {"profile": "h100-sxm"}}).workload
    w2 = next(k for k in wl.modules[1].kernels if k.name == "w2")
    assert not w2.weight_grad and w2.bwd_flops == w2.fwd_flops
    tok = 2048  # micro-batch 1 x the default seq_len
    assert base.modules[1].saved_bytes - wl.modules[1].saved_bytes == tok * TINY["ffn_hidden"] * 2  # w2's input
    assert base.modules[1].bwd_flops - wl.modules[1].bwd_flops == w2.fwd_flops


def test_bf16_storage_halves_parameters_and_optimizer_states():
    """Pure bf16 training: the sharded parameters and AdamW's zeros_like states in bf16, no copy-in cast."""
    fp32, bf16 = _run(TINY), _run(TINY, param_storage_dtype="bf16")
    for category in ("sharded_params", "optimizer_states"):
        a = sum(b.nbytes for b in fp32.graph.persistent if b.category == category)
        b = sum(b.nbytes for b in bf16.graph.persistent if b.category == category)
        assert b * 2 == a, category
    assert not [op for op in bf16.graph.ops if op.kind == "alloc" and "copy-in cast" in op.buffer.name]
    assert bf16.to_dict()["model"]["param_storage_dtype"] == "bf16"


@pytest.mark.parametrize("stage, strategy", [(3, "FULL_SHARD"), (2, "SHARD_GRAD_OP"), (1, "SHARD_GRAD_OP")])
def test_zero_stage_words_map_onto_the_strategies(stage, strategy):
    r = _run(TINY, fsdp={"zero_stage": stage})
    assert r.scenario.sharding_strategy == strategy
    d = r.to_dict()
    ref = _run(TINY, fsdp={"sharding_strategy": strategy}).to_dict()
    assert d["peak"]["allocated_bytes"] == ref["peak"]["allocated_bytes"]
    assert ("note " in summary(d)) == (stage != 3)


@pytest.mark.parametrize("model, fsdp, training, key", [
    (TINY | {"frozen": ["no_such_module"]}, {}, {}, r"model\.frozen\[0\]"),
    (TINY | {"frozen": "tok_embeddings", "frozen_dtype": "int4"}, {}, {}, r"model\.frozen_dtype"),
    (TINY | {"frozen_dtype": "bf16"}, {}, {}, r"model\.frozen_dtype"),
    (TINY | {"frozen": [3]}, {}, {}, r"model\.frozen"),
    (TINY, {"zero_stage": 4}, {}, r"fsdp\.zero_stage"),
    (TINY, {"zero_stage": 3, "sharding_strategy": "FULL_SHARD"}, {}, r"fsdp\.zero_stage"),
    (TINY, {}, {"param_storage_dtype": "fp8"}, r"training\.param_storage_dtype"),
])
def test_bad_input_names_the_key(model, fsdp, training, key):
    with pytest.raises(ScenarioError, match=key):
        _run(model, fsdp=fsdp, **training)


PREFIXES = ("tok_embeddings", "layers.0", "layers.1.attention", "layers.*.feed_forward.w2", "norm", "output")


@settings(max_examples=20, deadline=None)
@given(frozen=st.sets(st.sampled_from(PREFIXES), min_size=1, max_size=5), world=st.sampled_from([1, 2, 4]),
       storage=st.sampled_from(["fp32", "bf16"]), dtype=st.sampled_from(["bf16", "fp32"]),
       wrap=st.sampled_from(["per_block", "torchtitan"]))
def test_frozen_invariants(frozen, world, storage, dtype, wrap):
    """Any frozen set: no gradient buffer names a frozen parameter, a unit with nothing to train runs no
    foreach_reduce, the optimizer states are two zeros_like of each trainable shard, the sharded parameters
    are each parameter's shard in its stored dtype, and the step leaks nothing."""
    r = _run(TINY | {"frozen": sorted(frozen), "frozen_dtype": dtype}, fsdp={"wrap": wrap}, world=world,
             param_storage_dtype=storage)
    frozen_names = {p.name for p in r.scenario.workload.params if not p.trainable}
    grads = [op.buffer.name for op in r.graph.ops if op.kind == "alloc" and op.buffer.category == "unsharded_grads"]
    assert not [g for g in grads if g.removesuffix(" unsharded grad") in frozen_names]
    for u in r.scenario.units:
        reduced = [op for op in r.graph.ops if op.name == f"{u.name} reduce-scatter copy-in"]  # foreach_reduce ran
        assert bool(reduced) == any(p.trainable for p in u.params)
    size = 4 if storage == "fp32" else 2
    shards = sum(p.padded_shard_numel(world) for p in r.scenario.workload.params if p.trainable)
    assert sum(b.nbytes for b in r.graph.persistent if b.category == "optimizer_states") == 2 * shards * size
    stored = sum(p.padded_shard_numel(world) * (size if p.trainable else 4 if dtype == "fp32" else 2)
                 for p in r.scenario.workload.params)
    assert sum(b.nbytes for b in r.graph.persistent if b.category == "sharded_params") == stored
    expected = {b.id: b.nbytes for b in r.graph.persistent}
    assert {b.id: b.nbytes for b in r.memory.live_at_end} == expected


try:
    from fsdp_sim.torch_tools.lora_referee import LORA_CASES as _CASES
except ImportError:  # no torch: the referee cases are skipped
    _CASES = []
FROZEN_CASES = [c for c in _CASES if c[0].startswith("frozen")]


@pytest.mark.parametrize("case_id, model, run, prep", FROZEN_CASES, ids=[c[0] for c in FROZEN_CASES])
def test_frozen_peak_agrees_with_fsdp_mem_tracker(case_id, model, run, prep):
    from tests.test_lora import check_referee_case
    check_referee_case(model, run, prep)


@pytest.mark.parametrize("frozen, tail", [([], True), (["pos_embeddings"], True), (["tok_embeddings"], False)])
def test_the_tied_embeddings_last_moment_needs_its_tied_weight_trained(frozen, tail):
    """A tied embedding's backward ends with its gradient joining the head's, out of place (two more
    vocab x hidden tensors a moment, `transformer.build_transformer`); with the tied weight frozen neither
    gradient exists, even when the position embedding beside it still trains."""
    from fsdp_sim.workload import TransformerDims, build_transformer
    from fsdp_sim.workload.frozen import freeze

    dims = TransformerDims(hidden=64, layers=2, heads=4, kv_heads=2, vocab=1000, tie_embeddings=True,
                           learned_pos=True, max_seq=128)
    wl = freeze(build_transformer(dims, micro_batch=1, seq_len=64, act_dtype="bf16", name="tied"), frozen, "bf16")
    embedding = wl.modules[0]
    assert embedding.bwd_tail_bytes == (2 * 1000 * 64 * 2 - 64 * 64 * 2 if tail else 0)
