"""The workload: the trace of one model's forward and backward, as plain data.

A workload is an ordered list of `Module`s in forward execution order. Each module knows its own
parameters (with shapes, because FSDP2 pads every parameter on dim 0), its FLOPs, and the bytes its
forward and backward allocate. Nothing here knows about FSDP, hardware or time.

Activation accounting convention (one owner per tensor, so nothing is counted twice):
- `output_bytes`: the module's output, allocated when its forward ends. It is the next module's input.
- `saves_input`: whether this module keeps its input for backward. If so the previous module's output
  stays alive until this module's backward ends; if not it is freed when this module's forward ends.
- `saved_bytes`: every other tensor the forward allocates and autograd keeps for backward
  (excluding the input and the output), freed when the module's backward ends.
- `fwd_temp_bytes` / `bwd_temp_bytes`: transient peak above that during the forward / backward compute
  (workspaces, intermediate results freed before the module returns).
- In backward the gradient w.r.t. the module's input (same size as the input) is allocated; the gradient
  w.r.t. its output (allocated by the next module's backward) is freed when this module's backward ends.
Sizes are for `activation_dtype`; a scenario with another compute dtype scales them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter tensor: fully-qualified name, shape, storage dtype and whether it is trained."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "fp32"
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def padded_shard_numel(self, world: int) -> int:
        """Elements of one rank's shard: FSDP2 chunks dim 0 into `world` pieces and pads to the largest."""
        if not self.shape:
            return 1
        rows = -(-self.shape[0] // world)
        return rows * math.prod(self.shape[1:])


@dataclass(frozen=True, slots=True)
class Module:
    """One module of the trace, in forward execution order. See the module docstring for the byte fields.

    `tied_params` names parameters owned by an earlier module that this one also uses (a tied output
    head): its backward produces their gradient, so that gradient exists from this module's backward on.
    `fwd_time_s` / `bwd_time_s`: measured compute durations of the module's forward / backward (seconds,
    e.g. from a profiler trace, see `workload/profile_trace.py`); None when only FLOPs and bytes are known.
    """

    name: str
    kind: str
    params: tuple[Param, ...] = ()
    tied_params: tuple[str, ...] = ()
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_hbm_bytes: float = 0.0
    saved_bytes: int = 0
    fwd_temp_bytes: int = 0
    bwd_temp_bytes: int = 0
    output_bytes: int = 0
    saves_input: bool = True
    is_block: bool = False
    in_model: bool = True
    fwd_time_s: float | None = None
    bwd_time_s: float | None = None

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(frozen=True, slots=True)
class Workload:
    """A model's trace: its modules in forward order, plus what the input batch costs.

    `in_model=False` marks modules outside the FSDP root (the loss). `input_bytes` is the batch on the
    device (token ids), alive for the whole step.
    """

    name: str
    modules: tuple[Module, ...]
    activation_dtype: str = "bf16"
    input_bytes: int = 0
    tokens: int = 0
    model_flops: float = 0.0
    meta: dict = field(default_factory=dict)

    @property
    def params(self) -> tuple[Param, ...]:
        return tuple(p for m in self.modules for p in m.params)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def to_dict(self) -> dict:
        d = asdict(self)
        for m in d["modules"]:
            for p in m["params"]:
                p["shape"] = list(p["shape"])
        return d
