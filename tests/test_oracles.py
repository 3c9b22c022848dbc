"""Oracles from outside the code: the ZeRO paper's model-state formulas, Korthikanti et al.'s activation
formula, the serial step time, and monotonicity of per-rank state in the world size.

Each expected number is computed here from a published formula or from the op list's own prices,
never from the simulator's results.
"""

from __future__ import annotations

import pytest
from conftest import model_dicts, padded_shard_numel, run, scenario_dict
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.engine import play
from fsdp_sim.hardware.costs import OpCosts
from fsdp_sim.schedule.ops import CATEGORIES, TIMED_KINDS
from fsdp_sim.workload.transformer import TransformerDims, block_activations

# hidden 64, ffn 256, vocab 512: every parameter's dim 0 is divisible by 2..16, so no dim-0 padding
UNPADDED = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 512, "mlp": "gelu"}
CAT = {c: i for i, c in enumerate(CATEGORIES)}


def zero_model_state_bytes(psi: float, n: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per device, Rajbhandari et al. 2020 (ZeRO), Sec. 5 / Table 1.

    Mixed-precision Adam keeps 2 bytes of fp16 params, 2 of fp16 grads and K = 12 of optimizer state
    (fp32 master params, momentum, variance) per parameter. Stage 0 (DP): (2+2+K)Psi; stage 1 (P_os):
    4Psi + K Psi/N; stage 2 (P_os+g): 2Psi + (2+K)Psi/N; stage 3 (P_os+g+p): (2+2+K)Psi/N.
    FSDP with fp32 sharded params as the master copy stores 4 (params) + 4 (fp32 grads) + 8 (AdamW
    exp_avg, exp_avg_sq) = 16 bytes per parameter, the same total as 2 + 2 + K.
    """
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n, 3: (4 + k) * psi / n}[stage]


def test_zero_formula_reproduces_table_1():
    """Table 1 of the ZeRO paper, Psi = 7.5B, N = 64 (GB = 1e9 B): 120, 31.4, 16.6, 1.88."""
    psi, n = 7.5e9, 64
    assert zero_model_state_bytes(psi, n, 0) == 120e9
    assert round(zero_model_state_bytes(psi, n, 1) / 1e9, 1) == 31.4
    assert round(zero_model_state_bytes(psi, n, 2) / 1e9, 1) == 16.6
    assert zero_model_state_bytes(psi, n, 3) == 1.875e9


def _world(n: int) -> dict:
    return {"nodes": 2, "gpus_per_node": n // 2} if n > 8 else {"nodes": 1, "gpus_per_node": n}


def _model_state_at_optimizer_step(result) -> dict[str, int]:
    """Sharded params and optimizer states (persistent) + sharded grads alive when the optimizer starts."""
    state = {"sharded_params": 0, "optimizer_states": 0}
    for b in result.memory.persistent:
        state[b.category] += b.nbytes
    row = next(i + 1 for i, (op, _, _) in enumerate(result.memory.events) if op.phase == "optimizer")
    state["sharded_grads"] = int(result.memory.levels[row, CAT["sharded_grads"]])
    return state


def _row_at_end_of_forward(result) -> int:
    return max(i + 1 for i, (op, _, _) in enumerate(result.memory.events) if op.phase == "forward")


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_full_shard_model_state_is_zero_stage_3(n):
    """FULL_SHARD + AdamW: 4 + 4 + 8 bytes per parameter, divided by N, exactly (no padding)."""
    sc, r = run(scenario_dict(UNPADDED, **_world(n), fsdp={"sharding_strategy": "FULL_SHARD"}))
    psi = sc.workload.numel
    state = _model_state_at_optimizer_step(r)
    assert state == {"sharded_params": 4 * psi // n, "optimizer_states": 8 * psi // n, "sharded_grads": 4 * psi // n}
    assert sum(state.values()) == zero_model_state_bytes(psi, n, 3)


def test_no_shard_model_state_is_data_parallel_baseline():
    """NO_SHARD (shard size 1, 8 replicas): every rank holds 16 Psi, the ZeRO baseline."""
    sc, r = run(scenario_dict(UNPADDED, gpus_per_node=8, fsdp={"sharding_strategy": "NO_SHARD"}))
    psi = sc.workload.numel
    assert (sc.settings.shard_size, sc.settings.replicate_size) == (1, 8)
    assert sum(_model_state_at_optimizer_step(r).values()) == zero_model_state_bytes(psi, 8, 0)


@pytest.mark.parametrize("n", [2, 8, 16])
def test_shard_grad_op_keeps_unsharded_params_from_forward_to_backward(n):
    """SHARD_GRAD_OP: the same 16 Psi/N at the optimizer step, but after forward every unit's bf16
    unsharded params (2 bytes x padded numel) are still alive, as ZeRO-2's replicated 2 Psi. FULL_SHARD
    at the same point keeps only the root's (never resharded after forward)."""
    sc, r = run(scenario_dict(UNPADDED, **_world(n), fsdp={"sharding_strategy": "SHARD_GRAD_OP"}))
    psi = sc.workload.numel
    assert sum(_model_state_at_optimizer_step(r).values()) == zero_model_state_bytes(psi, n, 3)
    row = _row_at_end_of_forward(r)
    live = {b.name: b.nbytes for b in r.memory.live_at(row) if b.category == "unsharded_params"}
    padded = {u.name: n * sum(padded_shard_numel(p.shape, n) for p in u.params) for u in sc.units}
    assert live == {f"{u.name} unsharded params": 2 * padded[u.name] for u in sc.units}
    assert r.memory.levels[row, CAT["unsharded_params"]] == 2 * psi  # no padding: ZeRO-2's 2 Psi

    sc, r = run(scenario_dict(UNPADDED, **_world(n), fsdp={"sharding_strategy": "FULL_SHARD"}))
    assert r.memory.levels[_row_at_end_of_forward(r), CAT["unsharded_params"]] == 2 * sc.units[0].numel


def test_no_shard_allocates_no_all_gather_buffers():
    """With a shard group of one rank FSDPParamGroup.unshard returns before foreach_all_gather and
    wait_for_unshard copies each shard straight into the parameter storage (torch 2.13
    _fsdp_param_group.py, `if world_size == 1`; docs/fsdp2-runtime.md section 1.3): no all-gather
    output buffer ever exists."""
    _, r = run(scenario_dict(UNPADDED, gpus_per_node=8, fsdp={"sharding_strategy": "NO_SHARD"}))
    assert r.memory.levels[:, CAT["all_gather_buffers"]].max() == 0


# ---- activations: Korthikanti et al. 2022 ---------------------------------------------------------
def korthikanti_layer_bytes(s: int, b: int, h: int, a: int) -> int:
    """Per-layer activation bytes, Korthikanti et al. 2022 eq. (1) without parallelism: sbh(34 + 5as/h),
    with 2-byte activations, 1-byte dropout masks, eager attention, a 4h GELU MLP. Plus 16 bs: the
    fp32 mean and rstd LayerNorm saves (2 norms x 2 tensors x 4 bytes per token), which the paper omits."""
    return 34 * s * b * h + 5 * a * s * s * b + 16 * b * s


KORTHIKANTI = {"attention": "eager", "dropout": True, "mlp": "gelu", "norm": "layernorm"}


@pytest.mark.parametrize("b,s,h,a", [(1, 8, 16, 1), (2, 128, 64, 4), (4, 512, 256, 8), (1, 2048, 4096, 32), (3, 100, 96, 12)])
def test_block_activations_match_korthikanti(b, s, h, a):
    d = TransformerDims(hidden=h, layers=1, heads=a, vocab=100, **KORTHIKANTI)
    assert block_activations(d, b, s, 2).saved + 2 * s * b * h == korthikanti_layer_bytes(s, b, h, a)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("b,s,layers", [(1, 64, 2), (2, 128, 4)])
def test_activations_after_forward(ac, b, s, layers):
    """Activations alive at the end of forward = per layer Korthikanti's sbh(34 + 5as/h) + 16bs without
    checkpointing, or only the layer input 2sbh with full AC, plus the non-block modules: the last
    block's output (the final norm's input), the norm's statistics and output, the loss's fp32
    log-softmax and loss value. The embedding output is layer 0's input. bf16 activations."""
    h, a = 64, 4
    model = {"hidden": h, "layers": layers, "heads": a, "vocab": 500, **KORTHIKANTI}
    sc, r = run(scenario_dict(model, gpus_per_node=4, training={"micro_batch": b, "seq_len": s, "activation_checkpointing": ac}))
    mods = {m.name: m for m in sc.workload.modules}
    extras = (mods[f"layers.{layers - 1}"].output_bytes + mods["norm"].saved_bytes + mods["norm"].output_bytes
              + mods["loss"].saved_bytes + mods["loss"].output_bytes)
    per_layer = korthikanti_layer_bytes(s, b, h, a) if ac == "none" else 2 * s * b * h
    row = _row_at_end_of_forward(r)
    assert r.memory.levels[row, CAT["activations"]] == layers * per_layer + extras
    assert r.memory.levels[row, CAT["temporaries"]] == 0


# ---- serial step time ----------------------------------------------------------------------------
@pytest.mark.parametrize("gpn,param,reduce,ac", [(2, "bf16", "fp32", "none"), (8, "bf16", "bf16", "full"),
                                                  (4, "fp32", "fp32", "none"), (8, "fp32", "bf16", "full")])
def test_single_unit_without_prefetch_is_fully_serial(gpn, param, reduce, ac):
    """One unit (whole_model), no backward prefetch, one node: nothing can overlap, so the step time is
    the sum of every compute, copy and collective duration, priced independently with OpCosts."""
    data = scenario_dict({**UNPADDED, "vocab": 1000, "layers": 3}, gpus_per_node=gpn,
                         fsdp={"wrap": "whole_model", "backward_prefetch": False,
                               "mixed_precision": {"param_dtype": param, "reduce_dtype": reduce}},
                         training={"micro_batch": 2, "seq_len": 64, "activation_checkpointing": ac})
    sc, r = run(data)
    assert len(sc.units) == 1
    s = sc.settings
    costs = OpCosts(sc.cluster, shard_size=s.shard_size, replicate_size=s.replicate_size, compute_dtype=s.param_dtype)
    kinds = {op.kind for op in r.graph.ops}
    assert {"compute", "copy", "all_gather", "reduce_scatter"} <= kinds
    serial = sum(costs.duration(op) for op in r.graph.ops if op.kind in TIMED_KINDS)
    # played without the CPU issue thread's launch costs the chain is exactly serial (and nothing overlaps,
    # so nothing is slowed); with them the step can only be longer
    assert play(r.graph.ops, costs.duration, slowdowns=costs.slowdowns).makespan == pytest.approx(serial, rel=1e-9)
    assert r.step_time_s >= serial * (1 - 1e-9)


# ---- monotonicity in the world size --------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(model_dicts(), st.integers(1, 15), st.integers(1, 16), st.sampled_from(["per_block", "every_k_blocks", "whole_model"]),
       st.sampled_from(["adamw", "sgd"]))
def test_more_ranks_never_raise_per_rank_persistent_memory(model, w1, dw, wrap, optimizer):
    """FULL_SHARD: each parameter's shard is ceil(dim0/W) rows, non-increasing in W, so per-rank
    persistent bytes (sharded params + optimizer states) never grow when the world grows."""
    def persistent(w):
        data = scenario_dict(model, gpus_per_node=w, fsdp={"wrap": wrap, "sharding_strategy": "FULL_SHARD"},
                             training={"micro_batch": 1, "seq_len": 8, "optimizer": optimizer})
        _, r = run(data)
        return sum(b.nbytes for b in r.graph.persistent)
    w2 = w1 + dw
    assert persistent(w2) <= persistent(w1)
