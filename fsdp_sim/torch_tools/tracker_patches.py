"""The tracker the referee harnesses run, and the patches that make it count what CUDA would.

`_make_tracker_class()` subclasses torch's ``FSDPMemTracker`` to record the peak moment's categories and
where it happened and to skip DTensor's global-shape sharding propagation (see the harness docstring in
`memtracker.py`); the `_patch_*` context managers round requests to the CUDA caching allocator's 512 B
(the tracker runs on the CPU) and build hpZ's post-forward mesh outside the fake mode. Shared by the FSDP2
harness (`memtracker.py`) and the FSDP1 one (`memtracker_fsdp1.py`); importable without torch.
"""

from __future__ import annotations

import threading
from functools import wraps
from typing import Any

#: Category names as FSDPMemTracker spells them (``_FSDPRefType`` values), in display order.
CATEGORIES = (
    "Sharded Param",
    "Unsharded Param",
    "Buffer",
    "Sharded Grad",
    "Unsharded Grad",
    "Activation",
    "Temp",
    "All Gather",
    "Reduce Scatter",
    "OptState",
    "Inputs",
)

_TOTAL = "Total"
_DTYPES = ("fp32", "bf16", "fp16")


def _import_torch():
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        from torch.distributed._tools import fsdp2_mem_tracker  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "fsdp_sim.torch_tools.memtracker needs PyTorch (with torch.distributed); "
            "install it with `pip install -e '.[torch]' from a clone, or pip install torch==2.13.0`"
        ) from exc


def _cat_dict(dev_snap: dict) -> dict[str, int]:
    """Turn a tracker device snapshot (enum keys) into ``{category name: bytes}`` + Total."""
    out = {c: 0 for c in CATEGORIES}
    for k, v in dev_snap.items():
        name = k if k == _TOTAL else getattr(k, "value", str(k))
        out[name] = int(v)
    out.setdefault(_TOTAL, sum(out[c] for c in CATEGORIES))
    return out


