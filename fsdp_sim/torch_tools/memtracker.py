"""Referee harness: PyTorch's own ``FSDPMemTracker`` on one rank of an FSDP2 job, on CPU.

``run_fsdp_mem_tracker(cfg, world_size=..., batch=..., seq=..., ...)`` builds
:class:`~fsdp_sim.torch_tools.reference_model.ReferenceTransformer` on ``meta`` inside a
``FakeTensorMode``, applies ``fully_shard`` (FSDP2) on a 1-D mesh of a ``"fake"`` process group
(rank 0 of ``world_size``), runs ``iterations`` full training steps (forward, fp32 cross-entropy,
backward, optimizer step, ``zero_grad``) under ``FSDPMemTracker`` and reports the peak of the
tracked bytes from the second iteration on, its per-category breakdown at the peak moment, and
where it happened.  No real memory is allocated and no collective runs; FSDP2's own Python code
(padding, mixed-precision casts, all-gather/reduce-scatter buffers, resharding, prefetch) runs
unmodified.  See ``docs/referee-measurements.md``; the recipe is torchtitan's
``scripts/estimate/estimation.py`` around ``torch/distributed/_tools/fsdp2_mem_tracker.py``.

What this harness does beyond the stock recipe:

* **First-step overcount.**  Under an outer ``FakeTensorMode`` DTensor's sharding propagation
  (``ShardingPropagator._propagate_tensor_meta_non_cached``) runs each op on *global-shape* fake
  tensors in the same fake mode, and the stock tracker counts them; they only show while DTensor's
  propagation cache is cold (the first ``optimizer.step()``).  We skip every op dispatched inside
  that function (``skip_dtensor_propagation=True``) *and* only compare from the second iteration
  on: the tracker's peak is re-armed after iteration 0 (which also has no optimizer state yet).
* **Peak breakdown.**  The tracker's ``"peak"`` snapshot is a copy of the *running* per-category
  snapshot taken at the op where the total peaked, i.e. the categories *at the peak moment* (not
  per-category maxima).  We record the same thing independently (and per-category maxima, and the
  location) by hooking ``_update_peak_stats``, and cross-check the two.
* **Where.**  ``peak_where`` gives the iteration, the phase (``forward`` / ``loss`` / ``backward`` /
  ``optimizer`` / ``zero_grad``), the innermost module ModTracker reports active, the op that set
  the peak, the tracker's internal ``_FSDPState``, the last FSDP hook event
  (``"<unit>: in pre-backward"`` = inside FSDP's hook; ``"<unit>: after pre-backward"`` = the
  unit's own compute that follows) and whether a checkpointed block was being recomputed.
  During AC recomputation ModTracker still names the module whose *backward* was running.

The module is importable without torch; calling :func:`run_fsdp_mem_tracker` without torch raises
an ``ImportError`` that says to ``pip install -e '.[torch]'``.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .reference_model import ReferenceConfig

from .tracker_patches import (  # the tracker and its patches, shared with FSDP1's harness
    _DTYPES, _TOTAL, CATEGORIES, _cat_dict, _import_torch, _make_tracker_class, _patch_cuda_rounding,
    _patch_post_forward_mesh, _patch_sharding_propagation)

__all__ = ["run_fsdp_mem_tracker", "CATEGORIES"]


def _apply_fully_shard(model, mesh, *, wrap: str, reshard_after_forward, root_reshard_after_forward,
                       mp, head_mp, blocks_per_unit: int = 1) -> list:
    """``fully_shard`` bottom-up as the wrap names it; returns the FSDP modules with parameters, in
    pre-forward order (the root first when it has any).

    * ``per_block``: each TransformerBlock, then the root (which keeps the embedding, norm and head);
    * ``every_k_blocks``: ``fully_shard(layers[i:i + k])`` for each run of ``blocks_per_unit`` blocks (one
      FSDP state per group, its forward hooks on the group), then the root;
    * ``torchtitan``: ``apply_fsdp_to_decoder`` (torchtitan/distributed/fsdp.py): the embedding, the norm
      and head grouped with ``reshard_after_forward=False``, each block, then the root (no parameters);
    * ``whole_model``: the root only.

    ``head_mp`` is the policy of the unit that holds ``output`` (the root under ``per_block``).
    """
    from torch.distributed.fsdp import fully_shard

    def root_kwargs():
        if root_reshard_after_forward is None:  # FSDP's default: the root keeps its parameters
            return {}
        return {"reshard_after_forward": root_reshard_after_forward}

    units = []
    if wrap == "torchtitan":
        if model.cfg.tie_embeddings or model.pos_embeddings is not None:
            raise ValueError("wrap='torchtitan' in the referee: untied weights and no position embedding only")
        fully_shard(model.tok_embeddings, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        units.append(model.tok_embeddings)
    if wrap in ("per_block", "torchtitan"):
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
            units.append(block)
    if wrap == "every_k_blocks":
        blocks = list(model.layers)
        for i in range(0, len(blocks), blocks_per_unit):
            fully_shard(blocks[i:i + blocks_per_unit], mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
            units.append(blocks[i])  # the group's FSDP state, reached through any of its modules
    if wrap == "torchtitan":
        fully_shard([model.norm, model.output], mesh=mesh, reshard_after_forward=False, mp_policy=head_mp)
        units.append(model.norm)  # the group's FSDP state, reached through either module
        fully_shard(model, mesh=mesh, mp_policy=mp, **root_kwargs())
        return units
    fully_shard(model, mesh=mesh, mp_policy=head_mp, **root_kwargs())
    return [model, *units]


def _set_prefetch(units: list, root, *, forward_prefetch: int, backward_prefetch: int) -> None:
    """Explicit prefetch lists on every FSDP module with parameters: the next ``forward_prefetch`` in
    pre-forward order, the ``backward_prefetch`` before it in post-forward order (the root's forward
    ends last). ``backward_prefetch`` 1 keeps FSDP2's default; 0 is ``m.set_modules_to_backward_prefetch([m])``."""
    for i, m in enumerate(units):
        if forward_prefetch:
            targets = units[i + 1:i + 1 + forward_prefetch]
            if targets:
                m.set_modules_to_forward_prefetch(targets)
    post_forward = units[1:] + units[:1] if units and units[0] is root else units
    for i, m in enumerate(post_forward):
        if backward_prefetch == 0:
            m.set_modules_to_backward_prefetch([m])
        elif backward_prefetch > 1 and i > 0:
            m.set_modules_to_backward_prefetch(post_forward[max(0, i - backward_prefetch):i][::-1])


