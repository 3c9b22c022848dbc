"""No input breaks the command line: mutated scenarios, Hugging Face configs, workload files, profiler traces,
hardware profiles, raw YAML text and sweep `--set` values each give a valid result or one error line.

The cases are `benchmarks/fuzz.py`'s (`python benchmarks/fuzz.py 10000` runs many more), drawn here by
hypothesis from a bounded number of seeds. Each runs `fsdp-sim` in a forked child with a time and memory
limit; the outcome must be "ok" (strict JSON, exact int bytes, finite times, MFU in [0, 1], headroom =
budget - required) or "clean error" (exit 2, one line of at most 300 characters on stderr).
"""

from __future__ import annotations

import copy
import importlib.util
import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

pytestmark = pytest.mark.slow

if not hasattr(__import__("os"), "fork"):  # pragma: no cover - the runner forks
    pytest.skip("the fuzz runner needs os.fork", allow_module_level=True)

_SPEC = importlib.util.spec_from_file_location("fsdp_fuzz", Path(__file__).parents[1] / "benchmarks" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_SPEC)
sys.modules["fsdp_fuzz"] = fuzz
_SPEC.loader.exec_module(fuzz)  # puts benchmarks/ on the path: its cases' modules import after it
import fuzz_cases  # noqa: E402
import fuzz_values  # noqa: E402


def _outcome(case, tmp_path: Path) -> tuple[str, str, list[str]]:
    [(_, outcome, detail, argv)] = fuzz.run_cases([(0, case)], tmp_path, timeout=20.0)
    return outcome, detail, argv


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_no_input_breaks_the_cli(seed, tmp_path_factory):
    case = fuzz_cases.make_case(random.Random(seed))
    outcome, detail, argv = _outcome(case, tmp_path_factory.mktemp("fuzz"))
    assert outcome in fuzz.GOOD, f"{outcome}: {'; '.join(case.notes)[:300]}\n{argv}\n{detail}"


@pytest.mark.parametrize("mutation", [m.__name__ for m, _ in fuzz_cases.MUTATIONS])
def test_each_kind_of_mutation(mutation, tmp_path):
    """A few cases of every mutation alone, so each kind of input is covered whatever hypothesis draws."""
    fn = {m.__name__: m for m, _ in fuzz_cases.MUTATIONS}[mutation]
    for seed in range(4):
        rng = random.Random(seed)
        case = fuzz_cases.Case(copy.deepcopy(fuzz_values.TINY if seed % 2 else fuzz_values.TRACED))
        fn(rng, case)
        if isinstance(case.data, dict) and isinstance(case.data.get("compute"), dict) \
                and "trace.json" not in case.files:
            case.files["trace.json"] = fuzz_values.TRACE_FIXTURE.read_bytes()
        outcome, detail, argv = _outcome(case, tmp_path / str(seed))
        assert outcome in fuzz.GOOD, f"{outcome}: {'; '.join(case.notes)[:300]}\n{argv}\n{detail}"


@pytest.mark.parametrize("text", [
    "model: !!python/object/apply:os.system ['touch PWNED']\n",
    "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
    "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
    "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\nmodel: {hidden: 64, layers: [*g, *g, *g, *g, *g, *g, *g, *g]}\n",
    "model: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "",
    "model: {hidden: 64, layers: 2, heads: 4, vocab: 256}\nhardware: {profile: h100-sxm}\ntraining: {micro_batch: 1.0e+300}\n",
])
def test_named_inputs(text, tmp_path):
    """Inputs the issue names: a tag that would run code, an alias bomb, deep nesting, an empty file, 1e300."""
    case = fuzz_cases.Case({}, text=text)
    outcome, detail, _ = _outcome(case, tmp_path)
    assert outcome == "clean error", (outcome, detail)
    assert not (tmp_path / "PWNED").exists()
