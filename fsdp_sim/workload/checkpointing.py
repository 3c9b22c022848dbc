"""Which blocks activation checkpointing wraps, and what a selective policy keeps, as torchtitan applies them.

`training.activation_checkpointing` names one of torchtitan's modes (`torchtitan/distributed/
activation_checkpoint.py`, `apply_ac`), each a non-reentrant `checkpoint_wrapper` around a block:
- `full`: every block; its forward keeps only the block's input, and backward recomputes the forward up
  to the last tensor the backward needs (`early_stop=True`: a SwiGLU block's w2 is not rerun).
- `selective_layer` (`selective_ac_option: "k"`): `_apply_layer_sac` counts the blocks it is called on,
  from 1, and wraps the ones whose count is a multiple of k: blocks k-1, 2k-1, ... (0-based); the
  others keep everything, as without checkpointing. k = 1 is `full`.
- `selective_op` (`selective_ac_option: "op"`): every block is wrapped with a selective-checkpoint policy
  (`_apply_op_sac`): an op in `_op_sac_save_list` (llama3's `parallelize.py`: `aten.mm`, the SDPA
  kernels -- flash, efficient, cudnn; `_scaled_dot_product_flash_attention_for_cpu` on the CPU --,
  `reduce_scatter_tensor`, `aten.max`) is MUST_SAVE, except every second `aten.mm` of the block
  (`meta["forward_mm_count"] % 2 == 0`); everything else is recomputed. A biased Linear dispatches
  `aten.addmm`, which the list does not name and which does not move the count, so a biased block keeps
  only its attention output. The saved outputs sit in the checkpoint's cache from forward to the end of
  the block's backward (the recompute pops them instead of rerunning the op: no FLOPs); the cache entries
  autograd saves anyway are shared with the recompute, the others (w2's output; q before rotary
  embedding; k, v before the grouped-query expansion) are kept in addition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import ScenarioError
from fsdp_sim.workload.model import Kernel, Module, Workload, derived

COMPILED_SAC = "compiled_selective_op"  # Workload.meta: the blocks torch.compile compiled under the op-level policy
INDUCTOR_KERNEL = "inductor "  # how a compiled block's kernels from Inductor's table are named (compiled_block.py)

MODES = ("none", "full", "selective_layer", "selective_op")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """How one checkpointed block runs: the policy's cache, and the recompute its backward runs first.

    `cache_bytes`: the saved ops' outputs, alive from the block's forward to the end of its backward;
    `shared_bytes`: the part of them autograd keeps anyway (already in `Module.saved_bytes`), so the
    recompute materialises `saved_bytes - shared_bytes` more. `recompute_kernels`: the block's kernels
    with the cached ones marked not recomputed. Full checkpointing has no cache."""

    cache_bytes: int = 0
    shared_bytes: int = 0
    recompute_kernels: tuple[Kernel, ...] = ()
    recompute_flops: float = field(init=False, repr=False, compare=False)  # what the recompute reruns

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute_flops", sum(k.fwd_flops for k in self.recompute_kernels if k.recompute))


def output_bytes(k: Kernel, p: int) -> int:
    """The output of a kernel the save list names: an mm's (m, n) in the activation dtype; SDPA's
    (b, heads, s, head_dim) output and its fp32 logsumexp (b, heads, s)."""
    if k.kind == "gemm":
        m, n, _ = k.shape
        return m * n * p
    b, h, s, d = k.shape
    return b * h * s * d * p + b * h * s * 4


def op_policy(m: Module, p: int) -> Checkpoint:
    """torchtitan's op-level policy on one block: save the SDPA outputs and the odd-numbered mm's."""
    count, cache, shared, kernels = 0, 0, 0, []
    for k in m.kernels:
        save = k.aten_op == "sdpa"
        if k.aten_op == "mm":
            count += 1
            save = count % 2 == 1
        if save and k.recompute:  # past the last saved tensor the recompute stops anyway: nothing to pop
            nbytes = output_bytes(k, p)
            cache += nbytes
            shared += nbytes if k.output_saved else 0
            k = replace(k, recompute=False)
        elif save:  # w2's output: cached in forward, never popped (early stop), freed with the block
            cache += output_bytes(k, p)
        kernels.append(k)
    return Checkpoint(cache, shared, tuple(kernels))


def compiled_op_policy(m: Module, p: int) -> Checkpoint:
    """The op-level policy on a block torch.compile compiled with it (workload/compiled_block.py): the
    partitioner follows the policy's tags, so the block keeps the compiled forward's saved set
    (`m.saved_bytes`, the MUST_SAVE outputs the backward reads and what the policy cannot recompute)
    from its forward to the end of its backward, nothing more; its backward graph reruns the GEMMs
    the policy does not cache (their FLOPs: the recompute) with the recomputed memory-bound ops fused
    into its own kernels (their bytes in the compiled backward's, not rerun here). Kernels added after
    the table (torchao's float8 casts) rerun as the eager policy says: the table does not show them."""
    kernels = tuple(replace(k, recompute=False) if k.name.startswith(INDUCTOR_KERNEL) else k
                    for k in op_policy(m, p).recompute_kernels)
    return Checkpoint(m.saved_bytes, m.saved_bytes, kernels)


def checkpoint_plans(workload: Workload, mode: str, every: int) -> dict[str, Checkpoint]:
    """The checkpointed blocks of `workload` by name, each with how it runs (see the module docstring);
    remembered for the workload (`derived`), read-only."""
    return derived(workload, ("checkpoint plans", mode, every), lambda: _plans(workload, mode, every))


def _plans(workload: Workload, mode: str, every: int) -> dict[str, Checkpoint]:
    if mode == "none":
        return {}
    blocks = [m for m in workload.modules if m.is_block]
    if mode == "selective_layer":
        blocks = [m for i, m in enumerate(blocks) if (i + 1) % every == 0]
    # a wrapped block that records no graph (the frozen prefix, `Module.records_graph`) packs no saved
    # tensor, so nothing refers to the checkpoint's frame and its input goes as without the wrapper
    blocks = [m for m in blocks if m.records_graph]
    if mode != "selective_op":
        return _by_kernels(blocks, lambda m: Checkpoint(recompute_kernels=m.kernels))
    p = itemsize(workload.activation_dtype)
    for m in blocks:
        unknown = [k.name for k in m.kernels if k.kind == "gemm" and not k.aten_op]
        if not m.kernels or unknown:
            raise ScenarioError("training.activation_checkpointing: selective_op needs each block's kernels with "
                                f"the ATen op they dispatch; {m.name} has {unknown[0] if unknown else 'no kernels'} "
                                "without (dense blocks from dimensions or an HF config have them; mixture-of-experts and traced "
                                "blocks do not)")
    compiled = set(workload.meta.get(COMPILED_SAC, ()))  # compiled under the policy (workload/compiled_block.py)
    eager = _by_kernels([m for m in blocks if m.name not in compiled], lambda m: op_policy(m, p))
    return {m.name: compiled_op_policy(m, p) if m.name in compiled else eager[m.name] for m in blocks}


def _by_kernels(blocks: list[Module], plan: Callable[[Module], Checkpoint]) -> dict[str, Checkpoint]:
    """`plan(m)` of each block by name, made once per kernels tuple: a model's blocks share one (Llama 3 70B's
    80; transformer.py builds it once per model), and the plan reads nothing else of an eager block
    (`op_policy`, and full checkpointing's rerun of every kernel). The tuple is compared by identity, as
    hashing its kernels field by field costs more than a plan; blocks with equal kernels in other tuples
    each get their own plan, the same."""
    plans: dict[int, Checkpoint] = {}
    out = {}
    for m in blocks:
        ck = plans.get(id(m.kernels))
        if ck is None:
            ck = plans[id(m.kernels)] = plan(m)
        out[m.name] = ck
    return out


def ac_frequency(mode: str, every: int | None) -> int:
    """`training.ac_every` (torchtitan's `selective_ac_option: k`): selective_layer's k, required there
    and refused with any other mode, where it would silently mean nothing."""
    if mode == "selective_layer" and every is None:
        raise ScenarioError("training.ac_every: missing (selective_layer checkpoints every k-th block; give k)")
    if mode != "selective_layer" and every is not None:
        raise ScenarioError(f"training.ac_every: only selective_layer takes it, got activation_checkpointing {mode}")
    return every or 1
