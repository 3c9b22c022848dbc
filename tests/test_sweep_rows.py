"""`fsdp-sim sweep -o FILE`: rows written as they finish, kept when the sweep is stopped, completed by
`--resume` into the file an uninterrupted run writes; named choices in every format; the progress bar."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fsdp_sim import sweep as sweep_module
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


def test_a_named_choice_grid_writes_csv_json_and_jsonl(tmp_path, capsys):
    """The techniques grid names its choices: the rows carry the name under the axis (not the keys each
    choice sets, which differ between choices and crashed the CSV writer), in every format; bytes are
    integers."""
    scenario = ROOT / "scenarios" / "llama2-70b-8xa100-80gb.yaml"
    grid = ROOT / "scenarios" / "llama2-70b-8xa100-80gb-techniques.grid.yaml"
    names = list(yaml.safe_load(grid.read_text())["technique"])
    rows = {}
    for name in ("rows.csv", "rows.json", "rows.jsonl"):
        out = tmp_path / name
        assert main(["sweep", str(scenario), "--grid", str(grid), "--jobs", "1", "-q", "-o", str(out)]) == 0
        rows[name] = json.loads(out.read_text()) if name.endswith(".json") else _records(out)
    header = next(csv.reader(io.StringIO((tmp_path / "rows.csv").read_text())))
    assert header == ["technique", *COLUMNS]
    assert [r["technique"] for r in rows["rows.csv"]] == names
    assert rows["rows.json"] == rows["rows.jsonl"] and [r["technique"] for r in rows["rows.json"]] == names
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


RUN_POINT = sweep_module.run_point


class _Points:
    """run_point as the sweep calls it, counting the points it runs and stopping (Ctrl-C) at call `stop`."""

    def __init__(self, monkeypatch, stop: int | None = None):
        self.run, self.stop, self.seen = RUN_POINT, stop, []
        monkeypatch.setattr(sweep_module, "run_point", self)

    def __call__(self, data: dict, base):
        if self.stop is not None and len(self.seen) + 1 == self.stop:
            raise KeyboardInterrupt
        training, fsdp = data["training"], data.get("fsdp", {})
        self.seen.append((training["micro_batch"], fsdp["wrap"], fsdp["shard_size"]))
        return self.run(data, base)


def _swept(record: dict) -> tuple:
    return tuple(str(record[k]) for k in ("training.micro_batch", "fsdp.wrap", "fsdp.shard_size"))


@pytest.mark.parametrize("name", ["rows.csv", "rows.json", "rows.jsonl"])
def test_an_interrupted_sweep_keeps_its_rows_and_resume_runs_only_the_rest(tmp_path, monkeypatch, capsys, name):
    """Ctrl-C at the ninth point: the eight finished rows are in the file (flushed as they finished) and the
    exit is 130 with one line saying how to go on; `--resume` runs exactly the other eight points, and the
    file and the printed table are those of an uninterrupted run, byte for byte."""
    path = _scenario(tmp_path)
    reference = tmp_path / f"reference{Path(name).suffix}"
    assert main(["sweep", path, *AXES, "--jobs", "1", "-o", str(reference)]) == 0
    table = capsys.readouterr().out
    out = tmp_path / name

    _Points(monkeypatch, stop=9)
    assert main(["sweep", path, *AXES, "--jobs", "1", "-q", "-o", str(out)]) == 130
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "interrupted" in err[0] and str(out) in err[0] and "--resume" in err[0]
    kept = _records(out)
    assert len(kept) == 8
    by_point = {_swept(r): r for r in _records(reference)}
    assert all(by_point[_swept(r)] == r for r in kept)  # each kept row is its point's finished row
    assert {bool(r["error"]) for r in kept} == {True, False}  # failed points' rows (no figures) read back too

    points = _Points(monkeypatch)
    assert main(["sweep", path, *AXES, "--jobs", "1", "-o", str(out), "--resume"]) == 0
    assert len(points.seen) == TOTAL - 8
    assert {tuple(map(str, p)) for p in points.seen} == set(by_point) - {_swept(r) for r in kept}
    assert out.read_bytes() == reference.read_bytes()
    assert capsys.readouterr().out == table  # the table shows the resumed rows too


@pytest.mark.parametrize("name", ["rows.csv", "rows.json", "rows.jsonl"])
def test_resume_drops_a_row_cut_short_and_gives_the_rows_of_an_uninterrupted_sweep(tmp_path, monkeypatch, name):
    """A file cut in the middle of a row (a kill while writing), in completion order as a sweep writes it:
    `--resume` keeps the whole rows before the cut, reruns the cut one and the rest, and returns the rows an
    uninterrupted sweep returns (typed again from CSV text), with the row's file in the sweep's order.
    `--max-batch` too: its micro-batch is a result, not part of a point's identity."""
    from fsdp_sim.sweep import sweep

    path = _scenario(tmp_path)
    for max_batch, axes in ((False, AXES[1::2]), (True, ["fsdp.wrap=per_block,whole_model", "fsdp.shard_size=3,8"])):
        out = tmp_path / name
        keys, rows = sweep(path, axes, jobs=1, max_batch=max_batch, output=str(out))
        whole = out.read_text()
        lines = whole.splitlines(keepends=True)
        head = lines[:1] if name != "rows.jsonl" else []
        body = [line for line in lines[len(head):] if line.strip() not in ("]",)]
        body = body[::-1]  # another completion order
        cut = "".join(head + body[:2]) + body[2][: len(body[2]) // 2]
        if name == "rows.json":
            cut = "[\n" + "".join(line.rstrip("\n").removesuffix(",") + ",\n" for line in body[:2]) + body[2][:30]
        out.write_text(cut)
        points = _Points(monkeypatch) if not max_batch else None
        assert sweep(path, axes, jobs=1, max_batch=max_batch, output=str(out), resume=True) == (keys, rows)
        if points is not None:
            assert len(points.seen) == len(rows) - 2
            monkeypatch.undo()
        assert out.read_text() == whole


def test_resume_refuses_another_sweeps_file_in_one_line(tmp_path, capsys):
    path = _scenario(tmp_path)
    out = tmp_path / "rows.csv"
    assert main(["sweep", path, "--set", "training.micro_batch=1,2", "--jobs", "1", "-q", "-o", str(out)]) == 0
    cases = {  # argv after the scenario: words the one error line must name
        "another axis": (["--set", "fsdp.wrap=per_block", "-o", str(out), "--resume"], ["--resume", "rows.csv", "columns"]),
        "another value": (["--set", "training.micro_batch=1,4", "-o", str(out), "--resume"],
                          ["--resume", "training.micro_batch=2", "not a point"]),
        "no file named": (["--set", "training.micro_batch=1,2", "--resume"], ["--resume", "-o"]),
    }
    for argv, words in cases.values():
        assert main(["sweep", path, *argv, "--jobs", "1", "-q"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('{"training.micro_batch": 1, "error": ""}\nnot json\n{"training.micro_batch": 2, "error": ""}\n')
    assert main(["sweep", path, "--set", "training.micro_batch=1,2", "-q", "-o", str(jsonl), "--resume"]) == 2
    assert "line 2 is not a JSON row" in capsys.readouterr().err
    fresh = tmp_path / "fresh.jsonl"  # no file yet: --resume runs every point
    assert main(["sweep", path, "--set", "training.micro_batch=1,2", "--jobs", "1", "-q", "-o", str(fresh), "--resume"]) == 0
    assert len(_records(fresh)) == 2


def test_a_link_is_followed_and_a_pipe_gets_the_rows_as_they_finish(tmp_path):
    """The final rewrite replaces the regular file a link names, not the link (`-o /dev/stdout` with stdout
    redirected to a file must not replace /dev/stdout); a named pipe gets every row once, as they finish,
    and stays a pipe."""
    import stat
    import threading

    path = _scenario(tmp_path)
    argv = ["sweep", path, "--set", "training.micro_batch=1,2,3", "--jobs", "1", "-q", "-o"]
    target, link = tmp_path / "rows.csv", tmp_path / "link.csv"
    assert main([*argv, str(target)]) == 0
    expected = target.read_text()
    target.write_text("old")
    link.symlink_to(target)
    assert main([*argv, str(link)]) == 0
    assert link.is_symlink() and target.read_text() == expected
    fifo = tmp_path / "rows.fifo.csv"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    assert main([*argv, str(fifo)]) == 0
    reader.join(timeout=60)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(got[0].splitlines()) == sorted(expected.splitlines())
    assert main([*argv, str(fifo), "--resume"]) == 2  # nothing to read back from a pipe


# -- a sweep stopped from outside: a process of its own, stopped once its first rows are in the file -----------

LLAMA = ROOT / "scenarios" / "llama3-8b-8xh100.yaml"
BIG = ["--set", "training.micro_batch=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20",
       "--set", "training.seq_len=1024,2048,4096,8192", "--set", "fsdp.backward_prefetch=true,false",
       "--set", "training.activation_checkpointing=none,full"]
BIG_TOTAL = 320


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "fsdp_sim.cli", "sweep", str(LLAMA), *BIG, *argv]


@pytest.fixture(scope="module")
def big_reference(tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("reference") / "rows.csv"
    done = subprocess.run(_cli("--jobs", "2", "-q", "-o", str(out)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out.read_bytes()


def _start_and_wait_for_rows(argv: list[str], out: Path, rows: int = 1) -> subprocess.Popen:
    """The sweep in a process group of its own (as a shell runs it), once `rows` rows are in its file."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") > rows:  # the header, then rows
            return proc
        time.sleep(0.005)
    proc.kill()
    pytest.fail(f"no rows in {out} (exit {proc.poll()}): {proc.stderr.read()}")


def _children(pid: int) -> list[int]:
    psutil = pytest.importorskip("psutil")
    return [p.pid for p in psutil.Process(pid).children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "kill", "worker killed"])
def test_a_stopped_sweep_keeps_its_rows_and_resume_completes_it(tmp_path, big_reference, how):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it), SIGKILL of the group, or SIGKILL of one
    of the two pool workers, once the first rows are in the file: the finished rows stay (CSV parses, each
    row whole); Ctrl-C exits 130 and a dead worker 1, each with one line and no traceback; `--resume` then
    writes the file of an uninterrupted sweep."""
    out = tmp_path / "rows.csv"
    proc = _start_and_wait_for_rows(_cli("--jobs", "2", "-q", "-o", str(out)), out)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    elif how == "kill":
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        os.kill(_children(proc.pid)[0], signal.SIGKILL)
    code, err = proc.wait(timeout=60), proc.stderr.read()
    kept = _records(out)
    assert 0 < len(kept) < BIG_TOTAL, "the sweep ended before it was stopped"
    reference = {_swept_llama(r): r for r in csv.DictReader(io.StringIO(big_reference.decode()))}
    assert all(reference[_swept_llama(r)] == r for r in kept)
    if how != "kill":
        assert code == (130 if how == "ctrl-c" else 1)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "--resume" in lines[0] and "Traceback" not in err, err
        assert how == "ctrl-c" or "worker process died" in lines[0]
    with pytest.raises(ProcessLookupError):  # no worker left behind
        for _ in range(200):
            os.killpg(proc.pid, 0)
            time.sleep(0.05)
    done = subprocess.run(_cli("--jobs", "2", "-q", "-o", str(out), "--resume"), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == big_reference


def _swept_llama(record: dict) -> tuple:
    return tuple(record[k] for k in ("training.micro_batch", "training.seq_len", "fsdp.backward_prefetch",
                                     "training.activation_checkpointing"))


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
