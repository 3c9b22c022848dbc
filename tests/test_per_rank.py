"""`fsdp-sim run --per-rank` (simulate_ranks, results/ranks.py): every rank at its own speed agrees with the
default mode where it must (every GPU alike; the order-statistics answer on average), a straggler costs
what its compute-bound time says, a seed gives the same bytes, and bad `variation:` input is one line."""

from __future__ import annotations

import html
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from fsdp_sim.cli import main
from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.variation import Variation
from fsdp_sim.scenario import load_scenario, parse_scenario
from fsdp_sim.simulate import _simulate, simulate, simulate_ranks


def _llama3_8b(gpus: int, variation: dict | None = None, micro_batch: int = 1) -> dict:
    data = {"model": "llama3-8b", "training": {"micro_batch": micro_batch, "seq_len": 4096},
            "hardware": {"profile": "h100-sxm", "nodes": max(1, gpus // 8), "gpus_per_node": min(gpus, 8)}}
    return data | ({"variation": variation} if variation is not None else {})


@pytest.mark.parametrize("name", ["llama3-8b-8xh100", "llama2-7b-8xh100-fsdp1", "llama3-8b-32xh200-hsdp",
                                  "llama3-70b-64xh100-tp8", "llama3-8b-32xh100-efa-hpz",
                                  "llama2-7b-16xh100-fsdp1-hsdp-no-sync", "llama2-70b-8xa100-80gb-cpu-offload"])
def test_every_gpu_alike_is_the_default_mode(name):
    """Spread 0, nobody named: every rank is the representative rank, to the last bit or nearly (FSDP1's
    blocked CPU, HSDP, TP, hpZ, offload; a folded step against its every micro-batch played)."""
    sc = replace(load_scenario(f"scenarios/{name}.yaml"), variation=Variation(0.0))
    r, d = simulate_ranks(sc, traced=()), _simulate(sc)
    assert r.step_time_s == pytest.approx(d.step_time_s, rel=1e-12)
    assert np.allclose(r.ranks.end, d.step_time_s, rtol=1e-12, atol=0)
    a = r.activity()
    assert not a.waiting_s.any() and not a.stalled_s.any() and not r.ranks.held_back_s.any() and r.attribution() == []
    assert np.allclose(a.exposed_s, d.exposed_communication()[0], rtol=1e-9, atol=1e-12)
    # one answer: the per-rank compute and communication sections are the default mode's
    for got, want in ((r.compute(), d.compute()), (r.communication(), d.communication())):
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_one_rank_at_90_percent_slows_a_compute_bound_step_by_its_compute_share():
    """Llama 3 8B on 8 H100 at micro-batch 2 (compute-bound: 71 % of the step compute-bound kernels, 92 %
    overlap): with rank 3 at 0.9 of the speed, the step grows by its compute-bound seconds (matmul +
    attention) x (1/0.9 - 1): 8.6 % here. The memory-bound kernels and the communication do not scale.
    Exact in this model (to rounding): rank 3 arrives last at every collective, so its streams never wait
    for another rank and its step is the representative rank's with each kernel's compute-bound time scaled
    (the interference its kernels meet kept as the representative rank met it, engine/ranks.py)."""
    alike = simulate(parse_scenario(_llama3_8b(8, {"gpu_speed_spread": 0}, micro_batch=2)))
    r = simulate_ranks(parse_scenario(_llama3_8b(8, {"gpu_speed_spread": 0, "stragglers": [{"rank": 3, "speed": 0.9}]},
                                                 micro_batch=2)))
    br = alike.compute()["breakdown"]
    growth = (br["matmul_s"] + br["attention_s"]) * (1 / 0.9 - 1)
    assert r.step_time_s - alike.step_time_s == pytest.approx(growth, rel=1e-9)
    assert 0.07 < growth / alike.step_time_s < 0.1
    d = r.to_dict()
    assert d["per_rank"]["slowest_rank"] == 3 and d["per_rank"]["attribution"][0]["rank"] == 3
    # without rank 3 every rank is alike again: it cost the step all it added
    assert d["per_rank"]["attribution"][0]["cost_s"] == pytest.approx(r.step_time_s - alike.step_time_s, rel=1e-9)
    delayed = d["per_rank"]["collectives"]
    assert {c["rank"] for c in delayed} == {3} and sum(c["held_back_s"] for c in delayed) == pytest.approx(
        d["ranks"][3]["held_back_s"], rel=1e-12)
    assert d["ranks"][3]["collective_wait_s"] == 0 and all(x["collective_wait_s"] > 0 for x in d["ranks"] if x["rank"] != 3)
    assert d["ranks"][3]["stalled_s"] == 0  # nobody to wait for


def test_a_ranks_step_is_its_compute_exposed_communication_stall_and_the_rest():
    """Llama 3 8B on 32 H100 with a 2.6 % spread: per rank busy + exposed + stalled never passes its step,
    and the rest (the CPU, copies) is small; the waits for the group's last rank run mostly beside compute
    (prefetched), so the stall is a part of the wait; the summary, the JSON's compute and communication
    sections and the per_rank section give one figure each (the mean over the ranks)."""
    r = simulate_ranks(parse_scenario(_llama3_8b(32, {"gpu_speed_spread": 0.026})), traced=())
    a, d = r.activity(), r.to_dict()
    parts = a.busy_s + a.exposed_s + a.stalled_s
    assert (parts <= r.ranks.end + 1e-9).all() and (r.ranks.end - parts < 0.01 * r.ranks.end).all()
    assert (a.stalled_s <= a.waiting_s + 1e-12).all() and a.waiting_s.mean() > 2 * a.stalled_s.mean()
    p = d["per_rank"]
    assert d["communication"]["exposed_s"] == p["exposed_communication_s"]["mean"] == pytest.approx(a.exposed_s.mean())
    assert d["compute"]["busy_s"] == p["compute_busy_s"]["mean"]
    assert sum(d["communication"]["exposed_by_collective_s"].values()) >= d["communication"]["exposed_s"] - 1e-12
    br = d["compute"]["breakdown"]  # the classes still add up to the (mean) busy time
    assert br["matmul_s"] + br["attention_s"] + br["memory_bound_s"] + br["interference_s"] == pytest.approx(
        d["compute"]["busy_s"], rel=1e-3)
    for row, key in ((d["ranks"][5], "compute_busy_s"), (d["ranks"][5], "stalled_s")):
        assert row[key] == float(getattr(a, key.removeprefix("compute_"))[5])


def test_a_slow_node_is_its_ranks():
    nodes = simulate_ranks(parse_scenario(_llama3_8b(16, {"gpu_speed_spread": 0, "nodes": [{"node": 1, "speed": 0.9}]})))
    ranks = simulate_ranks(parse_scenario(_llama3_8b(16, {"gpu_speed_spread": 0, "stragglers": [
        {"rank": r, "speed": 0.9} for r in range(8, 16)]})))
    assert nodes.speeds.tolist() == ranks.speeds.tolist() == [1.0] * 8 + [0.9] * 8
    assert nodes.step_time_s == ranks.step_time_s


@pytest.mark.parametrize("gpus", [8, 128])
def test_per_rank_agrees_with_the_order_statistics_on_average(gpus):
    """The default mode paces the representative rank at the expected slowest of N draws, 1 - k_N sigma
    (hardware/variation.py); `--per-rank` draws the N speeds. Over 24 seeds the mean per-rank step is the
    default's within 4 standard errors of that mean (the seeds' spread) plus 0.3 % of the step: the default
    re-prices the collectives' interference at the paced speed, per-rank keeps the mean rank's, and
    E[1 / slowest] passes 1 / E[slowest] (Jensen), each a few tenths of a percent at most."""
    sc = parse_scenario(_llama3_8b(gpus, {"gpu_speed_spread": 0.026}))
    default = simulate(sc).step_time_s
    alike = simulate(replace(sc, variation=Variation(0.0))).step_time_s
    steps = np.array([simulate_ranks(replace(sc, variation=Variation(0.026, seed)), traced=()).step_time_s
                      for seed in range(24)])
    error = steps.std(ddof=1) / math.sqrt(len(steps))
    assert abs(steps.mean() - default) <= 4 * error + 0.003 * default
    assert steps.mean() > alike + 0.5 * (default - alike)  # the cost of scale is there, not lost in the slack


def _cli(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def _write(tmp_path, data, name="s.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_the_same_seed_gives_the_same_bytes(tmp_path, capsys):
    path = _write(tmp_path, _llama3_8b(16, {"gpu_speed_spread": 0.05, "seed": 7}))
    outs = []
    for k in range(2):
        rc, out, _ = _cli(["run", path, "--per-rank", "--json", str(tmp_path / f"{k}.json"),
                           "--trace", str(tmp_path / f"{k}.trace.json")], capsys)
        assert rc == 0
        outs.append(out)
    assert (tmp_path / "0.json").read_bytes() == (tmp_path / "1.json").read_bytes()
    assert (tmp_path / "0.trace.json").read_bytes() == (tmp_path / "1.trace.json").read_bytes()
    assert outs[0] == outs[1]
    other = _write(tmp_path, _llama3_8b(16, {"gpu_speed_spread": 0.05, "seed": 8}), "other.yaml")
    _cli(["run", other, "--per-rank", "-q", "--json", str(tmp_path / "2.json")], capsys)
    assert (tmp_path / "2.json").read_bytes() != (tmp_path / "0.json").read_bytes()


def test_the_json_summary_and_trace_say_who_held_the_step_back(tmp_path, capsys):
    path = _write(tmp_path, _llama3_8b(32, {"gpu_speed_spread": 0.01, "stragglers": [{"rank": 17, "speed": 0.9}]}))
    rc, out, _ = _cli(["run", path, "--per-rank", "--json", str(tmp_path / "r.json"), "--trace", str(tmp_path / "t.json"),
                       "--html", str(tmp_path / "r.html")], capsys)
    assert rc == 0
    d = json.loads((tmp_path / "r.json").read_text())
    assert len(d["ranks"]) == 32 and [x["rank"] for x in d["ranks"]] == list(range(32))
    assert d["step_time_s"] == max(x["step_time_s"] for x in d["ranks"])
    assert d["hardware"]["slowest_rank_factor"] == 1.0  # not paced: every rank played at its own speed
    top = d["per_rank"]["attribution"][0]
    assert top["rank"] == 17 and top["cost_s"] > 0
    assert "held back by       rank 17 (speed" in out and "cost the step" in out
    # each figure once, labelled whose it is: the summary prints the JSON's
    from fsdp_sim.results.report import fmt_time

    p = d["per_rank"]
    assert (f"{fmt_time(d['communication']['exposed_s'])} exposed a rank (mean of 32 ranks; most "
            f"{fmt_time(p['exposed_communication_s']['max'])})") in out
    assert f"{fmt_time(d['compute']['busy_s'])} a rank (mean of 32 ranks" in out
    assert (f"for the group's last rank {fmt_time(p['collective_wait_s']['mean'])} a rank: "
            f"{fmt_time(p['stalled_s']['mean'])} of it stalls the compute stream") in out
    assert "in collectives for the group's last rank" not in out
    page = (tmp_path / "r.html").read_text()  # the report's summary is the terminal's, its table the JSON's
    assert html.escape(out.rstrip("\n")) in page
    assert (f"<td>stalled for the group&#x27;s last rank</td><td data-v=\"{p['stalled_s']['mean']}\">"
            f"{fmt_time(p['stalled_s']['mean'])}</td>") in page
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert set(names) == {0, 17, d["per_rank"]["fastest_rank"]} and "slowest" in names[17]
    rc, _, _ = _cli(["run", path, "--per-rank", "-q", "--trace", str(tmp_path / "t2.json"), "--trace-ranks", "5,2"], capsys)
    trace = json.loads((tmp_path / "t2.json").read_text())
    assert rc == 0 and trace["otherData"]["traced_ranks"] == [2, 5]


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.floats(0.5, 1.5)), max_size=4, unique_by=lambda x: x[0]),
       st.integers(0, 15), st.floats(0.5, 0.99))
def test_slowing_a_rank_never_shortens_a_step(stragglers, rank, factor):
    """Monotone: one rank made slower, no rank's step ends sooner; and the step lies between every rank at
    the slowest speed and every rank at the fastest (nodes of alike ranks)."""
    base = {r: s for r, s in stragglers}
    sc = parse_scenario(_llama3_8b(16, {"gpu_speed_spread": 0}, micro_batch=1) | {
        "model": {"hidden": 512, "layers": 4, "heads": 8, "vocab": 32000}})

    def run(speeds: dict):
        return simulate_ranks(replace(sc, variation=Variation(0.0, stragglers=tuple(sorted(speeds.items())))), traced=())

    before = run(base)
    after = run(base | {rank: base.get(rank, 1.0) * factor})
    assert (after.ranks.end >= before.ranks.end - 1e-12).all()
    lo, hi = min(before.speeds), max(before.speeds)
    uniform = {v: replace(sc, variation=Variation(0.0, nodes=((0, v), (1, v)))) for v in (lo, hi)}
    slowest, fastest = (simulate_ranks(uniform[v], traced=()).step_time_s for v in (lo, hi))
    assert fastest - 1e-12 <= before.step_time_s <= slowest + 1e-12


BAD = {
    "rank out of range": ({"stragglers": [{"rank": 16, "speed": 0.9}]}, ["variation.stragglers[0].rank", "16", "0 to 15"]),
    "node out of range": ({"nodes": [{"node": 2, "speed": 0.9}]}, ["variation.nodes[0].node", "2"]),
    "speed zero": ({"stragglers": [{"rank": 1, "speed": 0}]}, ["variation.stragglers[0].speed", "(0, 1.5]"]),
    "speed too high": ({"nodes": [{"node": 0, "speed": 2.0}]}, ["variation.nodes[0].speed", "2.0"]),
    "unknown key": ({"straglers": []}, ["variation.straglers", "unknown key"]),
    "unknown item key": ({"stragglers": [{"rank": 1, "speed": 0.9, "why": "hot"}]}, ["variation.stragglers[0].why"]),
    "named twice": ({"stragglers": [{"rank": 1, "speed": 0.9}, {"rank": 1, "speed": 0.8}]}, ["rank 1", "twice"]),
    "not a list": ({"stragglers": {"rank": 1}}, ["variation.stragglers", "list"]),
    "negative seed": ({"seed": -1}, ["variation.seed", "-1"]),
    "seed not an integer": ({"seed": "x"}, ["variation.seed"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_variation_is_one_line_and_exit_2(case, tmp_path, capsys):
    variation, words = BAD[case]
    rc, out, err = _cli(["run", _write(tmp_path, _llama3_8b(16, variation)), "--per-rank"], capsys)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("argv, words", [(["--trace-ranks", "3"], ["--trace-ranks", "--per-rank"]),
                                         (["--per-rank", "--trace-ranks", "3"], ["--trace-ranks", "--trace"]),
                                         (["--per-rank", "--trace", "T", "--trace-ranks", "99"], ["--trace-ranks", "99", "16 ranks"])])
def test_bad_trace_ranks_is_one_line(argv, words, tmp_path, capsys):
    argv = [str(tmp_path / "t.json") if a == "T" else a for a in argv]
    rc, _, err = _cli(["run", _write(tmp_path, _llama3_8b(16))] + argv, capsys)
    assert rc == 2 and len(err.splitlines()) == 1
    for word in words:
        assert word in err


def test_a_named_straggler_paces_the_default_mode_too():
    """Without --per-rank the representative rank runs at the slowest rank's pace: a straggler slower than
    the spread's expected slowest sets it."""
    d = simulate(parse_scenario(_llama3_8b(8, {"gpu_speed_spread": 0.01, "stragglers": [{"rank": 0, "speed": 0.8}]})))
    hw = d.to_dict()["hardware"]
    assert hw["slowest_rank_factor"] == pytest.approx(1 / 0.8) and hw["slowest_named_speed"] == 0.8
    assert "slowest_named_speed" not in simulate(parse_scenario(_llama3_8b(8))).to_dict()["hardware"]


def test_a_straggler_in_a_named_node_paces_the_default_mode_at_both_speeds():
    """A rank named slow in a node named slow runs at the product of the two (`rank_speeds`), and the default
    mode's pace is that rank's; a rank named fast is no named pace."""
    var = {"gpu_speed_spread": 0.0, "stragglers": [{"rank": 9, "speed": 0.8}], "nodes": [{"node": 1, "speed": 0.9}]}
    sc = parse_scenario(_llama3_8b(16, var))
    hw = simulate(sc).to_dict()["hardware"]
    from fsdp_sim.hardware.variation import rank_speeds
    slowest = rank_speeds(sc.variation, 16, 8).min()
    assert hw["slowest_named_speed"] == pytest.approx(slowest) and hw["slowest_rank_factor"] == pytest.approx(1 / slowest)
    fast = simulate(parse_scenario(_llama3_8b(16, {"stragglers": [{"rank": 9, "speed": 1.2}]}))).to_dict()["hardware"]
    assert "slowest_named_speed" not in fast


def test_a_seed_drawing_a_rank_that_cannot_run_is_refused():
    from fsdp_sim.hardware.variation import rank_speeds

    # at the largest spread a scenario admits (0.15) a rank at zero is 6.7 sigma out, which no seed finds in
    # a test's time; a spread past that limit (rank_speeds checks whatever it is given) draws one at once
    with pytest.raises(ScenarioError, match="variation.seed"):
        rank_speeds(Variation(0.5, seed=0), 1024, 8)
