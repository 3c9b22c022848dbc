"""FSDP2's setters as scenario keys (issue #7, section 2): each knob's closed form where one exists, and the
direction it moves memory or time.

- `reshard_after_forward: k` (ZeRO++ hpZ): after forward each unit keeps 1/k of its padded unsharded
  parameters (`FSDPParam.to_sharded_post_forward`); backward all-gathers them inside the post-forward
  group of k ranks (`_get_post_forward_mesh_info`), a process group of its own.
- `forward_prefetch: k` / `backward_prefetch: k`: `set_modules_to_forward_prefetch` with the next k units,
  `set_modules_to_backward_prefetch` with the k before (post-forward order).
- FSDP1 strategy names are meshes with a default; any explicit `reshard_after_forward` is taken.
- `root_reshard_after_forward: true`: the root is resharded after forward (only None keeps it).
- `MixedPrecisionPolicy` as PyTorch defaults it (no reduce_dtype: the compute dtype), `output_dtype`,
  `cast_forward_inputs`.
- `requires_all_reduce: false` (HSDP) and `reshard_after_backward: false` in gradient accumulation.
- `wrap: torchtitan`: embedding, blocks, [norm, output] not resharded, the root.
"""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import run, scenario_dict, scenario_dicts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.collectives import ProcessGroup, collective_time
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.fsdp2 import build_fsdp2_step
from fsdp_sim.schedule.ops import CATEGORIES
from fsdp_sim.simulate import op_costs

MODEL = {"hidden": 64, "layers": 6, "heads": 4, "vocab": 512}
BF16 = {"param_dtype": "bf16", "reduce_dtype": "fp32"}


def _scenario(fsdp: dict | None = None, *, nodes: int = 1, gpus_per_node: int = 8, training: dict | None = None,
              model: dict | None = None):
    fsdp = {"mixed_precision": dict(BF16)} | (fsdp or {})
    return parse_scenario(scenario_dict(model or MODEL, nodes=nodes, gpus_per_node=gpus_per_node, fsdp=fsdp,
                                        training=training))


def _graph(sc):
    return build_fsdp2_step(sc.workload, sc.units, sc.settings)


def _unsharded_bytes(sc, unit) -> int:
    """Padded unsharded bytes of a unit in param_dtype: W x its padded shard."""
    s = sc.settings
    return unit.shard_numel(s.shard_size) * s.shard_size * s.param_bytes


def _level(result, row: int, category: str) -> int:
    return int(result.memory.levels[row][CATEGORIES.index(category)])


def _row_after(result, predicate) -> int:
    """The ledger row right after the first memory event whose op satisfies `predicate`."""
    return next(i + 1 for i, (op, _, _) in enumerate(result.memory.events) if predicate(op))


def _level_at_op(result, predicate, category: str) -> int:
    """A category's level when the first op satisfying `predicate` is issued (after every earlier event)."""
    ops = result.graph.ops
    first = next(op.id for op in ops if predicate(op))
    rows = [i + 1 for i, (op, _, _) in enumerate(result.memory.events) if op.id < first]
    return _level(result, rows[-1] if rows else 0, category)


