"""Plain training (one GPU, `fsdp.version: none`) against its own tensors: a CPU referee for allocated
memory and for what the caching allocator model is fed.

FSDPMemTracker needs FSDP, and reserved memory has no CPU counterpart at all. This runs the training
steps eagerly on fake tensors (`FakeTensorMode`: real shapes, no memory), logs every storage as PyTorch
creates and frees it (a dispatch mode registers each new storage, a weakref finalizer logs its free: the
order in which eager PyTorch calls the allocator), and replays that log on the allocator model
(`engine/allocator.py`, which follows CUDACachingAllocator.cpp) as the simulator replays its own
buffers. Two figures come out beside the simulator's:
- the peak of live bytes, which is what `torch.cuda.max_memory_allocated` counts: a referee for the
  plain schedule's allocated peak, as FSDPMemTracker is for FSDP's;
- reserved memory for the real tensor sequence. The allocator model is the same on both sides, so the
  difference is only the simulator's buffers: it allocates a module's saved activations and its
  temporaries as one block each where PyTorch allocates each tensor.
The model is the ReferenceTransformer stored in one dtype (`training.param_storage_dtype`), trained with
torch.optim.AdamW (foreach) and `zero_grad(set_to_none=True)`; every storage is on the one stream, so all
go to the compute stream's pools. The CPU's kernels run (composite norms, the CPU's SDPA, whose saved
outputs are the CUDA flash kernel's: output and fp32 logsumexp). `autocast=True` stores fp32 and runs the
forward and loss under `torch.autocast("cpu", dtype=torch.bfloat16)`, the simulator's default plain step:
CPU autocast casts the same GEMMs and SDPA as CUDA's; its norms and losses here see fp32 inputs (the
embedding is not cast, so the residual stream stays fp32), where both lists give fp32.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_sim.engine.allocator import AllocatorConfig, CachingAllocator
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.torch_tools.lora_referee import prepare as prepare_lora, scenario_keys as lora_keys
from fsdp_sim.torch_tools.reference_model import ReferenceConfig, ReferenceTransformer, loss_fn
from fsdp_sim.torch_tools.referee import reference_scenario
from fsdp_sim.torch_tools.technique_referee import selective_checkpointing

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
STEPS = 3  # the first step and two steady ones: the simulator's replay stops once a step adds nothing


class _StorageLog(TorchDispatchMode):
    """Every storage an op returns that was not seen before is an allocation; its finalizer, a free."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = WeakIdKeyDictionary()
        self.events: list[tuple] = []  # ("alloc" | "free" | "step", storage, bytes), ("phase", name, 0)
        self.recording = False
        self.count = 0  # storage ids (the dictionary shrinks as storages die)

    def see(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self.seen:
            return
        sid = self.seen[storage] = self.count
        self.count += 1
        if self.recording:
            nbytes = storage.nbytes()
            self.events.append(("alloc", sid, nbytes))
            weakref.finalize(storage, self.events.append, ("free", sid, nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.see(t)
        return out


@dataclass(frozen=True)
class EagerSteps:
    """What the eager steps allocated, replayed on the allocator model."""

    allocated_bytes: int  # peak live bytes, parameters included (max_memory_allocated)
    reserved_bytes: list[int]  # reserved after each step (max_memory_reserved: it never decreases)
    phase_bytes: dict[str, int]  # peak live bytes by phase: "forward" (and its loss, inside autocast), "backward"


def eager_steps(cfg: ReferenceConfig, *, batch: int, seq: int, activation_checkpointing: str = "none",
                dtype: str = "bf16", expandable_segments: bool = False, autocast: bool = False,
                grad_accumulation: int = 1, lora: dict | None = None) -> EagerSteps:
    """`STEPS` training steps of the ReferenceTransformer, logged storage by storage and replayed on the
    allocator model (with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` when asked); each step runs
    `grad_accumulation` forwards and backwards (a new batch each, the previous dropped) before the step."""
    log = _StorageLog()
    with FakeTensorMode():
        torch.set_default_dtype(DTYPES[dtype])  # fake parameters cannot be converted after creation
        try:
            model = ReferenceTransformer(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
        if lora is not None:  # peft's adapters, the rest frozen (lora_referee.prepare's keywords)
            prepare_lora(model, **lora, input_cast=True)
        if activation_checkpointing != "none":
            selective_checkpointing(activation_checkpointing)(model)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4, foreach=True)
        for p in params:  # allocated before the first step, as the simulator's persistent buffers
            log.see(p)
        with log:
            log.recording = True
            for step in range(STEPS):
                for _ in range(grad_accumulation):
                    tokens = torch.randint(0, cfg.vocab, (batch, seq))
                    labels = torch.randint(0, cfg.vocab, (batch, seq))
                    log.events.append(("phase", "forward", 0))
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        loss = loss_fn(model(tokens), labels)
                        log.events.append(("phase", "", 0))  # the last moment inside the region
                    log.events.append(("phase", "backward", 0))
                    loss.backward()
                    log.events.append(("phase", "", 0))
                    del loss
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                gc.collect()  # autograd's graph holds no cycle, but a finalizer may wait for a collection
                log.events.append(("step", step, 0))
    return _replay(log.events, [p.untyped_storage().nbytes() for p in params], AllocatorConfig(expandable_segments))


def _replay(events: list[tuple], persistent: list[int], config: AllocatorConfig) -> EagerSteps:
    alloc = CachingAllocator(config)
    for nbytes in persistent:
        alloc.malloc(nbytes, "compute")
    live = peak = sum(persistent)
    blocks, reserved = {}, []
    phase, phase_peaks = "", {}
    for kind, sid, nbytes in events:
        if kind == "alloc":
            blocks[sid] = alloc.malloc(nbytes, "compute")
            live += nbytes
            peak = max(peak, live)
        elif kind == "free":
            alloc.free(blocks.pop(sid))
            live -= nbytes
        elif kind == "phase":
            phase = sid
        else:
            reserved.append(alloc.reserved)
        if phase:
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), live)
    return EagerSteps(peak, reserved, phase_peaks)


def simulated(cfg: ReferenceConfig, *, batch: int, seq: int, activation_checkpointing: str = "none",
              dtype: str = "bf16", expandable_segments: bool = False, autocast: bool = False, grad_accumulation: int = 1,
              lora: dict | None = None):
    """The simulator's step of the same job: plain training, parameters stored in `dtype`, computing in
    it (or, with `autocast`, in bf16 under autocast)."""
    data = reference_scenario(cfg, world_size=1, batch=batch, seq=seq, activation_checkpointing=activation_checkpointing,
                              grad_accumulation=grad_accumulation)
    data["allocator"] = {"expandable_segments": expandable_segments}
    data["fsdp"] = {"version": "none", "mixed_precision": {"param_dtype": "bf16" if autocast else dtype}}
    data["training"]["param_storage_dtype"] = dtype
    if lora is not None:
        data["model"] |= lora_keys(**lora)
    return simulate(parse_scenario(data, name="eager-referee"))


def simulated_phase_bytes(result) -> dict[str, int]:
    """The simulated step's peak allocated bytes by phase, as `EagerSteps.phase_bytes` counts them: "forward"
    and "backward" over every micro-batch (the phases "forward #2" and so on)."""
    memory, peaks = result.memory, {}
    for row in range(len(memory.total)):
        op = memory.op_at(row)
        phase = op.phase.split(" #")[0] if op is not None else ""
        if phase in ("forward", "backward"):
            peaks[phase] = max(peaks.get(phase, 0), int(memory.total[row]))
    return peaks
