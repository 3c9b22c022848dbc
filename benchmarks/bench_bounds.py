"""How much of a cold step is logic: the bare steps of its three algorithms, timed beside the SimPy floor and
the cold `simulate()`, so that a target such as issue 27's (2.0x the floor for llama3-70b/64, 2.5x for
llama3-8b/8 and llama3-405b/1024) can be read as the logic it leaves room for.

Each algorithm is timed at its barest Python, with the step's own counts and none of its logic:
- build: one slots object per op with its ten fields stored, as `OpGraph` makes an alloc or a free (no
  runtime hook, no pricing, no decision);
- play: a chain of one SimPy wake-up per timed op (`engine/device.py` `WakeUp`, each scheduled by the one
  before), as the device completes each timed op (allocs and frees take no SimPy event);
- replay: two steps' allocator events, each one bisection, one pop or insort on a pool list and one dict store
  or pop (the least a best fit or a free costs). Two steps is the fewest any replay plays: the first makes the
  cache the next starts from, and whether a steady step grows it is known only by playing it (best fit's choice
  for a request depends on every free block of its pool).

Their sum is the bound. A target of k x the floor leaves k x floor - bound for all the logic (the runtime's
hooks, pricing, processor sharing, the allocator's splits and merges, the ledger, the result), which takes
cold - bound now; the last column is how many times cheaper that logic would have to become.

Everything runs in one process, cold (every memo emptied, the scenario loaded anew: `bench_scenarios.py`
`clear_memos`), alternating, best of N each, so a machine whose speed moves meets every column alike.
Run: python benchmarks/bench_bounds.py [N=7] [NAMES]
e.g. python benchmarks/bench_bounds.py 7 llama3-8b-8xh100,llama3-70b-64xh100,llama3-405b-1024xh100
"""

from __future__ import annotations

import gc
import sys
import time
from bisect import bisect_left, insort
from pathlib import Path

import simpy
from simpy.events import NORMAL

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scenarios import clear_memos, simpy_floor  # noqa: E402

from fsdp_sim.engine.device import WakeUp  # noqa: E402
from fsdp_sim.scenario import load_scenario  # noqa: E402
from fsdp_sim.schedule.ops import TIMED_KINDS  # noqa: E402
from fsdp_sim.simulate import simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"llama3-70b-64xh100": 2.0}  # issue 27; 2.5x for every other scenario
POOL = 64  # free blocks in the bare replay's pool list (a pool holds a few dozen)


class _Op:
    __slots__ = ("id", "kind", "stream", "name", "unit", "phase", "deps", "buffer", "record_stream", "cpu_wait")


def bare_build(n: int) -> None:
    """n ops made as `OpGraph._memory` makes an alloc or free: a slots object, its ten fields stored."""
    new, ops = object.__new__, []
    for i in range(n):
        op = new(_Op)
        op.id, op.kind, op.stream, op.name, op.unit = i, "alloc", "compute", "x", "u"
        op.phase, op.deps, op.buffer, op.record_stream, op.cpu_wait = "forward", (), None, "", -1
        ops.append(op)


def bare_play(n: int) -> None:
    """A chain of n SimPy wake-ups, each scheduled by the callback of the one before."""
    env = simpy.Environment()
    left = n

    def wake(_event) -> None:
        nonlocal left
        left -= 1
        if left > 0:
            env.schedule(WakeUp(wake), NORMAL, 1e-6)

    if n:
        env.schedule(WakeUp(wake), NORMAL, 1e-6)
    env.run()


def bare_replay(n: int) -> None:
    """n allocator events, alternately a best fit (bisection, pop, dict store) and a free (dict pop, insort)."""
    pool = [(k * 512, k, None) for k in range(POOL)]
    blocks = {}
    for i in range(n // 2):
        blocks[i] = pool.pop(bisect_left(pool, ((i % POOL) * 512,)))
        insort(pool, blocks.pop(i))


def timed(run, *args) -> float:
    t0 = time.perf_counter()
    run(*args)
    return time.perf_counter() - t0


def measure(path: Path, repeats: int) -> dict:
    """Best of `repeats` of each column, alternating: cold simulate(), the floor and the three bare steps."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        clear_memos()
        gc.collect()
        scenario = load_scenario(path)
        t0 = time.perf_counter()
        result = simulate(scenario)
        wall = time.perf_counter() - t0
        ops = result.graph.ops
        kinds = frozenset(TIMED_KINDS)
        counts = {"ops": len(ops), "timed": sum(op.kind in kinds for op in ops),
                  "events": len(result.memory.allocator.plan.events)}
        gc.disable()
        times = {"cold": wall, "floor": simpy_floor(counts["ops"], 1), "build": timed(bare_build, counts["ops"]),
                 "play": timed(bare_play, counts["timed"]), "replay": timed(bare_replay, 2 * counts["events"])}
        gc.enable()
        for key, value in times.items():
            best[key] = min(best.get(key, value), value)
    return counts | best


def main() -> None:
    repeats = sys.argv[1] if len(sys.argv) > 1 else "7"
    if not repeats.isdigit() or int(repeats) < 1:
        print(f"bench_bounds.py: N: expected a whole number of runs >= 1, got {repeats!r}", file=sys.stderr)
        sys.exit(2)
    repeats = int(repeats)
    names = (sys.argv[2] if len(sys.argv) > 2 else "llama3-8b-8xh100,llama3-70b-64xh100,llama3-405b-1024xh100").split(",")
    missing = [name for name in names if not (ROOT / "scenarios" / f"{name}.yaml").is_file()]
    if missing:
        print(f"bench_bounds.py: NAMES: no scenarios/{missing[0]}.yaml (expected shipped scenario names)", file=sys.stderr)
        sys.exit(2)
    print(f"{'scenario':<26}{'ops':>6}{'timed':>6}{'events':>7}{'floor':>7}{'cold':>7}{'build':>7}{'play':>6}"
          f"{'replay':>7}{'bound':>7}{'x fl':>6}{'target':>7}{'logic':>7}{'room':>7}{'cut':>6}")
    for name in names:
        m = measure(ROOT / "scenarios" / f"{name}.yaml", repeats)
        bound = m["build"] + m["play"] + m["replay"]
        target = TARGETS.get(name, 2.5)
        logic, room = m["cold"] - bound, target * m["floor"] - bound
        cut = f"{logic / room:.1f}x" if room > 0 else "none"
        print(f"{name:<26}{m['ops']:>6}{m['timed']:>6}{m['events']:>7}"
              + "".join(f"{m[k] * 1e3:>{w}.2f}" for k, w in (("floor", 7), ("cold", 7), ("build", 7), ("play", 6), ("replay", 7)))
              + f"{bound * 1e3:>7.2f}{bound / m['floor']:>6.2f}{target:>6.1f}x{logic * 1e3:>7.2f}{room * 1e3:>7.2f}{cut:>6}")
    print(f"(ms, best of {repeats}, cold, one process; events: one step's allocator events, replayed twice in the "
          "bound; x fl: bound / floor; logic: cold - bound; room: target x floor - bound; cut: logic / room)")


if __name__ == "__main__":
    main()
