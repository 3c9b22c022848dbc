"""FSDP1 with frozen weights, as LoRA and QLoRA run it (issue 24, items 4-9), against torch 2.13's source.

Each test quotes the lines of torch/distributed/fsdp (`_flat_param.py`, `_runtime_utils.py`), peft or
bitsandbytes whose behaviour it checks; the expected figures are computed here from the parameter shapes.
The referee cases (PyTorch's MemTracker on the same jobs) are in test_referee_fsdp1_lora.py.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from conftest import scenario_dict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.build import build_step
from fsdp_sim.schedule.fsdp1 import FSDP1Runtime
from fsdp_sim.simulate import simulate
from fsdp_sim.workload.frozen import trainable_counts
from fsdp_sim.workload.lora import nf4_bytes, packed_shape

MODEL = {"hidden": 64, "layers": 3, "heads": 4, "vocab": 509}
LORA = {"rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}
QLORA = {"rank": 8, "alpha": 16, "targets": "all-linear", "quantize": "nf4"}


def _scenario(lora=LORA, frozen_dtype="fp32", storage="fp32", gpus=4, training=None, model=None, **fsdp):
    data = scenario_dict(MODEL, gpus_per_node=gpus, training=training,
                         fsdp={"version": 1, "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}} | fsdp)
    data["model"] |= (model or {}) | ({"lora": lora, "frozen_dtype": frozen_dtype} if lora else {})
    data["training"] |= {"param_storage_dtype": storage}
    return parse_scenario(data)


def _graph(sc):
    return build_step(sc.workload, sc.units, sc.settings)


def _numel(shape) -> int:
    return math.prod(shape)


# ---- item 4: what _validate_tensors_to_flatten refuses ------------------------------------------------
def test_mixed_requires_grad_is_refused_without_use_orig_params():
    """`_validate_tensors_to_flatten`: `if not self._use_orig_params and flat_param_requires_grad is not None
    and tensor.requires_grad != flat_param_requires_grad: raise ValueError("Must flatten tensors with uniform
    `requires_grad` when `use_orig_params=False`")`: a block holding peft's adapters beside its frozen base."""
    with pytest.raises(ScenarioError, match=r"^fsdp\.use_orig_params: false.*fsdp\.wrap: peft or fsdp\.use_orig_params: true"):
        _graph(_scenario())


def test_mixed_dtypes_are_refused_even_with_use_orig_params():
    """`if dtype is not None and tensor.dtype != dtype: raise ValueError(f"Must flatten tensors with uniform
    dtype ...")`, whatever use_orig_params: a bf16 base beside fp32 adapters."""
    with pytest.raises(ScenarioError, match=r"^model\.frozen_dtype: unit layers\.0 mixes the frozen .* \(bf16\)"):
        _graph(_scenario(frozen_dtype="bf16", use_orig_params=True))


def test_a_uint8_packed_base_cannot_be_flattened():
    """`if dtype is None and not tensor.is_floating_point(): raise ValueError("Cannot flatten integer dtype
    tensors")`: bitsandbytes' default `quant_storage=torch.uint8` (Linear4bit's signature) under FSDP1; the way
    out is `bnb_4bit_quant_storage`, `model.lora.quant_storage: bf16`."""
    with pytest.raises(ScenarioError, match=r"^model\.lora\.quant_storage: uint8 .* model\.lora\.quant_storage: bf16"):
        _graph(_scenario(QLORA, frozen_dtype="bf16", storage="bf16", wrap="peft"))


def test_a_packed_base_must_not_be_cast_by_mixed_precision():
    """fsdp_qlora's train.py: "The Linear4Bit quant_storage dtype should always match the FSDP param_dtype":
    `_mp_shard` would convert the codes' bits as numbers (`_uses_param_mixed_precision`)."""
    with pytest.raises(ScenarioError, match=r"^fsdp\.mixed_precision\.param_dtype: fp32 would cast"):
        _graph(_scenario(QLORA | {"quant_storage": "bf16"}, frozen_dtype="bf16", storage="bf16", wrap="peft",
                         mixed_precision={"param_dtype": "fp32"}))


def test_what_torch_accepts_runs():
    """The peft wrap (uniform units) and use_orig_params with one dtype both flatten."""
    for sc in (_scenario(frozen_dtype="bf16", wrap="peft"), _scenario(use_orig_params=True)):
        assert simulate(sc).peak()["allocated_bytes"] > 0


# ---- item 5: use_orig_params with frozen weights ---------------------------------------------------
def _runtime(sc) -> FSDP1Runtime:
    rt = FSDP1Runtime(sc.workload, sc.units, sc.settings)
    rt.build()
    return rt


