"""The caching allocator model (engine/allocator.py, engine/reserved.py): exact cases worked by hand from
c10/cuda/CUDACachingAllocator.cpp's rules, hypothesis invariants, record_stream in a closed-form toy, and
the scenario switches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run, scenario_dict
from fsdp_sim.engine import replay
from fsdp_sim.engine.allocator import (LARGE_BUFFER, AllocatorConfig, CachingAllocator, round_size,
                                       segment_size)
from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule.ops import OpGraph

MiB = 1 << 20
EXPANDABLE = AllocatorConfig(expandable_segments=True)
TINY = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 512}


def test_alloc_free_alloc_reuses_one_large_buffer():
    """3 MiB is under kMinLargeAlloc: a 20 MiB segment; freed and asked again, the cached block serves it."""
    a = CachingAllocator()
    a.free(a.malloc(3 * MiB, "compute"))
    a.malloc(3 * MiB, "compute")
    assert a.reserved == 20 * MiB and len(a.segments) == 1


def test_size_class_boundaries():
    """round_size to 512 B; <= 1 MiB: a 2 MiB small segment; < 10 MiB: 20 MiB; else rounded to 2 MiB."""
    assert [round_size(n) for n in (1, 512, 513)] == [512, 512, 1024]
    assert segment_size(round_size(MiB)) == 2 * MiB
    assert segment_size(round_size(MiB + 1)) == 20 * MiB
    assert segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(round_size(10 * MiB + 1)) == 12 * MiB
    small = CachingAllocator()
    small.malloc(MiB, "compute")
    small.malloc(MiB, "compute")  # the second 1 MiB fills the same 2 MiB small segment
    assert small.reserved == 2 * MiB and small.segments[0].small


def test_large_split_needs_more_than_1mib_left():
    """should_split (large pool): the rest must exceed kSmallSize; 11 MiB in a 12 MiB block is not split."""
    a = CachingAllocator()
    a.free(a.malloc(12 * MiB, "compute"))
    a.malloc(11 * MiB, "compute")  # takes the whole 12 MiB block
    a.malloc(MiB // 2, "compute")  # small pool: a new 2 MiB segment, not the 1 MiB rest
    assert a.reserved == 14 * MiB
    b = CachingAllocator()
    b.malloc(3 * MiB, "compute")
    b.malloc(3 * MiB, "compute")  # the 17 MiB rest of the first segment was split off and cached
    assert b.reserved == 20 * MiB


def test_per_stream_pools():
    """A block freed on one stream is not reused by a request on another."""
    a = CachingAllocator()
    a.free(a.malloc(3 * MiB, "all_gather_copy_in"))
    a.malloc(3 * MiB, "compute")
    assert a.reserved == 40 * MiB


def test_segments_never_merge_without_expandable_segments():
    """hardware.md 5.3 [S15]: 8 x 16 MiB then 4 x 32 MiB reserve 256 MiB; expandable segments map 140 MiB
    (20 MiB pages) for the same sequence."""
    for config, expected in ((AllocatorConfig(), 256 * MiB), (EXPANDABLE, 140 * MiB)):
        a = CachingAllocator(config)
        for b in [a.malloc(16 * MiB, "compute") for _ in range(8)]:
            a.free(b)
        for _ in range(4):
            a.malloc(32 * MiB, "compute")
        assert a.reserved == expected


def test_expandable_pages_can_exceed_a_rounded_segment():
    """Not an invariant: one 12 MiB request is a 12 MiB segment by default but a 20 MiB page when expandable."""
    default, expandable = CachingAllocator(), CachingAllocator(EXPANDABLE)
    default.malloc(12 * MiB, "compute")
    expandable.malloc(12 * MiB, "compute")
    assert (default.reserved, expandable.reserved) == (12 * MiB, 20 * MiB)


def test_max_split_size():
    """With max_split_size a request under it takes no cached block at or over it."""
    a = CachingAllocator(AllocatorConfig(max_split_size=40 * MiB))
    a.free(a.malloc(64 * MiB, "compute"))
    a.malloc(4 * MiB, "compute")
    assert a.reserved == 64 * MiB + LARGE_BUFFER
    b = CachingAllocator()
    b.free(b.malloc(64 * MiB, "compute"))
    b.malloc(4 * MiB, "compute")
    assert b.reserved == 64 * MiB


def test_empty_cache_returns_free_segments():
    a = CachingAllocator()
    keep = a.malloc(3 * MiB, "compute")
    a.free(a.malloc(30 * MiB, "compute"))
    assert a.releasable() == 30 * MiB
    a.free(keep)
    assert a.releasable() == 50 * MiB


def test_record_stream_delays_reuse_until_the_event():
    """A 12 MiB block whose event completes at t=5 is not reusable by a request at t=1, but is at t=6."""
    a = CachingAllocator()
    a.free(a.malloc(12 * MiB, "compute"), ready_at=5.0)
    a.malloc(12 * MiB, "compute", now=1.0)
    assert a.reserved == 24 * MiB
    b = CachingAllocator()
    b.free(b.malloc(12 * MiB, "compute"), ready_at=5.0)
    b.malloc(12 * MiB, "compute", now=6.0)
    assert b.reserved == 12 * MiB


@pytest.mark.parametrize("second_issued, expected", [(1.0, 2), (3.0, 1)])
def test_record_stream_in_the_ledger(second_issued, expected):
    """Closed form through the ledger: x (12 MiB) is used by a kernel on `side` that ends at t=2 and freed
    at t=0.5 with record_stream(side); a second 12 MiB request issued at t=1 needs a second segment, one
    issued at t=3 reuses x's block. Allocated is the same either way."""
    g = OpGraph()
    x = g.alloc("compute", "x", "activations", 12 * MiB)
    g.add("compute", "side", "reader", deps=())
    g.free("compute", x, record_stream="side")
    g.alloc("compute", "y", "activations", 12 * MiB)
    start = np.array([0.0, 0.0, 0.5, second_issued])
    end = np.array([0.0, 2.0, 0.5, second_issued])
    trace = replay(g, start, start, end)
    assert int(trace.total.max()) == 12 * MiB
    assert trace.allocator.first_step_reserved_bytes == expected * 12 * MiB


