"""The allocator replay's memo (engine/reserved.py `MEMO`): a step that makes the requests a step replayed
before made, in the same order, gets that replay's figures, and they are the figures a fresh replay gives;
a step whose frees wait for recorded streams (FSDP1) is never remembered, as the times move its replay."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.datafile import read_data
from fsdp_sim.engine import reserved
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
BASE = read_data(ROOT / "scenarios" / "llama3-8b-8xh100.yaml", "scenario")
FIGURES = ("reserved_bytes", "first_step_allocated_bytes", "first_step_row", "first_step_reserved_bytes",
           "releasable_bytes", "by_stream", "steps")


def _sim(training: dict, fsdp: dict | None = None):
    data = copy.deepcopy(BASE)
    data["training"].update(training)
    data["fsdp"] = {**data.get("fsdp", {}), **(fsdp or {})}
    return simulate(parse_scenario(data, base=ROOT / "scenarios"))


def _figures(result) -> tuple:
    model = result.memory.allocator
    limit = int(0.6 * model.reserved_bytes)  # a driver limit this step passes: the capped replay runs
    capped = model.capped(limit)
    return (*(getattr(model, f) for f in FIGURES), model.timeline.tolist(),
            (capped.oom, capped.reserved_bytes, capped.retries_per_step, capped.retries, capped.steps))


# the 10,000-point benchmark grid's axes (benchmarks/llama3-8b-10k.grid.yaml), at sizes that run fast
POINT = st.fixed_dictionaries({
    "training": st.fixed_dictionaries({"micro_batch": st.integers(1, 4), "seq_len": st.sampled_from([512, 1024, 2048]),
                                       "activation_checkpointing": st.sampled_from(["none", "full"])}),
    "fsdp": st.fixed_dictionaries({"wrap": st.sampled_from(["per_block", "whole_model"]),
                                   "backward_prefetch": st.booleans(),
                                   "mixed_precision": st.sampled_from([{"param_dtype": "bf16", "reduce_dtype": "fp32"},
                                                                       {"param_dtype": "bf16", "reduce_dtype": "bf16"}])}),
})


@settings(max_examples=12, deadline=None)
@given(first=POINT, second=POINT)
def test_a_remembered_replay_gives_a_fresh_replays_figures(first, second):
    reserved.MEMO.clear()
    _sim(**first)
    remembered = _figures(_sim(**second))  # from the memo where the two steps make the same requests
    reserved.MEMO.clear()
    assert remembered == _figures(_sim(**second))


def test_the_same_requests_hit_and_other_requests_do_not():
    """Micro-batch 2 x 1024 tokens and 1 x 2048 allocate alike (the step times differ: attention is
    quadratic in the sequence); a bf16 reduce-scatter changes the gradient buffers, so it replays anew."""
    reserved.MEMO.clear()
    a = _sim({"micro_batch": 2, "seq_len": 1024})
    b = _sim({"micro_batch": 1, "seq_len": 2048})
    assert b.step_time_s != a.step_time_s
    assert b.memory.allocator.timeline is a.memory.allocator.timeline and len(reserved.MEMO.entries) == 1
    assert not b.memory.allocator.timeline.flags.writeable  # shared by both results
    c = _sim({"micro_batch": 1, "seq_len": 2048}, {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"}})
    assert c.memory.allocator.timeline is not a.memory.allocator.timeline and len(reserved.MEMO.entries) == 2


def test_a_step_whose_frees_wait_for_recorded_streams_is_not_remembered():
    reserved.MEMO.clear()
    data = read_data(ROOT / "scenarios" / "llama2-7b-8xh100-fsdp1.yaml", "scenario")
    result = simulate(parse_scenario(data, base=ROOT / "scenarios"))
    assert any(op.kind == "free" and op.record_stream for op in result.graph.ops)
    assert not reserved.MEMO.entries


def _model(n: int) -> reserved.ReservedModel:
    return reserved.ReservedModel(np.zeros(n, dtype=np.int64), 0, 0, 0, 0, 0, {}, 1, lambda: None)


@pytest.mark.parametrize("budget_entries", [1, 2, 3])
def test_the_memo_keeps_the_most_recently_used_within_its_budget(budget_entries):
    memo = reserved._Memo(budget_entries * 800)  # 100 int64s a timeline
    for key in (b"a", b"b", b"c"):
        memo.put(key, _model(100))
        memo.get(b"a")  # used again: kept while the budget allows two
    kept = set(memo.entries)
    assert memo.used == 800 * len(kept) <= memo.budget
    assert kept == {1: {b"c"}, 2: {b"a", b"c"}, 3: {b"a", b"b", b"c"}}[budget_entries]
