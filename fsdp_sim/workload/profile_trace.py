"""Measured per-module compute times from a PyTorch profiler (Kineto) Chrome trace.

`apply_profile_trace(workload, "profile.json")` returns the workload with `fwd_time_s` / `bwd_time_s`
set on the modules the trace times. Two sources, the first that matches wins:

1. Labels: `record_function` ranges named `fsdp_sim::<module name>::forward` / `::backward`
   (`fsdp_sim.torch_tools.profiling.profile_labels` puts them around every unit and the loss). When the
   trace has GPU kernels, a range's time is the sum of the kernels launched inside it (matched through
   the launch's correlation id), i.e. device busy time; on a CPU-only trace it is the range's duration.
2. Module ranges: the `nn.Module: <Class>_<n>` events a `with_stack=True` profile emits. They are
   matched to the workload's in-model modules in forward order (by class when the workload was traced
   and its `meta.module_classes` says them, else the root module's direct children one to one).
   Backward has no such events, so this gives `fwd_time_s` only; it is the CPU time of the Python call.

With several profiled steps (`ProfilerStep#N` ranges) a module's time is the median over steps of its
per-step total; without step markers, the median over its occurrences. Times are seconds. Modules the
trace does not mention keep `None`. Reading the trace is pure Python (no torch needed).
"""

from __future__ import annotations

import re
import statistics
from bisect import bisect_right
from dataclasses import replace
from pathlib import Path
from typing import Any

from fsdp_sim.datafile import read_data
from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.workload.model import Workload

LABEL = re.compile(r"^fsdp_sim::(?P<name>.+)::(?P<phase>forward|backward)$")
MODULE_EVENT = re.compile(r"^nn\.Module: (?P<cls>.+)_(?P<n>\d+)$")
_US = 1e-6  # Chrome trace timestamps and durations are microseconds


MAX_US = 1e12  # a duration past 11.6 days (in microseconds) is not one training step's
MAX_TS_US = 1e18  # timestamps are microseconds since an epoch (Kineto's: about 5e12)


