"""Referee cases for frozen parameters and LoRA: the ReferenceTransformer prepared as peft would leave it.

peft is not a dependency: `LoraLinear` is peft's `lora.Linear` forward written out (`result =
base_layer(x); x = self._cast_input_dtype(x, lora_A.weight.dtype)` (with `input_cast`); `result = result +
lora_B(lora_A(lora_dropout(x))) * scaling; result = result.to(torch_result_dtype)`, the dropout an
`nn.Identity` at p = 0), and `prepare` does what `get_peft_model` does to the parameters: every
parameter but the adapters' `requires_grad_(False)` (`mark_only_lora_as_trainable`, bias="none"),
the frozen ones in the dtype the base model was loaded in. `LORA_CASES` pairs each tracker case with the
scenario keys that describe the same model (`model.lora`, `model.frozen`, `model.frozen_dtype`).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from fsdp_sim.workload.lora import PEFT_NAMES

_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_OURS = {v: k for k, v in PEFT_NAMES.items()}  # wq -> q_proj


class CudaDropout(nn.Dropout):
    """peft's `nn.Dropout` as CUDA runs it: `F.dropout` dispatches to `native_dropout` there, which keeps a
    bool mask for backward, where the CPU multiplies by a mask in the input's dtype (`cuda_kernels.py`).
    The CPU has `native_dropout` too, so the referee runs the GPU's kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, self.p, self.training)[0]


