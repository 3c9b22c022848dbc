"""fsdp-sim against PyTorch's own trackers: every referee case of the test suite in one table.

Issue 24's gate reads "memory agrees with the tracker within 3 % on every referee case, median within 1 %":
this prints each case's signed error of the simulated peak allocated bytes against the referee's, then
max |error| and median |error| over them all. The cases are the tests' own lists, read where they live
(the `torch_tools` modules, or the test modules and their `parametrize` marks), so a case added to a test
is a row here:
- FSDP2, FSDPMemTracker (`referee.CASES` from dimensions and from the traced workload, `MOMENT_CASES`,
  `SETTER_CASES`), frozen weights and LoRA (`lora_referee.LORA_CASES`), techniques
  (`technique_referee.CASES`: checkpointing policies, losses, optimizers, whose step's own peak is a row
  too), TP 2 x FSDP 4 (tests/test_tp.py, tests/test_tp_plans.py);
- FSDP1, MemTracker (tests/test_referee_fsdp1.py, tests/test_referee_fsdp1_lora.py);
- plain training against its own tensors on fake tensors (tests/test_eager_referee.py: the step's peak, and
  the forward's and the backward's where the test gates them).
Not rows: the tests that check a structure rather than a peak (copy-out order, tracker semantics, the
compiled block's saved set) and the eager referee's reserved bytes (the allocator model on both sides).
Needs torch (`pip install -e '.[torch]'`); minutes on one CPU core.
Run: python benchmarks/bench_referee.py [family ...]   (families: fsdp2 lora techniques tp fsdp1 eager)
"""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def _test_module(name: str):
    """A test module, imported from its file (tests/ is not a package; some import its conftest): its case
    lists are the cases."""
    if str(TESTS) not in sys.path:
        sys.path.append(str(TESTS))
    spec = importlib.util.spec_from_file_location(f"_referee_{name}", TESTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _params(fn) -> list[dict]:
    """The parameter sets of a test function's stacked `parametrize` marks (their product, as pytest runs them)."""
    grids = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else list(mark.args[0])
        grids.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in mark.args[1]])
    return [dict(kv for d in combo for kv in d.items()) for combo in itertools.product(*grids)]


def _error(ours: int, theirs: int) -> float:
    return (ours - theirs) / theirs


def fsdp2():
    from fsdp_sim.torch_tools.memtracker import run_fsdp_mem_tracker
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig
    from fsdp_sim.torch_tools.referee import (BASE, CASES, MOMENT_CASES, SETTER_CASES, case_settings, simulate_reference,
                                              traced_reference_workload)
    from fsdp_sim.workload.io import save_workload
    import tempfile

    for case_id, model, run in CASES + MOMENT_CASES + SETTER_CASES:
        cfg, settings = ReferenceConfig(**(BASE | model)), case_settings(run)
        tracker = run_fsdp_mem_tracker(cfg, **settings)["peak_bytes"]
        yield case_id, _error(simulate_reference(cfg, **settings)["peak_bytes"], tracker)
        if (case_id, model, run) in CASES:
            traced = traced_reference_workload(cfg, batch=settings["batch"], seq=settings["seq"],
                                               param_dtype=settings["param_dtype"])
            with tempfile.TemporaryDirectory() as tmp:
                save_workload(traced, Path(tmp) / "reference.yaml")
                sim = simulate_reference(cfg, workload_file=str(Path(tmp) / "reference.yaml"), **settings)
            yield f"{case_id} (traced)", _error(sim["peak_bytes"], tracker)


def lora():
    from fsdp_sim.torch_tools.lora_referee import LORA_CASES, run_case

    for case_id, model, run, prep in LORA_CASES:
        sim, tracker = run_case(model, run, prep)
        yield case_id, _error(sim["peak_bytes"], tracker["peak_bytes"])


def techniques():
    from fsdp_sim.torch_tools.technique_referee import CASES, relative_errors

    for case in CASES:
        errors = relative_errors(case[0])
        yield case[0], errors["peak_bytes"]
        if "optimizer_peak_bytes" in errors:
            yield f"{case[0]} (optimizer step)", errors["optimizer_peak_bytes"]


def tp():
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig
    from fsdp_sim.torch_tools.referee import simulate_reference
    from fsdp_sim.torch_tools.tp_plan_referee import run_plan_fsdp_mem_tracker
    from fsdp_sim.torch_tools.tp_referee import run_tp_fsdp_mem_tracker

    cfg = ReferenceConfig(hidden=256, layers=2, heads=8, kv_heads=4, ffn_hidden=512, vocab=512)  # the tests' model
    run = dict(batch=2, seq=128)
    for p in _params(_test_module("test_tp").test_tp2_fsdp4_peak_agrees_with_fsdp_mem_tracker):
        tracker = run_tp_fsdp_mem_tracker(cfg, tp=2, dp=4, activation_checkpointing=p["ac"], sequence_parallel=p["sp"], **run)
        sim = simulate_reference(cfg, world_size=8, activation_checkpointing=p["ac"], **run,
                                 sections={"parallelism": {"tp": 2, "sequence_parallel": p["sp"]}})
        yield f"tp2-fsdp4-torchtitan-sp={p['sp']}-ac={p['ac']}", _error(sim["peak_bytes"], tracker["peak_bytes"])
    for p in _params(_test_module("test_tp_plans").test_tp2_fsdp4_peak_agrees_with_fsdp_mem_tracker):
        tracker = run_plan_fsdp_mem_tracker(cfg, p["plan"], tp=2, dp=4, activation_checkpointing=p["ac"], **run)
        sim = simulate_reference(cfg, world_size=8, activation_checkpointing=p["ac"], **run,
                                 sections={"parallelism": {"tp": 2, "tp_plan": p["plan"]}})
        yield f"tp2-fsdp4-{p['plan']}-ac={p['ac']}", _error(sim["peak_bytes"], tracker["peak_bytes"])


