"""`fsdp-sim sweep -o FILE`: the rows of a grid with named choices in every format; the progress bar."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdp_sim.cli import main
from fsdp_sim.sweep import COLUMNS

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}, "training": {"seq_len": 32},
        "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": 8}}
# 16 points, 8 of them errors (a shard size of 3 does not divide 8 GPUs)
AXES = ["--set", "training.micro_batch=1,2,3,4", "--set", "fsdp.wrap=per_block,whole_model", "--set", "fsdp.shard_size=3,8"]
TOTAL = 16


def _scenario(tmp_path: Path, data: dict = TINY) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _records(path: Path) -> list[dict]:
    """The rows in a file of any format, complete or stopped part-way (CSV cells as text)."""
    text = path.read_text()
    if path.suffix == ".csv":
        return list(csv.DictReader(io.StringIO(text)))
    lines = [line.removesuffix(",") for line in text.splitlines()]
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_a_named_choice_grid_writes_csv_and_json(tmp_path, capsys):
    """The techniques grid names its choices: the rows carry the name under the axis (not the keys each
    choice sets, which differ between choices and crashed the CSV writer), in CSV and JSON; bytes are
    integers."""
    scenario = ROOT / "scenarios" / "llama2-70b-8xa100-80gb.yaml"
    grid = ROOT / "scenarios" / "llama2-70b-8xa100-80gb-techniques.grid.yaml"
    names = list(yaml.safe_load(grid.read_text())["technique"])
    rows = {}
    for name in ("rows.csv", "rows.json"):
        out = tmp_path / name
        assert main(["sweep", str(scenario), "--grid", str(grid), "--jobs", "1", "-q", "-o", str(out)]) == 0
        rows[name] = json.loads(out.read_text()) if name.endswith(".json") else _records(out)
    header = next(csv.reader(io.StringIO((tmp_path / "rows.csv").read_text())))
    assert header == ["technique", *COLUMNS]
    assert [r["technique"] for r in rows["rows.csv"]] == names
    assert [r["technique"] for r in rows["rows.json"]] == names
    assert all(set(r) == {"technique", *COLUMNS} for r in rows["rows.json"])
    assert all(isinstance(r["peak_allocated_bytes"], int) and isinstance(r["required_bytes"], int) for r in rows["rows.json"])
    for text_row, json_row in zip(rows["rows.csv"], rows["rows.json"]):
        assert text_row["required_bytes"] == str(json_row["required_bytes"])
    assert capsys.readouterr().err == ""


def test_a_named_choice_colours_the_plot_by_its_name(tmp_path):
    """`--color-by` takes the columns the rows have: a named axis's name (its default), not the keys its
    choices set."""
    pytest.importorskip("matplotlib")
    path = _scenario(tmp_path)
    grid = tmp_path / "g.grid.yaml"
    grid.write_text("technique:\n  plain: {training.activation_checkpointing: none}\n"
                    "  checkpointing: {training.activation_checkpointing: full}\ntraining.micro_batch: [1, 2]\n")
    for extra in ([], ["--color-by", "technique"]):
        assert main(["sweep", path, "--grid", str(grid), "--jobs", "1", "-q", "--plot", str(tmp_path / "p.png"), *extra]) == 0
    assert main(["sweep", path, "--grid", str(grid), "--jobs", "1", "-q", "--plot", str(tmp_path / "p.png"),
                 "--color-by", "training.activation_checkpointing"]) == 2


LLAMA = ROOT / "scenarios" / "llama3-8b-8xh100.yaml"


def test_the_progress_bar_shows_on_a_terminal_with_an_eta_and_never_in_a_pipe(tmp_path):
    """stderr a terminal: a bar with a rate and an ETA; stderr a pipe (a log, CI): nothing on it."""
    import fcntl
    import pty
    import struct
    import termios

    argv = [sys.executable, "-m", "fsdp_sim.cli", "sweep", str(LLAMA), "--set", "training.micro_batch=1,2,3,4,5,6,7,8",
            "--set", "training.seq_len=1024,2048,4096,8192", "--set", "fsdp.backward_prefetch=true,false", "--jobs", "1"]
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # tqdm draws nothing 0 wide
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    stderr = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed: the sweep ended
            break
        if not chunk:
            break
        stderr += chunk
    stdout = proc.communicate(timeout=120)[0]
    os.close(leader)
    text = stderr.decode(errors="replace")
    assert proc.returncode == 0 and stdout.count("\n") == 65, text  # the table went to stdout: header and 64 rows
    assert "/64" in text and "config/s" in text and re.search(r"<\d\d:\d\d", text), text  # ETA: <mm:ss
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and piped.stderr == "" and piped.stdout == stdout
