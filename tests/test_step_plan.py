"""The step plan's events (engine/step_plan.py): each request rounded (`round_size`) and pooled
(`get_pool`) as the allocator would, each free in its request's pool, worked out per distinct (stream,
bytes) over arrays; checked event by event against the allocator's own rules on random ledgers."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.engine.allocator import AllocatorConfig, pool_key, round_size
from fsdp_sim.engine.step_plan import MemoryEvents, step_plan

MiB = 1 << 20
nbytes = st.one_of(st.integers(0, 2 * MiB), st.integers(0, 48 * MiB), st.sampled_from([0, 511, 512, 513, MiB, MiB + 1]))


@st.composite
def ledgers(draw):
    """Allocs and frees in issue order over three streams: buffers 0-9 are allocated before the step (their
    frees have no request in it), buffers 10 up are allocated at most once and freed at most once after."""
    events, live, next_buffer = [], [], 10
    for _ in range(draw(st.integers(1, 60))):
        stream = draw(st.sampled_from(["compute", "all_gather_copy_in", "reduce_scatter"]))
        kind = draw(st.sampled_from(["alloc", "free", "free_outside"]))
        if kind == "alloc" or (kind == "free" and not live):
            size = draw(nbytes)
            events.append((next_buffer, size, True, stream))
            live.append((next_buffer, size))
            next_buffer += 1
        elif kind == "free":
            buf, size = live.pop(draw(st.integers(0, len(live) - 1)))
            events.append((buf, -size, False, stream))
        else:
            events.append((draw(st.integers(0, 9)), -draw(nbytes), False, stream))
    return events


@settings(max_examples=300, deadline=None)
@given(ledgers(), st.booleans())
def test_each_event_is_rounded_and_pooled_as_the_allocator_does(ledger, timeless):
    n = len(ledger)
    buffers, deltas, allocs, streams = zip(*ledger)
    events = MemoryEvents(np.arange(n, dtype=np.intp), np.array(buffers, dtype=np.intp), np.array(deltas, dtype=np.int64),
                          np.array(allocs, dtype=bool), list(streams), None)
    issued = np.arange(n, dtype=np.float64) * 1e-3
    plan = step_plan([], events, [], issued, issued + 1.0, AllocatorConfig(), timeless=timeless)
    request_pool = {}
    for k, (buf, delta, alloc, stream) in enumerate(ledger):
        got = plan.events[k]
        assert got[0] == buf and got[1] == delta and got[4] == issued[k] and got[5] is None
        if alloc:
            size = round_size(delta)
            assert got[2] == size and got[3] == pool_key(stream, size)
            assert type(got[2]) is int and type(got[3][1]) is bool  # the allocator compares them as Python values
            request_pool[buf] = got[3]
        else:
            assert got[2] == 0 and got[3] == request_pool.get(buf)
