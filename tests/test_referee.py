"""The referee: fsdp-sim against PyTorch's own FSDPMemTracker, on the same model and settings.

Each case builds the ReferenceTransformer, shards it with FSDP2 `fully_shard` under FakeTensorMode with a
fake process group (rank 0 of W), tracks a training step after a first one (so optimizer state exists)
with `torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`, and compares with fsdp-sim's
simulation of the same job. The gate: peak allocated bytes within 5 %, and every category at the peak
within 5 % or 8 MiB. Skipped without torch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from fsdp_sim.torch_tools.memtracker import run_fsdp_mem_tracker  # noqa: E402
from fsdp_sim.torch_tools.reference_model import ReferenceConfig  # noqa: E402
from fsdp_sim.torch_tools.referee import BASE, CASES, case_settings, simulate_reference  # noqa: E402

MiB = 1 << 20


@pytest.mark.parametrize("case_id, model, run", CASES, ids=[c[0] for c in CASES])
def test_simulated_peak_agrees_with_fsdp_mem_tracker(case_id, model, run):
    cfg = ReferenceConfig(**(BASE | model))
    settings = case_settings(run)
    tracker = run_fsdp_mem_tracker(cfg, **settings)
    sim = simulate_reference(cfg, **settings)
    error = (sim["peak_bytes"] - tracker["peak_bytes"]) / tracker["peak_bytes"]
    assert abs(error) <= 0.05, (f"{case_id}: simulated peak {sim['peak_bytes']} vs tracker {tracker['peak_bytes']} "
                                f"({100 * error:+.2f} %), sim at {sim['phase']}/{sim['op']}, tracker at {tracker.get('peak_where')}")
    for category, theirs in tracker["peak_by_category"].items():
        ours = sim["peak_by_category"].get(category, 0)
        assert abs(ours - theirs) <= max(0.05 * theirs, 8 * MiB), f"{case_id}: {category} {ours} vs tracker {theirs}"
