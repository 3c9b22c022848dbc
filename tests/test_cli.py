"""The command line: bad input gives one error line and exit 2; a good run writes JSON, trace and CSV
with the documented content, and the text summary gives every number a unit.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys

import pytest
import yaml

from fsdp_sim.cli import main
from fsdp_sim.scenario import load_scenario
from fsdp_sim.schedule.ops import CATEGORIES
from fsdp_sim.simulate import simulate

GOOD = {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 1000},
        "training": {"micro_batch": 2, "seq_len": 32},
        "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": 8},
        "fsdp": {"wrap": "per_block"}}


def _write(tmp_path, data, name="tiny.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _with(section: str, key: str, value) -> dict:
    data = json.loads(json.dumps(GOOD))
    data.setdefault(section, {})[key] = value
    return data


def _run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


BAD = {  # case: (scenario data or YAML text, words the error line must contain)
    "unknown top-level key": ({**GOOD, "optimiser": "adamw"}, ["optimiser"]),
    "unknown nested key": (_with("fsdp", "wrapp", "per_block"), ["fsdp.wrapp"]),
    "wrong type": (_with("training", "micro_batch", "four"), ["training.micro_batch", "four"]),
    "unknown preset": ({**GOOD, "model": "gpt5-mini"}, ["model.preset", "gpt5-mini"]),
    "unknown hardware profile": (_with("hardware", "profile", "h999-sxm"), ["hardware.profile", "h999-sxm"]),
    "shard size not dividing world": (_with("fsdp", "shard_size", 3), ["fsdp.shard_size", "3", "8"]),
    "negative size": (_with("training", "seq_len", -5), ["training.seq_len", "-5"]),
    "invalid YAML": ("model: {hidden: 64, layers: [2\nhardware: h100\n", ["tiny.yaml", "YAML"]),
    "empty value": (_with("training", "seq_len", None), ["training.seq_len", "null"]),
    "absurd size": (_with("model", "hidden", 10**9), ["model.hidden", "limit"]),
    "absurd activations": ({**GOOD, "training": {"micro_batch": 2**20, "seq_len": 2**24}}, ["model", "PiB"]),
    "missing subcommand argument": (None, ["scenario"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    data, words = BAD[case]
    rc, out, err = _run(["run"] + ([str(_write(tmp_path, data))] if data is not None else []), capsys)
    assert rc == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fsdp-sim: error: ")
    assert "Traceback" not in err and out == ""
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_missing_file(tmp_path, capsys):
    rc, _, err = _run(["run", str(tmp_path / "nowhere.yaml")], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and "nowhere.yaml" in err


def test_subprocess_exit_status_and_stderr(tmp_path):
    """The real entry point (python -m fsdp_sim.cli): exit status 2, one stderr line, nothing else."""
    path = _write(tmp_path, _with("fsdp", "wrapp", "per_block"))
    p = subprocess.run([sys.executable, "-m", "fsdp_sim.cli", "run", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.splitlines() == [p.stderr.strip()] and "fsdp.wrapp" in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


def _run_model_source(key, tmp_path):
    (tmp_path / "model.json").write_text("{}")
    path = _write(tmp_path, {**GOOD, "model": {key: "model.json"}})
    return subprocess.run([sys.executable, "-m", "fsdp_sim.cli", "run", "-q", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("key", ["workload", "hf_config"])
def test_model_file_sources_error_cleanly(key, tmp_path):
    """model.workload / model.hf_config pointing at an empty JSON file: the one-line error naming the
    key or the file, never a traceback."""
    p = _run_model_source(key, tmp_path)
    assert "Traceback" not in p.stderr
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1
    assert "model.json" in p.stderr or f"model.{key}" in p.stderr


# ---- happy path ------------------------------------------------------------------------------------
JSON_KEYS = ["step_time_s", "peak.allocated_bytes", "peak.reserved_bytes", "peak.time_s", "peak.phase", "peak.unit",
             "peak.by_category", "memory.capacity_bytes", "memory.fits", "communication.all_gather_bytes",
             "communication.reduce_scatter_bytes", "communication.total_s", "communication.exposed_s",
             "communication.overlap_fraction", "compute.busy_s", "compute.mfu", "model.params", "units"]


@pytest.fixture(scope="module")
def happy(tmp_path_factory):
    """One run with every output file; returns (rc, stdout, stderr, dir, in-process result of the same file)."""
    tmp = tmp_path_factory.mktemp("happy")
    path = _write(tmp, GOOD)
    p = subprocess.run([sys.executable, "-m", "fsdp_sim.cli", "run", str(path), "--json", str(tmp / "r.json"),
                        "--trace", str(tmp / "t.json"), "--timeline-csv", str(tmp / "m.csv")],
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr, tmp, simulate(load_scenario(path))


def test_json_has_documented_keys(happy):
    rc, _, err, tmp, result = happy
    assert rc == 0 and err == ""
    data = json.loads((tmp / "r.json").read_text())
    for dotted in JSON_KEYS:
        node = data
        for part in dotted.split("."):
            assert part in node, dotted
            node = node[part]
    assert set(data["peak"]["by_category"]) == set(CATEGORIES)
    assert sum(data["peak"]["by_category"].values()) == data["peak"]["allocated_bytes"]
    over = data["memory"]["overheads_bytes"]
    assert set(over) == {"cuda_context", "nccl", "reserved_minus_allocated"}
    assert over["reserved_minus_allocated"] == data["peak"]["reserved_bytes"] - data["peak"]["allocated_bytes"]
    assert data["memory"]["required_bytes"] == data["peak"]["reserved_bytes"] + over["cuda_context"] + over["nccl"]
    persistent = data["memory"]["persistent_bytes"]
    assert {"sharded_params", "sharded_grads", "optimizer_states"} <= set(persistent)
    assert persistent["sharded_grads"] == max(int(v) for v in result.memory.levels[:, CATEGORIES.index("sharded_grads")])
    assert data["units"] and all(isinstance(u["params"], int) for u in data["units"])
    assert sum(u["params"] for u in data["units"]) == data["model"]["params"]
    assert data["step_time_s"] == pytest.approx(result.step_time_s)


def test_trace_is_chrome_trace_in_microseconds(happy):
    _, _, _, tmp, result = happy
    events = json.loads((tmp / "t.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] != "cpu"]
    assert len(spans) == sum(op.kind not in ("alloc", "free") for op in result.graph.ops)
    assert all(e["dur"] >= e["args"]["alone_us"] * (1 - 1e-9) for e in spans)  # overlap only slows
    launches = [e for e in events if e["ph"] == "X" and e["cat"] == "cpu"]
    assert launches and sum(e["dur"] for e in launches) == pytest.approx(result.timing.issued[-1] * 1e6)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(result.step_time_s * 1e6, rel=1e-9)
    threads = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "all_gather"} <= threads
    assert any(e["ph"] == "C" for e in events)


def test_timeline_csv_ends_at_persistent_bytes(happy):
    _, _, _, tmp, result = happy
    rows = list(csv.reader((tmp / "m.csv").read_text().splitlines()))
    header = rows[0]
    assert header[0] == "time_s" and "total_bytes" in header
    total = header.index("total_bytes")
    persistent = sum(b.nbytes for b in result.graph.persistent)
    assert int(rows[-1][total]) == persistent == int(rows[1][total])
    assert len(rows) - 1 == len(result.memory.time)


NUMBER = re.compile(r"(?<![\w.\-])-?\d+(?:\.\d+)?(?![\w.])")
UNIT_AFTER = re.compile(r"\s*(GiB|MiB|KiB|ms|s|%|B params|params|GPUs|GPU|units|tokens/s|tokens)\b|\s*%")


def test_summary_numbers_carry_units(happy):
    """Every standalone number in the text summary is followed by its unit. Identifiers with digits
    (h100-sxm, bf16, layers.0, 1x8, torch 2.13, NCCL 2.28.9) are not numbers; the mesh shape
    `shard N x replicate M` is a count."""
    rc, out, _, _, _ = happy
    assert rc == 0 and out.strip()
    for line in out.splitlines():
        text = re.sub(r"shard \d+ x replicate \d+|(torch|NCCL) [\d.]+", "", line)
        for m in NUMBER.finditer(text):
            assert UNIT_AFTER.match(text, m.end()), f"number {m.group()!r} without unit in: {line!r}"


def test_cli_surface_is_frozen():
    """Scripts call these commands and options: renaming one is a breaking change, made here on purpose."""
    from fsdp_sim.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    surface = {name: sorted(opt for a in p._actions for opt in a.option_strings) for name, p in sub.choices.items()}
    search = ["--color-by", "--executor", "--grid", "--html", "--jobs", "--max-batch", "--plot", "--quiet", "--scheduler",
              "--set", "-h", "--help", "-q"]
    assert surface == {
        "run": sorted(["--html", "--json", "--memory-snapshot", "--per-rank", "--plot", "--quiet", "--require-fit",
                       "--safety-margin", "--set", "--timeline-csv", "--trace", "--trace-ranks", "-h", "--help", "-q"]),
        "sweep": sorted([*search, "--output", "-o", "--resume"]),
        "recommend": sorted([*search, "--global-batch", "--json", "--save", "--top"]),
        "trace": sorted(["--batch", "--block-type", "--dtype", "--input-shape", "--name", "--output", "--quiet", "--seq",
                         "-h", "--help", "-o", "-q"]),
        "topology": sorted(["--nodes-per-leaf", "--output", "--quiet", "--spines", "--topology", "-h", "--help", "-o",
                            "-q"]),
    }
    assert sorted(opt for a in parser._actions for opt in a.option_strings) == ["--help", "--version", "-h"]


def test_plot_writes_a_png(tmp_path):
    """`--plot` draws the memory timeline and the streams (skipped without matplotlib)."""
    pytest.importorskip("matplotlib")
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump({"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256},
                                        "training": {"seq_len": 32}, "hardware": {"profile": "h100-sxm"}}))
    out = tmp_path / "step.png"
    assert main(["run", str(scenario), "-q", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_draws_budget_required_and_reserved(tmp_path):
    """The memory plot carries the lines the verdict is made of, so a peak under the capacity line cannot
    hide a DOES NOT FIT; forward, backward and the optimizer are shaded."""
    pytest.importorskip("matplotlib")
    from fsdp_sim.results.plot import phase_spans, step_figure

    path = _write(tmp_path, GOOD)
    result = simulate(load_scenario(path))
    summary = result.to_dict()["memory"]
    ax = step_figure(result).axes[0]
    levels = {round(line.get_ydata()[0] * (1 << 30)) for line in ax.lines if len(set(line.get_ydata())) == 1}
    for key in ("capacity_bytes", "budget_bytes", "required_bytes"):
        assert any(abs(v - summary[key]) <= 1 for v in levels), key
    assert any(abs(v - result.memory.reserved_bytes) <= 1 for v in levels)
    assert [p for p, _, _ in phase_spans(result)] == ["forward", "backward", "optimizer"]
    assert "FITS" in ax.get_title()


def test_envelope_keeps_the_peak_and_the_troughs():
    import numpy as np

    from fsdp_sim.results.plot import envelope_rows

    total = np.abs(np.sin(np.arange(100_000) / 7.0)) * np.arange(100_000)
    rows = envelope_rows(total, max_rows=1000)
    assert len(rows) <= 1003 and list(rows) == sorted(set(rows))
    assert int(np.argmax(total)) in rows and rows[0] == 0 and rows[-1] == len(total) - 1
    assert list(envelope_rows(total[:50])) == list(range(50))


def test_run_set_takes_a_flow_list_as_the_file_would(tmp_path, capsys):
    """`run --set 'variation.stragglers=[{...}]'` is the scenario with that list written in it: same JSON, and
    unlike the scenario without it (rank 3 at 0.8 paces the step: the slowest rank's factor 1 / 0.8)."""
    stragglers = [{"rank": 3, "speed": 0.8}]
    base = _write(tmp_path, GOOD)
    results = []
    for argv in (["--set", "variation.stragglers=[{rank: 3, speed: 0.8}]"], []):
        out = tmp_path / f"{len(results)}.json"
        assert main(["run", str(base), "-q", "--json", str(out), *argv]) == 0
        results.append(json.loads(out.read_text()))
    written = _write(tmp_path, {**GOOD, "variation": {"stragglers": stragglers}}, name="straggler.yaml")
    assert main(["run", str(written), "-q", "--json", str(tmp_path / "w.json")]) == 0
    from_file = json.loads((tmp_path / "w.json").read_text())
    drop = ("scenario", "name")
    assert {k: v for k, v in results[0].items() if k not in drop} == {k: v for k, v in from_file.items() if k not in drop}
    assert results[0]["hardware"]["slowest_rank_factor"] == pytest.approx(1 / 0.8)
    assert results[1]["hardware"]["slowest_rank_factor"] < 1.1  # the 2.6 % spread's expected slowest of 8
    capsys.readouterr()
    rc, out, err = _run(["run", str(base), "--set", "variation.stragglers=[{rank: 3, speed: 0.8}"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "variation.stragglers" in err and "expected" in err
