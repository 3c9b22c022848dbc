"""The referee for FSDP1: fsdp-sim against PyTorch's MemTracker on FullyShardedDataParallel, on the CPU.

Each case wraps the ReferenceTransformer's blocks and root with FullyShardedDataParallel
(use_orig_params=False) under FakeTensorMode and a fake process group (rank 0 of W), tracks a training
step after a first one with `torch.distributed._tools.mem_tracker.MemTracker`
(`fsdp_sim/torch_tools/memtracker_fsdp1.py`) and compares the peak with fsdp-sim's simulation of the same
job (`fsdp.version: 1`). Gate: the peak within 2 %. The small-batch cases (one sequence of 32 tokens, a
512-word vocabulary) put the peak in the blocks' backward, where the flat parameters, the prefetch policy
and the strategy decide it; the larger one puts it at the loss. The hybrid strategies run on a (2, 4)
device mesh. Skipped without torch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from fsdp_sim.torch_tools.memtracker_fsdp1 import run_fsdp1_mem_tracker, simulate_fsdp1_reference  # noqa: E402
from fsdp_sim.torch_tools.reference_model import ReferenceConfig  # noqa: E402
from fsdp_sim.torch_tools.referee import BASE  # noqa: E402

SMALL = {"batch": 1, "seq": 32}
CASES = [
    ("full-shard-backward-pre", {}, {}),
    ("full-shard-backward-pre-small-batch", {"vocab": 512}, SMALL),
    ("full-shard-backward-post-small-batch", {"vocab": 512}, SMALL | {"backward_prefetch": "BACKWARD_POST"}),
    ("full-shard-no-prefetch-small-batch", {"vocab": 512}, SMALL | {"backward_prefetch": None}),
    ("shard-grad-op-small-batch", {"vocab": 512}, SMALL | {"sharding_strategy": "SHARD_GRAD_OP"}),
    ("shard-grad-op-w8-vocab1003-padding", {"vocab": 1003}, SMALL | {"world_size": 8, "sharding_strategy": "SHARD_GRAD_OP"}),
    ("no-shard-small-batch", {"vocab": 512}, SMALL | {"sharding_strategy": "NO_SHARD"}),
    ("fp32-params-small-batch", {"vocab": 512}, SMALL | {"param_dtype": "fp32", "reduce_dtype": "fp32"}),
    # each forward-prefetched unit's post-backward hook runs one unit late (autograd's node order)
    ("forward-prefetch-small-batch", {"vocab": 512}, SMALL | {"forward_prefetch": True}),
    ("forward-prefetch-backward-post-fp32-small-batch", {"vocab": 512},
     SMALL | {"forward_prefetch": True, "backward_prefetch": "BACKWARD_POST", "param_dtype": "fp32", "reduce_dtype": "fp32"}),
    ("hybrid-shard-2x4-small-batch", {"vocab": 512}, SMALL | {"world_size": 8, "shard_size": 4, "sharding_strategy": "HYBRID_SHARD"}),
    ("hybrid-shard-zero2-2x4-small-batch", {"vocab": 512},
     SMALL | {"world_size": 8, "shard_size": 4, "sharding_strategy": "_HYBRID_SHARD_ZERO2"}),
    ("bf16-reduce-no-limiter-w2", {"vocab": 1003}, SMALL | {"world_size": 2, "reduce_dtype": None, "limit_all_gathers": False}),
    ("fp16-params-fp16-reduce-shard-grad-op-small-batch", {"vocab": 512},
     SMALL | {"param_dtype": "fp16", "reduce_dtype": None, "sharding_strategy": "SHARD_GRAD_OP"}),
]


@pytest.mark.parametrize("case_id, model, run", CASES, ids=[c[0] for c in CASES])
def test_simulated_peak_agrees_with_mem_tracker_on_fsdp1(case_id, model, run):
    cfg = ReferenceConfig(**(BASE | model))
    settings = {"world_size": 4, "batch": 2, "seq": 128} | run
    tracker = run_fsdp1_mem_tracker(cfg, **settings)
    sim = simulate_fsdp1_reference(cfg, **settings)
    error = (sim["peak_bytes"] - tracker["peak_bytes"]) / tracker["peak_bytes"]
    assert abs(error) <= 0.02, (f"{case_id}: simulated peak {sim['peak_bytes']} vs MemTracker {tracker['peak_bytes']} "
                                f"({100 * error:+.3f} %), sim at {sim['phase']}/{sim['op']}, tracker at {tracker['peak_where']}")