# ---- reshard_after_forward: k (hpZ) ------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 4])
def test_hpz_keeps_one_kth_of_each_units_unsharded_parameters_after_forward(k):
    sc, r = run(scenario_dict(MODEL, fsdp={"reshard_after_forward": k, "mixed_precision": BF16}))
    inner = [u for u in sc.units if not u.is_root]
    kept = Counter()
    for buf in r.graph.buffers:
        if "resharded to" in buf.name:
            kept[buf.unit] += buf.nbytes
    assert kept == {u.name: _unsharded_bytes(sc, u) // k for u in inner}
    # at the end of forward: every inner unit's 1/k copy, and the root's parameters (never resharded)
    end_of_forward = max(i + 1 for i, (op, _, _) in enumerate(r.memory.events) if op.phase == "forward" and op.unit)
    root = sc.units[0]
    assert _level(r, end_of_forward, "unsharded_params") == _unsharded_bytes(sc, root) + sum(
        _unsharded_bytes(sc, u) // k for u in inner)
    # and each copy dies at its unit's backward copy-out
    assert all(op.phase == "backward" for op in r.graph.ops if op.kind == "free" and "resharded to" in op.name)


def test_hpz_backward_all_gathers_run_in_the_post_forward_group_of_k():
    k = 4
    sc = _scenario({"reshard_after_forward": k}, nodes=2)  # W = 16 over two nodes, groups of 4 in a node
    ops = _graph(sc).ops
    inner = {u.name: u for u in sc.units if not u.is_root}
    forward = [op for op in ops if op.kind == "all_gather" and op.phase == "forward" and op.unit in inner]
    backward = [op for op in ops if op.kind == "all_gather" and op.phase == "backward"]
    assert {op.group for op in forward} == {"shard"}
    assert {op.group for op in backward} == {f"post_forward_{k}"} and len(backward) == len(inner)
    costs = op_costs(sc)
    group = costs.groups[f"post_forward_{k}"]
    assert (group.ranks, group.nodes) == (k, 1)
    for op in backward:  # the output is the full padded unsharded size; the input (copy-in) 1/k of it
        unsharded = _unsharded_bytes(sc, inner[op.unit])
        assert op.comm_bytes == unsharded
        temp = next(o for o in ops if o.kind == "alloc" and o.unit == op.unit and o.id < op.id
                    and o.phase == "backward" and o.name.endswith("copy-in cast"))
        assert temp.buffer.nbytes == unsharded // k
        # the time is the collective's over its own group's links
        assert costs.duration(op) == collective_time("all_gather", op.comm_bytes, ProcessGroup(k, 1), costs.fabric)


def test_hpz_backward_all_gather_inside_a_node_is_faster_than_across_nodes():
    """Two nodes behind one 100 Gb/s NIC each: hpZ's backward all-gathers stay on NVLink, and in backward
    (where they are exposed on this network) the step gains what they save."""
    slow = {"nics_per_node": 1, "nic_gbps": 100}
    model = {"hidden": 1024, "layers": 4, "heads": 8, "vocab": 4096}
    training = {"micro_batch": 1, "seq_len": 512}
    full_data = scenario_dict(model, nodes=2, training=training, fsdp={"mixed_precision": BF16})
    hpz_data = scenario_dict(model, nodes=2, training=training,
                             fsdp={"reshard_after_forward": 8, "mixed_precision": BF16})
    for data in (full_data, hpz_data):
        data["hardware"]["network"] = slow
    (full, rf), (hpz, rh) = run(full_data), run(hpz_data)

    def backward_all_gather_s(sc, r):
        return sum(r.timing.end[op.id] - r.timing.start[op.id] for op in r.graph.ops
                   if op.kind == "all_gather" and op.phase == "backward")

    saved = backward_all_gather_s(full, rf) - backward_all_gather_s(hpz, rh)
    assert backward_all_gather_s(hpz, rh) < 0.5 * backward_all_gather_s(full, rf)
    assert rf.step_time_s - rh.step_time_s > 0.5 * saved


def test_hpz_memory_lies_between_reshard_true_and_false():
    peaks = {raf: run(scenario_dict(MODEL, fsdp={"reshard_after_forward": raf, "mixed_precision": BF16}))[1]
             .peak()["allocated_bytes"] for raf in (True, 4, 2, False)}
    assert peaks[True] < peaks[4] < peaks[2] < peaks[False]


@pytest.mark.parametrize("value, expected", [(1, False), (8, True), (2, 2), (4, 4)])
def test_hpz_group_size_is_normalised_as_get_post_forward_mesh_info_does(value, expected):
    """1 is no resharding (torch warns), the shard group's size is True, a divisor between is hpZ."""
    raf = _scenario({"reshard_after_forward": value}).settings.reshard_after_forward
    assert raf == expected and type(raf) is type(expected)


@pytest.mark.parametrize("value", [3, 16, 0, -2, "two"])
def test_hpz_group_size_must_divide_the_shard_group(value):
    with pytest.raises(ScenarioError, match="reshard_after_forward"):
        _scenario({"reshard_after_forward": value})


# ---- explicit prefetch depth ----------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_forward_prefetch_depth_k_keeps_k_all_gathers_ahead(depth):
    """During layers.1's forward compute: its own output (freed at the next copy-out) plus the k prefetched."""
    sc, r = run(scenario_dict(MODEL, fsdp={"forward_prefetch": depth, "mixed_precision": BF16}))
    block = _unsharded_bytes(sc, sc.units[1])
    live = _level_at_op(r, lambda op: op.kind == "compute" and op.unit == "layers.1" and op.phase == "forward",
                        "all_gather_buffers")
    assert live == (1 + depth) * block
    ops = r.graph.ops
    if depth:  # the prefetched all-gather is issued before the prefetching unit's compute
        ag = next(op.id for op in ops if op.kind == "all_gather" and op.unit == f"layers.{1 + depth}")
        compute = next(op.id for op in ops if op.kind == "compute" and op.unit == "layers.1")
        assert ag < compute


@pytest.mark.parametrize("depth", [False, True, 2, 3])
def test_backward_prefetch_depth_k_all_gathers_the_k_units_before(depth):
    """During layers.4's gradient kernels: the k prefetched all-gather outputs (its own is copied out)."""
    sc, r = run(scenario_dict(MODEL, fsdp={"backward_prefetch": depth, "mixed_precision": BF16}))
    block = _unsharded_bytes(sc, sc.units[1])
    live = _level_at_op(r, lambda op: op.kind == "compute" and op.unit == "layers.4" and op.phase == "backward",
                        "all_gather_buffers")
    assert live == int(depth) * block


def test_prefetch_depth_costs_memory_and_never_time():
    base = run(scenario_dict(MODEL, fsdp={"mixed_precision": BF16}))[1]
    deep = run(scenario_dict(MODEL, fsdp={"forward_prefetch": 3, "backward_prefetch": 3, "mixed_precision": BF16}))[1]
    assert deep.peak()["allocated_bytes"] > base.peak()["allocated_bytes"]
    assert deep.step_time_s <= base.step_time_s * 1.001


@pytest.mark.parametrize("key, value", [("forward_prefetch", -1), ("backward_prefetch", "two"),
                                        ("forward_prefetch", 1.5)])
def test_prefetch_depth_is_checked(key, value):
    with pytest.raises(ScenarioError, match=key):
        _scenario({key: value})


# ---- FSDP1 strategy names are meshes with a default -------------------------------------------------
@pytest.mark.parametrize("strategy", [None, "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
@pytest.mark.parametrize("reshard", [True, False])
def test_an_explicit_reshard_after_forward_is_taken_on_any_strategy(strategy, reshard):
    fsdp = {"reshard_after_forward": reshard} | ({"sharding_strategy": strategy} if strategy else {})
    sc = _scenario(fsdp, nodes=2)
    assert sc.settings.reshard_after_forward is reshard
    backward = [op for op in _graph(sc).ops if op.kind == "all_gather" and op.phase == "backward"]
    assert bool(backward) is reshard


def test_a_strategy_with_the_other_reshard_is_the_matching_strategy():
    """SHARD_GRAD_OP with reshard true is FULL_SHARD; FULL_SHARD with reshard false is SHARD_GRAD_OP."""
    def peak(fsdp):
        return run(scenario_dict(MODEL, fsdp=fsdp | {"mixed_precision": BF16}))[1].peak()["allocated_bytes"]
    assert peak({"sharding_strategy": "SHARD_GRAD_OP", "reshard_after_forward": True}) == \
        peak({"sharding_strategy": "FULL_SHARD"})
    assert peak({"sharding_strategy": "FULL_SHARD", "reshard_after_forward": False}) == \
        peak({"sharding_strategy": "SHARD_GRAD_OP"})


# ---- the root's reshard_after_forward ---------------------------------------------------------------
@pytest.mark.parametrize("root, all_gathers", [(None, 1), (False, 1), (True, 2)])
def test_the_root_is_resharded_after_forward_only_when_told(root, all_gathers):
    fsdp = {} if root is None else {"root_reshard_after_forward": root}
    sc, r = run(scenario_dict(MODEL, fsdp=fsdp | {"mixed_precision": BF16}))
    ops = r.graph.ops
    assert sum(op.kind == "all_gather" and op.unit == "root" for op in ops) == all_gathers
    root_bytes = _unsharded_bytes(sc, sc.units[0])
    # the root's parameters when backward begins (its pre-backward, first thing of backward)
    first_backward = next(op.id for op in ops if op.phase == "backward")
    rows = [i + 1 for i, (op, _, _) in enumerate(r.memory.events) if op.id < first_backward]
    kept = _level(r, rows[-1], "unsharded_params")
    assert kept == (0 if root else root_bytes)


def test_a_resharded_root_costs_an_exposed_all_gather_and_saves_its_parameters():
    keep = run(scenario_dict(MODEL, fsdp={"mixed_precision": BF16}))[1]
    free = run(scenario_dict(MODEL, fsdp={"root_reshard_after_forward": True, "mixed_precision": BF16}))[1]
    assert free.step_time_s > keep.step_time_s
    assert free.peak()["allocated_bytes"] <= keep.peak()["allocated_bytes"]


# ---- MixedPrecisionPolicy -----------------------------------------------------------------------------
def test_reduce_dtype_unset_reduces_in_the_compute_dtype():
    sc = parse_scenario(scenario_dict(MODEL, fsdp={"mixed_precision": {"param_dtype": "bf16"}}))
    assert sc.settings.reduce_dtype == "bf16"
    ops = _graph(sc).ops
    for u in sc.units:
        rs_in = next(op for op in ops if op.kind == "alloc" and op.unit == u.name and op.name.endswith("reduce-scatter input"))
        assert rs_in.buffer.nbytes == u.shard_numel(8) * 8 * 2  # W x S x bf16
    assert parse_scenario(scenario_dict(MODEL, fsdp={"mixed_precision": {"param_dtype": "fp32"}})).settings.reduce_dtype == "fp32"


def test_fp32_head_output_makes_the_loss_upcast_a_no_op():
    """output_dtype on the unit that holds the head: the logits are cast once in its post-forward, and the
    loss's `.float()` copy (its forward temporary) is not made."""
    base, rb = run(scenario_dict(MODEL, fsdp={"mixed_precision": BF16}))
    head, rh = run(scenario_dict(MODEL, fsdp={"mixed_precision": BF16 | {"output_dtype": {"output": "fp32"}}}))
    logits = next(m for m in head.workload.modules if m.name == "output").output_bytes  # bf16
    casts = [b for b in rh.graph.buffers if b.name == "output output in fp32"]
    assert [b.nbytes for b in casts] == [2 * logits]
    assert any(b.name == "loss forward temporaries" for b in rb.graph.buffers)
    assert not any(b.name == "loss forward temporaries" for b in rh.graph.buffers)
    assert rh.peak()["allocated_bytes"] <= rb.peak()["allocated_bytes"]


@pytest.mark.parametrize("cast_forward_inputs", [True, False])
def test_an_output_dtype_on_every_unit_is_cast_back_at_the_next_units_input(cast_forward_inputs):
    mp = BF16 | {"output_dtype": "fp32", "cast_forward_inputs": cast_forward_inputs}
    _, r = run(scenario_dict(MODEL, fsdp={"mixed_precision": mp}))
    to_fp32 = [b for b in r.graph.buffers if b.name.endswith("output in fp32")]
    to_bf16 = [b for b in r.graph.buffers if b.name.endswith("output in bf16")]
    # every block's output goes to fp32; the next block casts it back (layers.0's input is the
    # embedding's output, inside the root, which casts only at the model's output: the logits)
    assert len(to_fp32) == MODEL["layers"] + 1
    assert len(to_bf16) == (MODEL["layers"] - 1 if cast_forward_inputs else 0)


def test_output_dtype_names_a_module_of_the_model():
    with pytest.raises(ScenarioError, match="output_dtype.lm_head"):
        _scenario({"mixed_precision": BF16 | {"output_dtype": {"lm_head": "fp32"}}})


# ---- gradient accumulation setters ---------------------------------------------------------------------
def test_hsdp_without_all_reduce_all_reduces_once_and_keeps_a_partial_output():
    n = 3
    sc = _scenario({"sharding_strategy": "HYBRID_SHARD", "requires_all_reduce": False}, nodes=2,
                   training={"micro_batch": 1, "seq_len": 16, "grad_accumulation": n})
    ops = _graph(sc).ops
    units = [u for u in sc.units if u.params]
    rs = [op for op in ops if op.kind == "reduce_scatter"]
    ar = [op for op in ops if op.kind == "all_reduce" and "clip_grad_norm_" not in op.name]
    assert len(rs) == n * len(units)
    assert len(ar) == len(units) and all(op.phase == f"backward #{n}" for op in ar)
    partial = {op.buffer.id: op for op in ops if op.kind == "alloc" and op.name.endswith("partial reduce output")}
    assert len(partial) == len(units) and all(op.phase == "backward #1" for op in partial.values())
    for op in partial.values():
        unit = next(u for u in units if u.name == op.unit)
        assert op.buffer.nbytes == unit.shard_numel(sc.settings.shard_size) * 4  # S x fp32 (reduce dtype)
    frees = [op for op in ops if op.kind == "free" and op.buffer.id in partial]
    assert len(frees) == len(units) and all(op.phase == f"backward #{n}" for op in frees)
    adds = [op for op in ops if op.name.endswith("accumulate partial reduce output")]
    assert len(adds) == (n - 2) * len(units)


def test_hsdp_without_all_reduce_moves_fewer_bytes_between_replicas():
    # without clip_grad_norm_'s all-reduce of the norm (4 bytes each step, however many micro-batches)
    training = {"micro_batch": 1, "seq_len": 16, "grad_accumulation": 4, "max_norm": None}
    base = run(scenario_dict(MODEL, nodes=2, training=training,
                             fsdp={"sharding_strategy": "HYBRID_SHARD", "mixed_precision": BF16}))[1]
    fewer = run(scenario_dict(MODEL, nodes=2, training=training,
                              fsdp={"sharding_strategy": "HYBRID_SHARD", "requires_all_reduce": False,
                                    "mixed_precision": BF16}))[1]
    assert fewer.communication()["all_reduce_bytes"] == pytest.approx(base.communication()["all_reduce_bytes"] / 4)
    assert fewer.step_time_s <= base.step_time_s


def test_no_reshard_after_backward_skips_the_next_forward_all_gathers():
    n = 2
    training = {"micro_batch": 1, "seq_len": 16, "grad_accumulation": n}
    sc, r = run(scenario_dict(MODEL, training=training,
                              fsdp={"reshard_after_backward": False, "mixed_precision": BF16}))
    ops = r.graph.ops
    inner = [u for u in sc.units if not u.is_root]
    assert not [op for op in ops if op.kind == "all_gather" and op.phase == "forward #2"]
    for u in inner:  # forward #1, then every backward
        assert sum(op.kind == "all_gather" and op.unit == u.name for op in ops) == 1 + n
    # when the second forward begins, every unit's parameters are still unsharded
    row = _row_after(r, lambda op: op.phase == "forward #2")
    assert _level(r, row, "unsharded_params") == sum(_unsharded_bytes(sc, u) for u in sc.units)
    base = run(scenario_dict(MODEL, training=training, fsdp={"mixed_precision": BF16}))[1]
    assert r.peak()["allocated_bytes"] > base.peak()["allocated_bytes"]


# ---- wrap: torchtitan ---------------------------------------------------------------------------------
def test_torchtitan_wrap_is_embedding_blocks_norm_and_head_then_an_empty_root():
    sc = _scenario({"wrap": "torchtitan"})
    names = [u.name for u in sc.units]
    assert names == ["root", "tok_embeddings", *[f"layers.{i}" for i in range(MODEL["layers"])], "norm..output"]
    assert sc.units[0].params == ()
    head = sc.units[-1]
    assert head.modules == ("norm", "output") and head.reshard_after_forward is False
    ops = _graph(sc).ops
    assert sum(op.kind == "all_gather" and op.unit == head.name for op in ops) == 1  # kept for backward
    assert sum(op.kind == "all_gather" and op.unit == "tok_embeddings" for op in ops) == 2
    assert not [op for op in ops if op.unit == "root" and op.kind in ("all_gather", "reduce_scatter")]


def test_torchtitan_wrap_with_tied_weights_groups_the_embedding_with_the_head():
    sc = _scenario({"wrap": "torchtitan"}, model=MODEL | {"tie_embeddings": True})
    head = sc.units[1]
    assert head.modules == ("tok_embeddings", "norm", "output") and head.reshard_after_forward is False
    assert [u.name for u in sc.units[2:]] == [f"layers.{i}" for i in range(MODEL["layers"])]
    run(scenario_dict(MODEL | {"tie_embeddings": True}, fsdp={"wrap": "torchtitan", "mixed_precision": BF16}))


# ---- every setter together keeps the step's invariants --------------------------------------------------
@st.composite
def setter_scenarios(draw) -> dict:
    """conftest's random scenarios with the setters drawn on top (an hpZ size among the shard size's divisors)."""
    data = draw(scenario_dicts())
    fsdp = data["fsdp"]
    sc = parse_scenario(data)
    divisors = [k for k in range(1, sc.settings.shard_size + 1) if sc.settings.shard_size % k == 0]
    fsdp["reshard_after_forward"] = draw(st.sampled_from([True, False, *divisors]))
    fsdp["root_reshard_after_forward"] = draw(st.sampled_from([None, True, False, *divisors]))
    fsdp["forward_prefetch"] = draw(st.integers(0, 3))
    fsdp["backward_prefetch"] = draw(st.sampled_from([False, True, 2, 3]))
    fsdp["requires_all_reduce"] = draw(st.booleans())
    fsdp["reshard_after_backward"] = draw(st.booleans())
    mp = fsdp["mixed_precision"]
    if draw(st.booleans()):
        del mp["reduce_dtype"]
    mp["output_dtype"] = draw(st.sampled_from([None, "fp32", "bf16", {"output": "fp32"}]))
    mp["cast_forward_inputs"] = draw(st.booleans())
    return data


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setter_scenarios())
def test_setters_leak_nothing_and_free_everything_once(data):
    sc, r = run(data)
    allocs = Counter(op.buffer.id for op in r.graph.ops if op.kind == "alloc")
    frees = Counter(op.buffer.id for op in r.graph.ops if op.kind == "free")
    persistent = {b.id for b in r.graph.persistent}
    for buf in r.graph.buffers:
        expected = (0, 0) if buf.id in persistent else (1, 1)
        assert (allocs[buf.id], frees[buf.id]) == expected, buf.name
    assert (r.memory.levels >= 0).all()
    assert {b.id for b in r.memory.live_at_end} == persistent
    assert r.step_time_s > 0
