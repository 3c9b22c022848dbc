"""The sample outputs of README.md and docs/*.md, made by the tool: rewrite them (default) or check them
(--check).

A sample is a fenced block without a language whose first line is `$ fsdp-sim ARGS`. Its command runs
in a scratch folder: an argument naming a file of the repository (scenarios/...) is given that file, and a
file the command names that the repository lacks comes from a ```yaml block whose first line is `# NAME`
or `# NAME: ...`: the sample's own document's block if it has one, else the block of that name in another
document (README.md, then docs/*.md in name order). What it prints (stdout, then stderr) is the sample's text.

A line `...` in a sample stands for any number of lines the README leaves out; every other line must be
the tool's, in order. Rewriting keeps each cut: a part between cuts runs from the line that looks like
its old first line (numbers aside) to the one that looks like its old last line.

Run: python benchmarks/readme_samples.py [--check] [FILE.md ...]   (default: README.md and docs/*.md;
tests/test_readme.py checks)
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUT = "..."
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
NUMBER = re.compile(r"[-+]?\d[\d,.]*")


@dataclass(frozen=True)
class Sample:
    command: str  # the `$ fsdp-sim ...` line, without "$ "
    lines: list[str]  # what the README shows under it
    start: int  # character offsets of the block's body in the README
    end: int


def documents() -> list[Path]:
    """The files whose samples are the tool's: README.md, then docs/*.md in name order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def files_in(text: str) -> dict[str, str]:
    """A document's yaml blocks whose first line names a file."""
    out = {}
    for m in FENCE.finditer(text):
        head = m.group(2).split("\n", 1)[0]
        name = re.match(r"#\s*([\w./-]+\.ya?ml)\b", head)
        if m.group(1) == "yaml" and name:
            out[name.group(1)] = m.group(2)
    return out


def files_for(path: Path) -> dict[str, str]:
    """The yaml blocks a sample of `path` may use: its own, then those of the other documents."""
    out: dict[str, str] = {}
    for other in reversed(documents()):
        if other.resolve() != Path(path).resolve():
            out.update(files_in(other.read_text()))
    out.update(files_in(Path(path).read_text()))
    return out


def samples(text: str) -> list[Sample]:
    out = []
    for m in FENCE.finditer(text):
        body = m.group(2)
        if m.group(1) or not body.startswith("$ fsdp-sim "):
            continue
        first, _, rest = body.partition("\n")
        out.append(Sample(first[2:], rest.rstrip("\n").split("\n"), m.start(2), m.end(2)))
    return out


def run(command: str, files: dict[str, str]) -> list[str]:
    """The lines `command` prints, run in a scratch folder."""
    from fsdp_sim.cli import main

    argv = shlex.split(command)[1:]
    with tempfile.TemporaryDirectory() as scratch:
        for i, arg in enumerate(argv):
            if (ROOT / arg).is_file():
                argv[i] = str(ROOT / arg)
            elif arg in files:
                (Path(scratch) / arg).write_text(files[arg])
        out = io.StringIO()
        cwd = Path.cwd()
        try:
            os.chdir(scratch)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                main(argv)
        finally:
            os.chdir(cwd)
    return out.getvalue().rstrip("\n").split("\n")


def _parts(lines: list[str]) -> list[list[str]]:
    parts, current = [], []
    for line in lines:
        if line.strip() == CUT:
            parts.append(current)
            current = []
        else:
            current.append(line)
    return parts + [current]


def _first_difference(shown: list[str], actual: list[str], where: str) -> str:
    i = next((i for i, (x, y) in enumerate(zip(shown, actual)) if x != y), min(len(shown), len(actual)))
    return (f"line {i + 1} of the part {where} differs:\n  shown:  {shown[i] if i < len(shown) else '(nothing)'!r}\n"
            f"  actual: {actual[i] if i < len(actual) else '(nothing)'!r}")


def mismatch(shown: list[str], actual: list[str]) -> str | None:
    """None when `shown` is `actual` with some runs of lines cut to `...`; else what differs."""
    parts = _parts([line.rstrip() for line in shown])
    actual = [line.rstrip() for line in actual]
    at = 0
    for k, part in enumerate(parts):
        if k == 0:
            if actual[:len(part)] != part:
                return _first_difference(part, actual[:len(part)], "from the start")
            at = len(part)
            continue
        if k == len(parts) - 1:  # the last part ends the output
            if part and (actual[-len(part):] != part or len(actual) - len(part) < at):
                return _first_difference(part, actual[-len(part):], "at the end")
            continue
        for i in range(at, len(actual) - len(part) + 1):
            if actual[i:i + len(part)] == part:
                at = i + len(part)
                break
        else:
            return f"not in the output (in this order): {part[0]!r}"
    return None


def _mask(line: str) -> str:
    return NUMBER.sub("#", line.rstrip())


def _label(line: str) -> str:
    """What a line says before its first number ("Peak allocated"), or the line masked if it has none."""
    m = NUMBER.search(line)
    return line[:m.start()].rstrip() if m and line[:m.start()].strip() else _mask(line)


def _find(actual: list[str], line: str, at: int) -> int | None:
    """The first line from `at` that looks like `line`: the same but for numbers, else the same label."""
    for key in (_mask, _label):
        found = next((i for i in range(at, len(actual)) if key(actual[i]) == key(line)), None)
        if found is not None:
            return found
    return None


def regenerate(shown: list[str], actual: list[str]) -> list[str]:
    """`actual` with the cuts of `shown` kept (see the module docstring); each cut line as it was."""
    parts = _parts(shown)
    if len(parts) == 1:
        return actual
    cuts = [line for line in shown if line.strip() == CUT]
    out, at = [], 0
    for k, part in enumerate(parts):
        if k:
            out.append(cuts[k - 1])
        if not part:
            continue
        start = 0 if k == 0 else _find(actual, part[0], at)
        if start is None:
            raise SystemExit(f"cannot place {part[0]!r} in the new output: edit that sample by hand")
        end = len(actual) - 1 if k == len(parts) - 1 else _find(actual, part[-1], start)
        if end is None:
            end = start + len(part) - 1
        out += actual[start:end + 1]
        at = end + 1
    return out


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def process(path: Path, check: bool) -> tuple[int, int]:
    """Check or rewrite the samples of one document: (samples, how many differ)."""
    text = path.read_text()
    files = files_for(path)
    pieces, last, failed = [], 0, 0
    found = samples(text)
    for sample in found:
        actual = run(sample.command, files)
        problem = mismatch(sample.lines, actual)
        print(f"{'differs' if problem else 'same   '} {_shown(path)}: $ {sample.command}")
        failed += bool(problem)
        if check:
            if problem:
                print(f"  {problem}")
            continue
        new = regenerate(sample.lines, actual) if problem else sample.lines
        pieces += [text[last:sample.start], f"$ {sample.command}\n" + "\n".join(new) + "\n"]
        last = sample.end
    if not check and failed:
        path.write_text("".join(pieces) + text[last:])
    return len(found), failed


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if not a.startswith("--")] or documents()
    total = failed = 0
    for path in paths:
        n, bad = process(path, check)
        total, failed = total + n, failed + bad
    verb = "differ" if check else "rewritten"
    print(f"{total} samples in {len(paths)} files: {total - failed} the same, {failed} {verb}")
    return 1 if check and failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