class LoraLinear(nn.Module):
    """peft's `lora.Linear`: the base Linear, A (r x in) and B (out x r) beside it."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, input_cast: bool = False) -> None:
        super().__init__()
        self.input_cast = input_cast
        self.base_layer = base
        self.lora_dropout = CudaDropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.input_cast and x.dtype != self.lora_A.weight.dtype:  # peft's `_cast_input_dtype`
            x = x.to(self.lora_A.weight.dtype)
        return (result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling).to(result.dtype)


def prepare(model: nn.Module, *, targets: tuple[str, ...] = (), rank: int = 8, alpha: float = 16.0,
            dropout: float = 0.0, frozen: tuple[str, ...] = (), frozen_dtype: str = "bf16", input_cast: bool = False) -> None:
    """Add adapters beside the block Linears `targets` names (peft's names or "all-linear") and freeze the
    rest; or, without targets, freeze the parameters whose names start with one of `frozen`. `input_cast`:
    peft's `_cast_input_dtype` (the plain step under autocast, `eager_referee.py`); off for the FSDP cases,
    where an FSDP1 adapter unit's weight reads fp32 (its sharded view) when the forward reads its dtype and
    bf16 (prefetched, unsharded) in a checkpoint's recompute, which torch.utils.checkpoint refuses
    ("Recomputed values ... have different metadata"): not modelled."""
    for block in getattr(model, "layers", []):
        for parent in (block.attention, block.feed_forward):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and ("all-linear" in targets or _OURS.get(name) in targets):
                    setattr(parent, name, LoraLinear(child, rank, alpha, dropout, input_cast))
    originals = dict(model.named_parameters())  # kept alive, so their ids stay theirs during the swap
    first_name = {id(param): full for full, param in originals.items()}  # a tied one appears once, first name
    replaced: dict[int, nn.Parameter] = {}  # one frozen copy per tensor: a tied weight stays tied
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            full = first_name[id(param)]
            if targets:
                is_frozen = ".lora_" not in full
            else:
                is_frozen = any(full == f or full.startswith(f + ".") for f in frozen)
            if is_frozen:
                if id(param) not in replaced:
                    replaced[id(param)] = nn.Parameter(param.detach().to(_DTYPE[frozen_dtype]), requires_grad=False)
                setattr(module, name, replaced[id(param)])


def scenario_keys(*, targets=(), rank=8, alpha=16.0, dropout=0.0, frozen=(), frozen_dtype="bf16") -> dict:
    """The `model` keys that describe what `prepare` did."""
    keys: dict = {"frozen_dtype": frozen_dtype}
    if targets:
        keys["lora"] = {"rank": rank, "alpha": alpha, "targets": list(targets), "dropout": dropout}
    else:
        keys["frozen"] = list(frozen)
    return keys


SMALL = {"batch": 1, "seq": 32}
# (id, model overrides, run settings, prepare's arguments); the peak gated at 2 %
LORA_CASES = [
    ("lora-qkvo", {}, {}, {"targets": ("q_proj", "k_proj", "v_proj", "o_proj"), "rank": 8}),
    ("lora-all-linear", {}, {}, {"targets": ("all-linear",), "rank": 16}),
    ("lora-all-linear-small-batch", {"vocab": 512}, SMALL, {"targets": ("all-linear",), "rank": 16}),
    ("lora-qv-dropout", {}, {}, {"targets": ("q_proj", "v_proj"), "rank": 8, "dropout": 0.1}),
    ("lora-qkvo-fp32-base-w8", {}, {"world_size": 8}, {"targets": ("q_proj", "k_proj", "v_proj", "o_proj"),
                                                        "frozen_dtype": "fp32"}),
    ("lora-all-linear-fp16-base-small-batch", {"vocab": 512}, SMALL,
     {"targets": ("all-linear",), "frozen_dtype": "fp16"}),  # the bf16 policy casts the frozen fp16 base too
    ("frozen-embedding", {}, {}, {"frozen": ("tok_embeddings",)}),
    ("frozen-embedding-fp32", {}, {}, {"frozen": ("tok_embeddings",), "frozen_dtype": "fp32"}),
    ("frozen-attention-small-batch", {"vocab": 512}, SMALL, {"frozen": ("tok_embeddings", "layers.0", "layers.1")}),
    # an explicit fp32 policy casts the frozen bf16 weights up (FSDPParam.init_dtype_attrs)
    ("frozen-output-bf16-fp32-policy-small-batch", {"vocab": 4096}, SMALL | {"param_dtype": "fp32"}, {"frozen": ("output",)}),
    ("lora-all-linear-fp32-policy-small-batch", {"vocab": 512}, SMALL | {"param_dtype": "fp32"},
     {"targets": ("all-linear",), "rank": 8}),
    # a tied weight frozen once, for both its modules (the embedding and the head)
    ("frozen-tied-embedding", {"tie_embeddings": True}, {}, {"frozen": ("tok_embeddings",)}),
    ("lora-qv-tied", {"tie_embeddings": True}, {}, {"targets": ("q_proj", "v_proj"), "rank": 8}),
    # the blocks before the first trainable parameter run without a graph: their forward holds its live set
    ("frozen-first-block-forward-peak", {"hidden": 512, "layers": 2, "vocab": 256, "ffn_hidden": 1024},
     {"world_size": 1, "seq": 256}, {"frozen": ("tok_embeddings", "layers.0")}),
    # a checkpointed block's backward with frozen w1 / w3 / w2: no w2 gradient at the MLP's moment, and the
    # product w2 never saved is not released there (-7.3 % before)
    ("lora-qv-ac-full-block-backward-peak", {"hidden": 256, "heads": 4, "kv_heads": 4, "ffn_hidden": 1024, "vocab": 1000},
     {"world_size": 2, "batch": 4, "seq": 512, "activation_checkpointing": "full"}, {"targets": ("q_proj", "v_proj"), "rank": 8}),
    # a wrapped block of the frozen prefix records nothing, so its checkpoint keeps no input (+2.3 % before)
    ("frozen-prefix-ac-full", {"hidden": 128, "layers": 3, "heads": 2, "kv_heads": 1, "ffn_hidden": 500, "vocab": 256,
                               "norm": "layernorm"},
     {"world_size": 2, "batch": 4, "seq": 512, "activation_checkpointing": "full"}, {"frozen": ("tok_embeddings", "layers.0")}),
    # fp32: the first block's composite norm keeps no input it need not differentiate; a frozen final norm's
    # backward peaks as high as a trained one's, less its weight's gradient
    ("frozen-fp32-embedding-and-norm", {"layers": 1, "vocab": 256, "mlp": "gelu"},
     {"world_size": 2, "batch": 4, "seq": 512, "param_dtype": "fp32"}, {"frozen": ("tok_embeddings", "norm"), "frozen_dtype": "fp32"}),
    # the first block's frozen LayerNorm on an input without grad records nothing (-5.1 % before)
    ("lora-layernorm-first-block", {"layers": 1, "vocab": 256, "norm": "layernorm"}, {"world_size": 2, "batch": 4, "seq": 512},
     {"targets": ("k_proj", "v_proj"), "rank": 1}),
    # a checkpointed block's forward holds each adapter's scaled output and sum beside the base output
    # (-2.9 % before: w3's moment)
    ("lora-all-linear-ac-full-forward-peak", {"hidden": 512, "layers": 2, "heads": 16, "kv_heads": 4, "ffn_hidden": 1910,
                                              "vocab": 4096, "norm": "layernorm"},
     {"world_size": 4, "batch": 1, "seq": 512, "wrap": "whole_model", "activation_checkpointing": "full"},
     {"targets": ("all-linear",), "rank": 1, "frozen_dtype": "fp32"}),
    # and its adapters' dropouts keep no mask (-3.2 % before)
    ("lora-qv-dropout-first-block", {"layers": 1, "vocab": 256}, {"world_size": 2, "batch": 4, "seq": 512},
     {"targets": ("q_proj", "v_proj"), "rank": 8, "dropout": 0.1}),
]


def run_case(model: dict, run: dict, prep: dict) -> tuple[dict, dict]:
    """(fsdp-sim, FSDPMemTracker) on one case: `referee.simulate_reference`'s and `run_fsdp_mem_tracker`'s dicts."""
    from fsdp_sim.torch_tools.memtracker import run_fsdp_mem_tracker
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig
    from fsdp_sim.torch_tools.referee import BASE, case_settings, simulate_reference

    cfg = ReferenceConfig(**(BASE | model))
    settings = case_settings(run)
    tracker = run_fsdp_mem_tracker(cfg, prepare_model=partial(prepare, **prep), **settings)
    return simulate_reference(cfg, model_keys=scenario_keys(**prep), **settings), tracker
