"""fsdp-sim's plain training step against the same steps run eagerly on fake tensors (CPU), storage by storage.

For each case: the peak allocated of the eager steps (their live storages) and the simulator's, and the
reserved memory of the caching allocator model fed either the eager storages or the simulator's buffers
(`fsdp_sim/torch_tools/eager_referee.py`): the same allocator model on both sides, so the reserved
difference is what the simulator's buffers (a module's saved activations and temporaries as one block
each) do to fragmentation. Llama 3 8B's blocks (hidden 4096, FFN 14336, 32 heads, 8 KV heads) and
vocabulary (128256), 8192 tokens, AdamW: bf16 parameters with PyTorch's default allocator and with
expandable segments, and fp32 parameters under bf16 autocast (the simulator's default plain step). Needs
torch. About a minute.
Run: python benchmarks/eager_referee.py
"""

from __future__ import annotations

from fsdp_sim.torch_tools.eager_referee import eager_steps, simulated
from fsdp_sim.torch_tools.reference_model import ReferenceConfig

GIB = 2 ** 30
MODES = {"bf16": {}, "bf16, expandable": {"expandable_segments": True}, "fp32 autocast": {"dtype": "fp32", "autocast": True}}
CASES = [(layers, ac, mode) for layers in (2, 8) for ac in ("none", "selective_op", "full") for mode in MODES]
BATCH, SEQ = 1, 8192


def main() -> None:
    print(f"{'layers':>6} {'AC':>13} {'mode':>17}  {'allocated GiB eager / sim':>26} {'err %':>7}  "
          f"{'reserved GiB eager / sim':>25} {'err %':>7}")
    for layers, ac, mode in CASES:
        cfg = ReferenceConfig(hidden=4096, layers=layers, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256, max_seq=SEQ)
        eager = eager_steps(cfg, batch=BATCH, seq=SEQ, activation_checkpointing=ac, **MODES[mode])
        sim = simulated(cfg, batch=BATCH, seq=SEQ, activation_checkpointing=ac, **MODES[mode])
        allocated, reserved = int(sim.memory.total.max()), sim.memory.reserved_bytes
        real_reserved = eager.reserved_bytes[-1]
        print(f"{layers:>6} {ac:>13} {mode:>17}  {eager.allocated_bytes / GIB:>12.2f} / "
              f"{allocated / GIB:<11.2f} {100 * (allocated / eager.allocated_bytes - 1):>+7.2f}  {real_reserved / GIB:>11.2f} / "
              f"{reserved / GIB:<11.2f} {100 * (reserved / real_reserved - 1):>+7.2f}")


if __name__ == "__main__":
    main()