def _hook_recompute(model, fmt) -> None:
    """Mark the tracker while a checkpointed block's forward re-runs inside backward.

    (The FSDP unit is the ``CheckpointWrapper``; recomputation calls only the wrapped block, so the
    stock tracker's ``_in_ac`` never turns on and recomputed tensors are labelled ``Temp``.)
    """
    import torch

    def pre(_mod, _args):
        if torch._C._current_graph_task_id() != -1:
            fmt.recompute_depth += 1

    def post(_mod, _args, _out):
        if torch._C._current_graph_task_id() != -1:
            fmt.recompute_depth -= 1

    for block in model.layers:
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        if inner is not None:
            inner.register_forward_pre_hook(pre)
            # always_call: non-reentrant checkpoint stops the recomputation early by raising
            inner.register_forward_hook(post, always_call=True)


def _module_snapshots(fmt) -> dict[str, dict[str, dict[str, int]]]:
    """Per FSDP unit, per ``_FSDPModState``: the first snapshot of the last tracked iteration."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for mod_stats in fmt.memory_tracking.values():
        states: dict[str, dict[str, int]] = {}
        for state, snaps in mod_stats.snapshots.items():
            if snaps:
                dev_snaps = list(snaps[0].values())
                states[state.value] = _cat_dict(dev_snaps[0]) if dev_snaps else _cat_dict({})
        out[mod_stats.mod_fqn] = states
    return out


def run_fsdp_mem_tracker(
    cfg: ReferenceConfig,
    *,
    world_size: int,
    batch: int,
    seq: int,
    wrap: str = "per_block",
    blocks_per_unit: int = 1,
    reshard_after_forward: bool | int = True,
    root_reshard_after_forward: bool | int | None = None,
    shard_size: int | None = None,
    param_dtype: str = "bf16",
    reduce_dtype: str | None = "fp32",
    output_dtype: str | None = None,
    head_output_dtype: str | None = None,
    cast_forward_inputs: bool = True,
    forward_prefetch: int = 0,
    backward_prefetch: int = 1,
    optimizer: str = "adamw",
    activation_checkpointing: str = "none",
    grad_accumulation: int = 1,
    requires_gradient_sync: bool = True,
    requires_all_reduce: bool = True,
    reshard_after_backward: bool = True,
    iterations: int = 2,
    skip_dtensor_propagation: bool = True,
    emulate_cuda_rounding: bool = False,
    record_timeline: bool = False,
    fake_tensors: bool = True,
    prepare_model=None,
    loss_fn=None,
    optim_factory=None,
    mesh_fn=None,
) -> dict[str, Any]:
    """Run FSDPMemTracker on rank 0 of a ``world_size`` FSDP2 job (CPU, fake tensors, fake PG).

    Args:
        cfg: the model.
        world_size, batch, seq: data-parallel size and the per-rank batch / sequence length.
        wrap: ``'per_block'`` (``fully_shard`` each TransformerBlock, then the root),
            ``'torchtitan'`` (the embedding, each block, [norm, output] not resharded after forward,
            the root) or ``'whole_model'`` (``fully_shard`` the root only).
        reshard_after_forward: for the non-root units: True, False or an int k (hpZ: reshard to
            groups of k after forward).  Ignored for ``'whole_model'``.
        root_reshard_after_forward: the root's; None (FSDP's default) keeps it unsharded after
            forward, an explicit value is honoured.
        shard_size: ranks per shard group; less than ``world_size`` is HSDP on a
            (world_size / shard_size, shard_size) mesh.
        param_dtype, reduce_dtype: ``'fp32'`` | ``'bf16'`` for ``MixedPrecisionPolicy`` (reduce_dtype
            None: the policy's default, the gradient's dtype).
        output_dtype, head_output_dtype, cast_forward_inputs: ``MixedPrecisionPolicy``'s, for every
            unit / only for the unit that holds the output head.
        forward_prefetch, backward_prefetch: explicit prefetch depths (``set_modules_to_*_prefetch``
            with the next / previous k units); 0 and 1 are FSDP2's defaults, backward 0 is
            ``m.set_modules_to_backward_prefetch([m])`` (no prefetch).
        optimizer: ``'adamw'`` (AdamW, foreach=True, as on GPU) or ``'sgd'`` (momentum 0.9,
            foreach=True).
        activation_checkpointing: ``'none'`` or ``'full'`` (non-reentrant
            ``torch.utils.checkpoint`` around each TransformerBlock via ``checkpoint_wrapper``,
            applied before ``fully_shard``).
        grad_accumulation, requires_gradient_sync: micro-batches per optimizer step; without sync all
            but the last run under ``set_requires_gradient_sync(False)``; likewise
            ``requires_all_reduce`` (``set_requires_all_reduce``) and ``reshard_after_backward``
            (``set_reshard_after_backward``).
        iterations: training steps to run (>= 2); the peak is measured from the second one on.
        skip_dtensor_propagation: skip ops DTensor's sharding propagation runs on global-shape
            fake tensors (they are not real memory).
        emulate_cuda_rounding: round each storage up to 512 B as the tracker does on ``cuda``.
        record_timeline: also return the running snapshot after every tracked op of the window.
        fake_tensors: ``False`` runs on real (uninitialised) CPU tensors instead of
            ``FakeTensorMode`` -- the cross-check for the fake-mode run; only for small models.
        prepare_model: called on the model (on meta) before checkpointing and ``fully_shard``, to
            freeze parameters or add adapters (``lora_referee.py``); None leaves it as built.
        loss_fn, optim_factory: ``loss_fn(logits, labels)`` in place of the fp32 cross-entropy, and
            ``optim_factory(params)`` in place of ``optimizer``'s (``technique_referee.py``).
        mesh_fn: ``mesh_fn()`` returns the mesh to ``fully_shard`` on, built once the fake process group
            exists (the data-parallel dimension of a 2-D TP mesh, ``tp_referee.py``); None: the 1-D / HSDP
            mesh of ``world_size`` / ``shard_size``.

    Returns a dict with

    * ``peak_bytes``: the tracker's peak Total from iteration 1 on;
    * ``peak_by_category``: bytes per category *at the moment of that peak* (sums to
      ``peak_bytes``; identical to the tracker's own ``"peak"`` snapshot, checked);
    * ``peak_where``: see the module docstring;
    * ``per_category_max``: each category's own maximum over the same window (not simultaneous;
      comm buffers briefly show as Activation/Temp before the tracker relabels them);
    * ``tracker_peak_snapshot``, ``first_iteration_peak_bytes``, ``first_iteration`` (peak,
      categories and where of iteration 0, which has no optimizer state yet);
    * ``steady_state_bytes`` (after the last ``zero_grad``), ``module_snapshots`` (per FSDP unit,
      per ``_FSDPModState``, last iteration), ``params``, ``dtensor_propagation_skipped``,
      ``settings`` and, with ``record_timeline``, ``timeline``.
    """
    _import_torch()
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .reference_model import ReferenceTransformer
    from .reference_model import loss_fn as reference_loss

    if wrap not in ("per_block", "every_k_blocks", "whole_model", "torchtitan"):
        raise ValueError(f"wrap must be 'per_block', 'every_k_blocks', 'torchtitan' or 'whole_model', got {wrap!r}")
    if param_dtype not in _DTYPES or any(d not in (None, *_DTYPES) for d in (reduce_dtype, output_dtype, head_output_dtype)):
        raise ValueError("param_dtype / reduce_dtype / output_dtype must be 'fp32' or 'bf16'")
    shard_size = shard_size or world_size
    if world_size % shard_size:
        raise ValueError(f"shard_size {shard_size} does not divide world_size {world_size}")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    if activation_checkpointing not in ("none", "full"):
        raise ValueError("activation_checkpointing must be 'none' or 'full'")
    if iterations < 2:
        raise ValueError("iterations must be >= 2 (the first iteration is not compared)")
    dtype_of = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError(
                "a non-fake default process group is initialised; "
                "run the referee in its own process"
            )
        dist.destroy_process_group()  # left over from an earlier (interrupted) run
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())

    prop_depth = threading.local()
    restores = []
    gc_was_enabled = gc.isenabled()
    try:
        if skip_dtensor_propagation:
            restores.append(_patch_sharding_propagation(prop_depth))
        if emulate_cuda_rounding:
            restores.append(_patch_cuda_rounding())
        restores.append(_patch_post_forward_mesh())
        # "build_mesh has to happen outside of the FakeTensorMode" (torchtitan)
        if mesh_fn is not None:
            mesh = mesh_fn()
        elif shard_size == world_size:
            mesh = init_device_mesh("cpu", (world_size,))
        else:  # HSDP: (Replicate(), Shard(0)) on a 2-D mesh
            mesh = init_device_mesh("cpu", (world_size // shard_size, shard_size),
                                    mesh_dim_names=("replicate", "shard"))
        tracker_cls = _make_tracker_class()

        with FakeTensorMode() if fake_tensors else contextlib.nullcontext():
            with torch.device("meta"):
                model = ReferenceTransformer(cfg)
                if prepare_model is not None:
                    prepare_model(model)
            n_params = sum(p.numel() for p in model.parameters())
            if activation_checkpointing == "full":
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                    CheckpointImpl,
                    checkpoint_wrapper,
                )

                for i, block in enumerate(model.layers):
                    model.layers[i] = checkpoint_wrapper(
                        block,
                        checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                        preserve_rng_state=False,
                    )
            def policy(out_dtype):
                return MixedPrecisionPolicy(
                    param_dtype=dtype_of[param_dtype],
                    reduce_dtype=dtype_of.get(reduce_dtype),
                    output_dtype=dtype_of.get(out_dtype),
                    cast_forward_inputs=cast_forward_inputs,
                )

            units = _apply_fully_shard(
                model, mesh, wrap=wrap, reshard_after_forward=reshard_after_forward,
                root_reshard_after_forward=root_reshard_after_forward,
                mp=policy(output_dtype), head_mp=policy(head_output_dtype or output_dtype), blocks_per_unit=blocks_per_unit,
            )
            _set_prefetch(units, model, forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch)
            model.to_empty(device="cpu")

            params = list(model.parameters())
            if optim_factory is not None:
                optim = optim_factory(params)
            elif optimizer == "adamw":
                optim = torch.optim.AdamW(params, lr=1e-4, foreach=True)
            else:
                optim = torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True)

            tokens = torch.randint(0, cfg.vocab, (batch, seq), device="cpu")
            labels = torch.randint(0, cfg.vocab, (batch, seq), device="cpu")
            model._get_fsdp_state()._lazy_init()

            fmt = tracker_cls(
                model, optim, propagation_depth=prop_depth, record_timeline=record_timeline
            )
            fmt.track_inputs((tokens, labels))
            if activation_checkpointing == "full":
                _hook_recompute(model, fmt)
            first_iter: dict[str, Any] = {}
            with fmt:
                fmt.re_arm_peak()
                for it in range(iterations):
                    fmt.iteration = it
                    fmt.recompute_depth = 0
                    gc.disable()
                    for micro_batch in range(grad_accumulation):
                        last = micro_batch == grad_accumulation - 1
                        sync = requires_gradient_sync or last
                        model.set_requires_gradient_sync(sync)  # the all-reduce follows it
                        if sync and not (requires_all_reduce or last):
                            model.set_requires_all_reduce(False)
                        model.set_reshard_after_backward(reshard_after_backward or last)
                        fmt.phase = "forward"
                        logits = model(tokens)
                        fmt.phase = "loss"
                        loss = (loss_fn or reference_loss)(logits, labels)
                        del logits
                        fmt.phase = "backward"
                        loss.backward()
                        if not last:
                            del loss
                            fmt.reset_mod_stats()  # the root forward runs once per stats window
                    fmt.phase = "optimizer"
                    optim.step()
                    fmt.phase = "zero_grad"
                    optim.zero_grad()
                    del loss
                    gc.enable()
                    gc.collect()
                    if it == 0:
                        first_iter = {
                            "peak_bytes": fmt.window_peak,
                            "peak_by_category": {c: fmt.window_peak_snap[c] for c in CATEGORIES},
                            "peak_where": fmt.window_peak_where,
                        }
                        fmt.re_arm_peak()
                    if it < iterations - 1:
                        fmt.reset_mod_stats()  # root forward may run only once per stats window
            steady = fmt._current()
            tracker_peak = _cat_dict(next(iter(fmt.get_tracker_snapshot("peak").values())))
            module_snaps = _module_snapshots(fmt)

        if tracker_peak[_TOTAL] != fmt.window_peak or tracker_peak != fmt.window_peak_snap:
            raise RuntimeError(
                "internal check failed: tracker peak snapshot differs from the recorded one: "
                f"{tracker_peak} vs {fmt.window_peak_snap}"
            )
        result: dict[str, Any] = {
            "peak_bytes": fmt.window_peak,
            "peak_by_category": {c: fmt.window_peak_snap[c] for c in CATEGORIES},
            "peak_where": fmt.window_peak_where,
            "per_category_max": {c: fmt.window_cat_max.get(c, 0) for c in CATEGORIES},
            "tracker_peak_snapshot": tracker_peak,
            "first_iteration_peak_bytes": first_iter["peak_bytes"],
            "first_iteration": first_iter,
            "steady_state_bytes": steady,
            "module_snapshots": module_snaps,
            "params": {"total": n_params},
            "dtensor_propagation_skipped": {
                "ops": fmt.skipped_ops,
                "bytes": fmt.skipped_bytes,
            },
            "settings": {
                "cfg": dict(vars(cfg)),
                "world_size": world_size,
                "batch": batch,
                "seq": seq,
                "wrap": wrap,
                "reshard_after_forward": reshard_after_forward if wrap != "whole_model" else None,
                "root_reshard_after_forward": root_reshard_after_forward,
                "shard_size": shard_size,
                "param_dtype": param_dtype,
                "reduce_dtype": reduce_dtype,
                "output_dtype": output_dtype,
                "head_output_dtype": head_output_dtype,
                "cast_forward_inputs": cast_forward_inputs,
                "forward_prefetch": forward_prefetch,
                "backward_prefetch": backward_prefetch,
                "requires_all_reduce": requires_all_reduce,
                "reshard_after_backward": reshard_after_backward,
                "optimizer": optimizer,
                "activation_checkpointing": activation_checkpointing,
                "iterations": iterations,
                "emulate_cuda_rounding": emulate_cuda_rounding,
                "fake_tensors": fake_tensors,
            },
        }
        if record_timeline:
            result["timeline"] = fmt.timeline
        return result
    finally:
        if gc_was_enabled:
            gc.enable()
        else:
            gc.disable()
        for restore in reversed(restores):
            restore()
        if dist.is_initialized():
            dist.destroy_process_group()