def _make_tracker_class():
    """Build the FSDPMemTracker subclass lazily (so importing this module needs no torch)."""
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.tensor import DTensor

    class _RefereeTracker(FSDPMemTracker):
        """FSDPMemTracker + DTensor-propagation skip + peak-moment bookkeeping.

        Recording happens in ``_update_peak_stats``, which the stock tracker calls after every
        tracked op (the only point at which its peak can move).
        """

        def __init__(self, mod, optm, *, propagation_depth: threading.local, record_timeline: bool):
            super().__init__(mod, optm)
            self._prop = propagation_depth
            self._record_timeline = record_timeline
            self.skipped_ops = 0
            self.skipped_bytes = 0
            self.iteration = 0
            self.phase = "forward"  # forward | loss | backward | optimizer | zero_grad
            self.last_event = "start"
            # > 0 while a checkpointed block re-runs its forward inside backward
            self.recompute_depth = 0
            self._last_func = None
            self.window_active = False
            self.window_peak = -1
            self.window_peak_snap: dict[str, int] = {}
            self.window_peak_where: dict[str, Any] = {}
            self.window_cat_max: dict[str, int] = {}
            self.timeline: list[dict[str, Any]] = []

        # -- DTensor sharding-propagation skip -------------------------------------------------
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(self._prop, "depth", 0) > 0 and not any(t == DTensor for t in types):
                res = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(res):
                    if isinstance(t, torch.Tensor):
                        self.skipped_ops += 1
                        self.skipped_bytes += t.untyped_storage().nbytes()
                return res
            self._last_func = func
            return super().__torch_dispatch__(func, types, args, kwargs)

        # -- FSDP hook events (for "where") -------------------------------------------------------
        def _label(self, fsdp_mod) -> str:
            return self._mod_tracker.get_known_fqn(fsdp_mod) or type(fsdp_mod).__name__

        def _wrap_events(self, fsdp_mod, inner, hook: str):
            # "<unit>: in pre-backward" = inside FSDP's hook (unshard / prefetch / reshard /
            # reduce-scatter); "<unit>: after pre-backward" = the unit's own compute that follows.
            @wraps(inner)
            def w(*args, **kwargs):
                name = self._label(fsdp_mod)
                self.last_event = f"{name}: in {hook}"
                out = inner(*args, **kwargs)
                self.last_event = f"{name}: after {hook}"
                return out

            return w

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)
            return self._wrap_events(fsdp_mod, inner, "pre-forward")

        def _fsdp_state_post_forward(self, fsdp_mod, orig):
            inner = super()._fsdp_state_post_forward(fsdp_mod, orig)
            return self._wrap_events(fsdp_mod, inner, "post-forward")

        def _fsdp_param_group_pre_backward(self, fsdp_mod, orig):
            inner = super()._fsdp_param_group_pre_backward(fsdp_mod, orig)
            return self._wrap_events(fsdp_mod, inner, "pre-backward")

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
            """torch 2.13's wrapper of `FSDPParamGroup.post_backward`, less a reference it leaks: torch's loop
            `for fsdp_param in ...: unsharded_grad = fsdp_param._unsharded_param.grad` leaves its variable on
            the unit's last gradient while it calls the original, so that gradient outlives FSDP's
            `foreach_reduce` (`unsharded_grads.clear()` frees the others after the copy-in) until the hook
            returns. Without the tracker nothing else holds it (refcount of the last gradient in
            `foreach_reduce`: 3 untracked, 4 tracked), so CUDA frees it at the copy-in; torch's count
            put the root's output-head gradient (vocab x hidden) above the peak of a small step."""
            from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState, _FSDPRefType, _FSDPState

            @wraps(orig)
            def inner(*args, **kwargs):
                state = fsdp_mod._get_fsdp_state()
                group = state._fsdp_param_group
                for p in group.fsdp_params if group else ():
                    if p._unsharded_param.grad is not None:
                        self._update_and_maybe_create_winfos(p._unsharded_param.grad, _FSDPRefType.UNSHARDED_GRAD,
                                                             update_existing=True)
                stat = self.memory_tracking[fsdp_mod]
                stat.snapshots.setdefault(_FSDPModState.BEF_POST_BW, []).append(self.get_tracker_snapshot())
                self._fsdp_state = _FSDPState.POST_BW
                orig(*args, **kwargs)
                for p in group.fsdp_params if group else ():
                    if p.sharded_param.grad is not None:
                        self._update_and_maybe_create_winfos(p.sharded_param.grad, _FSDPRefType.SHARDED_GRAD)
                stat.snapshots.setdefault(_FSDPModState.AFT_POST_BW, []).append(self.get_tracker_snapshot())

            return self._wrap_events(fsdp_mod, inner, "post-backward")

        # -- grouped fully_shard ---------------------------------------------------------------------
        def _instrument_fsdp_module(self) -> None:
            """torch 2.13's, but a state shared by several modules (`fully_shard([a, b])`) gets its wrapped
            forward hooks the way FSDP registers its own (`_register_group_forward_hooks`: the group unshards
            before its first module runs and reshards after its last). torch's puts them on every module
            of the group, so the group unshards and reshards around each of its modules, another program
            than the one FSDP runs (twice the all-gathers of an `every_k_blocks: 2` wrap, +9 % peak)."""
            from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType, _SavedFSDPMethods
            from torch.distributed.fsdp import FSDPModule
            from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks

            states: dict[int, tuple] = {}  # one entry per state, with its first module
            for module in self._root_mod.modules():
                if isinstance(module, FSDPModule):
                    state = module._get_fsdp_state()
                    if state._fsdp_param_group is not None:
                        states.setdefault(id(state), (module, state))
            for module, state in states.values():
                state._pre_forward_hook_handle.remove()  # a group's _MultiHandle removes every module's
                state._post_forward_hook_handle.remove()
                group = state._fsdp_param_group
                self._instrument_fsdp_sharded_params_grads(group)
                pre = self._fsdp_state_pre_forward(module, state._pre_forward)
                post = self._fsdp_state_post_forward(module, state._post_forward)
                if len(state._modules) == 1:
                    state._pre_forward_hook_handle = module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True)
                    state._post_forward_hook_handle = module.register_forward_hook(post, prepend=False, always_call=True)
                else:
                    handle = _register_group_forward_hooks(state._modules, pre, post, state._modules_to_run_forward,
                                                           state._cast_output_dtype)
                    state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
                self._fsdp_mod_to_saved_methods[module] = _SavedFSDPMethods(group.pre_backward, group.post_backward)
                group.pre_backward = self._fsdp_param_group_pre_backward(module, group.pre_backward)
                group.post_backward = self._fsdp_param_group_post_backward(module, group.post_backward)
            for buffer in self._root_mod.buffers():
                self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

        def _deregister_module_and_optimizer_hooks(self) -> None:
            """torch's, then a group's own forward hooks back as FSDP registered them (torch's puts
            per-module ones on the group's first module only)."""
            from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks

            groups = [mod._get_fsdp_state() for mod in self._fsdp_mod_to_saved_methods.keys()]
            super()._deregister_module_and_optimizer_hooks()
            for state in groups:
                if len(state._modules) > 1:
                    state._pre_forward_hook_handle.remove()
                    state._post_forward_hook_handle.remove()
                    handle = _register_group_forward_hooks(state._modules, state._pre_forward, state._post_forward,
                                                           state._modules_to_run_forward, state._cast_output_dtype)
                    state._pre_forward_hook_handle = state._post_forward_hook_handle = handle

        # -- peak bookkeeping ---------------------------------------------------------------------
        def _where(self) -> dict[str, Any]:
            parents = sorted(p for p in self._mod_tracker.parents if p != "Global")
            innermost = max(parents, key=lambda p: (p.count("."), len(p))) if parents else "Global"
            func = self._last_func
            return {
                "iteration": self.iteration,
                "phase": "optimizer" if self._in_opt else self.phase,
                "module": innermost,
                "active_modules": parents,
                "fsdp_state": self._fsdp_state.name,
                "last_fsdp_event": self.last_event,
                "op": str(func) if func is not None else None,
                "in_ac_recompute": self.recompute_depth > 0,
            }

        def re_arm_peak(self) -> None:
            """Forget the peak so far (tracker's and ours): measure from now on."""
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {d: s[_TOTAL] for d, s in self._peak_mem_snap.items()}
            self.window_active = True
            cur = self._current()
            self.window_peak = cur[_TOTAL]
            self.window_peak_snap = dict(cur)
            self.window_peak_where = {"iteration": self.iteration, "phase": "window start"}
            self.window_cat_max = dict(cur)

        def _current(self) -> dict[str, int]:
            snap = self._curr_mem_snap
            if not snap:
                return _cat_dict({})
            if len(snap) != 1:
                raise RuntimeError(f"expected one tracked device, got {list(snap)}")
            return _cat_dict(next(iter(snap.values())))

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            if not self.window_active:
                return
            cur = self._current()
            for k, v in cur.items():
                if v > self.window_cat_max.get(k, 0):
                    self.window_cat_max[k] = v
            if cur[_TOTAL] > self.window_peak:
                self.window_peak = cur[_TOTAL]
                self.window_peak_snap = dict(cur)
                self.window_peak_where = self._where()
            if self._record_timeline:
                self.timeline.append({"where": self._where(), **cur})

    return _RefereeTracker


