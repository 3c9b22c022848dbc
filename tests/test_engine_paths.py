"""The stream's short path for an alloc or free that waits on nothing (`_Stream.advance`: an op's id alone in
its queue) gives the trace the general path gives the same op as (id, no deps, not a collective): every start,
end and issue time to the last bit, on steps of random small models, FSDP1 (whose rate limiter blocks the
CPU issue thread) and FSDP2, at random kernel prices and launch costs from GPU-bound to CPU-bound (where
streams wait for the CPU to issue their next op, the short path's one wait)."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings, strategies as st

from conftest import model_dicts, scenario_dict
from fsdp_sim.engine import play, queue_layout
from fsdp_sim.engine.simulator import QueueLayout
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.build import build_step
from fsdp_sim.schedule.ops import COLLECTIVES


def _general(layout: QueueLayout) -> QueueLayout:
    """`layout` with every short-path item (an id alone) as the general path's (id, no deps, not a collective)."""
    streams = [[(item, (), False) if item.__class__ is int else item for item in queue] for queue in layout.streams]
    return QueueLayout(streams, layout.lanes, layout.timed, layout.first_wait)


@settings(max_examples=40, deadline=None)
@given(model=model_dicts(max_layers=4), version=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 32 - 1),
       launch=st.sampled_from([0.0, 1e-6, 1e-5, 1e-4]), contended=st.booleans())
def test_the_short_path_gives_the_general_paths_trace(model, version, seed, launch, contended):
    fsdp = {"version": version} | ({"limit_all_gathers": True} if version == 1 else {})
    scenario = parse_scenario(scenario_dict(model, fsdp=fsdp))
    ops = build_step(scenario.workload, scenario.units, scenario.settings).ops
    rng = random.Random(seed)
    price = [rng.choice([0.0, rng.uniform(1e-6, 1e-3)]) if op.kind in COLLECTIVES else rng.uniform(1e-7, 1e-3)
             for op in ops]
    host = [rng.uniform(0.0, 2 * launch) for _ in ops]
    slowdowns = (lambda running: [1.0 + 0.5 * (op.kind in COLLECTIVES) + 0.25 * len(running) for op in running]) \
        if contended else None
    layout = queue_layout(ops)
    assert any(item.__class__ is int for queue in layout.streams for item in queue)  # the short path is taken
    args = dict(host_s=lambda op: host[op.id], slowdowns=slowdowns)
    short = play(ops, lambda op: price[op.id], layout=layout, **args)
    general = play(ops, lambda op: price[op.id], layout=_general(layout), **args)
    for a, b in ((short.start, general.start), (short.end, general.end), (short.issued, general.issued)):
        assert np.array_equal(a, b)
