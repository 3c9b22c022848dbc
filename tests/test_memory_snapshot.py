"""`run --memory-snapshot`: a torch.cuda.memory._snapshot() pickle PyTorch's visualiser reads, whose
allocated curve is the ledger's; the Perfetto trace's reserved counter is the ledger's reserved model."""

from __future__ import annotations

import json
import pickle

import pytest
import yaml

from fsdp_sim.cli import main
from fsdp_sim.results.export import chrome_trace
from fsdp_sim.results.memory_viz import memory_snapshot
from fsdp_sim.scenario import load_scenario, parse_scenario
from fsdp_sim.simulate import simulate

SMALL = {"model": {"hidden": 256, "layers": 3, "heads": 4, "vocab": 1000}, "training": {"seq_len": 128, "micro_batch": 2},
         "hardware": {"profile": "h100-sxm", "nodes": 2, "gpus_per_node": 4},
         "fsdp": {"sharding_strategy": "HYBRID_SHARD"}}


def _allocated_curve(snapshot: dict) -> list[int]:
    """Allocated bytes after each trace entry, as MemoryViz.js's Active Memory Timeline adds them up."""
    level, out = 0, []
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            level += e["size"]
        elif e["action"] == "free_completed":
            level -= e["size"]
        out.append(level)
    return out


@pytest.fixture(scope="module", params=["small", "llama3-8b"])
def step(request):
    if request.param == "small":
        return simulate(parse_scenario(SMALL))
    return simulate(load_scenario("scenarios/llama3-8b-8xh100.yaml"))


def test_allocated_curve_is_the_ledger_and_the_end_state_is_the_persistent_set(step):
    snap = memory_snapshot(step)
    peak = step.to_dict()["peak"]
    curve = _allocated_curve(snap)
    assert max(curve) == peak["allocated_bytes"] and curve[-1] == int(step.memory.total[-1])
    active = [b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert sorted(b["requested_size"] for b in active) == sorted(b.nbytes for b in step.memory.persistent)


def test_blocks_lie_in_their_segments_and_never_overlap(step):
    snap = memory_snapshot(step)
    segments, live = [], {}
    for e in snap["device_traces"][0]:
        if e["action"] == "segment_alloc":
            segments.append((e["addr"], e["addr"] + e["size"], e["stream"]))
        elif e["action"] == "alloc":
            seg = [s for s in segments if s[0] <= e["addr"] < s[1]]
            assert len(seg) == 1 and e["addr"] + e["size"] <= seg[0][1] and seg[0][2] == e["stream"]
            for a, size in live.values():
                assert e["addr"] + e["size"] <= a or a + size <= e["addr"], "live blocks overlap"
            live[e["addr"]] = (e["addr"], e["size"])
        elif e["action"] == "free_completed":
            del live[e["addr"]]
    assert sum(s["total_size"] for s in snap["segments"]) == sum(b - a for a, b, _ in segments)
    assert sum(s["total_size"] for s in snap["segments"]) >= int(step.memory.total.max())  # segments hold the peak


def test_pytorch_memory_viz_reads_it(tmp_path):
    """The file the CLI writes goes through torch.cuda._memory_viz's CPU-side readers without error."""
    mv = pytest.importorskip("torch.cuda._memory_viz")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    out = tmp_path / "snapshot.pickle"
    assert main(["run", str(path), "-q", "--memory-snapshot", str(out), "--json", str(tmp_path / "r.json")]) == 0
    snap = pickle.loads(out.read_bytes())
    summary = mv.segsum(snap)  # checks allocated + free inside the segments adds up to reserved
    assert f"segments: {len(snap['segments'])}" in summary
    assert "cudaMalloc" in mv.trace(snap) and "free completed" in mv.trace(snap)
    for html in (mv.trace_plot(snap), mv.trace_plot(snap, plot_segments=True), mv.segment_plot(snap)):
        assert "add_local_files" in html and "snapshot.pickle" in html
    peak = json.loads((tmp_path / "r.json").read_text())["peak"]
    assert max(_allocated_curve(snap)) == peak["allocated_bytes"]


def test_trace_has_a_reserved_counter_ending_at_peak_reserved(step):
    events = chrome_trace(step)["traceEvents"]
    reserved = [e["args"]["bytes"] for e in events if e.get("name") == "memory reserved (bytes)"]
    assert reserved and reserved[-1] == step.memory.reserved_bytes
    assert all(a <= b for a, b in zip(reserved, reserved[1:]))  # the caching allocator keeps what it reserved
    allocated = [e["args"]["bytes"] for e in events if e.get("name") == "memory allocated (bytes)"]
    assert len(allocated) == len(reserved) and all(a <= r for a, r in zip(allocated, reserved))
