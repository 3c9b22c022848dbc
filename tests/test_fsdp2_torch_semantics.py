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
