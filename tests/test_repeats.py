"""A sweep's repeated rows (sweep.py `_repeat_key`, schedule/build.py `structure_class`): points whose graphs
are equal share one simulation, and only those. Three things make that exact, each tested here: a structure
class is shared only by graphs that re-size alike (and two fresh builds in one class at one workload are equal);
what the rest of a step reads of its scenario is all in the key (every read recorded); and the rows a sweep
gives with repeats shared are the rows each point gives alone."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
from conftest import scenario_dicts
from hypothesis import HealthCheck, given, settings

from fsdp_sim import sweep
from fsdp_sim.datafile import read_data
from fsdp_sim.engine import play, replay
from fsdp_sim.errors import ScenarioError
from fsdp_sim.results.analysis import StepResult
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.schedule import build
from fsdp_sim.simulate import op_costs

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted(p for p in (ROOT / "scenarios").glob("*.yaml") if not p.name.endswith(".grid.yaml"))
BASE = read_data(ROOT / "scenarios" / "llama3-8b-8xh100.yaml", "scenario")
# the scenario's fields the step reads past its graph; the settings' are sweep.SETTINGS_READ
SCENARIO_READ = {"workload", "cluster", "compute", "allocator", "safety_margin", "settings"}


class _Recorder:
    """Forwards attribute reads to `obj`, noting each name."""

    def __init__(self, obj, seen: set, prefix: str) -> None:
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_seen", seen)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name):
        self._seen.add(self._prefix + name)
        return getattr(self._obj, name)


def _reads_past_the_graph(scenario) -> set[str]:
    """What pricing, play, memory replay and the sweep row read of the scenario and its settings."""
    seen: set[str] = set()
    graph = build.build_step(scenario.workload, scenario.units, scenario.settings)
    watched = _Recorder(dataclasses.replace(scenario, settings=_Recorder(scenario.settings, seen, "settings.")),
                        seen, "")
    costs = op_costs(watched)
    timing = play(graph.ops, costs.duration, host_s=costs.host_s, slowdowns=costs.slowdowns)
    memory = replay(graph, timing.start, timing.issued, timing.end, watched.allocator)
    sweep._row(StepResult(watched, graph, timing, memory, costs.times, costs.duration))
    return seen


def _allowed(seen: set[str]) -> set[str]:
    return seen - SCENARIO_READ - {f"settings.{f}" for f in sweep.SETTINGS_READ}


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_every_read_past_the_graph_of_a_shipped_scenario_is_in_the_repeat_key(path):
    assert not _allowed(_reads_past_the_graph(parse_scenario(read_data(path, "scenario"), base=path.parent)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario_dicts())
def test_every_read_past_the_graph_of_a_random_setup_is_in_the_repeat_key(data):
    try:
        scenario = parse_scenario(data)
    except ScenarioError:
        return
    assert not _allowed(_reads_past_the_graph(scenario))


def _point(**fsdp):
    data = copy.deepcopy(BASE)
    data["fsdp"] = {**data.get("fsdp", {}), **fsdp}
    data["training"] = {**data["training"], "micro_batch": 1, "seq_len": 1024}
    return parse_scenario(data, base=ROOT / "scenarios")


def _fresh(scenario):
    build._last.entry = None
    return build.build_step(scenario.workload, scenario.units, scenario.settings)


def _graphs_equal(a, b) -> bool:
    return (a.ops == b.ops and a.buffers == b.buffers and a.persistent == b.persistent
            and (a.memory_ops, a.memory_buffers, a.memory_bytes, a.memory_streams, a.compute_sites, a.memory_sites)
            == (b.memory_ops, b.memory_buffers, b.memory_bytes, b.memory_streams, b.compute_sites, b.memory_sites))


VARIANTS = [dict(wrap=w, **k, **s, backward_prefetch=p, mixed_precision={"reduce_dtype": r})
            for w, k in (("per_block", {}), ("every_k_blocks", {"blocks_per_unit": 4}), ("whole_model", {}))
            for s in ({"sharding_strategy": "FULL_SHARD", "reshard_after_forward": True},
                      {"sharding_strategy": "SHARD_GRAD_OP", "reshard_after_forward": False})
            for p in (True, False) for r in ("fp32", "bf16")]


def test_one_class_holds_exactly_the_settings_whose_graphs_are_equal():
    """Over wraps, sharding strategies, backward prefetch and reduce dtypes of llama3-8b: two settings share a
    structure class exactly when their fresh graphs at one token count are equal, and the runtime's no-ops are
    among them (prefetch under SHARD_GRAD_OP, prefetch and strategy for one whole-model unit)."""
    scenarios = [_point(**v) for v in VARIANTS]
    graphs = [_fresh(s) for s in scenarios]
    tokens = [build.structure_class(g) for g in graphs]
    assert all(t is not None for t in tokens)
    for i in range(len(graphs)):
        for j in range(i):
            assert (tokens[i] is tokens[j]) == _graphs_equal(graphs[i], graphs[j]), (VARIANTS[i], VARIANTS[j])
    same = {(i, j) for i in range(len(graphs)) for j in range(i) if tokens[i] is tokens[j]}
    assert len(same) >= 8 and len({id(t) for t in tokens}) < len(tokens)


def test_a_class_re_sizes_alike_at_another_token_count():
    """Settings that share a class at 1 x 1024 tokens, each made from its own template, give equal graphs at
    3 x 2048."""
    a, b = (dict(wrap="per_block", sharding_strategy="SHARD_GRAD_OP", reshard_after_forward=False, backward_prefetch=p)
            for p in (True, False))
    first = [_point(**a), _point(**b)]
    later = []
    for s, fsdp in zip(first, (a, b)):
        build._last.entry = None
        build.build_step(s.workload, s.units, s.settings)
        data = copy.deepcopy(BASE)
        data["fsdp"] = {**data.get("fsdp", {}), **fsdp}
        data["training"] = {**data["training"], "micro_batch": 3, "seq_len": 2048}
        other = parse_scenario(data, base=ROOT / "scenarios")
        later.append(build.build_step(other.workload, other.units, other.settings))
    assert build.structure_class(later[0]) is build.structure_class(later[1])
    assert _graphs_equal(*later)


def test_a_sweep_s_shared_repeats_give_each_point_s_own_row():
    """A grid with the runtime's no-ops in it, run in one process: rows equal each point's row computed alone
    (memos emptied before each), and some were shared."""
    axes = [("training.micro_batch", [1, 2]), ("training.seq_len", [1024, 2048]), ("fsdp.backward_prefetch", [True, False]),
            ("fsdp.sharding_strategy", ["FULL_SHARD", "SHARD_GRAD_OP"]), ("fsdp.wrap", ["per_block", "whole_model"])]
    datas = [data for _, data in sweep.points(BASE, axes)]
    shared, calls = [], []
    simulate = sweep.simulate

    def counted(*args):
        calls.append(1)
        return simulate(*args)
    sweep._repeats().clear()
    try:
        sweep.simulate = counted
        rows = sweep.sweep_points(datas, ROOT / "scenarios", jobs=1)
    finally:
        sweep.simulate = simulate
    shared = len(datas) - len(calls)
    for data, row in zip(datas, rows):
        sweep._repeats().clear()
        build._last.entry = None
        assert sweep.run_point(data, ROOT / "scenarios") == row
    assert shared >= len(datas) // 4


def test_a_structure_leaves_out_only_what_a_re_size_makes_again():
    """A compute site's work and a memory site's bytes are left out of a graph's structure; a collective's bytes,
    another buffer's size, a memory op's stream and a persistent buffer are not."""
    graph = _fresh(_point(wrap="per_block"))
    base = build._structure(graph)
    site = graph.compute_sites[0][0]
    sized = {b for *_, ids in graph.memory_sites for b in ids if b is not None}
    ops = list(graph.ops)
    ops[site] = dataclasses.replace(ops[site], flops=2 * ops[site].flops + 1)
    assert build._structure(graph.with_ops(ops)) == base
    buffers = list(graph.buffers)
    b = min(sized)
    buffers[b] = dataclasses.replace(buffers[b], nbytes=buffers[b].nbytes + 512)
    assert build._structure(graph.with_ops(list(graph.ops), buffers)) == base

    gather = next(op for op in graph.ops if op.kind == "all_gather")
    ops = list(graph.ops)
    ops[gather.id] = dataclasses.replace(gather, comm_bytes=gather.comm_bytes + 1)
    assert build._structure(graph.with_ops(ops)) != base
    buffers = list(graph.buffers)
    other = next(x for x in graph.buffers if x.id not in sized and x not in graph.persistent)
    buffers[other.id] = dataclasses.replace(other, nbytes=other.nbytes + 512)
    assert build._structure(graph.with_ops(list(graph.ops), buffers)) != base
    free = next(op for op in graph.ops if op.kind == "free")
    ops = list(graph.ops)
    ops[free.id] = dataclasses.replace(free, stream="elsewhere")
    assert build._structure(graph.with_ops(ops)) != base
    twin = graph.with_ops(list(graph.ops))
    twin.persistent = [dataclasses.replace(graph.persistent[0], nbytes=graph.persistent[0].nbytes + 512),
                       *graph.persistent[1:]]
    assert build._structure(twin) != base