def fsdp1():
    from fsdp_sim.torch_tools.lora_referee import prepare
    from fsdp_sim.torch_tools.memtracker_fsdp1 import run_fsdp1_mem_tracker, simulate_fsdp1_reference
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig
    from fsdp_sim.torch_tools.referee import BASE

    for case_id, model, run in _test_module("test_referee_fsdp1").CASES:
        cfg, settings = ReferenceConfig(**(BASE | model)), {"world_size": 4, "batch": 2, "seq": 128} | run
        tracker = run_fsdp1_mem_tracker(cfg, **settings)
        yield f"fsdp1 {case_id}", _error(simulate_fsdp1_reference(cfg, **settings)["peak_bytes"], tracker["peak_bytes"])
    module = _test_module("test_referee_fsdp1_lora")
    for case_id, model, run, prep, every_rank in module.CASES:
        cfg, settings = ReferenceConfig(**(BASE | model)), module._settings(run)
        ranks = range(settings["world_size"]) if every_rank else (0,)
        tracker = max(run_fsdp1_mem_tracker(cfg, prepare_model=partial(prepare, **prep), rank=r, **settings)["peak_bytes"]
                      for r in ranks)
        yield f"fsdp1 {case_id}", _error(module._simulate(cfg, settings, prep)["peak_bytes"], tracker)


def eager():
    from fsdp_sim.torch_tools.eager_referee import eager_steps, simulated, simulated_phase_bytes
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig

    t = _test_module("test_eager_referee")
    big = ReferenceConfig(max_seq=8192, layers=2, vocab=128256, **t.WIDE)
    lora = dict(targets=("all-linear",), rank=16, alpha=32.0, frozen_dtype="bf16")
    cases = [(f"plain {'wide' if p['model'] is not t.GELU else 'gelu'} {p['dtype']} ac={p['ac']}",
              ReferenceConfig(max_seq=4096, **p["model"]), dict(batch=1, seq=4096, activation_checkpointing=p["ac"],
                                                                 dtype=p["dtype"]), False)
             for p in _params(t.test_the_plain_steps_allocated_peak_is_the_live_storages_peak)]
    cases.append(("plain wide bf16 ac=selective_op", ReferenceConfig(max_seq=4096, layers=2, vocab=2048, **t.WIDE),
                  dict(batch=1, seq=4096, activation_checkpointing="selective_op"), False))
    cases += [(f"plain llama3-vocab {p['mode']} ac={p['ac']}", big,
               dict(batch=1, seq=8192, activation_checkpointing=p["ac"], **t.MODES[p["mode"]]), False)
              for p in _params(t.test_reserved_for_the_simulators_buffers_is_near_reserved_for_the_real_tensors)]
    cases += [(f"plain fp32-under-autocast ac={p['ac']} accumulation={p['grad_accumulation']}", t.ACCUMULATING,
               dict(batch=1, seq=64, activation_checkpointing=p["ac"], dtype="fp32", autocast=True,
                    grad_accumulation=p["grad_accumulation"]), True)
              for p in _params(t.test_fp32_parameters_under_autocast_forward_and_backward_peaks)]
    cases += [(f"plain peft-input-cast dropout={p['dropout']} ac={p['ac']}", t.LORA_MODEL,
               dict(batch=1, seq=2048, activation_checkpointing=p["ac"], dtype="fp32", autocast=True,
                    lora=lora | {"dropout": p["dropout"]}), True)
              for p in _params(t.test_peft_input_casts_under_autocast)]
    for name, cfg, run, by_phase in cases:
        theirs, sim = eager_steps(cfg, **run), simulated(cfg, **run)
        yield name, _error(int(sim.memory.total.max()), theirs.allocated_bytes)
        if by_phase:
            ours = simulated_phase_bytes(sim)
            for phase in ("forward", "backward"):
                yield f"{name} ({phase})", _error(ours[phase], theirs.phase_bytes[phase])


FAMILIES = {"fsdp2": fsdp2, "lora": lora, "techniques": techniques, "tp": tp, "fsdp1": fsdp1, "eager": eager}


def main(names: list[str]) -> None:
    warnings.simplefilter("ignore")  # FSDP1's deprecations and FakeTensor's data_ptr, once per case
    errors = []
    print(f"{'family':<11}{'case':<62}{'error %':>9}{'s':>7}")
    for family in names or FAMILIES:
        t0 = time.perf_counter()
        for case_id, error in FAMILIES[family]():
            errors.append(error)
            print(f"{family:<11}{case_id:<62}{100 * error:>+9.2f}{time.perf_counter() - t0:>7.1f}", flush=True)
            t0 = time.perf_counter()
    magnitudes = [abs(e) for e in errors]
    print(f"{len(errors)} cases: max |error| {100 * max(magnitudes):.2f} %, median |error| "
          f"{100 * statistics.median(magnitudes):.2f} %, beyond 3 %: {sum(m > 0.03 for m in magnitudes)}")


if __name__ == "__main__":
    main(sys.argv[1:])
