"""The re-priced and re-sized graphs (schedule/build.py) are the graphs a build gives: op by op, buffer by
buffer, over every shipped scenario and over random setups, for points that split a micro-batch's tokens
differently, points at other token counts and modules whose compute alone was changed; and they are made
exactly where two fresh builds differ only in their module passes' compute ops and their buffers' bytes."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import scenario_dicts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_sim.datafile import read_data
from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule import build
from fsdp_sim.workload.model import Workload

SCENARIOS = sorted(p for p in (Path(__file__).parents[1] / "scenarios").glob("*.yaml") if not p.name.endswith(".grid.yaml"))
FRESH = build.BUILDERS


def _same(a, b) -> bool:
    """Two graphs equal in every op (all fields, buffers included), buffer, memory column and site."""
    return (a.ops == b.ops and a.buffers == b.buffers and a.persistent == b.persistent
            and (a.memory_ops, a.memory_buffers, a.memory_bytes, a.memory_streams, a.recorded_frees, a.compute_sites)
            == (b.memory_ops, b.memory_buffers, b.memory_bytes, b.memory_streams, b.recorded_frees, b.compute_sites))


def _only_work_differs(a, b, *, sizes: bool) -> bool:
    """Fresh builds `a` and `b` differ at most in the work of their module passes' compute ops and, with
    `sizes`, in the bytes of their buffers (the same buffers, allocated and freed by the same ops)."""
    if a.compute_sites is None or a.compute_sites != b.compute_sites or len(a.ops) != len(b.ops):
        return False
    sites = {i for i, _, _ in a.compute_sites}
    work = ("flops", "hbm_bytes", "measured_s", "kernels")

    def blank(op):
        if op.id in sites:
            return replace(op, **{f: None for f in work})
        if sizes and op.kind in ("alloc", "free"):
            return replace(op, buffer=replace(op.buffer, nbytes=0))
        return op
    unsized = (lambda bufs: [replace(x, nbytes=0) for x in bufs]) if sizes else list  # noqa: E731
    return ([blank(op) for op in a.ops] == [blank(op) for op in b.ops] and unsized(a.buffers) == unsized(b.buffers)
            and a.persistent == b.persistent and (sizes or a.memory_bytes == b.memory_bytes))


def _after(first, second):
    """`second`'s graph from `build_step` right after `first`'s, and whether it was made from the first's."""
    build._last.entries = {}
    build.build_step(first.workload, first.units, first.settings)
    template = build._last.entries.get(first.settings.grad_accumulation)
    graph = build.build_step(second.workload, second.units, second.settings)
    return graph, (template is not None and graph is not template[1]
                   and build._last.entries.get(second.settings.grad_accumulation) is template)


def _check_pair(first, second) -> bool:
    graph, reused = _after(first, second)
    fresh = FRESH[second.settings.version](second.workload, second.units, second.settings)
    assert _same(graph, fresh)
    s = first.settings
    reusable = s.version > 0 and s.tp == 1  # build.py: plain and TP are built afresh
    resizable = not (s.activation_offload or s.output_dtype or s.unit_output_dtype)  # build.py: bytes read elsewhere
    other = FRESH[s.version](first.workload, first.units, s)
    assert reused == (reusable and _only_work_differs(other, fresh, sizes=resizable))
    return reused


def _split(data: dict, base: Path | None):
    """The scenario of `data` and its twin: twice the micro-batch at half the sequence (None: odd sequence)."""
    first = parse_scenario(data, base=base)
    seq = first.workload.meta.get("block_activations", {}).get("seq_len")
    if not seq or seq % 2:
        return first, None
    twin = copy.deepcopy(data)
    training = twin.setdefault("training", {})
    training["micro_batch"], training["seq_len"] = 2 * training.get("micro_batch", 1), seq // 2
    return first, parse_scenario(twin, base=base)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_a_twin_of_every_shipped_scenario_is_repriced_exactly_when_only_its_compute_differs(path):
    first, twin = _split(read_data(path, "scenario"), path.parent)
    if twin is None:
        pytest.skip("its workload has no sequence to split (a traced workload, a vision model)")
    _check_pair(first, twin)


