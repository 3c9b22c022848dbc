"""Referee cases for selective checkpointing, the loss kernels that run on the CPU and torch.optim's
implementations: the ReferenceTransformer set up as torchtitan / torchtune would, under FSDPMemTracker.

- `selective_checkpointing(mode, every)`: a `prepare_model` for `run_fsdp_mem_tracker` that wraps the
  blocks as torchtitan's `apply_ac` does: `selective_layer` wraps block i when (i + 1) % every == 0;
  `selective_op` wraps every block with `_apply_op_sac`'s policy (`_op_sac_save_list` of llama3's
  parallelize.py, plus `_scaled_dot_product_flash_attention_for_cpu`, the SDPA kernel the CPU runs).
- `chunked_output`: torchtune's `chunked_output` (`output(c) for c in h.tensor_split(8, dim=1)`), with
  `chunked_cross_entropy` its `CEWithChunkedOutputLoss.forward`; `bf16_cross_entropy` is
  `F.cross_entropy` on the logits without the upcast.
- `optimizer_factory(optimizer, impl, momentum)`: torch.optim's AdamW / Adam / SGD with foreach=True,
  foreach=False (the for-loop path) or fused=True.
`CASES` pairs each case's tracker setup with the scenario keys that describe the same job.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_sim.workload.loss import TORCHTUNE_OUTPUT_CHUNKS


def _save_list() -> set:
    ops = torch.ops.aten
    names = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
             "_scaled_dot_product_flash_attention_for_cpu")
    return {ops.mm.default, ops.max.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
            *(getattr(ops, n).default for n in names)}


def _op_sac_context():
    """`_apply_op_sac`'s policy: save the listed ops' outputs, except every second mm of the block."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save, meta = _save_list(), defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[key] += 1
        keep = func in save and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def selective_checkpointing(mode: str, every: int = 1):
    """A `prepare_model` wrapping the blocks in non-reentrant `checkpoint_wrapper`s as torchtitan does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def prepare(model: nn.Module) -> None:
        for i, block in enumerate(model.layers):
            if mode == "selective_op":
                model.layers[i] = checkpoint_wrapper(block, context_fn=_op_sac_context, preserve_rng_state=False)
            elif (i + 1) % every == 0:
                model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    return prepare


class _ChunkedOutput(nn.Linear):
    """The output head applied to each of `TORCHTUNE_OUTPUT_CHUNKS` sequence pieces (torchtune)."""

    def forward(self, h: torch.Tensor) -> list[torch.Tensor]:
        return [F.linear(c, self.weight) for c in h.tensor_split(TORCHTUNE_OUTPUT_CHUNKS, dim=1)]


def chunked_output(model: nn.Module) -> None:
    """A `prepare_model`: the model returns its logits as torchtune's chunked output."""
    head = model.output
    model.output = _ChunkedOutput(head.in_features, head.out_features, bias=False, device=head.weight.device)


