"""The README's sample outputs are the tool's: each `$ fsdp-sim ...` block, run, prints what it shows
(a `...` line standing for lines left out). Fix a failure with `python benchmarks/readme_samples.py`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_samples", ROOT / "benchmarks" / "readme_samples.py")
readme = sys.modules.setdefault("readme_samples", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(readme)
TEXT = (ROOT / "README.md").read_text()
SAMPLES = readme.samples(TEXT)


def test_the_readme_has_its_samples():
    commands = [s.command.split()[1] for s in SAMPLES]
    assert len(SAMPLES) >= 5 and {"run", "sweep", "recommend"} <= set(commands)


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.command[:60] for s in SAMPLES])
def test_sample_is_what_the_tool_prints(sample):
    if "--plot" in sample.command:
        pytest.importorskip("matplotlib")
    actual = readme.run(sample.command, readme.files_in(TEXT))
    problem = readme.mismatch(sample.lines, actual)
    assert problem is None, f"$ {sample.command}: {problem} (python benchmarks/readme_samples.py rewrites it)"


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