def test_the_llama3_8b_twin_is_repriced():
    """The case the shortcut is for: 2 x 4096 tokens after 1 x 8192 (llama3-8b's SDPA is linear in memory)."""
    first, twin = _split(read_data(SCENARIOS[0].parent / "llama3-8b-8xh100.yaml", "scenario"), SCENARIOS[0].parent)
    assert _check_pair(first, twin)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario_dicts(), st.sampled_from([1, 2]), st.sampled_from(["none", "full", "selective_op", "selective_layer"]),
       st.booleans(), st.booleans())
def test_random_setups_and_their_twins(data, version, ac, lora, offload):
    data = copy.deepcopy(data)
    data["fsdp"]["version"] = version
    data["training"]["activation_checkpointing"] = ac
    if ac == "selective_layer":
        data["training"]["ac_every"] = 2
    if lora:
        data["lora"] = {"rank": 4, "targets": ["q_proj", "v_proj"]}
    if offload:
        data["fsdp"]["offload_policy" if version == 2 else "cpu_offload"] = "CPUOffloadPolicy" if version == 2 else True
    data["training"]["seq_len"] += data["training"]["seq_len"] % 2
    try:
        first, twin = _split(data, None)
    except ScenarioError:
        return  # a combination the scenario refuses (its own tests cover the refusals)
    _check_pair(first, twin)
    longer = _resized(data, None, seq_len=data["training"]["seq_len"] + 6, micro_batch=data["training"]["micro_batch"] + 1)
    if longer is not None:
        _check_pair(first, longer)


def _recomputed(workload: Workload) -> Workload:
    """`workload` with every module's compute changed and nothing else: FLOPs, HBM bytes, measured times,
    and kernels of twice the rows (which moves what a selective policy caches: a byte a build reads)."""
    def kernels(m):
        return tuple(replace(k, shape=(2 * k.shape[0], *k.shape[1:])) if k.shape else k for k in m.kernels)
    modules = tuple(replace(m, fwd_flops=3 * m.fwd_flops + 1, bwd_flops=2 * m.bwd_flops + 1, kernels=kernels(m),
                            fwd_hbm_bytes=5 * m.fwd_hbm_bytes + 7, fwd_time_s=1e-3, bwd_time_s=2e-3)
                    for m in workload.modules)
    return replace(workload, modules=modules, model_flops=workload.model_flops + 1)


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_no_build_reads_compute_or_the_workloads_name_flops_and_meta(path):
    """A workload whose name and meta changed is re-priced, and one whose modules' compute changed is
    re-priced or re-sized exactly when fresh builds differ only there (a selective policy's cache moves
    with its kernels), into what a build of it gives (FSDP, no TP): no branch of a build reads them."""
    sc = parse_scenario(read_data(path, "scenario"), base=path.parent)
    if sc.settings.version == 0 or sc.settings.tp > 1:
        pytest.skip("built afresh at every point (schedule/build.py)")
    assert _check_pair(sc, replace(sc, workload=replace(sc.workload, name="renamed", meta={})))
    _check_pair(sc, replace(sc, workload=_recomputed(sc.workload)))