def _check_event(path, i: int, e: dict) -> dict:
    """One complete event, checked where later steps rely on it: `ts` and `dur` finite numbers (dur >= 0),
    `pid` / `tid` / `args.correlation` scalars, `args` a mapping. A malformed one is refused, naming it."""
    def bad(key: str, expected: str):
        return ScenarioError(f"compute.trace: {path}: traceEvents[{i}].{key} must be {expected}, "
                             f"got {show(e.get(key) if '.' not in key else args.get('correlation'))}")
    for key, limit in (("ts", MAX_TS_US), ("dur", MAX_US)):
        value = e[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= limit \
                or (key == "dur" and value < 0):
            raise bad(key, f"a {'non-negative ' if key == 'dur' else ''}number of microseconds of at most {limit:g}")
    for key in ("pid", "tid"):
        if isinstance(e.get(key), (list, dict, float)):
            raise bad(key, "an integer or a string")
    args = e.get("args")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise bad("args", "a mapping")
    if isinstance(args.get("correlation"), (list, dict, float, bool)):
        raise bad("args.correlation", "an integer")
    if not isinstance(e.get("name", ""), str) or not isinstance(e.get("cat", ""), (str, type(None))):
        raise bad("name" if not isinstance(e.get("name", ""), str) else "cat", "a string")
    return e


def load_trace_events(path: str | Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace file (`{"traceEvents": [...]}` or a bare list)."""
    data = read_data(path, "compute.trace", fmt="json")
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ScenarioError(f"compute.trace: {path} has no traceEvents list (not a Chrome trace)")
    return [_check_event(path, i, e) for i, e in enumerate(events) if isinstance(e, dict) and e.get("ph") == "X"
            and "ts" in e and "dur" in e]


def apply_profile_trace(workload: Workload, trace_path: str | Path) -> Workload:
    """`workload` with the forward/backward times of its modules read from the trace at `trace_path`."""
    events = load_trace_events(trace_path)
    names = {m.name for m in workload.modules}
    times, source = _label_times(events), "labels"
    unknown = sorted({name for name, _ in times} - names)
    times = {k: v for k, v in times.items() if k[0] in names}
    if not times:
        times, source = _module_times(events, workload), "nn.Module"
    if not times:
        hint = f" (its labels name no module of the workload: {unknown[:3]})" if unknown else ""
        raise ScenarioError(f"compute.trace: {trace_path} has no fsdp_sim::<module>::forward/backward ranges "
                            f"and no nn.Module ranges matching the workload's modules{hint}")
    modules = tuple(replace(m, fwd_time_s=times.get((m.name, "forward"), m.fwd_time_s),
                            bwd_time_s=times.get((m.name, "backward"), m.bwd_time_s))
                    for m in workload.modules)
    info = {"path": str(trace_path), "source": source, "timed": sorted({n for n, _ in times})}
    if unknown:
        info["unknown_labels"] = unknown
    return replace(workload, modules=modules, meta={**workload.meta, "profile_trace": info})


# ---- 1. fsdp_sim:: labels -----------------------------------------------------------------------
def _label_times(events: list[dict]) -> dict[tuple[str, str], float]:
    labels = [e for e in events if e.get("cat") != "gpu_user_annotation" and LABEL.match(str(e.get("name")))]
    if not labels:
        return {}
    kernels = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                kernels[corr] = kernels.get(corr, 0.0) + e["dur"]
    durations = [0.0] * len(labels) if kernels else [float(e["dur"]) for e in labels]
    if kernels:
        # each kernel launch counts for the innermost label range open on its thread when it was issued
        by_thread: dict[tuple, list[int]] = {}
        for i, e in enumerate(labels):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(i)
        for idx in by_thread.values():
            idx.sort(key=lambda i: labels[i]["ts"])
        starts = {k: [labels[i]["ts"] for i in idx] for k, idx in by_thread.items()}
        for e in events:
            corr = (e.get("args") or {}).get("correlation")
            if corr not in kernels or e.get("cat") not in ("cuda_runtime", "cuda_driver", "runtime"):
                continue
            key = (e.get("pid"), e.get("tid"))
            if key not in by_thread:
                continue
            idx = by_thread[key]
            j = bisect_right(starts[key], e["ts"]) - 1
            while j >= 0:  # the latest-starting range that still contains the launch
                lab = labels[idx[j]]
                if lab["ts"] + lab["dur"] >= e["ts"]:
                    durations[idx[j]] += kernels[corr]
                    break
                j -= 1
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
    per: dict[tuple[str, str], dict[Any, float]] = {}
    for i, (e, dur) in enumerate(zip(labels, durations)):
        m = LABEL.match(e["name"])
        key = (m["name"], m["phase"])
        step = _step_of(e["ts"], steps) if steps else i  # no steps: every occurrence on its own
        per.setdefault(key, {})
        per[key][step] = per[key].get(step, 0.0) + dur
    return {k: statistics.median(v.values()) * _US for k, v in per.items()}


def _step_of(ts: float, steps: list[tuple[float, float]]) -> int:
    """The last step that began at or before `ts` (a range after its step's marker closed stays with it)."""
    return bisect_right([s for s, _ in steps], ts) - 1


# ---- 2. nn.Module ranges ------------------------------------------------------------------------
def _module_times(events: list[dict], workload: Workload) -> dict[tuple[str, str], float]:
    mods = sorted((e for e in events if MODULE_EVENT.match(str(e.get("name")))), key=lambda e: (e["ts"], -e["dur"]))
    if not mods:
        return {}
    # nesting per thread: an event's parent is the innermost earlier event still open
    parent: dict[int, int | None] = {}
    open_by_thread: dict[tuple, list[int]] = {}
    for i, e in enumerate(mods):
        stack = open_by_thread.setdefault((e.get("pid"), e.get("tid")), [])
        while stack and mods[stack[-1]]["ts"] + mods[stack[-1]]["dur"] < e["ts"] + e["dur"]:
            stack.pop()
        parent[i] = stack[-1] if stack else None
        stack.append(i)
    model = [m for m in workload.modules if m.in_model]
    classes = workload.meta.get("module_classes") or {}
    root_class = workload.meta.get("model_class")
    if not isinstance(classes, dict) or not all(isinstance(c, str) for c in classes.values()):
        classes = {}  # a hand-edited meta that does not say the classes: match the root's children instead
    if not isinstance(root_class, str):
        root_class = None
    cls = lambda i: MODULE_EVENT.match(mods[i]["name"])["cls"]  # noqa: E731
    roots = [i for i in parent if parent[i] is None and (root_class is None or cls(i) == root_class)]
    per: dict[tuple[str, str], list[float]] = {}
    for r in roots:
        inside = [i for i in range(len(mods)) if i != r and _within(mods[i], mods[r])]
        matched: list[tuple[str, int]] = []
        if classes and all(m.name in classes for m in model):
            end = mods[r]["ts"]
            for m in model:  # greedy, in forward order: the next event of the module's class after the last match
                nxt = next((i for i in inside if mods[i]["ts"] >= end and cls(i) == classes[m.name]), None)
                if nxt is None:
                    break
                matched.append((m.name, nxt))
                end = mods[nxt]["ts"] + mods[nxt]["dur"]
        else:
            children = [i for i in inside if parent[i] == r]
            if len(children) == len(model):
                matched = [(m.name, i) for m, i in zip(model, children)]
        if len(matched) != len(model):
            continue
        for name, i in matched:
            per.setdefault((name, "forward"), []).append(float(mods[i]["dur"]))
    return {k: statistics.median(v) * _US for k, v in per.items()}


def _within(inner: dict, outer: dict) -> bool:
    return (inner.get("pid"), inner.get("tid")) == (outer.get("pid"), outer.get("tid")) and \
        outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
