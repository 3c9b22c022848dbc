"""Per-module times from a PyTorch profiler Chrome trace (`apply_profile_trace`)."""

from __future__ import annotations

import json
from dataclasses import replace
import statistics
from pathlib import Path

import pytest

from fsdp_sim.errors import ScenarioError
from fsdp_sim.workload import TransformerDims, build_transformer
from fsdp_sim.workload.io import load_workload, save_workload
from fsdp_sim.workload.profile_trace import apply_profile_trace

FIXTURE = Path(__file__).parent / "fixtures" / "profile_reference.json"
# the model tests/fixtures/make_profile_trace.py profiles (its TINY config), as dimensions
DIMS = TransformerDims(hidden=64, layers=2, heads=4, kv_heads=4, ffn_hidden=172, vocab=256)


def _analytic():
    return build_transformer(DIMS, micro_batch=2, seq_len=32, act_dtype="bf16", name="tiny")


def _expected(path: Path) -> dict[tuple[str, str], float]:
    """Median over the recorded steps of each label's duration, seconds (one occurrence per step here)."""
    per: dict[tuple[str, str], list[float]] = {}
    for e in json.loads(path.read_text())["traceEvents"]:
        if e["name"].startswith("fsdp_sim::"):
            _, name, phase = e["name"].split("::")
            per.setdefault((name, phase), []).append(e["dur"] * 1e-6)
    return {k: statistics.median(v) for k, v in per.items()}


def test_fixture_is_small_and_made_by_the_profiler():
    assert FIXTURE.stat().st_size < 300_000
    events = json.loads(FIXTURE.read_text())["traceEvents"]
    assert sum(e["name"].startswith("ProfilerStep#") for e in events) == 2


def test_labels_time_every_module():
    timed = apply_profile_trace(_analytic(), FIXTURE)
    expected = _expected(FIXTURE)
    assert [m.name for m in timed.modules] == ["tok_embeddings", "layers.0", "layers.1", "norm", "output", "loss"]
    for m in timed.modules:
        assert m.fwd_time_s == pytest.approx(expected[(m.name, "forward")])
        assert m.bwd_time_s == pytest.approx(expected[(m.name, "backward")])
        assert 0 < m.fwd_time_s < 1 and 0 < m.bwd_time_s < 1
    assert timed.meta["profile_trace"]["source"] == "labels"
    # everything else is unchanged
    assert [(m.name, m.saved_bytes, m.fwd_flops) for m in timed.modules] == \
        [(m.name, m.saved_bytes, m.fwd_flops) for m in _analytic().modules]


def test_times_survive_a_workload_file(tmp_path):
    timed = apply_profile_trace(_analytic(), FIXTURE)
    save_workload(timed, tmp_path / "w.yaml")
    assert load_workload(tmp_path / "w.yaml") == timed