def chunked_cross_entropy(logits: list[torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    total = (labels != -100).sum()
    pieces = [t.reshape(-1) for t in labels.tensor_split(len(logits), dim=1)]
    loss = 0.0
    for chunk, target in zip(logits, pieces, strict=True):
        loss += F.cross_entropy(chunk.reshape(-1, chunk.size(-1)).float(), target, reduction="sum")
    return loss / total


def bf16_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def optimizer_factory(optimizer: str, impl: str = "foreach", momentum: bool = True):
    """torch.optim's optimizer in the implementation `impl` names, as the referee's defaults set it up."""
    flags = {"foreach": {"foreach": True}, "for_loop": {"foreach": False}, "fused": {"fused": True}}[impl]

    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=1e-2, momentum=0.9 if momentum else 0.0, **flags)
        return {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[optimizer](params, lr=1e-4, **flags)
    return make


def stored_in_bf16(model) -> None:
    """A `prepare_model`: the parameters stored in bf16 before `fully_shard`, as `model.to(torch.bfloat16)`
    leaves them (set through `.data`: `Module.to` swaps tensors, which the fake-tensor mode's weak
    references forbid)."""
    import torch

    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)


# (id, model overrides, run settings, tracker setup, scenario training keys); learned positions: the
# reference model has no rotary embedding, so q is wq's output as the dimensions' builder then assumes
_POS = {"learned_pos": True, "max_seq": 128}
CASES = [
    ("selective-layer-2", {}, {}, {"prepare_model": selective_checkpointing("selective_layer", 2)},
     {"activation_checkpointing": "selective_layer", "ac_every": 2}),
    ("selective-layer-3-w2-no-reshard", {}, {"world_size": 2, "reshard_after_forward": False},
     {"prepare_model": selective_checkpointing("selective_layer", 3)},
     {"activation_checkpointing": "selective_layer", "ac_every": 3}),
    ("selective-op", _POS, {}, {"prepare_model": selective_checkpointing("selective_op")},
     {"activation_checkpointing": "selective_op"}),
    ("selective-op-gqa-gelu-w8", _POS | {"kv_heads": 2, "mlp": "gelu", "ffn_hidden": 1024}, {"world_size": 8},
     {"prepare_model": selective_checkpointing("selective_op")}, {"activation_checkpointing": "selective_op"}),
    ("selective-op-bias", _POS | {"bias": True}, {}, {"prepare_model": selective_checkpointing("selective_op")},
     {"activation_checkpointing": "selective_op"}),
    ("loss-chunked", {}, {}, {"prepare_model": chunked_output, "loss_fn": chunked_cross_entropy}, {"loss": "chunked"}),
    ("loss-chunked-seq-100", {}, {"seq": 100}, {"prepare_model": chunked_output, "loss_fn": chunked_cross_entropy},
     {"loss": "chunked"}),
    ("loss-bf16-logits", {}, {}, {"loss_fn": bf16_cross_entropy}, {"loss": "bf16_logits"}),
    ("adam-foreach-small-batch", {"vocab": 1000}, {"world_size": 2, "batch": 1, "seq": 16},
     {"optim_factory": optimizer_factory("adam")}, {"optimizer": "adam"}),
    ("adamw-for-loop-small-batch", {"vocab": 1000}, {"world_size": 2, "batch": 1, "seq": 16},
     {"optim_factory": optimizer_factory("adamw", "for_loop")}, {"optimizer_impl": "for_loop"}),
    ("adam-for-loop-small-batch", {"vocab": 1000}, {"world_size": 2, "batch": 1, "seq": 16},
     {"optim_factory": optimizer_factory("adam", "for_loop")}, {"optimizer": "adam", "optimizer_impl": "for_loop"}),
    ("adamw-fused-small-batch", {"vocab": 1000}, {"world_size": 2, "batch": 1, "seq": 16},
     {"optim_factory": optimizer_factory("adamw", "fused")}, {"optimizer_impl": "fused"}),
    # a model stored in bf16 (no master copy): its states and the step's temporaries are bf16
    ("bf16-storage-adamw-foreach-small-batch", {"vocab": 1000}, {"world_size": 2, "batch": 1, "seq": 16, "reduce_dtype": None},
     {"optim_factory": optimizer_factory("adamw"), "prepare_model": stored_in_bf16}, {"param_storage_dtype": "bf16"}),
    ("bf16-storage-adamw-for-loop-small-batch", {"vocab": 1000}, {"world_size": 2, "batch": 1, "seq": 16, "reduce_dtype": None},
     {"optim_factory": optimizer_factory("adamw", "for_loop"), "prepare_model": stored_in_bf16},
     {"param_storage_dtype": "bf16", "optimizer_impl": "for_loop"}),
    ("sgd-no-momentum", {}, {"optimizer": "sgd"}, {"optim_factory": optimizer_factory("sgd", momentum=False)},
     {"momentum": False}),
    ("sgd-no-momentum-small-batch", {"vocab": 1000}, {"world_size": 2, "batch": 1, "seq": 16, "optimizer": "sgd"},
     {"optim_factory": optimizer_factory("sgd", momentum=False)}, {"momentum": False}),
]


def compare(case: tuple) -> tuple[dict, dict]:
    """(fsdp-sim's peak and categories, the tracker's) for one of `CASES`; for the optimizer cases each
    also has `optimizer_peak_bytes`, the highest total while `optimizer.step()` runs."""
    from fsdp_sim.scenario import parse_scenario
    from fsdp_sim.simulate import simulate
    from fsdp_sim.torch_tools.memtracker import run_fsdp_mem_tracker
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig
    from fsdp_sim.torch_tools.referee import BASE, case_settings, reference_scenario, simulate_reference

    _, model, run, setup, keys = case
    cfg = ReferenceConfig(**(BASE | model))
    settings = case_settings(run)
    stepping = "optim_factory" in setup
    tracker = run_fsdp_mem_tracker(cfg, **settings, **setup, record_timeline=stepping)
    sim = simulate_reference(cfg, training_keys=keys, **settings)
    if stepping:
        data = reference_scenario(cfg, **settings)
        data["training"] |= keys
        memory = simulate(parse_scenario(data, name="referee")).memory
        # the level entering the phase counts: the step runs on what backward left before its first free
        sim["optimizer_peak_bytes"] = int(max(memory.total[row - 1:row + 1].max() for row in range(1, len(memory.total))
                                              if memory.op_at(row).phase == "optimizer"))
        tracker["optimizer_peak_bytes"] = max(e["Total"] for e in tracker["timeline"] if e["where"]["phase"] == "optimizer")
    return sim, tracker


def relative_errors(case_id: str) -> dict[str, float]:
    """fsdp-sim against the tracker for the case named `case_id`: (sim - tracker) / tracker of the peak,
    and of the optimizer step's peak where the case has one."""
    sim, tracker = compare(next(c for c in CASES if c[0] == case_id))
    return {key: (sim[key] - tracker[key]) / tracker[key] for key in ("peak_bytes", "optimizer_peak_bytes") if key in sim}
