"""Sweeps on a Dask distributed cluster give the rows of the local run (skipped without dask.distributed)."""

from __future__ import annotations

import pytest
import yaml

from fsdp_sim.cli import main
from fsdp_sim.errors import ScenarioError
from fsdp_sim.executors import open_runner
from fsdp_sim.sweep import sweep

distributed = pytest.importorskip("distributed")

TINY = {"model": {"hidden": 64, "layers": 2, "heads": 4, "vocab": 256}, "training": {"seq_len": 32},
        "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": 8}}
AXES = ["training.micro_batch=1,2,3", "fsdp.wrap=per_block,whole_model", "fsdp.shard_size=3,8"]


@pytest.fixture(scope="module")
def cluster():
    """Two workers in this process: the point is the Dask path (tasks, chunks, gather), not the speed."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as c:
        yield c


def _scenario(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def test_rows_on_a_two_worker_cluster_equal_the_local_run(tmp_path, cluster):
    path = _scenario(tmp_path)
    local = sweep(path, AXES, jobs=1)
    remote = sweep(path, AXES, executor="dask", scheduler=cluster.scheduler_address)
    assert remote == local
    assert len(local[1]) == 12 and sum(bool(r["error"]) for r in local[1]) == 6  # shard size 3 does not divide 8
    assert "run_chunk" in cluster.scheduler.task_prefixes  # the work went through the scheduler
    assert all(w.state.executed_count for w in cluster.workers.values())  # and both workers ran some


def test_max_batch_on_the_cluster(tmp_path, cluster):
    path = _scenario(tmp_path)
    axes = ["fsdp.wrap=per_block,whole_model"]
    assert (sweep(path, axes, max_batch=True, executor="dask", scheduler=cluster.scheduler_address)
            == sweep(path, axes, max_batch=True, jobs=1))


def test_cli_sweep_and_recommend_on_the_cluster(tmp_path, cluster, capsys):
    path = _scenario(tmp_path)
    assert main(["sweep", path, "--set", "fsdp.wrap=per_block,whole_model", "--jobs", "1", "-o",
                 str(tmp_path / "local.json"), "-q"]) == 0
    assert main(["sweep", path, "--set", "fsdp.wrap=per_block,whole_model", "--executor", "dask", "--scheduler",
                 cluster.scheduler_address, "-o", str(tmp_path / "dask.json"), "-q"]) == 0
    assert (tmp_path / "dask.json").read_text() == (tmp_path / "local.json").read_text()
    grid = ["--set", "training.micro_batch=1,2", "--set", "fsdp.backward_prefetch=true,false"]
    assert main(["recommend", path, *grid, "--jobs", "1"]) == 0
    local = capsys.readouterr().out
    assert main(["recommend", path, *grid, "--executor", "dask", "--scheduler", cluster.scheduler_address]) == 0
    assert capsys.readouterr().out == local and local.startswith("Recommended")


def test_dask_local_starts_and_closes_its_own_cluster(tmp_path):
    with open_runner("dask-local", jobs=2, processes=False) as runner:
        assert runner.workers() == 2
        assert runner.map(abs, [-1, 2, -3], lambda n: None) == [1, 2, 3]
        client = runner.client
    assert client.status == "closed"


@pytest.mark.slow
def test_cli_dask_local_with_worker_processes(tmp_path):
    """--executor dask-local as a user runs it: a LocalCluster of two worker processes, the same rows."""
    path = _scenario(tmp_path)
    axes = ["--set", "training.micro_batch=1,2", "--set", "fsdp.wrap=per_block,whole_model", "-q"]
    assert main(["sweep", path, *axes, "--jobs", "1", "-o", str(tmp_path / "local.csv")]) == 0
    assert main(["sweep", path, *axes, "--executor", "dask-local", "--jobs", "2", "-o", str(tmp_path / "dask.csv")]) == 0
    assert (tmp_path / "dask.csv").read_text() == (tmp_path / "local.csv").read_text()


def test_bad_executor_options_are_one_line(tmp_path, capsys):
    path = _scenario(tmp_path)
    with pytest.raises(ScenarioError, match="--scheduler"):
        sweep(path, AXES, executor="dask")
    assert main(["sweep", path, "--set", "fsdp.wrap=per_block", "--scheduler", "tcp://127.0.0.1:1"]) == 2
    assert "only with --executor dask" in capsys.readouterr().err
    with pytest.raises(ScenarioError, match="cannot connect"):  # nothing listens there
        with open_runner("dask", scheduler="tcp://127.0.0.1:1", timeout_s=1):
            pass


def _die_once(marker: str, folder: str, data: dict) -> dict:
    """run_point, except that the first point of micro-batch 3 kills its worker process (as the kernel's OOM
    killer or a lost node would) before it returns: once, marked by a file all workers see."""
    import os
    import signal

    from fsdp_sim.sweep import run_point

    if data["training"]["micro_batch"] == 3 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return run_point(data, folder)


@pytest.mark.slow
def test_a_worker_killed_mid_chunk_is_replaced_and_the_rows_are_those_of_a_run_without_the_loss(tmp_path):
    """A dask-local cluster of two worker processes; one dies in the middle of a chunk. The scheduler runs
    that chunk again on a worker that lives (the nanny restarts the dead one), and every row arrives once,
    equal to the serial run's."""
    from functools import partial

    from fsdp_sim.sweep import points

    datas = [d for _, d in points(TINY, [("training.micro_batch", [1, 2, 3, 4]), ("fsdp.wrap", ["per_block", "whole_model"]),
                                         ("fsdp.shard_size", [3, 8]), ("fsdp.backward_prefetch", [True, False])])]
    marker = tmp_path / "died"
    work = partial(_die_once, str(marker), str(tmp_path))
    finished: list[int] = []
    def workers(client) -> set[str]:  # as the scheduler knows them (asking a worker could wait on the dead one)
        return set(client.scheduler_info()["workers"])  # addresses: a restarted worker listens on a new port

    with open_runner("dask-local", jobs=2) as runner:
        runner.client.wait_for_workers(2)
        before = workers(runner.client)
        rows = runner.map(work, datas, done=lambda at, results: finished.extend(at))
        after = workers(runner.client)
    assert len(before) == 2 and marker.exists() and before - after  # a worker did die; its chunk ran elsewhere
    assert sorted(finished) == list(range(len(datas)))  # each chunk's rows once
    assert rows == [_die_once(str(marker), str(tmp_path), d) for d in datas]