def _patch_sharding_propagation(depth: threading.local):
    """Make ``_propagate_tensor_meta_non_cached`` bump ``depth.depth`` while it runs."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator.__dict__["_propagate_tensor_meta_non_cached"]

    @wraps(orig)
    def patched(self, *args, **kwargs):
        depth.depth = getattr(depth, "depth", 0) + 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            depth.depth -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = patched

    def restore():
        ShardingPropagator._propagate_tensor_meta_non_cached = orig

    return restore


def _patch_cuda_rounding():
    """Make the tracker round every storage up to 512 B, as it does for ``cuda`` devices."""
    import math

    from torch.distributed._tools import mem_tracker as mt

    orig = mt._WeakRefInfo._calculate_mem_consumed

    def rounded(self):
        mem = self.size * self.element_size
        return math.ceil(mem / mt._PYTORCH_MIN_ALLOCATE) * mt._PYTORCH_MIN_ALLOCATE

    mt._WeakRefInfo._calculate_mem_consumed = rounded

    def restore():
        mt._WeakRefInfo._calculate_mem_consumed = orig

    return restore


def _patch_post_forward_mesh():
    """Run FSDP2's ``_get_post_forward_mesh_info`` with the fake mode switched off.

    ``reshard_after_forward=k`` (hpZ) builds a DeviceMesh from ``mesh.mesh.view(-1, k)``: under an outer
    ``FakeTensorMode`` the view of the real mesh tensor fails ("Please convert all Tensors to FakeTensors
    first ... aten.as_strided"). Meshes are built outside the fake mode anyway (torchtitan's rule)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    orig = _fsdp_init._get_post_forward_mesh_info

    @wraps(orig)
    def real_mode(*args, **kwargs):
        with unset_fake_temporarily():
            return orig(*args, **kwargs)

    _fsdp_init._get_post_forward_mesh_info = real_mode
    _fully_shard._get_post_forward_mesh_info = real_mode

    def restore():
        _fsdp_init._get_post_forward_mesh_info = orig
        _fully_shard._get_post_forward_mesh_info = orig

    return restore
