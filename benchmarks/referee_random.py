"""fsdp-sim against PyTorch's FSDPMemTracker on random models and settings, not the referee grid's.

The referee grid (tests/test_referee.py) holds cases chosen by hand; this draws N cases at random (a seed
makes them repeatable): the ReferenceTransformer's shape (heads, head size, GQA, FFN width, vocabulary
including odd sizes, SwiGLU / GELU, RMSNorm / LayerNorm, biases, tied and learned embeddings, 1-6 blocks)
and the FSDP2 job (1-8 GPUs, every wrap the harness builds, reshard after forward, fp32 / bf16 / fp16
parameters, each reduce dtype, AdamW / SGD, full checkpointing, gradient accumulation, prefetch depths),
runs the tracker (CPU, fake tensors, ~3 s a case) and the simulator on each, and prints every case's error
and where the simulated peak is, then the distribution. A case the harness cannot build (torchtitan's wrap
with tied or learned embeddings) is skipped. `fsdp1` draws FSDP1 jobs instead (MemTracker,
`FullyShardedDataParallel` with the transformer auto-wrap policy: every sharding strategy, hybrid shard
sizes, backward prefetch, forward prefetch, the rate limiter, each dtype); `lora` FSDP2 jobs with peft's
adapters on random targets, ranks and dropout over a base frozen in bf16 / fp16 / fp32, or random
parameters frozen (`lora_referee.py`). Needs torch (`pip install -e '.[torch]'`).
Run: python benchmarks/referee_random.py [N=40] [SEED=0] [fsdp2 | fsdp1 | lora]
"""

from __future__ import annotations

import random
import sys

from fsdp_sim.errors import ScenarioError
from fsdp_sim.torch_tools.lora_referee import run_case
from fsdp_sim.torch_tools.memtracker import run_fsdp_mem_tracker
from fsdp_sim.torch_tools.memtracker_fsdp1 import run_fsdp1_mem_tracker, simulate_fsdp1_reference
from fsdp_sim.torch_tools.reference_model import ReferenceConfig
from fsdp_sim.torch_tools.referee import simulate_reference


def draw(rng: random.Random) -> tuple[dict, dict]:
    """One random (model, FSDP2 settings) pair in run_fsdp_mem_tracker's terms."""
    heads = rng.choice([1, 2, 4, 8, 12, 16])
    hidden = heads * rng.choice([8, 16, 32, 64])
    seq = rng.choice([8, 16, 32, 64, 128, 256, 512])
    model = dict(hidden=hidden, layers=rng.randint(1, 6), heads=heads,
                 kv_heads=rng.choice([d for d in range(1, heads + 1) if heads % d == 0]),
                 ffn_hidden=rng.choice([2 * hidden, 4 * hidden, rng.randint(hidden, 4 * hidden)]),
                 vocab=rng.choice([256, 1000, 1003, 4096, 8192, rng.randint(100, 9000)]),
                 mlp=rng.choice(["swiglu", "gelu"]), norm=rng.choice(["rmsnorm", "layernorm"]),
                 bias=rng.random() < 0.3, tie_embeddings=rng.random() < 0.3, learned_pos=rng.random() < 0.2,
                 max_seq=max(seq, rng.choice([512, 2048])))
    wrap = rng.choice(["per_block", "per_block", "whole_model", "every_k_blocks", "torchtitan"])
    run = dict(world_size=rng.choice([1, 2, 3, 4, 8]), batch=rng.randint(1, 4), seq=seq, wrap=wrap,
               reshard_after_forward=rng.choice([True, True, False]), param_dtype=rng.choice(["bf16", "bf16", "fp32", "fp16"]),
               reduce_dtype=rng.choice(["fp32", "bf16", None]), optimizer=rng.choice(["adamw", "sgd"]),
               activation_checkpointing=rng.choice(["none", "full"]), grad_accumulation=rng.choice([1, 1, 2, 3]),
               backward_prefetch=rng.choice([1, 1, 0, 2]), forward_prefetch=rng.choice([0, 0, 1]))
    if wrap == "every_k_blocks":
        run["blocks_per_unit"] = rng.randint(1, 3)
    return model, run


