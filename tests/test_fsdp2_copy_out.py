"""FSDP2's copy-out as torch 2.13 orders it (`FSDPParamGroup.wait_for_unshard`, `_fsdp_param_group.py`):

- in FORWARD with implicit prefetching the previous unit's all-gather state is taken and
  `comm_ctx.all_gather_state` set to None before this unit's copy-out, but the walrus local
  `prev_all_gather_state` keeps its result alive until the method returns: at each forward copy-out the
  previous unit's output is still allocated (FSDPMemTracker's forward peak shows it: the LoRA small-batch
  referee cases in tests/test_lora.py), and it is freed right after;
- outside FORWARD the output is freed right after the copy-out and the copy-in and all-gather streams wait
  the copy-out's event (`_wait_all_gather_streams_on_event`): the next copy-in cannot run before it.
"""

from __future__ import annotations

import pytest

from conftest import scenario_dict
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.build import build_step

MODEL = {"hidden": 256, "layers": 4, "heads": 4, "vocab": 1000}


def _graph(**fsdp):
    sc = parse_scenario(scenario_dict(MODEL, fsdp=fsdp, training={"micro_batch": 2, "seq_len": 64}))
    return build_step(sc.workload, sc.units, sc.settings)


@pytest.mark.parametrize("fsdp", [{}, {"reshard_after_forward": False}, {"sharding_strategy": "SHARD_GRAD_OP"},
                                  {"forward_prefetch": 1}])
def test_a_forward_copy_out_runs_beside_the_previous_all_gather_output(fsdp):
    ops = _graph(**fsdp).ops
    live: set[str] = set()
    checked, previous = 0, None
    for op in ops:
        if not op.phase.startswith("forward") or op.kind not in ("alloc", "free"):
            continue
        name = op.buffer.name
        if name.endswith("all-gather output"):
            (live.add if op.kind == "alloc" else live.discard)(name)
        elif op.kind == "alloc" and name.endswith("unsharded params"):
            # at each copy-out this unit's output is alive, the previous unit's (held by the walrus local),
            # and with forward prefetch the next unit's, gathered but not yet copied out
            assert f"{op.buffer.unit} all-gather output" in live
            others = live - {f"{op.buffer.unit} all-gather output"}
            assert len(others) <= 1 + fsdp.get("forward_prefetch", 0), (name, sorted(live))
            if previous is not None:
                assert f"{previous} all-gather output" in live, (name, sorted(live))
            previous = op.buffer.unit
            checked += 1
    assert checked >= 4


def test_outside_forward_the_next_copy_in_waits_the_copy_out():
    ops = _graph().ops
    copy_outs = {op.unit: op.id for op in ops if op.phase.startswith("backward") and op.name.endswith("all-gather copy-out")}
    copy_ins = [op for op in ops if op.phase.startswith("backward") and op.name.endswith("all-gather copy-in")]
    assert copy_outs and copy_ins
    waited = 0
    for op in copy_ins:
        earlier = [i for u, i in copy_outs.items() if i < op.id]
        if earlier:  # the latest copy-out issued before this copy-in is among its waits
            assert max(earlier) in op.deps, op.name
            waited += 1
    assert waited >= 2
