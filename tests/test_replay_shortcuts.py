"""The replay's shortcuts against the replay without them, on random steps (persistent buffers, optimizer
states created in the first step, buffers alive past a step's end, two streams): a steady step that leaves
out the pools the step before did not change (reserved.py `_replay`), a capped replay that begins from
the unconstrained replay's state at a later step's start (`Restart`), under random limits, and a capped
replay whose steady step stops where its layout repeats the step before's (`replay_capped`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_sim.engine import reserved
from fsdp_sim.engine.allocator import AllocatorConfig, pool_key, round_size

MiB = 1 << 20

sizes = st.one_of(st.integers(1, 2 * MiB), st.integers(1, 48 * MiB),
                  st.sampled_from([MiB, 3 * MiB, 12 * MiB, 30 * MiB]))  # repeated sizes, as a model's layers make
configs = st.sampled_from([AllocatorConfig(), AllocatorConfig(max_split_size=32 * MiB), AllocatorConfig(expandable_segments=True)])


def _steps(max_events: int, streams: list[str], min_events: int = 1):
    return st.fixed_dictionaries({
        "persistent": st.lists(sizes, max_size=4), "lazy": st.lists(sizes, max_size=4),
        "events": st.lists(st.tuples(st.booleans(), sizes, st.sampled_from(streams), st.integers(0, 1 << 30)),
                           min_size=min_events, max_size=max_events),
        "lazy_at": st.floats(0, 1), "config": configs})


steps = _steps(50, ["compute", "side"])


def _plan(step: dict, regrow: bool = False, waits: tuple = ()) -> reserved.StepPlan:
    """A step plan of requests and frees of buffers 100 up (some alive at the step's end), buffers 0 up
    persistent and 50 up optimizer states; the k-th free waits `waits[k]` (None or missing: none) for a
    recorded stream. `regrow`: the step ends
    with 64 MiB (more than any other request) allocated and freed on the compute stream, and then an optimizer state of 64 MiB takes
    that block in the first step, so that the second grows at its end and a third is played whole."""
    events, live, deltas, pool_of, frees = [], [], [], {}, 0
    seed = [(True, 64 * MiB, "compute", 0), (False, 0, "compute", 0)] if regrow else []
    for k, (is_alloc, nbytes, stream, pick) in enumerate(step["events"] + seed):
        if is_alloc or not live:
            size = round_size(nbytes)
            pool_of[100 + k] = pool_key(stream, size)
            events.append((100 + k, nbytes, size, pool_of[100 + k], float(k), None))
            live.append((100 + k, nbytes))
            deltas.append(nbytes)
        else:
            buf, nbytes = live.pop(pick % len(live))
            wait = waits[frees] if frees < len(waits) else None
            events.append((buf, -nbytes, 0, pool_of[buf], float(k), None if wait is None else k + wait))
            frees += 1
            deltas.append(-nbytes)
    persistent = list(enumerate(step["persistent"]))
    lazy = [(50 + i, n) for i, n in enumerate([64 * MiB] * regrow + step["lazy"])]
    lazy_at = len(events) if regrow else int(step["lazy_at"] * len(events))
    return reserved.StepPlan(step["config"], persistent, lazy, lazy_at, float(lazy_at), events,
                             frozenset(i for i, _ in persistent + lazy), float(len(events)), np.array(deltas, dtype=np.int64),
                             any(e[5] is not None for e in events))


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


@settings(max_examples=300, deadline=None)
@given(_steps(120, ["compute", "compute", "side", "other"]))
def test_leaving_out_what_cannot_change_changes_nothing(step):
    """Leaving out the pools the step before did not change, and stopping a step at a checkpoint whose
    layout (`CachingAllocator.layout`: no free blocks, no segments, only their count) is the step before's."""
    plan = _plan(step, regrow=True)
    fast = reserved._replay(plan)
    held, checkpoints = reserved._held, reserved.CHECKPOINTS
    try:
        reserved._held = lambda alloc: {}  # no pool is ever found unchanged: every step plays every event
        reserved.CHECKPOINTS = ()  # and plays to its end
        full = reserved._replay(plan)
    finally:
        reserved._held, reserved.CHECKPOINTS = held, checkpoints
    assert fast.timeline.tolist() == full.timeline.tolist()
    assert (fast.reserved_bytes, fast.first_step_reserved_bytes, fast.releasable_bytes, fast.by_stream, fast.steps,
            _restart(fast)) == (full.reserved_bytes, full.first_step_reserved_bytes, full.releasable_bytes,
                                full.by_stream, full.steps, _restart(full))


def _restart(model: reserved.ReservedModel) -> tuple | None:
    r = model.restart
    return r and (r.starts, r.segments.tolist(), r.pools, r.allocated.tolist())


def _full_capped(plan: reserved.StepPlan, limit: int, restart: reserved.Restart | None = None) -> reserved.CappedReplay:
    """`replay_capped` with no checkpoints: every step played to its end."""
    checkpoints = reserved.CAPPED_CHECKPOINTS
    try:
        reserved.CAPPED_CHECKPOINTS = ()
        return reserved.replay_capped(plan, limit, restart)
    finally:
        reserved.CAPPED_CHECKPOINTS = checkpoints


@settings(max_examples=250, deadline=None)
@given(_steps(120, ["compute", "compute", "side"], 30), st.booleans(),
       st.lists(st.one_of(st.none(), st.floats(0, 8)), max_size=60), st.sampled_from([3, 4, 5]), st.data())
def test_a_capped_step_that_stops_where_it_repeats_the_step_before_equals_the_whole_loop(step, regrow, waits, max_steps,
                                                                                         data):
    """Under limits from the first step's peak allocated to past the unconstrained peak (retries, releases
    of oversize blocks, grown expandable segments, out of memory), preferring those where the loop plays
    three steps or more (a steady step may then repeat the one before: a fifth of these replays stop early),
    from the start and from a restart, with and without frees that wait for a recorded stream, whatever
    MAX_STEPS cuts short: every field of the replay is the full loop's."""
    plan = _plan(step, regrow, tuple(waits) if data.draw(st.sampled_from([False, False, True])) else ())
    kept = reserved.MAX_STEPS
    try:
        reserved.MAX_STEPS = max_steps
        model = reserved._replay(plan)
        lo, peak = model.first_step_allocated_bytes, model.reserved_bytes
        starts = [r for r, _, _ in model.restart.starts] if model.restart is not None else []
        limits = sorted({lo + (peak - lo) * k // 24 for k in range(25)} | set(starts) | {peak + 1})
        full = {limit: _full_capped(plan, limit) for limit in limits}
        longer = [limit for limit in limits if not full[limit].oom and full[limit].steps >= 3]
        limit = data.draw(st.sampled_from(longer or limits))
        assert reserved.replay_capped(plan, limit) == full[limit]
        assert reserved.replay_capped(plan, limit, model.restart) == _full_capped(plan, limit, model.restart)
    finally:
        reserved.MAX_STEPS = kept


@pytest.mark.parametrize("name", ["llama3-405b-1024xh100", "llama3-8b-8xh100"])
def test_a_shipped_capped_replay_that_stops_early_equals_the_whole_loop(name, monkeypatch):
    """The scenarios at their GPU's limit: llama3-405b's fourth step repeats its third at the first checkpoint,
    llama3-8b's steps never repeat (a retry every step) and play to MAX_STEPS; the figures are the whole loop's."""
    from pathlib import Path

    from fsdp_sim.scenario import load_scenario
    from fsdp_sim.simulate import simulate

    r = simulate(load_scenario(Path(__file__).resolve().parents[1] / "scenarios" / f"{name}.yaml"))
    model = r.memory.allocator
    limit = r.allocator_limit()
    assert model.reserved_bytes > limit  # replayed under the limit
    stopped = []
    step = reserved._step
    monkeypatch.setattr(reserved, "_step", lambda *a, **k: (out := step(*a, **k), stopped.append(out[2]))[0])
    early = reserved.replay_capped(model.plan, limit, model.restart)
    assert early == _full_capped(model.plan, limit, model.restart)
    assert any(stopped) == (name == "llama3-405b-1024xh100")
    assert early == model.capped(limit)
