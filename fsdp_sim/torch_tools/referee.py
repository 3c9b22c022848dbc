"""fsdp-sim beside PyTorch's FSDPMemTracker on the same model and settings.

`simulate_reference(cfg, ...)` simulates the ReferenceTransformer's step with fsdp-sim (from its
dimensions, or from its traced workload) and returns the peak and its categories under FSDPMemTracker's names, so a test or a benchmark can hold the two side by
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
# The referee grid (tests/test_referee.py, benchmarks/bench_referee.py): a small decoder and, per case,
# (id, model overrides, run settings); every factor issue #3 names appears at least once.
BASE = dict(hidden=256, layers=4, heads=8, kv_heads=8, ffn_hidden=688, vocab=4096, mlp="swiglu")
CASES = [
    ("base-w4", {}, {}),
    ("w2", {}, {"world_size": 2}),
    ("w8", {}, {"world_size": 8}),
    ("whole-model", {}, {"wrap": "whole_model"}),
    ("no-reshard", {}, {"reshard_after_forward": False}),
    ("fp32-params", {}, {"param_dtype": "fp32"}),
    ("sgd", {}, {"optimizer": "sgd"}),
    ("ac-full", {}, {"activation_checkpointing": "full"}),
    ("tied", {"tie_embeddings": True}, {}),
    ("gqa-gelu-ac-w8", {"kv_heads": 2, "mlp": "gelu", "ffn_hidden": 1024}, {"world_size": 8, "activation_checkpointing": "full"}),
    ("vocab1003-w8-padding", {"vocab": 1003}, {"world_size": 8}),
    ("small-batch-w2-optimizer-peak", {"vocab": 1000}, {"world_size": 2, "batch": 1, "seq": 16}),
    ("whole-model-fp32-sgd-w8", {}, {"world_size": 8, "wrap": "whole_model", "param_dtype": "fp32", "optimizer": "sgd"}),
    ("w2-ac-no-reshard", {}, {"world_size": 2, "activation_checkpointing": "full", "reshard_after_forward": False}),
    ("grad-accumulation-3-sync", {}, {"grad_accumulation": 3}),
    ("grad-accumulation-3-no-sync", {}, {"grad_accumulation": 3, "requires_gradient_sync": False}),
    ("gpt2-style-layernorm-bias-tied", {"norm": "layernorm", "bias": True, "tie_embeddings": True, "learned_pos": True,
                                        "max_seq": 128, "mlp": "gelu", "ffn_hidden": 1024}, {}),
    ("layernorm-bias-gelu-untied-ac-full", {"norm": "layernorm", "bias": True, "mlp": "gelu", "ffn_hidden": 1024},
     {"activation_checkpointing": "full"}),
    ("grad-accumulation-2-ac-full", {}, {"grad_accumulation": 2, "activation_checkpointing": "full"}),
]

# A block's backward moments, where one of them is the step's peak: gated at 0.5 % (tests/test_referee.py)
MOMENT_CASES = [
    # SDPA's backward comes after the MLP's saved tensors are released and its weight gradients made: here
    # below the MLP's moment, which is the peak (+2.8 % when the attention moment counted neither)
    ("gqa1-gelu-bias-fp32-ac-full-w8-mlp-backward-peak", {"hidden": 1024, "layers": 1, "heads": 16, "kv_heads": 1,
                                                        "ffn_hidden": 2048, "vocab": 256, "mlp": "gelu", "bias": True},
     {"world_size": 8, "batch": 3, "seq": 512, "param_dtype": "fp32", "optimizer": "sgd", "activation_checkpointing": "full"}),
]

# The FSDP2 setters (issue #7 section 2) and the other MixedPrecisionPolicy dtypes (fp16 params, bf16 and fp16
# reduction), each against the tracker; gated at 2 % on the peak. SMALL is a
# step whose parameters, not the logits, set the peak, so the knobs that move parameter memory show there.
SMALL = {"batch": 1, "seq": 32}
SETTER_CASES = [
    ("hpz-2", {}, {"reshard_after_forward": 2}),
    ("hpz-2-small-batch", {"vocab": 512}, SMALL | {"reshard_after_forward": 2}),
    ("hpz-4-w8-ac-full-small-batch", {"vocab": 512},
     SMALL | {"world_size": 8, "reshard_after_forward": 4, "activation_checkpointing": "full"}),
    ("backward-prefetch-off-small-batch", {"vocab": 512}, SMALL | {"backward_prefetch": 0}),
    ("shard-1-replicate-4-small-batch", {"vocab": 512}, SMALL | {"shard_size": 1}),  # FSDP2's NO_SHARD
    ("cast-forward-inputs-false", {}, {"cast_forward_inputs": False}),
    ("hsdp-2x2-ac-full", {}, {"shard_size": 2, "activation_checkpointing": "full"}),
    ("hsdp-2x4", {}, {"world_size": 8, "shard_size": 4}),
    ("hsdp-2x4-hpz-2-small-batch", {"vocab": 512}, SMALL | {"world_size": 8, "shard_size": 4, "reshard_after_forward": 2}),
    ("prefetch-forward-2-backward-2-small-batch", {"vocab": 512}, SMALL | {"forward_prefetch": 2, "backward_prefetch": 2}),
    ("prefetch-backward-3-small-batch", {"vocab": 512}, SMALL | {"backward_prefetch": 3}),
    ("root-reshard-after-forward-true", {}, {"root_reshard_after_forward": True}),
    ("root-reshard-after-forward-true-small-batch", {"vocab": 512}, SMALL | {"root_reshard_after_forward": True}),
    ("reduce-dtype-unset", {}, {"reduce_dtype": None}),
    ("torchtitan-wrap-fp32-head", {}, {"wrap": "torchtitan", "head_output_dtype": "fp32"}),
    ("torchtitan-wrap-small-batch", {"vocab": 512}, SMALL | {"wrap": "torchtitan"}),
    # fully_shard([layers[0], layers[1]]): one state whose group unshards before layers[0] and reshards after
    # layers[1] (the tracker's hooks put back as FSDP groups them: tracker_patches.py)
    ("every-2-blocks", {}, {"wrap": "every_k_blocks", "blocks_per_unit": 2}),
    ("every-2-blocks-small-batch", {"vocab": 512}, SMALL | {"wrap": "every_k_blocks", "blocks_per_unit": 2}),
    ("output-dtype-fp32-every-unit-small-batch", {"vocab": 512}, SMALL | {"output_dtype": "fp32"}),
    ("hsdp-2x4-accumulation-3-no-all-reduce", {"vocab": 512},
     SMALL | {"world_size": 8, "shard_size": 4, "grad_accumulation": 3, "requires_all_reduce": False}),
    ("accumulation-2-no-reshard-after-backward", {"vocab": 512},
     SMALL | {"grad_accumulation": 2, "reshard_after_backward": False}),
    ("fp16-params", {}, {"param_dtype": "fp16"}),
    ("fp16-params-fp16-reduce-small-batch", {"vocab": 512}, SMALL | {"param_dtype": "fp16", "reduce_dtype": "fp16"}),
    ("reduce-dtype-bf16", {}, {"reduce_dtype": "bf16"}),
    ("reduce-dtype-bf16-small-batch", {"vocab": 512}, SMALL | {"reduce_dtype": "bf16"}),
    # the peak at the root's reduce-scatter, its output head's gradient (vocab x hidden) kept by foreach_reduce
    ("root-keeps-head-grad-w2-vocab8192-small-batch", {"vocab": 8192}, SMALL | {"world_size": 2}),
    # the peak where the tied embedding's gradient joins the head's (autograd adds them out of place)
    ("tied-learned-pos-every-3-blocks-w3-fp32", {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 4, "ffn_hidden": 64,
                                                 "vocab": 1542, "tie_embeddings": True, "learned_pos": True},
     {"world_size": 3, "batch": 1, "seq": 16, "wrap": "every_k_blocks", "blocks_per_unit": 3, "param_dtype": "fp32",
      "reduce_dtype": None, "forward_prefetch": 1, "backward_prefetch": 0}),
    # the peak in a checkpointed block's forward: whole-model parameters, a vocabulary too small for the loss
    ("whole-model-ac-full-forward-peak", {"hidden": 128, "heads": 4, "kv_heads": 4, "ffn_hidden": 256, "layers": 5, "vocab": 256},
     {"wrap": "whole_model", "activation_checkpointing": "full"}),
]


def case_settings(overrides: dict) -> dict:
    """The run settings of a referee case: W=4, batch 2 x 128 tokens, per-block, bf16/fp32, AdamW."""
    return {"world_size": 4, "batch": 2, "seq": 128, "wrap": "per_block", "reshard_after_forward": True,
            "param_dtype": "bf16", "reduce_dtype": "fp32", "optimizer": "adamw",
            "activation_checkpointing": "none"} | overrides


_DIM_FIELDS = ("hidden", "layers", "heads", "kv_heads", "ffn_hidden", "vocab", "mlp", "norm", "bias",
               "tie_embeddings", "learned_pos", "max_seq")


def reference_scenario(cfg, *, world_size: int, batch: int, seq: int, wrap: str = "per_block", blocks_per_unit: int = 1,
                       reshard_after_forward: bool | int = True, root_reshard_after_forward: bool | int | None = None,
                       shard_size: int | None = None, param_dtype: str = "bf16", reduce_dtype: str | None = "fp32",
                       output_dtype: str | None = None, head_output_dtype: str | None = None,
                       cast_forward_inputs: bool = True, forward_prefetch: int = 0, backward_prefetch: int = 1,
                       optimizer: str = "adamw", activation_checkpointing: str = "none", grad_accumulation: int = 1,
                       requires_gradient_sync: bool = True, requires_all_reduce: bool = True,
                       reshard_after_backward: bool = True) -> dict:
    """The scenario (as data) that describes the same job as `run_fsdp_mem_tracker`'s arguments."""
    # nn.RMSNorm runs its composite (fp32-upcasting) implementation on the CPU the referee runs on
    dims = {k: v for k, v in asdict(cfg).items() if k in _DIM_FIELDS} | {"norm_impl": "composite"}
    if not dims.get("learned_pos"):
        dims.pop("max_seq", None)
    mixed_precision = {"param_dtype": param_dtype, "cast_forward_inputs": cast_forward_inputs}
    if reduce_dtype is not None:  # None: MixedPrecisionPolicy's default, the gradient's dtype
        mixed_precision["reduce_dtype"] = reduce_dtype
    if head_output_dtype is not None:  # the unit holding the output head (the root under per_block)
        mixed_precision["output_dtype"] = {"output": head_output_dtype}
    elif output_dtype is not None:
        mixed_precision["output_dtype"] = output_dtype
    fsdp = {"wrap": wrap, "reshard_after_forward": reshard_after_forward,
            "forward_prefetch": forward_prefetch, "backward_prefetch": backward_prefetch or False,
            "requires_gradient_sync": requires_gradient_sync, "requires_all_reduce": requires_all_reduce,
            "reshard_after_backward": reshard_after_backward, "mixed_precision": mixed_precision}
    if wrap == "every_k_blocks":
        fsdp["blocks_per_unit"] = blocks_per_unit
    if root_reshard_after_forward is not None:
        fsdp["root_reshard_after_forward"] = root_reshard_after_forward
    if shard_size is not None:
        fsdp["shard_size"] = shard_size
    return {
        "model": dims,
        "training": {"micro_batch": batch, "seq_len": seq, "optimizer": optimizer,
                     "activation_checkpointing": activation_checkpointing, "grad_accumulation": grad_accumulation},
        "hardware": {"profile": "h100-sxm", "nodes": 1, "gpus_per_node": world_size},
        "fsdp": fsdp,
    }


