"""Where a sweep's points run: in this process, in local processes, or on a Dask distributed cluster.

`open_runner(executor, jobs=..., scheduler=...)` is a context manager that yields a runner; its
`map(fn, items, tick, done=..., groups=...)` returns `[fn(x) for x in items]` in order, calling `tick(n)` as
n items finish and `done(indices, results)` with each finished chunk as it finishes (in the order they
finish, so that a sweep can write its rows while later chunks still run: a killed sweep keeps what
finished); `groups`, each item's group (alike items side by side), keeps a group in one chunk where it can.

- `local` (the default): this process for `jobs=1` or a single item, else a `ProcessPoolExecutor` with
  `jobs` workers (default: one per CPU), items sent in chunks.
- `dask`: the Dask cluster whose scheduler listens at `scheduler` (e.g. `tcp://10.0.0.5:8786`). Its
  workers need fsdp-sim installed (the same version) and any file the scenario names (a hardware
  profile path, an HF config, a workload) at the same absolute path, e.g. on a shared file system.
- `dask-local`: a `distributed.LocalCluster` on this machine, `jobs` single-threaded worker processes;
  started for the sweep and closed after it. Mostly a way to try the Dask path without a cluster.

Dask comes from the optional `dask` extra (`pip install -e '.[dask]'`, dask[distributed]). Items are sent
in chunks so that the scheduler's per-task cost (about a millisecond) stays small beside a point's.

A worker lost mid-sweep: on Dask, the scheduler hands the tasks the worker held (running, queued, or
finished but not yet gathered) to the other workers, and the rows are those of a run without the loss
(a task that kills `distributed.scheduler.allowed-failures` workers, 3 by default, is given up:
`WorkerLost`). No `retries=` on the tasks: those re-run a task that raised, and a point's own failure is
already its row's error; anything else a task raises is a bug that would raise again. A local process
pool cannot replace a dead process (`BrokenProcessPool`): `WorkerLost` too, and the sweep's finished
rows stay in its file for `--resume`.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from functools import partial
from typing import Any

from fsdp_sim.errors import ScenarioError

EXECUTORS = ("local", "dask", "dask-local")
_INSTALL = "pip install -e '.[dask]' (or pip install 'dask[distributed]')"

Tick = Callable[[int], None]
Done = Callable[[range, list], None]  # (the indices of a finished chunk's items, their results)


class WorkerLost(RuntimeError):
    """A worker process died (killed, out of memory, crashed) and its items cannot be run elsewhere."""


CHUNK = 64  # items: a chunk's dispatch (a pickled message each way, a few wake-ups) is then ~1 % of its work


def _starts(n: int, workers: int, groups: Sequence | None = None) -> list[int]:
    """Where each chunk of `n` items starts (and `n`, where the last ends): each chunk a (2 x workers)-th of
    the items left, at most CHUNK (guided self-scheduling). Chunks shrink toward the end, so that a worker
    that finishes early waits at most for a small one (in fixed chunks of 64 points of ~10 ms, one worker
    could idle for up to 0.6 s while the other ran the last). The items of a chunk stay together in one
    worker, in order; `groups` (each item's, alike items side by side: the sweep's dispatch order) moves a
    chunk's end back to where a group ends, when one does in the chunk's second half, so that a group's
    points meet one worker's memos (a graph re-sized rather than built) instead of two."""
    starts, at = [0], 0
    while at < n:
        end = at + min(CHUNK, -(-(n - at) // (2 * max(1, workers))))
        if groups is not None and end < n:
            cut = end
            while cut > at + (end - at) // 2 + 1 and groups[cut] == groups[cut - 1]:
                cut -= 1
            end = cut if groups[cut] != groups[cut - 1] else end
        starts.append(end)
        at = end
    return starts


def _chunks(items: Sequence, workers: int, groups: Sequence | None = None) -> list[tuple[int, list]]:
    """(start, its items) per chunk (`_starts`)."""
    starts = _starts(len(items), workers, groups)
    return [(a, list(items[a:b])) for a, b in zip(starts, starts[1:])]


def _run_chunk(fn: Callable, chunk: list) -> list:
    return [fn(x) for x in chunk]


def _deliver(out: list, start: int, results: list, done, tick: Tick) -> None:
    """A finished chunk's results into their places from `start`, told to `done` (rows written as they
    finish) and counted on the progress bar."""
    out[start:start + len(results)] = results
    if done is not None:
        done(range(start, start + len(results)), results)
    tick(len(results))


def _no_tick(n: int) -> None:
    pass


def _ignore_sigint() -> None:
    """A pool worker leaves Ctrl-C to the sweep's process (a terminal sends SIGINT to the whole group):
    that one keeps the finished rows and ends the workers, without a traceback from each of them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class SerialRunner:
    """Every item in this process, in order."""

    def map(self, fn: Callable, items: Sequence, tick: Tick = _no_tick, done: Done | None = None,
            groups: Sequence | None = None) -> list:
        out = []
        for i, x in enumerate(items):
            out.append(fn(x))
            if done is not None:
                done(range(i, i + 1), out[-1:])
            tick(1)
        return out


class ProcessRunner:
    """A pool of local processes, opened at the first map that needs it and kept for the next ones."""

    def __init__(self, jobs: int | None):
        self.jobs = jobs or os.cpu_count() or 1
        self._pool: ProcessPoolExecutor | None = None

    def map(self, fn: Callable, items: Sequence, tick: Tick = _no_tick, done: Done | None = None,
            groups: Sequence | None = None) -> list:
        if len(items) <= 1:
            return SerialRunner().map(fn, items, tick, done)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.jobs, initializer=_ignore_sigint)
        # submitted in order, as Executor.map would: the workers take the chunks in the dispatch order
        futures = {self._pool.submit(_run_chunk, fn, chunk): start for start, chunk in _chunks(items, self.jobs, groups)}
        out: list = [None] * len(items)
        finished = False
        try:
            for future in as_completed(futures):
                try:
                    results = future.result()
                except BrokenProcessPool:
                    raise WorkerLost("a worker process died (killed, or out of memory?)") from None
                _deliver(out, futures[future], results, done, tick)
            finished = True
        finally:
            if not finished:  # Ctrl-C, a dead worker, or `done` raised: end now, not after the queued chunks
                self._abandon()
        return out

    def _abandon(self) -> None:
        """End the workers now: a shutdown, even without waiting, leaves the running chunks to the
        interpreter's exit, which joins them. The pool's own thread then fails the chunks left (nothing
        is cancelled first: on Python 3.11 it would raise InvalidStateError setting their failure)."""
        pool, self._pool = self._pool, None  # the next map opens a fresh pool
        if pool is None:
            return
        processes = getattr(pool, "_processes", None)  # no public way before Python 3.14's terminate_workers
        if processes is None:
            pool.shutdown(wait=False, cancel_futures=True)
            return
        for process in list(processes.values()):
            process.terminate()
        pool.shutdown(wait=False)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class DaskRunner:
    """Chunks of items as tasks on a `distributed.Client`'s cluster; results gathered in order."""

    def __init__(self, client: Any):
        self.client = client

    def workers(self) -> int:
        return max(1, sum(self.client.nthreads().values()))

    def map(self, fn: Callable, items: Sequence, tick: Tick = _no_tick, done: Done | None = None,
            groups: Sequence | None = None) -> list:
        if not items:
            return []
        distributed = _distributed()
        starts, chunks = zip(*_chunks(items, self.workers(), groups))
        # pure=False: every point is its own task, and the scheduler need not hash the scenario data
        futures = self.client.map(partial(_run_chunk, fn), list(chunks), pure=False)
        start = {future.key: at for at, future in zip(starts, futures)}
        out: list = [None] * len(items)
        try:
            # as they finish; a lost worker's tasks run again elsewhere and arrive later (the module's docstring)
            for future, results in _gathered(distributed, futures):
                _deliver(out, start[future.key], results, done, tick)
        finally:
            self.client.cancel(futures)
        return out


def _gathered(distributed, futures) -> Iterator[tuple[Any, list]]:
    """(future, its results) as each finishes, a failure as one line."""
    try:
        yield from distributed.as_completed(futures, with_results=True)
    except ModuleNotFoundError as exc:  # a worker without fsdp-sim: say what to do, not a traceback
        raise ScenarioError(f"--executor dask: a worker cannot import {exc.name!r}; install fsdp-sim on every "
                            "worker (the same version as here)") from None
    except distributed.KilledWorker as exc:
        raise WorkerLost(f"a task was given up after it ended the workers that ran it ({exc})") from None


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