def _resized(data: dict, base: Path | None, **training):
    """The scenario of `data` with `training` changed (None: a combination the scenario refuses)."""
    other = copy.deepcopy(data)
    other.setdefault("training", {}).update(training)
    try:
        return parse_scenario(other, base=base)
    except ScenarioError:
        return None


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_other_token_counts_of_every_shipped_scenario_are_resized_exactly_when_only_sizes_and_compute_differ(path):
    """The same settings at other token counts (more and fewer sequences, a longer and a shorter sequence):
    the graph made from the last build is a fresh build's, and made exactly when the two fresh builds
    differ only in their buffers' bytes and their module passes' compute."""
    data = read_data(path, "scenario")
    first, _ = _split(data, path.parent)
    seq = first.workload.meta.get("block_activations", {}).get("seq_len")
    if not seq:
        pytest.skip("its workload has no sequence to change (a traced workload, a vision model)")
    mb = data.get("training", {}).get("micro_batch", 1)
    for training in ({"micro_batch": mb + 1, "seq_len": seq}, {"micro_batch": mb, "seq_len": 2 * seq},
                     {"micro_batch": mb, "seq_len": max(1, seq // 4)}):
        other = _resized(data, path.parent, **training)
        if other is not None:
            _check_pair(first, other)


def test_the_llama3_8b_grid_s_next_token_count_is_resized():
    """The case the re-size is for: 1 x 4096 tokens after 1 x 2048, the same settings."""
    data = read_data(SCENARIOS[0].parent / "llama3-8b-8xh100.yaml", "scenario")
    first = _resized(data, SCENARIOS[0].parent, micro_batch=1, seq_len=2048)
    assert _check_pair(first, _resized(data, SCENARIOS[0].parent, micro_batch=1, seq_len=4096))


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_a_step_simulated_right_after_another_token_count_gives_a_fresh_simulations_figures(path):
    """A re-sized or re-priced graph shares what was derived from its template's structure (`OpGraph.derived`:
    the stream queues, the ledger's columns, the compute stream's order); its simulation, made right after
    the template's, gives every figure a simulation of a fresh build of it gives."""
    from fsdp_sim.simulate import simulate

    data = read_data(path, "scenario")
    first, _ = _split(data, path.parent)
    seq = first.workload.meta.get("block_activations", {}).get("seq_len")
    other = _resized(data, path.parent, micro_batch=data.get("training", {}).get("micro_batch", 1) + 1,
                     seq_len=seq) if seq else None
    if other is None:
        pytest.skip("its workload has no sequence to change (a traced workload, a vision model)")
    build._last.entries = {}
    template = simulate(first)
    after = simulate(other)
    build._last.entries = {}
    fresh = simulate(other)
    queues = [r.graph.derived("queues", lambda: None) for r in (template, after, fresh)]
    assert queues[2] is not queues[1] and (queues[1] is queues[0] or path.stem not in REUSED), "derived again"
    assert after.to_dict() == fresh.to_dict()


REUSED = {"llama3-8b-8xh100", "llama2-7b-8xa100-80gb"}  # shipped scenarios whose next micro-batch is re-sized


def test_what_a_graph_derives_is_shared_by_its_twins_and_derived_again_once_it_grows():
    from fsdp_sim.schedule.ops import OpGraph

    g = OpGraph()
    g.alloc("compute", "a", "activations", 1 << 20)
    calls = []
    first = g.derived("x", lambda: calls.append(1) or len(g.ops))
    twin = g.with_ops(list(g.ops))
    assert twin.derived("x", lambda: calls.append(1) or -1) == first == 1 and len(calls) == 1
    g.alloc("compute", "b", "activations", 1 << 20)  # the graph grew: what it derived is out of date
    assert g.derived("x", lambda: calls.append(1) or len(g.ops)) == 2 and len(calls) == 2


def test_a_folded_steps_next_point_makes_both_its_graphs_from_the_last_pair():
    """A step of more than three micro-batches is simulated at two and three (results/folded.py): the next
    point (one more sequence per micro-batch) makes each of its two graphs from the last point's graph of the
    same count, where one kept graph would have been the other count's every time, and its figures are a
    fresh simulation's."""
    from fsdp_sim.simulate import simulate

    path = SCENARIOS[0].parent / "llama3-8b-8xh200-accumulation-keep-unsharded.yaml"
    data = read_data(path, "scenario")
    assert data["training"]["grad_accumulation"] > 3
    mb = data["training"].get("micro_batch", 1)
    first, second = (_resized(data, path.parent, micro_batch=mb + k) for k in (0, 1))
    build._last.entries = {}
    simulate(first)
    pair = dict(build._last.entries)
    assert sorted(pair) == [2, 3]
    after = simulate(second)
    assert build._last.entries == pair and all(build._last.entries[k] is pair[k] for k in pair)  # made from them
    build._last.entries = {}
    assert after.to_dict() == simulate(second).to_dict()
