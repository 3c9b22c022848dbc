"""Smoke test for the torch-side referee harness (FSDPMemTracker on CPU, fake tensors, fake PG)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed._tools.fsdp2_mem_tracker")

from fsdp_sim.torch_tools.memtracker import CATEGORIES, run_fsdp_mem_tracker  # noqa: E402
from fsdp_sim.torch_tools.reference_model import ReferenceConfig, ReferenceTransformer  # noqa: E402


def test_harness_runs_on_tiny_config():
    cfg = ReferenceConfig(hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab=130)
    r = run_fsdp_mem_tracker(cfg, world_size=4, batch=1, seq=16)

    for key in ("peak_bytes", "peak_by_category", "peak_where", "per_category_max"):
        assert key in r
    assert r["peak_bytes"] > 0
    assert set(r["peak_by_category"]) == set(CATEGORIES)
    assert set(r["per_category_max"]) == set(CATEGORIES)
    # the breakdown is taken at the peak moment, so it adds up to the peak
    assert sum(r["peak_by_category"].values()) == r["peak_bytes"]
    assert all(r["per_category_max"][c] >= r["peak_by_category"][c] for c in CATEGORIES)
    assert r["peak_where"]["iteration"] >= 1
    assert r["peak_where"]["phase"] in ("forward", "loss", "backward", "optimizer", "zero_grad")
    # AdamW state is there from iteration 1 on: exp_avg + exp_avg_sq >= 2x the sharded params
    steady = r["steady_state_bytes"]
    assert steady["OptState"] >= 2 * steady["Sharded Param"] > 0
    # FSDP2 pads each parameter's dim 0 to a multiple of world_size (vocab 130 -> 33 rows per rank)
    with torch.device("meta"):
        model = ReferenceTransformer(cfg)
    padded = sum(-(-p.shape[0] // 4) * (p.numel() // p.shape[0]) for p in model.parameters())
    assert steady["Sharded Param"] == 4 * padded
    assert not torch.distributed.is_initialized()