def traced_reference_workload(cfg, *, batch: int, seq: int, param_dtype: str = "bf16"):
    """The ReferenceTransformer's workload as `fsdp-sim trace` records it, with the CPU's kernels
    (what the CPU referee runs), instead of the analytic builder's. Needs torch."""
    import torch

    from fsdp_sim.torch_tools.reference_model import ReferenceTransformer, loss_fn
    from fsdp_sim.torch_tools.trace import trace_module

    with torch.device("meta"):
        model = ReferenceTransformer(cfg)
    ids = torch.randint(0, cfg.vocab, (batch, seq), device="meta")
    return trace_module(model, (ids,), loss_fn=loss_fn, dtype=param_dtype, emulate_cuda=False, name="reference")


def simulate_reference(cfg, *, workload_file: str | None = None, model_keys: dict | None = None,
                       training_keys: dict | None = None, sections: dict | None = None, **settings) -> dict:
    """fsdp-sim's peak allocated bytes and its categories, in FSDPMemTracker's category names.

    With `workload_file` (a saved traced workload) the model comes from it instead of the dimensions;
    `model_keys` adds scenario keys to the model section (`frozen`, `lora`: `lora_referee.py`),
    `training_keys` to the training section (`loss`, `ac_every`: `technique_referee.py`), `sections` whole
    sections (`parallelism`: `tp_referee.py`)."""
    data = reference_scenario(cfg, **settings)
    data["model"] |= model_keys or {}
    data["training"] |= training_keys or {}
    data |= sections or {}
    if workload_file is not None:  # the trace fixed the batch shape
        data["model"] = {"workload": workload_file}
        del data["training"]["micro_batch"], data["training"]["seq_len"]
    result = simulate(parse_scenario(data, name="referee"))
    peak = result.peak()
    by_category: dict[str, int] = {}
    for ours, theirs in TRACKER_CATEGORY.items():
        by_category[theirs] = by_category.get(theirs, 0) + peak["by_category"][ours]
    return {"peak_bytes": peak["allocated_bytes"], "peak_by_category": by_category,
            "phase": peak["phase"], "unit": peak["unit"], "op": peak["op"]}
