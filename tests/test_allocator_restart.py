"""A capped replay that begins from the unconstrained replay's state at a later step's start
(reserved.py `Restart`) gives what playing every step under the limit gives: random steps (persistent
buffers, optimizer states created in the first step, buffers alive past a step's end) under random limits."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.engine import reserved
from fsdp_sim.engine.allocator import AllocatorConfig, pool_key, round_size

MiB = 1 << 20

sizes = st.one_of(st.integers(1, 2 * MiB), st.integers(1, 48 * MiB))
steps = st.fixed_dictionaries({
    "persistent": st.lists(sizes, max_size=4), "lazy": st.lists(sizes, max_size=3),
    "events": st.lists(st.tuples(st.booleans(), sizes, st.sampled_from(["compute", "side"]), st.integers(0, 1 << 30)),
                       min_size=1, max_size=50),
    "lazy_at": st.floats(0, 1), "config": st.sampled_from([AllocatorConfig(), AllocatorConfig(max_split_size=32 * MiB),
                                                           AllocatorConfig(expandable_segments=True)])})


def _plan(step: dict) -> reserved.StepPlan:
    """A step plan of requests and frees of buffers 100 up (some alive at the step's end), buffers 0 up
    persistent and 50 up optimizer states; no free waits for a recorded stream."""
    events, live, deltas = [], [], []
    for k, (is_alloc, nbytes, stream, pick) in enumerate(step["events"]):
        if is_alloc or not live:
            size = round_size(nbytes)
            events.append((100 + k, nbytes, size, pool_key(stream, size), float(k), None))
            live.append((100 + k, nbytes))
            deltas.append(nbytes)
        else:
            buf, nbytes = live.pop(pick % len(live))
            events.append((buf, -nbytes, 0, None, float(k), None))
            deltas.append(-nbytes)
    persistent = list(enumerate(step["persistent"]))
    lazy = [(50 + i, n) for i, n in enumerate(step["lazy"])]
    lazy_at = int(step["lazy_at"] * len(events))
    return reserved.StepPlan(step["config"], persistent, lazy, lazy_at, float(lazy_at), events,
                             frozenset(i for i, _ in persistent + lazy), float(len(events)), np.array(deltas, dtype=np.int64))


@settings(max_examples=300, deadline=None)
@given(steps, st.data())
def test_a_capped_replay_from_a_later_step_equals_one_from_the_start(step, data):
    plan = _plan(step)
    model = reserved._replay(plan)
    if model.restart is not None:
        starts = [r for r, _, _ in model.restart.starts]
        # limits at, between and around the step starts' reserved, where a restart applies or just does not
        limit = data.draw(st.sampled_from(starts + [r + 1 for r in starts] + [r - 1 for r in starts]
                                          + [model.reserved_bytes, (starts[-1] + model.reserved_bytes) // 2]))
    else:
        assert step["config"].expandable_segments
        limit = data.draw(st.integers(0, model.reserved_bytes + 1))
    assert reserved.replay_capped(plan, limit, model.restart) == reserved.replay_capped(plan, limit)