def test_use_orig_params_steps_only_the_trained_parameters_but_reduces_the_whole_flat_gradient():
    """`_use_sharded_grad_views`: "parameters with ``requires_grad=False`` have their gradients set to ``None``"
    (the optimizer skips them: states for the trained elements of the shard only), while `_reduce_grad`
    reduce-scatters `flat_param.grad`, the whole (padded) flat gradient; the sharded gradient stays whole."""
    sc = _scenario(use_orig_params=True)
    rt = _runtime(sc)
    block = sc.units[1]
    trained = sum(_numel(p.shape) for p in block.params if p.trainable)
    local = rt.local[block.name]
    shards = rt._optimizer_tensors(block.name)
    assert 0 < sum(shards) <= trained < local  # views of this rank's shard, trained ones only
    states = [b for b in rt.g.persistent if b.name == f"{block.name} adamw states"]
    assert states[0].nbytes == 2 * 4 * sum(shards)  # exp_avg, exp_avg_sq in fp32
    flat_grad = next(b for b in rt.g.buffers if b.name == f"{block.name} flat grad")
    assert flat_grad.nbytes == rt.flat_numel[block.name] * 2  # every parameter's gradient, in bf16
    rs = [op for op in rt.g.ops if op.kind == "reduce_scatter" and op.unit == block.name]
    assert rs and all(op.comm_bytes == local * 4 * 4 for op in rs)  # the padded flat gradient, reduced in fp32
    sharded = next(b for b in rt.g.buffers if b.name == f"{block.name} sharded grad")
    assert sharded.nbytes == local * 4


def test_use_orig_params_computes_the_frozen_weights_gradients():
    """In forward every parameter is a view of the flat parameter (`_use_unsharded_views`), which requires grad
    (`flat_param_requires_grad or tensor.requires_grad`): autograd computes each frozen Linear's weight
    gradient too, 2 x tokens x out x in FLOPs each, which the peft wrap (a frozen FlatParameter) skips."""
    base = _scenario(frozen_dtype="bf16", storage="bf16", wrap="peft", mixed_precision={"param_dtype": None})
    orig = _scenario(frozen_dtype="bf16", storage="bf16", use_orig_params=True, mixed_precision={"param_dtype": None})

    def backward_flops(sc):
        return sum(op.flops for op in _graph(sc).ops if op.kind == "compute" and op.name.endswith(" backward"))
    tokens = 16
    h, kv = MODEL["hidden"], MODEL["hidden"]
    ffn = next(p.shape[0] for p in base.workload.params if p.name == "layers.0.feed_forward.w1.weight")
    per_block = 2 * tokens * (4 * h * kv + 3 * h * ffn)  # wq, wk, wv, wo and w1, w2, w3's weight gradients
    # the first block's input needs no gradient under the peft wrap either way; its weights now do
    extra = backward_flops(orig) - backward_flops(base)
    assert extra >= MODEL["layers"] * per_block


# ---- item 6: peft's fsdp_auto_wrap_policy ---------------------------------------------------------------
def test_peft_wrap_makes_every_trained_leaf_its_own_unit():
    """peft's `lambda_policy_fn`: `len(list(module.named_children())) == 0 and getattr(module, "weight", None)
    is not None and module.weight.requires_grad`, or'd with the transformer-block policy: each adapter
    (lora_A, lora_B) a unit nested in its block's, the block's unit the frozen base, the root the rest."""
    sc = _scenario(frozen_dtype="bf16", wrap="peft")
    root, *blocks = sc.units
    assert [u.name for u in blocks] == ["layers.0", "layers.1", "layers.2"]
    for u in blocks:
        assert [v.name for v in u.nested] == [f"{u.name}.attention.{t}.lora_{ab}" for t in ("wq", "wv") for ab in "AB"]
        assert not any(p.trainable for p in u.params)
        assert all(p.trainable for v in u.nested for p in v.params)
    assert not any(p.trainable for p in root.params)


def test_peft_wrap_gathers_each_adapter_and_reduces_only_the_adapters():
    """Every adapter unit is all-gathered in forward, again in the checkpointed block's recompute (its handle
    is idle there: `_pre_forward` skips only a handle in BACKWARD_PRE) and in backward; a frozen
    FlatParameter has no AccumulateGrad hook (`_register_post_backward_hook`: `if already_registered or not
    flat_param.requires_grad: return`), so only the adapters are reduce-scattered."""
    sc = _scenario(frozen_dtype="bf16", wrap="peft", training={"micro_batch": 1, "seq_len": 16,
                                                               "activation_checkpointing": "full"})
    g = _graph(sc)
    adapter = "layers.1.attention.wq.lora_A"
    gathers = [op.phase for op in g.ops if op.kind == "all_gather" and op.unit == adapter]
    assert gathers.count("forward") == 1 and gathers.count("backward") == 2
    reduced = {op.unit for op in g.ops if op.kind == "reduce_scatter"}
    assert reduced == {v.name for u in sc.units for v in u.nested}
    assert not any(b.category in ("sharded_grads", "optimizer_states") and b.unit in ("root", "layers.1")
                   for b in g.persistent)


