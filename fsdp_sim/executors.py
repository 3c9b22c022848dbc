"""Where a sweep's points run: in this process, in local processes, or on a Dask distributed cluster.

`open_runner(executor, jobs=..., scheduler=...)` is a context manager that yields a runner; its
`map(fn, items, tick)` returns `[fn(x) for x in items]` in order, calling `tick(n)` as n items finish.

- `local` (the default): this process for `jobs=1` or a single item, else a `ProcessPoolExecutor` with
  `jobs` workers (default: one per CPU), items sent in chunks.
- `dask`: the Dask cluster whose scheduler listens at `scheduler` (e.g. `tcp://10.0.0.5:8786`). Its
  workers need fsdp-sim installed (the same version) and any file the scenario names (a hardware
  profile path, an HF config, a workload) at the same absolute path, e.g. on a shared file system.
- `dask-local`: a `distributed.LocalCluster` on this machine, `jobs` single-threaded worker processes;
  started for the sweep and closed after it. Mostly a way to try the Dask path without a cluster.

Dask comes from the optional `dask` extra (`pip install -e '.[dask]'`, dask[distributed]). Items are sent
in chunks so that the scheduler's per-task cost (about a millisecond) stays small beside a point's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Any

from fsdp_sim.errors import ScenarioError

EXECUTORS = ("local", "dask", "dask-local")
_INSTALL = "pip install -e '.[dask]' (or pip install 'dask[distributed]')"

Tick = Callable[[int], None]


def _chunk_size(n: int, workers: int) -> int:
    """About eight chunks per worker, at most 64 items each: small enough to balance, large enough that
    dispatch costs little beside the work."""
    return max(1, min(64, n // (8 * max(1, workers))))


def _chunks(items: Sequence, size: int) -> list[list]:
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def _run_chunk(fn: Callable, chunk: list) -> list:
    return [fn(x) for x in chunk]


def _no_tick(n: int) -> None:
    pass


class SerialRunner:
    """Every item in this process, in order."""

    def map(self, fn: Callable, items: Sequence, tick: Tick = _no_tick) -> list:
        out = []
        for x in items:
            out.append(fn(x))
            tick(1)
        return out


class ProcessRunner:
    """A pool of local processes, opened at the first map that needs it and kept for the next ones."""

    def __init__(self, jobs: int | None):
        self.jobs = jobs or os.cpu_count() or 1
        self._pool: ProcessPoolExecutor | None = None

    def map(self, fn: Callable, items: Sequence, tick: Tick = _no_tick) -> list:
        if len(items) <= 1:
            return SerialRunner().map(fn, items, tick)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.jobs)
        out = []
        for x in self._pool.map(fn, items, chunksize=_chunk_size(len(items), self.jobs)):
            out.append(x)
            tick(1)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class DaskRunner:
    """Chunks of items as tasks on a `distributed.Client`'s cluster; results gathered in order."""

    def __init__(self, client: Any):
        self.client = client

    def workers(self) -> int:
        return max(1, sum(self.client.nthreads().values()))

    def map(self, fn: Callable, items: Sequence, tick: Tick = _no_tick) -> list:
        if not items:
            return []
        chunks = _chunks(items, _chunk_size(len(items), self.workers()))
        # pure=False: every point is its own task, and the scheduler need not hash the scenario data
        futures = self.client.map(partial(_run_chunk, fn), chunks, pure=False)
        out: list = []
        try:
            for future, chunk in zip(futures, chunks):
                out.extend(_result(future))
                tick(len(chunk))
        finally:
            self.client.cancel(futures)
        return out


def _result(future) -> list:
    try:
        return future.result()
    except ModuleNotFoundError as exc:  # a worker without fsdp-sim: say what to do, not a traceback
        raise ScenarioError(f"--executor dask: a worker cannot import {exc.name!r}; install fsdp-sim on every "
                            "worker (the same version as here)") from None


def _distributed():
    try:
        import distributed
    except ImportError:
        raise ScenarioError(f"--executor dask needs dask.distributed: {_INSTALL}") from None
    return distributed


def check(executor: str, scheduler: str | None) -> None:
    """Refuse a combination of options that cannot run, before any simulation."""
    if executor not in EXECUTORS:
        raise ScenarioError(f"--executor: {executor!r}, expected one of {list(EXECUTORS)}")
    if executor == "dask" and not scheduler:
        raise ScenarioError("--executor dask: give the scheduler's address with --scheduler, e.g. tcp://host:8786 "
                            "(or --executor dask-local for a cluster on this machine)")
    if scheduler and executor != "dask":
        raise ScenarioError(f"--scheduler: only with --executor dask (got --executor {executor})")
    if executor != "local":
        _distributed()


@contextmanager
def open_runner(executor: str = "local", *, jobs: int | None = None, scheduler: str | None = None,
                timeout_s: float = 30.0, processes: bool = True) -> Iterator[Any]:
    """A runner for `executor`, closed (its pool, client and local cluster) on exit.

    `processes=False` gives `dask-local` threads in this process instead of worker processes (for
    tests: the simulation holds the GIL, so it is no faster than `local` with jobs=1)."""
    check(executor, scheduler)
    if executor == "local":
        if jobs == 1:
            yield SerialRunner()
            return
        runner = ProcessRunner(jobs)
        try:
            yield runner
        finally:
            runner.close()
        return
    distributed = _distributed()
    cluster = None
    try:
        if executor == "dask-local":
            # CRITICAL: the cluster is this sweep's, closed by it, and its shutdown can race (a worker's
            # heartbeat to the closed scheduler logs a CommClosedError traceback after the rows are in);
            # a task that fails still reaches the sweep through its future
            cluster = distributed.LocalCluster(n_workers=jobs or os.cpu_count() or 1, threads_per_worker=1,
                                               processes=processes, dashboard_address=":0",
                                               silence_logs=logging.CRITICAL)
            client = distributed.Client(cluster)
        else:
            client = distributed.Client(scheduler, timeout=timeout_s)
    except (OSError, TimeoutError) as exc:
        if cluster is not None:
            cluster.close()
        raise ScenarioError(f"--scheduler {scheduler}: cannot connect to a Dask scheduler ({exc})") from None
    try:
        yield DaskRunner(client)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
