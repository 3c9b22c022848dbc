"""Referee for tensor parallel + FSDP2: FSDPMemTracker on rank 0 of a 2-D (dp, tp) mesh, on the CPU.

`run_tp_fsdp_mem_tracker` runs `run_fsdp_mem_tracker` with the ReferenceTransformer parallelized as
torchtitan's `apply_tp` does it (`models/llama3/infra/parallelize.py`): the embedding rowwise, the norms
`SequenceParallel`, each block's attention and MLP inputs redistributed by `PrepareModuleInput`, wq / wk / wv /
w1 / w3 colwise, wo / w2 rowwise, the output head colwise with its logits kept sharded for `loss_parallel`;
then `fully_shard` on the mesh's dp dimension. Without sequence parallel the same plan has `Replicate()`
where it has `Shard(1)`, and no `SequenceParallel` norms. The 2-D DeviceMesh is built with the fake mode
switched off (as the hpZ mesh is, `memtracker._patch_post_forward_mesh`): a mesh's rank tensor must be real.
So must the meshes FSDP2 derives from it (`FSDPParam._init_sharding_spec_tp` concatenates the dp and tp
meshes): `DeviceMesh.__init__`, its `mesh` property and `_MeshLayout.remap_to_tensor`, which index the root
mesh's rank tensor, run with the fake mode off.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any


def apply_tp(model, tp_mesh, *, sequence_parallel: bool = True) -> None:
    """torchtitan's TP plan on the ReferenceTransformer; the attention then runs 1/k of the heads."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    k = tp_mesh.size()
    for block in model.layers:
        plan = {"attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=seq),
                "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if hasattr(block.feed_forward, "w3"):
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(block, tp_mesh, plan)
        block.attention.heads //= k
        block.attention.kv_heads //= k


def run_tp_fsdp_mem_tracker(cfg, *, tp: int, dp: int, sequence_parallel: bool = True, **kwargs) -> dict[str, Any]:
    """`run_fsdp_mem_tracker` on a (dp, tp) mesh of dp x tp fake ranks, under `loss_parallel()` (the loss and
    its backward on vocabulary-sharded logits); `kwargs` are the harness's (batch, seq, dtypes, ...)."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return run_on_2d_mesh(cfg, lambda model, mesh: apply_tp(model, mesh, sequence_parallel=sequence_parallel),
                              tp=tp, dp=dp, **kwargs)


def run_on_2d_mesh(cfg, parallelize, *, tp: int, dp: int, **kwargs) -> dict[str, Any]:
    """`run_fsdp_mem_tracker` on rank 0 of a (dp, tp) mesh of fake ranks: `parallelize(model, tp_mesh)` before
    `fully_shard` on the dp dimension (a TP plan: torchtitan's here, transformers' in tp_plan_referee.py)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_sim.torch_tools.memtracker import run_fsdp_mem_tracker

    meshes = {}

    def mesh_fn():
        with unset_fake_temporarily():
            meshes["2d"] = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            return meshes["2d"]["dp"]

    with _real_mesh_tensors():
        return run_fsdp_mem_tracker(cfg, world_size=dp * tp, mesh_fn=mesh_fn,
                                    prepare_model=lambda model: parallelize(model, meshes["2d"]["tp"]), **kwargs)


@contextlib.contextmanager
def _real_mesh_tensors():
    """Every DeviceMesh rank tensor made outside the fake mode while the harness runs (module docstring)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.device_mesh import DeviceMesh

    patched = [(_MeshLayout, "remap_to_tensor"), (DeviceMesh, "__init__"), (DeviceMesh, "mesh")]
    originals = [cls.__dict__[name] for cls, name in patched]

    def real_mode(orig):
        @functools.wraps(orig)
        def run(*args, **kwargs):
            with unset_fake_temporarily():
                return orig(*args, **kwargs)
        return run

    for (cls, name), orig in zip(patched, originals):
        setattr(cls, name, property(real_mode(orig.fget)) if isinstance(orig, property) else real_mode(orig))
    try:
        yield
    finally:
        for (cls, name), orig in zip(patched, originals):
            setattr(cls, name, orig)