def _write(tmp_path, events, name="trace.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def _x(name, ts, dur, cat="user_annotation", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_gpu_trace_sums_the_kernels_launched_inside_each_range(tmp_path):
    events = [
        _x("ProfilerStep#1", 0, 1000),
        _x("fsdp_sim::layers.0::forward", 10, 100),
        _x("cudaLaunchKernel", 20, 5, cat="cuda_runtime", correlation=1),
        _x("cudaLaunchKernel", 40, 5, cat="cuda_runtime", correlation=2),
        _x("fsdp_sim::layers.1::forward", 120, 100),
        _x("cudaLaunchKernel", 130, 5, cat="cuda_runtime", correlation=3),
        _x("fsdp_sim::layers.1::backward", 300, 50, tid=2),  # the autograd thread
        _x("cudaLaunchKernel", 310, 5, cat="cuda_runtime", tid=2, correlation=4),
        _x("cudaLaunchKernel", 600, 5, cat="cuda_runtime", correlation=5),  # outside every range
        _x("gemm", 200, 30, cat="kernel", tid=7, correlation=1),
        _x("gemm", 230, 20, cat="kernel", tid=7, correlation=2),
        _x("gemm", 260, 15, cat="kernel", tid=7, correlation=3),
        _x("gemm", 400, 40, cat="kernel", tid=7, correlation=4),
        _x("gemm", 700, 99, cat="kernel", tid=7, correlation=5),
        _x("fsdp_sim::layers.0::forward", 10, 100, cat="gpu_user_annotation", tid=7),  # ignored: GPU mirror
    ]
    timed = apply_profile_trace(_analytic(), _write(tmp_path, events))
    by = {m.name: m for m in timed.modules}
    assert by["layers.0"].fwd_time_s == pytest.approx(50e-6)  # kernel time, not the 100 us CPU range
    assert by["layers.1"].fwd_time_s == pytest.approx(15e-6)
    assert by["layers.1"].bwd_time_s == pytest.approx(40e-6)
    assert by["layers.0"].bwd_time_s is None and by["norm"].fwd_time_s is None


def test_steps_are_summed_then_the_median_taken(tmp_path):
    events = [_x("ProfilerStep#1", 0, 100), _x("ProfilerStep#2", 100, 100), _x("ProfilerStep#3", 200, 100)]
    for step, durs in enumerate(([10, 5], [30], [12, 6])):  # a module called twice in step 1 and 3
        for j, d in enumerate(durs):
            events.append(_x("fsdp_sim::norm::forward", 100 * step + 10 + 20 * j, d))
    timed = apply_profile_trace(_analytic(), _write(tmp_path, events))
    assert next(m for m in timed.modules if m.name == "norm").fwd_time_s == pytest.approx(18e-6)


def test_unknown_labels_are_reported(tmp_path):
    events = [_x("fsdp_sim::norm::forward", 0, 10), _x("fsdp_sim::encoder.7::forward", 20, 10)]
    timed = apply_profile_trace(_analytic(), _write(tmp_path, events))
    assert timed.meta["profile_trace"]["unknown_labels"] == ["encoder.7"]
    with pytest.raises(ScenarioError, match="encoder.7"):
        apply_profile_trace(_analytic(), _write(tmp_path, [events[1]], "only_unknown.json"))


def _module_events(root_ts=0):
    """A with_stack trace: nn.Module ranges, the root's children in forward order with nested ones."""
    t = root_ts
    ev = [_x("nn.Module: ReferenceTransformer_0", t, 1000, cat="python_function"),
          _x("nn.Module: Embedding_0", t + 10, 50, cat="python_function")]
    for i, start in enumerate((100, 400)):
        ev += [_x(f"nn.Module: TransformerBlock_{i}", t + start, 250, cat="python_function"),
               _x(f"nn.Module: RMSNorm_{2 * i}", t + start + 10, 20, cat="python_function"),
               _x(f"nn.Module: Linear_{4 * i}", t + start + 40, 30, cat="python_function")]
    ev += [_x("nn.Module: RMSNorm_4", t + 700, 40, cat="python_function"),
           _x("nn.Module: Linear_8", t + 800, 90 + root_ts / 1000, cat="python_function")]
    return ev


@pytest.mark.parametrize("classes", [None, {"tok_embeddings": "Embedding", "layers.0": "TransformerBlock",
                                            "layers.1": "TransformerBlock", "norm": "RMSNorm", "output": "Linear"}])
def test_nn_module_ranges_give_forward_times(tmp_path, classes):
    wl = _analytic()
    if classes:
        from dataclasses import replace
        wl = replace(wl, meta={"module_classes": classes, "model_class": "ReferenceTransformer"})
    path = _write(tmp_path, _module_events(0) + _module_events(10_000) + _module_events(20_000))
    timed = apply_profile_trace(wl, path)
    by = {m.name: m for m in timed.modules}
    assert by["tok_embeddings"].fwd_time_s == pytest.approx(50e-6)
    assert by["layers.1"].fwd_time_s == pytest.approx(250e-6)
    assert by["norm"].fwd_time_s == pytest.approx(40e-6)  # the final norm, not a block's
    assert by["output"].fwd_time_s == pytest.approx(100e-6)  # median of 90, 100, 110
    assert all(m.bwd_time_s is None for m in timed.modules) and by["loss"].fwd_time_s is None
    assert timed.meta["profile_trace"]["source"] == "nn.Module"


def test_bad_traces_are_scenario_errors(tmp_path):
    with pytest.raises(ScenarioError, match="not found"):
        apply_profile_trace(_analytic(), tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ScenarioError, match="not valid JSON"):
        apply_profile_trace(_analytic(), bad)
    bad.write_text(json.dumps({"something": 1}))
    with pytest.raises(ScenarioError, match="no traceEvents"):
        apply_profile_trace(_analytic(), bad)
    with pytest.raises(ScenarioError, match="no fsdp_sim::"):
        apply_profile_trace(_analytic(), _write(tmp_path, [_x("aten::mm", 0, 10, cat="cpu_op")]))


def test_regenerated_fixture_matches_a_traced_workload(tmp_path):
    pytest.importorskip("torch")
    import importlib.util

    import torch

    from fsdp_sim.torch_tools.reference_model import ReferenceTransformer, loss_fn
    from fsdp_sim.torch_tools.trace import trace_module

    spec = importlib.util.spec_from_file_location("make_profile_trace", FIXTURE.parent / "make_profile_trace.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    out = tmp_path / "profile.json"
    maker.main(out)
    assert out.stat().st_size < 300_000
    with torch.device("meta"):
        model = ReferenceTransformer(maker.TINY)
    traced = trace_module(model, (torch.zeros(maker.BATCH, maker.SEQ, dtype=torch.long),), loss_fn=loss_fn)
    timed = apply_profile_trace(traced, out)
    assert all(m.fwd_time_s and m.bwd_time_s for m in timed.modules)


def test_a_scenario_takes_compute_times_from_the_trace(tmp_path):
    """`compute: {trace: ...}` in a scenario: the measured durations replace the FLOP-based ones, at the
    slowest rank's pace as compute-bound time is (`variation`: 1.0 with every GPU alike)."""
    from fsdp_sim.hardware.costs import OpCosts
    from fsdp_sim.scenario import parse_scenario
    from fsdp_sim.simulate import simulate

    data = {"model": {"hidden": 64, "layers": 2, "heads": 4, "ffn_hidden": 172, "vocab": 256, "norm_impl": "composite"},
            "training": {"micro_batch": 2, "seq_len": 32}, "hardware": {"profile": "h100-sxm", "gpus_per_node": 2},
            "compute": {"trace": str(FIXTURE)}, "variation": {"gpu_speed_spread": 0}}
    sc = parse_scenario(data)
    timed = {m.name: m for m in sc.workload.modules if m.fwd_time_s is not None}
    assert {"layers.0", "layers.1", "output", "loss"} <= set(timed)
    result = simulate(sc)
    ops = {op.name: op for op in result.graph.ops}
    for name, m in timed.items():  # the GPU time alone; overlap with a collective may stretch it further
        assert result.alone_s(ops[f"{name} forward"]).total == pytest.approx(m.fwd_time_s)
        if m.bwd_time_s is not None:
            assert result.alone_s(ops[f"{name} backward"]).total == pytest.approx(m.bwd_time_s)
    # a rank named at half speed paces the step: the measured module times double, as --per-rank plays them
    slow = parse_scenario(data | {"variation": {"gpu_speed_spread": 0, "stragglers": [{"rank": 1, "speed": 0.5}]}})
    paced = simulate(slow)
    assert paced.pace_factor() == 2.0
    assert paced.alone_s({op.name: op for op in paced.graph.ops}["layers.0 forward"]).total == \
        pytest.approx(2 * timed["layers.0"].fwd_time_s)
    costs = OpCosts(sc.cluster, shard_size=2, replicate_size=1, compute_dtype="bf16")
    block = ops["layers.0 forward"]
    estimate = costs.compute.times(replace(block, measured_s=None)).total
    assert estimate != pytest.approx(timed["layers.0"].fwd_time_s)


def test_a_missing_trace_file_is_one_line(tmp_path):
    from fsdp_sim.scenario import parse_scenario

    with pytest.raises(ScenarioError, match="compute.trace"):
        parse_scenario({"model": "llama3-8b", "hardware": {"profile": "h100-sxm"}, "compute": {"trace": "nope.json"}},
                       base=tmp_path)
