"""The sample outputs of README.md and docs/*.md are the tool's: each `$ fsdp-sim ...` block, run, prints
what it shows (a `...` line standing for lines left out). Fix a failure with
`python benchmarks/readme_samples.py`."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_samples", ROOT / "benchmarks" / "readme_samples.py")
readme = sys.modules.setdefault("readme_samples", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(readme)
DOCUMENTS = readme.documents()
CASES = [(path, sample) for path in DOCUMENTS for sample in readme.samples(path.read_text())]


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_readme_has_its_samples():
    assert DOCUMENTS[0] == ROOT / "README.md" and len(DOCUMENTS) > 1  # the README and docs/*.md
    commands = [sample.command.split()[1] for _, sample in CASES]
    assert len(CASES) >= 5 and {"run", "sweep", "recommend"} <= set(commands)
    in_readme = [sample for path, sample in CASES if path == ROOT / "README.md"]
    assert in_readme and in_readme[0].command.split()[1] == "run"
    # The README's first sample answers the question plainly: FITS or DOES NOT FIT, not inside the margin.
    assert any(re.search(r"-> (FITS|DOES NOT FIT), headroom", line) for line in in_readme[0].lines)


def test_the_readme_opens_with_the_ci_commands():
    """Two commands open the README: install and simulate a shipped scenario; install and test, as .ci/run."""
    head = readme.FENCE.search((ROOT / "README.md").read_text())
    assert head and head.group(1) == "bash"
    simulate, test = head.group(2).strip().split("\n")
    scenario = simulate.split()[-1]
    assert "fsdp-sim run" in simulate and (ROOT / scenario).is_file()
    ci = (ROOT / ".ci" / "run").read_text()
    extras = re.search(r"-e '(\.\[[\w,]+\])'", ci).group(1)
    last = ci.strip().split("\n")[-1]
    assert f"install -e '{extras}'" in test and test.endswith(f"&& {last}")


@pytest.mark.parametrize("path, sample", CASES, ids=[f"{_where(p)}: {s.command[:60]}" for p, s in CASES])
def test_sample_is_what_the_tool_prints(path, sample):
    if "--plot" in sample.command:
        pytest.importorskip("matplotlib")
    actual = readme.run(sample.command, readme.files_for(path))
    problem = readme.mismatch(sample.lines, actual)
    assert problem is None, (f"{_where(path)}: $ {sample.command}: {problem} "
                             "(python benchmarks/readme_samples.py rewrites it)")


def test_cuts_are_honest():
    """A `...` stands for lines; every other line must be there, in order."""
    actual = ["a", "b 1", "c", "d", "e"]
    assert readme.mismatch(["a", "...", "d", "e"], actual) is None
    assert readme.mismatch(["a", "b 1", "c", "d", "e"], actual) is None
    assert readme.mismatch(["a", "...", "c", "...", "e"], actual) is None
    assert readme.mismatch(["a", "...", "c", "..."], actual) is None
    assert readme.mismatch(["a", "...", "d", "c", "..."], actual) is not None  # out of order
    assert readme.mismatch(["a", "b 2", "..."], actual) is not None  # a number changed
    assert readme.mismatch(["a", "...", "d"], actual) is not None  # the output goes on past d
    assert readme.mismatch(["...", "e", "..."], actual) is None
    assert readme.regenerate(["a", "b 9", "...", "e"], ["a", "b 1", "x", "y", "e"]) == ["a", "b 1", "...", "e"]