def draw_fsdp1(rng: random.Random) -> tuple[dict, dict]:
    """One random (model, FSDP1 settings) pair in run_fsdp1_mem_tracker's terms (the model as `draw`'s)."""
    model, fsdp2 = draw(rng)
    strategy = rng.choice(["FULL_SHARD", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
    world = rng.choice([2, 4, 8]) if "HYBRID" in strategy else rng.choice([1, 2, 4, 8])
    run = dict(world_size=world, batch=fsdp2["batch"], seq=fsdp2["seq"], sharding_strategy=strategy,
               backward_prefetch=rng.choice(["BACKWARD_PRE", "BACKWARD_POST", None]), forward_prefetch=rng.random() < 0.3,
               limit_all_gathers=rng.random() < 0.7, param_dtype=fsdp2["param_dtype"], reduce_dtype=fsdp2["reduce_dtype"])
    if "HYBRID" in strategy:
        run["shard_size"] = rng.choice([d for d in (1, 2, 4) if world % d == 0 and d < world])
    return model, run


PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def draw_lora(rng: random.Random) -> tuple[dict, dict, dict]:
    """`draw`'s pair (no forward prefetch: the harness's LoRA runs take the default) and what `prepare`
    does to the model: adapters (a GELU MLP has no up_proj) or frozen parameters."""
    model, run = draw(rng)
    run.pop("forward_prefetch")
    if rng.random() < 0.7:
        names = [t for t in PEFT_TARGETS if model["mlp"] == "swiglu" or t != "up_proj"]
        targets = ("all-linear",) if rng.random() < 0.3 else tuple(rng.sample(names, rng.randint(1, 4)))
        prep = dict(targets=targets, rank=rng.choice([1, 4, 8, 16, 32]), dropout=rng.choice([0.0, 0.0, 0.1]),
                    frozen_dtype=rng.choice(["bf16", "fp32", "fp16"]))
    else:
        prep = dict(frozen=tuple(rng.sample(["tok_embeddings", "layers.0", "layers.1", "norm", "output"], rng.randint(1, 2))),
                    frozen_dtype=rng.choice(["bf16", "fp32"]))
    return model, run, prep


def one(mode: str, rng: random.Random) -> tuple[dict, dict, dict, dict, str]:
    """(the tracker's dict, the simulator's, the model, the settings, what was done to it) for one case."""
    if mode == "fsdp1":
        model, run = draw_fsdp1(rng)
        cfg = ReferenceConfig(**model)
        return run_fsdp1_mem_tracker(cfg, **run), simulate_fsdp1_reference(cfg, **run), model, run, ""
    if mode == "lora":
        model, run, prep = draw_lora(rng)
        sim, tracker = run_case(model, run, prep)  # the drawn model and settings set every key it defaults
        return tracker, sim, model, run, f"; {prep}"
    model, run = draw(rng)
    cfg = ReferenceConfig(**model)
    return run_fsdp_mem_tracker(cfg, **run), simulate_reference(cfg, **run), model, run, ""


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    mode = sys.argv[3] if len(sys.argv) > 3 else "fsdp2"
    if mode not in ("fsdp2", "fsdp1", "lora"):
        sys.exit(f"referee_random.py: MODE must be fsdp2, fsdp1 or lora, got {mode!r}")
    errors = []
    print(f"{'case':>5}{'tracker peak B':>16}{'sim peak B':>14}{'error %':>10}  simulated peak at; model; settings")
    for i in range(n):
        try:
            tracker, sim, model, run, prep = one(mode, rng)
        except ScenarioError as exc:  # the simulator refused a job the tracker ran
            print(f"{i:>5}  fsdp-sim refused: {exc}")
            continue
        except ValueError as exc:  # a combination the harness does not build
            print(f"{i:>5}  skipped: {exc}")
            continue
        error = 100 * (sim["peak_bytes"] - tracker["peak_bytes"]) / tracker["peak_bytes"]
        errors.append(error)
        print(f"{i:>5}{tracker['peak_bytes']:>16,}{sim['peak_bytes']:>14,}{error:>+10.3f}  {sim['phase']} / {sim['op']}; "
              f"{model}; {run}{prep}", flush=True)
    magnitudes = sorted(abs(e) for e in errors)
    if magnitudes:
        print(f"{len(errors)} cases: |error| median {magnitudes[len(magnitudes) // 2]:.3f} %, "
              f"max {magnitudes[-1]:.3f} %; within 0.25 %: {sum(m <= 0.25 for m in magnitudes)}, "
              f"within 1 %: {sum(m <= 1 for m in magnitudes)}")


if __name__ == "__main__":
    main()
