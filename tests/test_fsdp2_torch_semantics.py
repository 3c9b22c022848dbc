"""The torch 2.13 behaviours the FSDP2 schedule relies on, observed in PyTorch itself (CPU, fake process group).

FSDP2's Python runs unmodified on the CPU with the "fake" backend (collectives are no-ops), so which
group all-gathers when, and what a group keeps alive, can be read off the real objects. Skipped without torch.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")


@contextlib.contextmanager
def _fake_world(world_size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Net(torch.nn.Module):
    """Three FSDP blocks and a root that owns the output layer."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _sharded(mesh, **kwargs):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net()
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _step(model):
    x = torch.randn(2, 8, requires_grad=True)
    model(x).float().sum().backward()


def _backward_log(monkeypatch, prefetch: str) -> list[str]:
    """Pre-backward entries and the all-gathers issued in backward, in order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup, TrainingState

    log: list[str] = []
    unshard, pre_backward = FSDPParamGroup.unshard, FSDPParamGroup.pre_backward

    def logged_unshard(self, async_op=False):
        pending = self._all_gather_result is None and not self.is_unsharded
        unshard(self, async_op)
        if pending and self._all_gather_result is not None and self._training_state == TrainingState.PRE_BACKWARD:
            log.append(f"all-gather {self._module_fqn}")

    def logged_pre_backward(self, default_prefetch, *args):
        log.append(f"pre_backward {self._module_fqn or 'root'}")
        return pre_backward(self, default_prefetch, *args)

    with monkeypatch.context() as patch, _fake_world(4):
        patch.setattr(FSDPParamGroup, "unshard", logged_unshard)
        patch.setattr(FSDPParamGroup, "pre_backward", logged_pre_backward)
        model = _sharded(init_device_mesh("cpu", (4,)))
        for m in [*model.blocks, model]:
            if prefetch == "empty list":
                m.set_modules_to_backward_prefetch([])
            elif prefetch == "itself":
                m.set_modules_to_backward_prefetch([m])
        _step(model)  # the first step records the post-forward order
        log.clear()
        _step(model)
    return log


def test_an_empty_prefetch_list_keeps_the_default_one_ahead_prefetch(monkeypatch):
    """`_fsdp_state._pre_backward`: default_prefetch = not _states_to_backward_prefetch, so [] keeps it."""
    default = _backward_log(monkeypatch, "default")
    assert default == ["pre_backward root", "all-gather blocks.2", "pre_backward blocks.2", "all-gather blocks.1",
                       "pre_backward blocks.1", "all-gather blocks.0", "pre_backward blocks.0"]
    assert _backward_log(monkeypatch, "empty list") == default


def test_prefetching_itself_turns_backward_prefetch_off(monkeypatch):
    """What fsdp.backward_prefetch: false models: each unit all-gathers in its own pre-backward."""
    assert _backward_log(monkeypatch, "itself") == [
        "pre_backward root", "pre_backward blocks.2", "all-gather blocks.2", "pre_backward blocks.1",
        "all-gather blocks.1", "pre_backward blocks.0", "all-gather blocks.0"]


def test_hsdp_keeps_each_groups_reduce_dtype_output_until_finalize_backward(monkeypatch):
    """bf16 reduce, fp32 parameters, (replicate 2 x shard 2): after its post_backward each group holds its
    bf16 reduce-scatter output (S elements) in `_all_reduce_state`; finalize_backward drops them all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    held: list[list[tuple | None]] = []
    finalize, finalized = FSDPParamGroup.finalize_backward, []

    def logged_finalize(self):
        finalized.append([g._all_reduce_state is not None for g in groups])
        finalize(self)

    monkeypatch.setattr(FSDPParamGroup, "finalize_backward", logged_finalize)
    with _fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        model = _sharded(mesh, mp_policy=mp)
        groups = [b._get_fsdp_state()._fsdp_param_group for b in model.blocks]
        post_backward = FSDPParamGroup.post_backward

        def logged_post_backward(self, *args):
            post_backward(self, *args)
            held.append([None if g._all_reduce_state is None else
                         (g._all_reduce_state.all_reduce_input.dtype, g._all_reduce_state.all_reduce_input.numel())
                         for g in groups])

        monkeypatch.setattr(FSDPParamGroup, "post_backward", logged_post_backward)
        _step(model)
    shard = (8 * 8 + 8) // 2
    kept = (torch.bfloat16, shard)
    # blocks 2, 1, 0 reduce in that order (then the root, in the final callback); nothing is dropped meanwhile
    assert held[:3] == [[None, None, kept], [None, kept, kept], [kept, kept, kept]]
    assert finalized[0] == [True, True, True]  # the root's finalize_backward comes first
    assert all(g._all_reduce_state is None for g in groups)


