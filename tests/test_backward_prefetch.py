"""`fsdp.backward_prefetch`: FSDP2's default one-ahead backward prefetch, or none.

true: `FSDPParamGroup._backward_prefetch` all-gathers the unit before this one (in post-forward order)
from this unit's pre-backward, before its gradient kernels. false: `m.set_modules_to_backward_prefetch([m])`
on every FSDP module m, so each unit all-gathers in its own pre-backward, after the reduce-scatter the
unit after it issued in its post-backward (tests/test_fsdp2_torch_semantics.py checks both in torch).
"""

from __future__ import annotations

from conftest import scenario_dict

from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.fsdp2 import build_fsdp2_step

MODEL = {"hidden": 64, "layers": 3, "heads": 4, "vocab": 512}


def _backward(prefetch: bool):
    sc = parse_scenario(scenario_dict(MODEL, gpus_per_node=4, fsdp={"backward_prefetch": prefetch}))
    ops = [op for op in build_fsdp2_step(sc.workload, sc.units, sc.settings).ops if op.phase == "backward"]
    layers = [u.name for u in sc.units if not u.is_root]
    all_gather = {op.unit: op.id for op in ops if op.kind == "all_gather"}
    first_backward = {}
    for op in ops:
        if op.kind == "compute":
            first_backward.setdefault(op.unit, op.id)
    reduce_scatter = {op.unit: op.id for op in ops if op.kind == "reduce_scatter"}
    return layers, all_gather, first_backward, reduce_scatter


def test_default_prefetch_issues_the_next_all_gather_before_the_current_gradient_kernels():
    layers, all_gather, first_backward, _ = _backward(True)
    assert set(all_gather) == set(layers)  # the root is not resharded after forward
    for earlier, later in zip(layers, layers[1:]):
        assert all_gather[earlier] < first_backward[later], earlier
    assert all_gather[layers[-1]] < first_backward["root"]  # the root prefetches the last block


def test_without_prefetch_each_unit_all_gathers_in_its_own_pre_backward():
    layers, all_gather, first_backward, reduce_scatter = _backward(False)
    assert set(all_gather) == set(layers)
    for earlier, later in zip(layers, layers[1:]):
        # after the later unit's post-backward reduce-scatter, right before its own gradient kernels
        assert reduce_scatter[later] < all_gather[earlier] < first_backward[earlier], earlier
    assert first_backward["root"] < all_gather[layers[-1]] < first_backward[layers[-1]]
