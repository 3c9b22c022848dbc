"""Fuzz the command line as an adversarial user would: `python benchmarks/fuzz.py N [--seed S] [--jobs J]`.

Each case mutates a shipped scenario (or a tiny one) and the files it points at (Hugging Face configs,
workload files, profiler traces, hardware profiles), or the raw YAML text, or a sweep's `--set` values,
or the command's own arguments, then runs `fsdp-sim` on it in a forked child (no shared state between
cases, a time limit and a memory limit each) and classifies what came back:

- ok: exit 0 (or 1: a step that does not fit under --require-fit, a sweep whose every point failed) with
  valid figures: strict JSON (no NaN / Infinity), every byte figure an exact int, every time finite and
  non-negative, MFU and overlap in [0, 1], headroom = budget - required, one-line row errors;
- clean error: exit 2 and one line on stderr, `fsdp-sim: error: ...`, of at most 300 characters;
  either may come with warnings, each one line `fsdp-sim: warning: ...` of at most 300 characters;
- traceback, hang (past the time limit), invalid figure, multi-line error, long error (one line over
  300 characters), code ran (a YAML tag executed something), crash (killed by a signal).

Prints the counts by outcome and, for each bad outcome, a few cases (what was mutated, the command and
the end of stderr). `tests/test_fuzz.py` draws a bounded number of the same cases with hypothesis.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its modules beside it, also when a test loads it by path
from fuzz_cases import Case, make_case  # noqa: E402
from fuzz_values import REPO, dump  # noqa: E402


MAX_ERROR = 300
GOOD = ("ok", "clean error")


def write_case(case: Case, folder: Path) -> list[str]:
    """The case's files under `folder`; returns the argv (paths relative to folder's parent, the cwd)."""
    folder.mkdir(parents=True)
    for name in ("hf", "traced"):
        (folder / name).symlink_to(REPO / "scenarios" / name)
    (folder / "dir.yaml").mkdir()
    for name, content in case.files.items():
        path = folder / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
        except OSError:
            pass  # a name the file system refuses: the run reports it missing
    text = case.text if case.text is not None else dump(case.data)
    if isinstance(text, str):
        text = text.encode("utf-8", "surrogatepass")
    if case.scenario not in ("dir.yaml", "missing.yaml"):
        try:
            (folder / case.scenario).parent.mkdir(parents=True, exist_ok=True)
            (folder / case.scenario).write_bytes(text)
        except OSError:
            pass
    scenario = f"{folder.name}/{case.scenario}"
    out = f"{folder.name}/out.json"
    if case.command == "sweep":
        argv = ["sweep", scenario, "--jobs", "1", "-o", out]
        for s in case.sets:
            argv += ["--set", s]
    elif case.command == "recommend":  # only with a (small) grid: the default space is a hundred points
        argv = ["recommend", scenario, "--jobs", "1", "--json", out]
        for s in case.sets:
            argv += ["--set", s]
    else:
        argv = ["run", scenario, "--json", out]
    return argv + [f"{folder.name}/{a[1:]}" if a.startswith("@") else a for a in case.args]  # @: a file in the folder


def _child(argv: list[str], cwd: Path, out_path: Path, err_path: Path, timeout: float) -> None:
    """In the forked child: run the CLI with stdout/stderr in files, a memory and a time limit."""
    try:
        os.chdir(cwd)
        out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        # as a process started from a shell has them (a test runner may have replaced them)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        limit = 4 << 30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(max(1, math.ceil(timeout)))
        from fsdp_sim.cli import main

        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        except BaseException:  # noqa: BLE001 - that is what the fuzzer looks for
            traceback.print_exc()
            rc = 70
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        rc = 70
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            os._exit(71)
    os._exit(rc)


def start(argv: list[str], cwd: Path, folder: Path, timeout: float) -> int:
    pid = os.fork()
    if pid == 0:
        _child(argv, cwd, folder / "_stdout", folder / "_stderr", timeout)
    return pid


_KEY_INT = re.compile(r"(bytes|(?<!use_orig_)params|tokens_per_step|tokens_per_rank|world_size|shard_size|replicate_size|"
                      r"nodes|gpus_per_node|grad_accumulation|modules)$")


def _strict_json(text: str) -> Any:
    def bad(name):
        raise ValueError(f"{name} in JSON")
    return json.loads(text, parse_constant=bad)


def _walk(data: Any, path: str, problems: list[str]) -> None:
    if isinstance(data, dict):
        for k, v in data.items():
            _walk(v, f"{path}.{k}", problems)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            _walk(v, f"{path}[{i}]", problems)
    else:
        leaf = path.rsplit(".", 1)[-1]
        if _KEY_INT.search(leaf) and not path.startswith(".swept"):
            if isinstance(data, bool) or not isinstance(data, int):
                if not (data is None and leaf.endswith("_bytes") and path.startswith(".row")):
                    problems.append(f"{path} = {data!r} is not an int")
        if leaf.endswith("_s") and data is not None and not (isinstance(data, (int, float)) and 0 <= data < math.inf):
            problems.append(f"{path} = {data!r} is not a finite time")
        if leaf in ("mfu", "overlap_fraction") and data is not None and not (isinstance(data, (int, float)) and 0 <= data <= 1):
            problems.append(f"{path} = {data!r} is outside [0, 1]")
        if isinstance(data, float) and not math.isfinite(data):
            problems.append(f"{path} = {data!r}")


def check_run_json(text: str) -> list[str]:
    problems: list[str] = []
    data = _strict_json(text)
    _walk(data, "", problems)
    mem = data["memory"]
    if mem["headroom_bytes"] != mem["budget_bytes"] - mem["required_bytes"]:
        problems.append(f"headroom {mem['headroom_bytes']} != budget - required "
                        f"{mem['budget_bytes'] - mem['required_bytes']}")
    if mem["within_budget"] != (mem["required_bytes"] <= mem["budget_bytes"]):
        problems.append("within_budget disagrees with required <= budget")
    if mem["fits"] != (mem["required_bytes"] <= mem["capacity_bytes"]):
        problems.append("fits disagrees with required <= capacity")
    if data["peak"]["allocated_bytes"] < 0:
        problems.append("negative peak")
    return problems


def check_rows(text: str) -> list[str]:
    problems: list[str] = []
    rows = _strict_json(text)
    from fsdp_sim.sweep import COLUMNS

    for i, row in enumerate(rows):
        figures = {k: v for k, v in row.items() if k in COLUMNS}
        _walk(figures, f".row[{i}]", problems)
        error = row.get("error") or ""
        if "\n" in error or len(error.splitlines()) > 1:
            problems.append(f"row {i}: multi-line error")
        if not error and row.get("headroom_bytes") is not None and row["within_budget"] != (row["headroom_bytes"] >= 0):
            problems.append(f"row {i}: within_budget disagrees with headroom")
        if not error and row.get("within_budget") and not row["fits"]:
            problems.append(f"row {i}: within the budget but does not fit")
    return problems


def _signature(err: str) -> str:
    """A traceback as its exception line and the innermost fsdp_sim frame (one kind of failure)."""
    frames = re.findall(r'File "([^"]*fsdp_sim[^"]*)", line (\d+), in (\S+)', err)
    last = [line for line in err.strip().splitlines() if line and not line.startswith(" ")]
    where = f"{frames[-1][0].split('fsdp_sim/')[-1]}:{frames[-1][1]} {frames[-1][2]}" if frames else "?"
    line = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", last[-1] if last else "?")
    return f"{line[:160]} @ {where}"


def check_recommendation(text: str) -> list[str]:
    data = _strict_json(text)
    return check_rows(json.dumps(data.get("rows", [])))


def classify(rc: int | None, signaled: int | None, out: str, err: str, folder: Path, argv: list[str]) -> tuple[str, str]:
    """(outcome, detail) of one finished case."""
    if (folder / "PWNED").exists() or (folder.parent / "PWNED").exists():
        return "code ran", "a YAML tag ran os.system"
    if signaled == signal.SIGALRM:
        return "hang", ""
    if signaled is not None:
        return "crash", f"signal {signaled}"
    if "Traceback (most recent call last)" in err or rc not in (0, 1, 2):
        return "traceback", _signature(err)
    # a warning is one line of its own (`fsdp-sim: warning: ...`): the rest of stderr is judged without them
    said = err.splitlines(keepends=True)
    if any(len(line.rstrip("\n")) > MAX_ERROR for line in said if line.startswith("fsdp-sim: warning: ")):
        return "long error", "a warning line past the limit"
    err = "".join(line for line in said if not line.startswith("fsdp-sim: warning: "))
    if rc == 2:
        lines = err.splitlines()
        if len(lines) != 1 or err.count("\n") != 1:
            return "multi-line error", err[:600]
        if len(lines[0]) > MAX_ERROR:
            return "long error", f"{len(lines[0])} chars: {lines[0][:200]}"
        if not lines[0].startswith("fsdp-sim: error: "):
            return "multi-line error", lines[0][:300]
        return "clean error", lines[0]
    # 0 or 1: a result
    if err.strip() and (len(err.splitlines()) > 1 or len(err) > MAX_ERROR + 1):
        return "multi-line error", err[:600]
    out_json = folder / "out.json"
    if "--json" in argv or "-o" in argv:
        option = "--json" if "--json" in argv else "-o"
        target = argv[len(argv) - 1 - argv[::-1].index(option) + 1]  # the last one given wins
        if target.endswith("out.json") and not (folder.parent / target).is_file() and rc == 0:
            return "invalid figure", "no output file written at exit 0"
    try:
        if out_json.is_file():
            text = out_json.read_text()
            problems = {"sweep": check_rows, "recommend": check_recommendation}.get(argv[0], check_run_json)(text)
            if problems:
                return "invalid figure", "; ".join(problems[:4])
    except (ValueError, KeyError, TypeError) as exc:
        return "invalid figure", f"{type(exc).__name__}: {exc}"[:300]
    m = re.search(r"MFU (\S+) %", out)
    if m and not (0 <= float(m.group(1)) <= 100):
        return "invalid figure", f"MFU {m.group(1)} % printed"
    if re.search(r"\b(nan|inf)\b", out, re.IGNORECASE) and argv[0] == "run":
        return "invalid figure", "nan/inf printed in the summary"
    return "ok", ""


def run_cases(cases: list[tuple[int, Case]], root: Path, *, jobs: int = 1, timeout: float = 10.0,
              on_result=None) -> list[tuple[int, str, str, list[str]]]:
    """Run the cases (an iterable) `jobs` at a time in forked children; returns (index, outcome, detail,
    argv) per case."""
    from fsdp_sim import cli  # noqa: F401 - imported once here, shared by every fork
    from fsdp_sim import scenario, simulate, sweep  # noqa: F401
    from fsdp_sim.results import export, report  # noqa: F401

    results = []
    todo = iter(cases)
    running: dict[int, tuple[int, Case, Path, list[str], float]] = {}
    more = True
    while more or running:
        while more and len(running) < jobs:
            item = next(todo, None)
            if item is None:
                more = False
                break
            index, case = item
            folder = root / f"case{index}"
            argv = write_case(case, folder)
            pid = start(argv, root, folder, timeout)
            running[pid] = (index, case, folder, argv, time.monotonic())
        if not running:
            break
        pid, status = os.wait()
        if pid not in running:
            continue
        index, case, folder, argv, began = running.pop(pid)
        rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        out = (folder / "_stdout").read_text(errors="replace")
        err = (folder / "_stderr").read_text(errors="replace")
        outcome, detail = classify(rc, sig, out, err, folder, argv)
        results.append((index, outcome, detail, argv))
        if on_result:
            on_result(index, case, outcome, detail, argv, time.monotonic() - began)
        shutil.rmtree(folder, ignore_errors=True)
        for stray in ("PWNED",):
            (root / stray).unlink(missing_ok=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, nargs="?", default=500, help="cases to run (default 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="cases at a time (default 1)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per case before it counts as a hang")
    parser.add_argument("--show", type=int, default=3, help="cases to show per bad outcome (default 3)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    rng = random.Random(args.seed)
    cases = ((i, make_case(rng)) for i in range(args.n))  # made as they run: a few hold 10 MB strings
    counts: Counter = Counter()
    kinds: Counter = Counter()  # traceback signature -> cases
    shown: dict[str, list[str]] = {}
    slow: list[tuple[float, int]] = []
    began = time.monotonic()

    def report(index, case, outcome, detail, argv, seconds):
        counts[outcome] += 1
        slow.append((seconds, index))
        if outcome == "traceback":
            kinds[detail] += 1
            if kinds[detail] > 1:
                return
        if outcome not in GOOD and len(shown.setdefault(outcome, [])) < args.show * (4 if outcome == "traceback" else 1):
            shown[outcome].append(f"  case {index}: {'; '.join(case.notes)[:300]}\n    argv: {[a[:60] for a in argv]}\n"
                                  f"    {detail.strip()[-900:]}")

    with tempfile.TemporaryDirectory(prefix="fsdp-fuzz-") as tmp:
        run_cases(cases, Path(tmp), jobs=args.jobs, timeout=args.timeout, on_result=report)
    elapsed = time.monotonic() - began
    print(f"fuzz: {args.n} cases, seed {args.seed}, {elapsed:.0f} s")
    for outcome in ("ok", "clean error", "traceback", "hang", "invalid figure", "multi-line error", "long error",
                    "code ran", "crash"):
        print(f"  {outcome:<18}{counts[outcome]:>7}")
    for outcome, lines in shown.items():
        print(f"\n{outcome}:")
        print("\n".join(lines))
    if kinds:
        print(f"\ntraceback kinds ({len(kinds)}):")
        for sig, n in kinds.most_common():
            print(f"  {n:>5}  {sig}")
    slow.sort(reverse=True)
    print(f"\nslowest: {', '.join(f'case {i} {s:.1f} s' for s, i in slow[:5])}")
    return 0 if all(counts[o] == 0 for o in counts if o not in GOOD) else 1


if __name__ == "__main__":
    sys.exit(main())