def _alive_after_copy_in(monkeypatch, world_size: int, tracker=None) -> list[list[bool]]:
    """Per foreach_reduce of the second step, which of its unsharded gradients are still alive once
    `unsharded_grads.clear()` has run (seen from `_div_if_needed`, foreach_reduce's next call). `tracker`:
    a memory-tracker class run around the step as FSDPMemTracker(model, optimizer)."""
    import weakref

    import torch.distributed.fsdp._fully_shard._fsdp_collectives as col
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg
    from torch.distributed.device_mesh import init_device_mesh

    seen, grads = [], []
    reduce, divide = pg.foreach_reduce, col._div_if_needed

    def logged_reduce(fsdp_params, unsharded_grads, *args, **kwargs):
        grads[:] = [weakref.ref(g) for g in unsharded_grads]
        return reduce(fsdp_params, unsharded_grads, *args, **kwargs)

    def logged_divide(tensor, factor):
        if grads:
            seen.append([ref() is not None for ref in grads])
            grads.clear()
        return divide(tensor, factor)

    monkeypatch.setattr(pg, "foreach_reduce", logged_reduce)
    monkeypatch.setattr(col, "_div_if_needed", logged_divide)
    with _fake_world(world_size):
        model = _sharded(init_device_mesh("cpu", (world_size,)))
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        memory = tracker(model, optim) if tracker else None
        with memory or contextlib.nullcontext():
            for _ in range(2):
                seen.clear()
                _step(model)
                optim.step()
                optim.zero_grad()
                if memory is not None:
                    memory.reset_mod_stats()  # it tracks one iteration at a time
    return seen


def test_foreach_reduce_keeps_the_last_gradient_until_it_returns_with_a_shard_group(monkeypatch):
    """What schedule/fsdp2_reduce.py models: with world_size > 1 the loop over (fsdp_param, unsharded_grad)
    that re-chunks Shard(dim != 0) gradients leaves its variable on the group's last gradient, so
    `unsharded_grads.clear()` frees all the others (each block's weight, the root's too) but not it;
    alone in its shard group it frees every one."""
    assert _alive_after_copy_in(monkeypatch, 4) == [[False, True]] * 4
    assert _alive_after_copy_in(monkeypatch, 1) == [[False, False]] * 4


def test_the_referee_tracker_does_not_keep_the_last_gradient_alive(monkeypatch):
    """torch's FSDPMemTracker wraps post_backward with a loop that leaves `unsharded_grad` on the group's
    last gradient while FSDP runs, which then outlives the copy-in even alone in its shard group (a peak
    CUDA would not have); the referee's tracker (tracker_patches.py) keeps no reference."""
    import threading

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fsdp_sim.torch_tools.tracker_patches import _make_tracker_class

    referee = _make_tracker_class()
    assert _alive_after_copy_in(monkeypatch, 1, FSDPMemTracker) == [[False, True]] * 4  # torch's: the leak
    patched = lambda model, optim: referee(model, optim, propagation_depth=threading.local(), record_timeline=False)
    assert _alive_after_copy_in(monkeypatch, 1, patched) == [[False, False]] * 4
