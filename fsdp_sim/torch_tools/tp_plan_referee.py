"""Referee for the TP plans' collectives: the functional collectives DTensor issues, recorded on the CPU.

`record_tp_collectives` builds the ReferenceTransformer in bf16 on rank 0 of a fake process group of k ranks,
parallelizes it with one plan (`apply_plan`), and runs one forward + loss and one backward recording every
functional collective (`torch.distributed._functional_collectives`' `all_reduce`, `all_gather_single`,
`reduce_scatter_single` (torch 2.13), which DTensor's redistributes and `loss_parallel`'s op handlers call; a dispatch
mode would miss the handlers', which run inside DTensor's dispatch) with its bytes, in fsdp-sim's convention
(an all-reduce its tensor, an all-gather its gathered output, a reduce-scatter its input). The plans:
- `torchtitan`: `tp_referee.apply_tp` (the loss under `loss_parallel()`);
- `hf`: transformers' `base_model_tp_plan` on the blocks (torch's default `ColwiseParallel()` on wq / wk / wv /
  w1 / w3, `RowwiseParallel()` on wo / w2: transformers' classes run the same hooks,
  `integrations/tensor_parallel.py`) and `lm_head: colwise_rep` (`ColwiseParallel(output_layouts=Replicate())`),
  the rest unplanned ("replicate": no collective);
- `blocks`: the blocks' Linears only.
The fake process group moves nothing, so the values are meaningless; which collectives run, in which pass,
and their sizes are what DTensor's redistributions ask for.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

KINDS = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter"}


def apply_plan(model, tp_mesh, plan: str, *, sequence_parallel: bool = True) -> None:
    """Parallelize the ReferenceTransformer with `plan` (module docstring); the attention then runs 1/k of
    the heads."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fsdp_sim.torch_tools.tp_referee import apply_tp

    if plan == "torchtitan":
        apply_tp(model, tp_mesh, sequence_parallel=sequence_parallel)
        return
    k = tp_mesh.size()
    for block in model.layers:
        styles = {f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}
        styles |= {"attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                   "feed_forward.w2": RowwiseParallel()}
        if hasattr(block.feed_forward, "w3"):
            styles["feed_forward.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, styles)
        block.attention.heads //= k
        block.attention.kv_heads //= k
    if plan == "hf":
        parallelize_module(model, tp_mesh, {"output": ColwiseParallel(output_layouts=Replicate())})


def record_tp_collectives(cfg, plan: str, *, tp: int, batch: int, seq: int,
                          sequence_parallel: bool = True) -> dict[str, Any]:
    """{"forward": [(kind, bytes), ...], "backward": [...]} in issue order (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_sim.torch_tools.reference_model import ReferenceTransformer, loss_fn

    ops: list[tuple[str, int]] = []
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        torch.manual_seed(0)
        model = ReferenceTransformer(cfg).to(torch.bfloat16)
        apply_plan(model, init_device_mesh("cpu", (tp,)), plan, sequence_parallel=sequence_parallel)
        tokens = torch.randint(0, cfg.vocab, (batch, seq))
        ctx = loss_parallel() if plan == "torchtitan" else contextlib.nullcontext()
        with functional_collectives_recorded(ops), ctx:
            loss = loss_fn(model(tokens), tokens)
            forward = list(ops)
            loss.backward()
        return {"forward": forward, "backward": ops[len(forward):], "counts": Counter(ops)}
    finally:
        if owns:
            dist.destroy_process_group()


@contextlib.contextmanager
def functional_collectives_recorded(ops: list):
    """Every functional collective called meanwhile appended to `ops` as (kind, bytes), in fsdp-sim's
    convention (module docstring)."""
    import torch.distributed._functional_collectives as funcol

    originals = {name: getattr(funcol, name) for name in KINDS}

    def recording(name, orig):
        def run(tensor, *args, **kwargs):
            out = orig(tensor, *args, **kwargs)
            counted = out if KINDS[name] == "all_gather" else tensor
            ops.append((KINDS[name], counted.numel() * counted.element_size()))
            return out
        return run

    for name, orig in originals.items():
        setattr(funcol, name, recording(name, orig))
    try:
        yield
    finally:
        for name, orig in originals.items():
            setattr(funcol, name, orig)


def record_tp_fsdp_collectives(cfg, *, tp: int, dp: int, sequence_parallel: bool = True, iterations: int = 2,
                               **kwargs) -> Counter:
    """The functional collectives of `iterations` training steps of torchtitan's plan under FSDP2 on a (dp, tp)
    mesh (`tp_referee.run_tp_fsdp_mem_tracker`, `kwargs` its batch, seq, ...): the plan's, and FSDP2's
    redistribution of the DTensor gradients in post-backward (the SequenceParallel norms' Partial gradients
    to Replicate). FSDP2's own all-gathers and reduce-scatters are c10d collectives, not counted."""
    from fsdp_sim.torch_tools.tp_referee import run_tp_fsdp_mem_tracker

    ops: list[tuple[str, int]] = []
    with functional_collectives_recorded(ops):
        run_tp_fsdp_mem_tracker(cfg, tp=tp, dp=dp, sequence_parallel=sequence_parallel, iterations=iterations, **kwargs)
    return Counter(ops)


def run_plan_fsdp_mem_tracker(cfg, plan: str, *, tp: int, dp: int, **kwargs) -> dict[str, Any]:
    """`tp_referee.run_tp_fsdp_mem_tracker` with the `hf` or `blocks` plan: FSDPMemTracker on rank 0 of a
    (dp, tp) mesh, `fully_shard` on dp over the planned model, the loss on the whole (replicated) logits
    (no `loss_parallel`); `kwargs` are the harness's (batch, seq, dtypes, ...)."""
    from fsdp_sim.torch_tools.tp_referee import run_on_2d_mesh

    return run_on_2d_mesh(cfg, lambda model, mesh: apply_plan(model, mesh, plan), tp=tp, dp=dp, **kwargs)
