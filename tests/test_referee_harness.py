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


@pytest.mark.parametrize("wrap, blocks_per_unit, all_gathers, reduce_scatters",
                         [("every_k_blocks", 2, 10, 6), ("per_block", 1, 18, 10), ("torchtitan", 1, 22, 12)])
def test_the_tracked_step_runs_the_collectives_fsdp_runs(monkeypatch, wrap, blocks_per_unit, all_gathers, reduce_scatters):
    """Under the referee's tracker a group of modules (`fully_shard([a, b])`) unshards and reshards once, as
    FSDP groups them: 4 blocks in 2 groups, two iterations, each forward all-gathering the root (which keeps
    its parameters) and the groups and each backward the groups again: 2 x (1 + 2 + 2) all-gathers and
    2 x (1 + 2) reduce-scatters. (torch's FSDPMemTracker hooks every module of a group: the per-block 18 / 10.)
    torchtitan's wrap: the embedding, 4 blocks and [norm, output] (not resharded) and an empty root."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg

    calls = {"ag": 0, "rs": 0}
    ag, rs = pg.foreach_all_gather, pg.foreach_reduce
    monkeypatch.setattr(pg, "foreach_all_gather", lambda *a, **k: (calls.__setitem__("ag", calls["ag"] + 1), ag(*a, **k))[1])
    monkeypatch.setattr(pg, "foreach_reduce", lambda *a, **k: (calls.__setitem__("rs", calls["rs"] + 1), rs(*a, **k))[1])
    cfg = ReferenceConfig(hidden=64, layers=4, heads=4, kv_heads=2, ffn_hidden=128, vocab=256)
    run_fsdp_mem_tracker(cfg, world_size=4, batch=1, seq=16, wrap=wrap, blocks_per_unit=blocks_per_unit)
    assert (calls["ag"], calls["rs"]) == (all_gathers, reduce_scatters)
