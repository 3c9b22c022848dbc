"""`OpCosts.slowdowns` works out each mix of rate classes once per step: the class must carry everything the
contention reads of an op, so that any op standing in for another of its class changes no factor."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings, strategies as st

from fsdp_sim.scenario import load_scenario
from fsdp_sim.schedule.build import build_step
from fsdp_sim.schedule.ops import COLLECTIVES, TIMED_KINDS
from fsdp_sim.simulate import op_costs

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("llama3-8b-32xh200-hsdp", "llama2-7b-8xh100-fsdp1-cpu-offload", "llama3-8b-8xh100-activation-offload")


def _priced(name: str):
    sc = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
    graph = build_step(sc.workload, sc.units, sc.settings)
    return op_costs(sc), [op for op in graph.ops if op.kind in TIMED_KINDS]


PRICED = {name: _priced(name) for name in SCENARIOS}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(SCENARIOS), picks=st.lists(st.integers(0, 10 ** 6), min_size=1, max_size=4),
       swap=st.integers(0, 10 ** 6))
def test_an_op_of_the_same_class_changes_no_factor(name, picks, swap):
    """A running set with a collective, its factors beside the same set with one op replaced by another of
    its class (the first of that class in the step), each worked out afresh: equal to the last bit."""
    costs, timed = PRICED[name]
    comm = [op for op in timed if op.kind in COLLECTIVES]
    running = [comm[picks[0] % len(comm)]] + [timed[p % len(timed)] for p in picks[1:]]
    running = list({op.id: op for op in running}.values())
    k = swap % len(running)
    twin = next(op for op in timed if costs._rate_class(op) == costs._rate_class(running[k]))
    other = running[:k] + [twin] + running[k + 1:]
    assert costs._contention(running) == costs._contention(other)
    assert costs.slowdowns(running) == costs._contention(running)  # the table answers as the worked-out mix


def test_the_class_found_by_price_is_the_class_worked_out():
    """`_rate_class` finds an op's class by what prices it (a collective's kind, group and bytes; a compute
    op's shared `KernelTimes`): the number is that of the class worked out from the op itself, for every
    timed op of the step, so two ops share a number exactly when they share a class."""
    from fsdp_sim.hardware.host_link import HOST_GROUPS
    for name in SCENARIOS:
        sc = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
        costs = op_costs(sc)
        timed = [op for op in build_step(sc.workload, sc.units, sc.settings).ops if op.kind in TIMED_KINDS]
        for op in timed:
            number = costs._rate_class(op)
            if op.kind in COLLECTIVES:
                cls = (op.kind, op.group, costs._hbm_demand(op))
            else:
                cls = ("compute", op.group in HOST_GROUPS, costs._memory_share(op))
            assert costs._class_numbers[cls] == number
        assert len(set(costs._class_numbers.values())) == len(costs._class_numbers)
