"""The Perfetto trace says how its memory counters are ordered and stamped (issue order, as
max_memory_allocated counts), and stamps them so: never before the event before them."""

from __future__ import annotations

from conftest import run, scenario_dict
from fsdp_sim.results.export import chrome_trace


def test_the_trace_says_how_its_memory_counters_are_stamped():
    _, result = run(scenario_dict({"hidden": 256, "layers": 3, "heads": 4, "vocab": 1000}))
    trace = chrome_trace(result)
    assert "issue order" in trace["otherData"]["memory_counters"]
    stamps = [e["ts"] for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "memory allocated (bytes)"]
    assert len(stamps) > 10 and stamps == sorted(stamps)
    peak = max(e["args"]["bytes"] for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "memory allocated (bytes)")
    assert peak == result.to_dict()["peak"]["allocated_bytes"]