ops = st.lists(st.tuples(st.booleans(), st.integers(1, 48 * MiB), st.sampled_from(["compute", "side"]),
                         st.integers(0, 1 << 30)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.booleans())
def test_invariants(sequence, expandable):
    """Reserved >= the live blocks at every instant and never decreases; a request only ever gets a block
    of its own stream's pool."""
    a = CachingAllocator(AllocatorConfig(expandable_segments=expandable))
    live, previous = [], 0
    for is_alloc, nbytes, stream, pick in sequence:
        if is_alloc or not live:
            block = a.malloc(nbytes, stream)
            assert block.segment.stream == stream and block.size >= round_size(nbytes)
            live.append(block)
        else:
            a.free(live.pop(pick % len(live)))
        assert a.reserved >= sum(b.size for b in live) >= 0
        assert a.reserved >= previous
        previous = a.reserved
        assert sum(s.size for s in a.segments) == a.reserved


def test_simulated_step_reserved_covers_allocated():
    """On a simulated step: reserved >= allocated at every event, monotone, and the first step (no
    optimizer states in forward and backward) peaks lower than the steady state."""
    _, step = run(scenario_dict(TINY))
    assert (step.memory.reserved >= step.memory.total).all()
    assert (np.diff(step.memory.reserved) >= 0).all()
    model = step.memory.allocator
    assert model.first_step_allocated_bytes <= int(step.memory.total.max())
    assert model.first_step_reserved_bytes <= model.reserved_bytes


def test_expandable_segments_lower_the_7b_step():
    """Direction on the shipped Llama 2 7B step: expandable segments reserve less, allocated is unchanged."""
    from fsdp_sim.scenario import load_scenario
    from fsdp_sim.simulate import simulate
    from dataclasses import replace
    base = load_scenario("scenarios/llama2-7b-8xa100-80gb.yaml")
    default, expandable = simulate(base), simulate(replace(base, allocator=EXPANDABLE))
    assert expandable.memory.reserved_bytes < default.memory.reserved_bytes
    assert int(expandable.memory.total.max()) == int(default.memory.total.max())


def test_hsdp_pays_nccl_buffers_for_two_groups():
    data = scenario_dict(TINY, nodes=2, fsdp={"sharding_strategy": "HYBRID_SHARD"})
    scenario, step = run(data)
    mem = step.memory_summary(step.peak())
    assert set(mem["nccl_groups_bytes"]) == {"shard", "replicate"}
    assert mem["overheads_bytes"]["nccl"] == 2 * scenario.cluster.gpu.nccl_bytes


def test_allocator_section():
    data = scenario_dict(TINY)
    assert parse_scenario(data).allocator == AllocatorConfig()
    on = parse_scenario(data | {"allocator": {"expandable_segments": True, "max_split_size_mb": 64}})
    assert on.allocator == AllocatorConfig(True, 64 * MiB)
    for bad, key in (({"expandable_segments": "yes"}, "expandable_segments"), ({"max_split_size_mb": 20}, "max_split_size_mb"),
                     ({"roundup_power2_divisions": 4}, "roundup_power2_divisions")):
        with pytest.raises(ScenarioError, match=f"allocator.{key}"):
            parse_scenario(data | {"allocator": bad})


@pytest.mark.parametrize("path, overrides", [
    ("scenarios/llama3-8b-8xh100.yaml", {}),
    ("scenarios/llama3-8b-8xh100.yaml", {"training": {"micro_batch": 3, "seq_len": 2048}}),
    ("scenarios/llama3-8b-8xh100.yaml", {"fsdp": {"wrap": "every_k_blocks", "blocks_per_unit": 4}}),
    ("scenarios/llama2-7b-8xa100-80gb.yaml", {}),
    # four steps, the last (whose reserved is recorded event by event) stopping at a checkpoint
    ("scenarios/llama3-8b-8xh100.yaml", {"training": {"micro_batch": 3, "seq_len": 1024},
                                         "fsdp": {"sharding_strategy": "SHARD_GRAD_OP", "reshard_after_forward": False}}),
])
def test_a_steady_step_stopped_at_a_checkpoint_gives_the_full_replays_figures(path, overrides, monkeypatch):
    """reserved.py stops a steady step where its layout equals the previous step's at a checkpoint: every
    figure is the one the whole replay gives (checkpoints off), and at least one case does stop early."""
    from pathlib import Path

    from fsdp_sim.datafile import read_data
    from fsdp_sim.engine import reserved

    data = read_data(Path(__file__).resolve().parents[1] / path, "scenario")
    for section, keys in overrides.items():
        data[section] = {**data[section], **keys}
    _, r = run(data)
    args = (r.graph.ops, r.memory.columns, r.memory.persistent, r.timing.issued, r.timing.end)
    stopped = []
    step = reserved._step
    monkeypatch.setattr(reserved, "_step", lambda *a, **k: (out := step(*a, **k), stopped.append(out[2]))[0])
    early = reserved.replay_allocator(*args)
    monkeypatch.setattr(reserved, "CHECKPOINTS", ())
    full = reserved.replay_allocator(*args)
    for field in ("reserved_bytes", "first_step_allocated_bytes", "first_step_row", "first_step_reserved_bytes",
                  "releasable_bytes", "by_stream", "steps"):
        assert getattr(early, field) == getattr(full, field), field
    assert (early.timeline == full.timeline).all()
    if path.startswith("scenarios/llama3-8b") and (not overrides or "sharding_strategy" in overrides.get("fsdp", {})):
        assert any(stopped), "this step's confirming step should stop at a checkpoint"
        assert full.steps == 4 or not overrides