def test_peft_wrap_is_fsdp1s():
    with pytest.raises(ScenarioError, match=r"^fsdp\.wrap: peft is peft's fsdp_auto_wrap_policy"):
        parse_scenario(scenario_dict(MODEL, gpus_per_node=4, fsdp={"version": 2, "wrap": "peft"}))


# ---- item 7: bnb_4bit_quant_storage -------------------------------------------------------------------
def test_quant_storage_packs_the_same_bytes_in_another_dtype():
    """bitsandbytes' `quantize_4bit` (backends/cuda/ops.py): `out = torch.empty(((n + 1) //
    (quant_storage.itemsize * 2), 1), dtype=quant_storage)`: n / 4 bf16 elements hold the n / 2 bytes of
    codes; peft counts two weights per byte of a Params4bit either way."""
    assert packed_shape(4096 * 4096, "bf16") == (4096 * 4096 // 4, 1)
    assert packed_shape(4096 * 4096, "uint8") == (4096 * 4096 // 2, 1)
    u8 = _scenario(QLORA, frozen_dtype="bf16", storage="bf16", version=2)  # FSDP2 takes the uint8 base
    bf = _scenario(QLORA | {"quant_storage": "bf16"}, frozen_dtype="bf16", storage="bf16", wrap="peft",
                   mixed_precision={"param_dtype": None})
    assert trainable_counts(u8.workload) == trainable_counts(bf.workload)
    wq8, wq16 = (next(p for p in sc.workload.params if p.name == "layers.0.attention.wq.weight") for sc in (u8, bf))
    assert (wq16.dtype, _numel(wq16.shape) * 2) == ("bf16", _numel(wq8.shape))


@pytest.fixture(name="qlora")
def _qlora():
    return _scenario(QLORA | {"quant_storage": "bf16"}, frozen_dtype="bf16", storage="bf16", wrap="peft",
                     mixed_precision={"param_dtype": None})


def test_a_qlora_block_is_gathered_as_its_packed_bytes(qlora):
    """The block's FlatParameter is the packed bf16 codes and its bf16 norms: no cast (`_fwd_bwd_param_dtype`
    is the flat parameter's own without a MixedPrecision param_dtype), each rank gathers W-1 shards."""
    block = qlora.units[1]
    numel = sum(_numel(p.shape) for p in block.params if not p.name.endswith(".absmax"))
    local = -(-numel // 4)
    g = _graph(qlora)
    gathers = [op for op in g.ops if op.kind == "all_gather" and op.unit == block.name]
    assert gathers and all(op.comm_bytes == local * 4 * 2 for op in gathers)
    assert not any(op.name.startswith(f"{block.name} cast shard") for op in g.ops)


def test_the_4bit_scales_stay_whole_on_every_rank(qlora):
    """bitsandbytes' scales are `Linear4bit.quant_state` (`fix_4bit_weight_quant_state_from_module`: "the quant
    state got lost when the parameter got converted. This happens for example for fsdp"): not a parameter, so
    not flattened or sharded: every rank holds all of them, on the GPU even under CPUOffload."""
    plain = _scenario({"rank": 8, "alpha": 16, "targets": "all-linear"})  # the same Linears unquantized: every Linear of the blocks is quantized
    expected = sum(nf4_bytes(_numel(p.shape), True)[1] for p in plain.workload.params
                   if p.name.startswith("layers.") and len(p.shape) == 2 and ".lora_" not in p.name)
    for sc in (qlora, _scenario(QLORA | {"quant_storage": "bf16"}, frozen_dtype="bf16", storage="bf16", wrap="peft",
                                mixed_precision={"param_dtype": None}, cpu_offload=True)):
        held = [b for b in _graph(sc).persistent if b.category == "buffers"]
        assert sum(b.nbytes for b in held) == expected  # whole, not / W


# ---- item 8: pre-backward unshard only for outputs that require grad ----------------------------------
def test_a_frozen_prefix_is_not_gathered_in_backward():
    """`_register_pre_backward_hooks`: `if t.requires_grad: ... handle._needs_pre_backward_unshard = True`, and
    `_get_handle_to_prefetch` takes a target only if `target_handle_candidate._needs_pre_backward_unshard`:
    a block whose output needs no gradient (the frozen prefix) is never all-gathered in backward."""
    for prefetch in ("BACKWARD_PRE", "BACKWARD_POST", "none"):
        sc = _scenario(None, model={"frozen": ["tok_embeddings", "layers.0", "norm", "output"]},
                       backward_prefetch=prefetch)
        g = _graph(sc)
        assert [op.phase for op in g.ops if op.kind == "all_gather" and op.unit == "layers.0"] == ["forward"]
        assert [op.phase for op in g.ops if op.kind == "all_gather" and op.unit == "layers.1"] == ["forward", "backward"]


# ---- item 9: FullyShardedDataParallel's mixed_precision=None ------------------------------------------
def test_mixed_precision_none_runs_in_the_flat_parameters_dtype():
    """`_init_param_dtype`: `self._fwd_bwd_param_dtype = mp_param_dtype or self._orig_param_dtype`,
    `self._reduce_dtype = mp_reduce_dtype or self._orig_param_dtype`: `param_dtype: null` gathers, computes and
    reduces in the storage dtype, with no `_mp_shard` cast. fsdp-sim's default is bf16 (documented in
    fsdp1_scenario.py): torch's default is written `mixed_precision: {param_dtype: null}`."""
    sc = parse_scenario(scenario_dict(MODEL, gpus_per_node=4, fsdp={"version": 1, "mixed_precision": {"param_dtype": None}}))
    assert (sc.settings.param_dtype, sc.settings.reduce_dtype) == ("fp32", "fp32")
    g = _graph(sc)
    assert not any(" cast shard " in op.name for op in g.ops)
    unit = sc.units[1]
    numel = sum(_numel(p.shape) for p in unit.params)
    assert next(op for op in g.ops if op.kind == "all_gather" and op.unit == unit.name).comm_bytes == -(-numel // 4) * 4 * 4
    default = parse_scenario(scenario_dict(MODEL, gpus_per_node=4, fsdp={"version": 1}))
    assert default.settings.param_dtype == "bf16"  # where fsdp-sim's default differs from FSDP1's


# ---- every combination leaks nothing ---------------------------------------------------------------------
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fsdp1_with_frozen_weights_allocates_and_frees_each_buffer_once(data):
    """Over the wraps and FSDP1's options with LoRA, QLoRA or a frozen prefix: every transient buffer is
    allocated once and freed once, after its allocation, and the step ends with its persistent state."""
    wrap, orig = data.draw(st.sampled_from([("peft", False), ("transformer_auto_wrap_policy", True), ("peft", True)]))
    adaptation = data.draw(st.sampled_from(["lora", "qlora", "prefix"]))
    fsdp = {"wrap": wrap, "use_orig_params": orig,
            "sharding_strategy": data.draw(st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])),
            "backward_prefetch": data.draw(st.sampled_from(["BACKWARD_PRE", "BACKWARD_POST", "none"])),
            "forward_prefetch": data.draw(st.booleans()), "limit_all_gathers": data.draw(st.booleans()),
            "no_sync": data.draw(st.booleans()),
            "mixed_precision": {"param_dtype": None} if adaptation == "qlora" else {"param_dtype": "bf16"}}
    if fsdp["sharding_strategy"] != "NO_SHARD" and data.draw(st.booleans()):
        fsdp["cpu_offload"] = True
    training = {"micro_batch": 1, "seq_len": 16, "grad_accumulation": data.draw(st.integers(1, 2)),
                "activation_checkpointing": data.draw(st.sampled_from(["none", "full"]))}
    lora = {"lora": LORA | {"dropout": data.draw(st.sampled_from([0.0, 0.1]))}} if adaptation == "lora" else \
        {"lora": QLORA | {"quant_storage": "bf16"}} if adaptation == "qlora" else {}
    model = {"frozen": ["tok_embeddings", "layers.0"]} if adaptation == "prefix" else {}
    store = "bf16" if adaptation == "qlora" else "fp32"
    frozen = {"frozen_dtype": store}
    if adaptation == "prefix" and not orig and wrap != "peft":
        model["frozen"] += ["norm", "output"]  # the root frozen whole: uniform without use_orig_params
    sc = _scenario(lora.get("lora"), frozen_dtype=store, storage=store, training=training,
                   model=model | (frozen if adaptation == "prefix" else {}), **fsdp)
    g = _graph(sc)
    persistent = {b.id for b in g.persistent}
    allocs = Counter(op.buffer.id for op in g.ops if op.kind == "alloc")
    frees = Counter(op.buffer.id for op in g.ops if op.kind == "free")
    first = {}
    for op in g.ops:
        if op.kind == "alloc":
            first[op.buffer.id] = op.id
        elif op.kind == "free" and op.buffer.id not in persistent:
            assert first.get(op.buffer.id, -1) < op.id, op.name
    for buf in g.buffers:
        assert (allocs[buf.id], frees[buf.id]) == ((0, 0) if buf.id in persistent else (1, 1)), buf.name
    r = simulate(sc)
    assert r.memory.total[-1] == sum(b.nbytes for b in g.persistent)