@pytest.mark.slow
def test_cli_dask_local_sweep_survives_a_killed_worker(tmp_path):
    """`fsdp-sim sweep --executor dask-local` as a user runs it; one of its two worker processes is killed
    once the first rows are in the file: the sweep ends normally, its file that of a local run."""
    import signal
    import subprocess
    import sys
    import time

    from pathlib import Path

    psutil = pytest.importorskip("psutil")
    # llama3-8b's points (a few ms each, not the tiny model's fraction of one): the sweep outlasts the kill
    path = str(Path(__file__).resolve().parents[1] / "scenarios" / "llama3-8b-8xh100.yaml")
    axes = ["--set", "training.micro_batch=" + ",".join(map(str, range(1, 41))), "--set", "training.seq_len=1024,2048",
            "--set", "fsdp.backward_prefetch=true,false", "-q"]
    assert main(["sweep", path, *axes, "--jobs", "1", "-o", str(tmp_path / "local.csv")]) == 0
    out = tmp_path / "dask.csv"
    argv = [sys.executable, "-m", "fsdp_sim.cli", "sweep", path, *axes, "--executor", "dask-local", "--jobs", "2",
            "-o", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_text().count("\n") > 1) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    written = out.read_text().count("\n") - 1 if out.exists() else 0
    workers = [p for p in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(p.cmdline())
               and "resource_tracker" not in " ".join(p.cmdline())]
    assert proc.poll() is None and 0 < written < 160 and len(workers) == 2, (written, proc.poll())
    workers[0].send_signal(signal.SIGKILL)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert out.read_text() == (tmp_path / "local.csv").read_text()
