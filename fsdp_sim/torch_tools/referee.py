"""fsdp-sim beside PyTorch's FSDPMemTracker on the same model and settings.

`simulate_reference(cfg, ...)` simulates the ReferenceTransformer's step with fsdp-sim and returns the
peak and its categories under FSDPMemTracker's names, so a test or a benchmark can hold the two side by
side. Gradients count as "Temp" in the tracker until FSDP's post-backward takes them, so the simulator's
unsharded gradients are compared under "Temp".
"""

from __future__ import annotations

from dataclasses import asdict

from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate

TRACKER_CATEGORY = {
    "sharded_params": "Sharded Param", "unsharded_params": "Unsharded Param", "sharded_grads": "Sharded Grad",
    "unsharded_grads": "Temp", "optimizer_states": "OptState", "activations": "Activation",
    "temporaries": "Temp", "all_gather_buffers": "All Gather", "reduce_scatter_buffers": "Reduce Scatter",
    "inputs": "Inputs", "buffers": "Buffer",
}
_DIM_FIELDS = ("hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab", "mlp", "norm", "bias",
               "tie_embeddings", "learned_pos", "max_seq")


def reference_scenario(cfg, *, world_size: int, batch: int, seq: int, wrap: str = "per_block",
                       reshard_after_forward: bool = True, param_dtype: str = "bf16", reduce_dtype: str = "fp32",
                       optimizer: str = "adamw", activation_checkpointing: str = "none") -> dict:
    """The scenario (as data) that describes the same job as `run_fsdp_mem_tracker`'s arguments."""
    # nn.RMSNorm runs its composite (fp32-upcasting) implementation on the CPU the referee runs on
    dims = {k: v for k, v in asdict(cfg).items() if k in _DIM_FIELDS} | {"norm_impl": "composite"}
    if not dims.get("learned_pos"):
        dims.pop("max_seq", None)
    return {
        "model": dims,
        "training": {"micro_batch": batch, "seq_len": seq, "optimizer": optimizer,
                     "activation_checkpointing": activation_checkpointing},
        "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": world_size},
        "fsdp": {"wrap": wrap, "reshard_after_forward": reshard_after_forward,
                 "mixed_precision": {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}},
    }


def simulate_reference(cfg, **settings) -> dict:
    """fsdp-sim's peak allocated bytes and its categories, in FSDPMemTracker's category names."""
    result = simulate(parse_scenario(reference_scenario(cfg, **settings), name="referee"))
    peak = result.peak()
    by_category: dict[str, int] = {}
    for ours, theirs in TRACKER_CATEGORY.items():
        by_category[theirs] = by_category.get(theirs, 0) + peak["by_category"][ours]
    return {"peak_bytes": peak["allocated_bytes"], "peak_by_category": by_category,
            "phase": peak["phase"], "unit": peak["unit"], "op": peak["op"]}
