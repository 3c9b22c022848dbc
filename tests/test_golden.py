"""Golden files: the full result of two tiny scenarios, so any change in behaviour shows up in review.

A behaviour change is a deliberate act: regenerate with `FSDP_SIM_REGEN_GOLDEN=1 python -m pytest
tests/test_golden.py` and let the diff of tests/golden/*.json explain itself in the commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fsdp_sim.results.export import timeline_csv
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate

GOLDEN = Path(__file__).parent / "golden"
# reduce_dtype spelled out: MixedPrecisionPolicy's default (None) reduces in the compute dtype
TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 1003}
SCENARIOS = {
    "tiny-full-shard": {"model": TINY, "training": {"micro_batch": 2, "seq_len": 32},
                        "hardware": {"profile": "h100-sxm", "gpus_per_node": 4},
                        "fsdp": {"mixed_precision": {"reduce_dtype": "fp32"}}},
    "tiny-hsdp-ac-sgd": {"model": TINY | {"mlp": "gelu", "tie_embeddings": True},
                         "training": {"micro_batch": 1, "seq_len": 64, "optimizer": "sgd", "activation_checkpointing": "full"},
                         "hardware": {"profile": "a100-80gb", "nodes": 2, "gpus_per_node": 2},
                         "fsdp": {"sharding_strategy": "HYBRID_SHARD", "mixed_precision": {"reduce_dtype": "fp32"}}},
    # FSDP1 (FullyShardedDataParallel) on the same job as tiny-full-shard: flat parameters, record_stream frees
    "tiny-fsdp1-full-shard": {"model": TINY, "training": {"micro_batch": 2, "seq_len": 32},
                              "hardware": {"profile": "h100-sxm", "gpus_per_node": 4},
                              "fsdp": {"version": 1, "mixed_precision": {"reduce_dtype": "fp32"}}},
    # CPUOffloadPolicy and save_on_cpu: the host section, the H2D/D2H copies and the CPU optimizer step
    "tiny-cpu-offload": {"model": TINY, "training": {"micro_batch": 2, "seq_len": 32, "activation_offload": True},
                         "hardware": {"profile": "a100-80gb", "gpus_per_node": 4},
                         "fsdp": {"offload_policy": "CPUOffloadPolicy", "mixed_precision": {"reduce_dtype": "fp32"}}},
    # LoRA on q/k/v/o with dropout over a frozen bf16 base; QLoRA (NF4) with bf16 storage in DeepSpeed's words
    "tiny-lora": {"model": TINY | {"lora": {"rank": 8, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "dropout": 0.1}},
                  "training": {"micro_batch": 2, "seq_len": 32}, "hardware": {"profile": "a100-80gb", "gpus_per_node": 4},
                  "fsdp": {"mixed_precision": {"reduce_dtype": "fp32"}}},
    "tiny-qlora-zero2-bf16": {"model": TINY | {"lora": {"rank": 8, "targets": "all-linear", "quantize": "nf4"}},
                              "training": {"micro_batch": 2, "seq_len": 32, "param_storage_dtype": "bf16"},
                              "hardware": {"profile": "a100-80gb", "gpus_per_node": 4}, "fsdp": {"zero_stage": 2}},
    # tensor parallel 2 x FSDP 2 with sequence parallel; torchao float8 with the float8 all-gather
    "tiny-tp2-fsdp2-sp": {"model": TINY | {"ffn_hidden": 192}, "training": {"micro_batch": 2, "seq_len": 32},
                          "hardware": {"profile": "h100-sxm", "gpus_per_node": 4}, "parallelism": {"tp": 2},
                          "fsdp": {"mixed_precision": {"reduce_dtype": "fp32"}}},
    "tiny-float8": {"model": TINY | {"ffn_hidden": 192}, "training": {"micro_batch": 2, "seq_len": 32},
                    "hardware": {"profile": "h100-sxm", "gpus_per_node": 4},
                    "compute": {"float8": {"enabled": True, "fsdp_float8_all_gather": True, "precompute_scale": True}},
                    "fsdp": {"mixed_precision": {"reduce_dtype": "fp32"}}},
    # torchtitan's op-level selective checkpointing with torchao's AdamW8bit; every second block checkpointed
    # with Liger's fused linear cross-entropy
    "tiny-selective-op-ac-adamw8bit": {"model": TINY, "training": {"micro_batch": 2, "seq_len": 32, "optimizer": "adamw8bit",
                                                                  "activation_checkpointing": "selective_op"},
                                       "hardware": {"profile": "h100-sxm", "gpus_per_node": 4},
                                       "fsdp": {"mixed_precision": {"reduce_dtype": "fp32"}}},
    "tiny-selective-layer-liger-loss": {"model": TINY, "training": {"micro_batch": 2, "seq_len": 32, "ac_every": 2,
                                                                   "activation_checkpointing": "selective_layer",
                                                                   "loss": "liger_fused_linear"},
                                        "hardware": {"profile": "h100-sxm", "gpus_per_node": 4},
                                        "fsdp": {"mixed_precision": {"reduce_dtype": "fp32"}}},
}


def _snapshot(data: dict) -> dict:
    result = simulate(parse_scenario(data, name="golden"))
    csv = timeline_csv(result).splitlines()
    return {"result": json.loads(json.dumps(result.to_dict())), "timeline_rows": len(csv) - 1,
            "timeline_head": csv[:4], "timeline_tail": csv[-3:]}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_result_matches_golden_file(name):
    path = GOLDEN / f"{name}.json"
    snapshot = _snapshot(SCENARIOS[name])
    if os.environ.get("FSDP_SIM_REGEN_GOLDEN"):
        path.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    assert snapshot == json.loads(path.read_text()), f"{name}: behaviour changed; see the module docstring"
