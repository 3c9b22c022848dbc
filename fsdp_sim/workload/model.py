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
- `bwd_temp_parts`: how many tensors of equal size the backward's transient moment is (the loss's two
  fp32 logits-sized gradients): the caching allocator places each on its own, where one block of their
  sum would need a hole that large (1: one tensor, or sizes not known).
- `bwd_tail_bytes`: a later backward moment, once its parameters' gradients all exist: what it then holds
  beyond its end state (its input's gradient and those gradients; its saved tensors released) -- a
  block's attention_norm backward, which with few tokens is the block's peak. The schedule adds it on top
  of the gradients the run actually computes (none for a frozen weight).
- `nosave_fwd_peak_bytes`: the forward's peak above its input when autograd saves nothing, its output
  counted from its creation: what a fully checkpointed block holds at most in its forward (0: unknown,
  and then its saved tensors and transients bound it).
- `records_graph`: False for a module before the model's first trainable parameter (`frozen.py`): no input
  or parameter of it requires grad, so autograd records nothing and its backward never runs (no
  gradient w.r.t. its output reaches it, its unit's backward hooks do not fire).
- In backward the gradient w.r.t. the module's input (same size as the input) is allocated; the gradient
  w.r.t. its output (allocated by the next module's backward) is freed when this module's backward ends.
Sizes are for `activation_dtype`; a scenario with another compute dtype scales them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter tensor: fully-qualified name, shape, storage dtype and whether it is trained."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "fp32"
    trainable: bool = True

    def __hash__(self) -> int:
        """The name's (cached by the string): equal parameters share it, and the caches keyed on a unit's
        parameters (FSDP1's flat parameters, schedule/fsdp1.py) hash every one of them at every sweep point."""
        return hash(self.name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def padded_shard_numel(self, world: int) -> int:
        """Elements of one rank's shard: FSDP2 chunks dim 0 into `world` pieces and pads to the largest."""
        if not self.shape:
            return 1
        rows = -(-self.shape[0] // world)
        return rows * math.prod(self.shape[1:])


KERNEL_KINDS = ("gemm", "attention", "attention_eager", "norm", "norm_unfused", "rope", "activation",
                "elementwise", "cross_entropy", "inductor_reduction", "inductor_pointwise")
ATEN_OPS = ("", "mm", "addmm", "sdpa")  # `Kernel.aten_op`: what a selective-checkpoint policy keys on


@dataclass(frozen=True, slots=True)
class Kernel:
    """One kernel (or one eager chain of small kernels) a module's forward launches, as shapes and bytes.

    The hardware model prices it (`fsdp_sim/hardware/kernels.py`), so the workload stays free of time:
    - `gemm`: `shape` (m, n, k) = (tokens, out features, in features), 2mnk FLOPs; its backward is two GEMMs
      (the input gradient (m, k, n) and the weight gradient (n, k, m)).
    - `attention` (SDPA) / `attention_eager` (explicit scores and softmax): `shape` (batch, heads, seq,
      head_dim); `causal` halves the FLOPs a flash kernel does, as its benchmarks count them.
    - memory-bound kinds (`norm`, `norm_unfused`, `rope`, `activation`, `elementwise`, `cross_entropy`):
      `shape` (rows, row width) where the kernel's speed depends on the width (else empty);
      `bytes` / `bwd_bytes` are the ideal HBM traffic (each input read and each output written once) of the
      forward / backward; the measured efficiency of each kind's eager kernels covers the rest.
    `launches` / `bwd_launches`: kernels eager PyTorch launches for it in forward / backward.
    `recompute=False`: the kernel comes after the module's last tensor saved for backward, so a
    non-reentrant checkpoint's recompute (`early_stop=True`) stops before it (a SwiGLU block's w2).
    """

    name: str
    kind: str
    shape: tuple[int, ...] = ()
    bytes: float = 0.0
    bwd_bytes: float = 0.0
    launches: int = 1
    bwd_launches: int = 1
    causal: bool = False
    recompute: bool = True
    input_grad: bool = True  # gemm: False when its input needs no gradient (a patch conv on pixels)
    # the ATen op it dispatches where a selective-checkpoint policy keys on it ("mm": a Linear without
    # bias, "addmm": with one, "sdpa": a fused attention op), "" where unknown; and whether autograd
    # keeps its output for backward anyway (SDPA saves q and v, SiLU its input): see checkpointing.py
    aten_op: str = ""
    output_saved: bool = False
    weight_grad: bool = True  # gemm: False when its weight is frozen (requires_grad=False: no dW GEMM)
    dtype: str = ""  # gemm: the dtype it runs in when not the compute dtype ("fp8": torchao's Float8Linear)

    @property
    def fwd_flops(self) -> float:
        if self.kind == "gemm":
            m, n, k = self.shape
            return 2.0 * m * n * k
        if self.kind in ("attention", "attention_eager"):
            b, h, s, d = self.shape
            # a flash kernel skips the masked half; explicit scores are computed in full
            return 4.0 * b * h * s * s * d * (0.5 if self.causal and self.kind == "attention" else 1.0)
        return 0.0

    @property
    def bwd_flops(self) -> float:
        """Two GEMMs per forward GEMM (none for an input without a gradient or a frozen weight); attention's
        backward is 2.5x its forward (5 bmm against 2, `torch/utils/flop_counter.py` sdpa backward;
        flash-attention's benchmark counts the same)."""
        if self.kind == "gemm":
            return self.fwd_flops * (float(self.input_grad) + float(self.weight_grad))
        return self.fwd_flops * 2.5


@dataclass(frozen=True, slots=True)
class Module:
    """One module of the trace, in forward execution order. See the module docstring for the byte fields.

    `tied_params` names parameters owned by an earlier module that this one also uses (a tied output
    head): its backward produces their gradient, so that gradient exists from this module's backward on.
    `kernels`: what the forward launches, in order (see `Kernel`; the builders and `fsdp-sim trace` list
    them); empty when only FLOPs and bytes are known (a hand-written workload), and then time is priced
    from `fwd_flops` and `fwd_hbm_bytes`.
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
    bwd_temp_parts: int = 1
    bwd_tail_bytes: int = 0
    nosave_fwd_peak_bytes: int = 0
    output_bytes: int = 0
    saves_input: bool = True
    is_block: bool = False
    in_model: bool = True
    records_graph: bool = True
    fwd_time_s: float | None = None
    bwd_time_s: float | None = None
    kernels: tuple[Kernel, ...] = ()

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
            for k in m["kernels"]:
                k["shape"] = list(k["shape"])
        return d


_BY_WORKLOAD: dict[int, tuple[Workload, dict]] = {}  # id -> (the workload, what was derived from it by key)
MAX_REMEMBERED_WORKLOADS = 256  # as many as build_transformer keeps


def derived(workload: Workload, key: Any, derive: Callable[[], Any]) -> Any:
    """`derive()`, remembered for this workload object and `key` (what is derived, with the other arguments
    it takes). A sweep's points share workloads (build_transformer caches them), and what the parse and the
    runtimes derive from one (its module bytes, FSDP units, checkpoint plans) would otherwise be redone at
    every point. The object is a complete key: a Workload, its modules and parameters are frozen; it is
    held here, so its id is not another's while remembered. What is remembered is shared: read-only."""
    entry = _BY_WORKLOAD.get(id(workload))
    if entry is None or entry[0] is not workload:
        if len(_BY_WORKLOAD) >= MAX_REMEMBERED_WORKLOADS:
            _BY_WORKLOAD.clear()
        entry = _BY_WORKLOAD[id(workload)] = (workload, {})
    found = entry[1]
    if key not in found:
        found[key] = derive()
    return found[key]


def share_kernels(workload: Workload) -> Workload:
    """`workload` with equal kernel tuples made one object. What a module's kernels cost and how it is
    checkpointed is worked out once per tuple, found by its identity (`ComputeCosts.times`, checkpoint plans)
    and else by its value, whose hash is every field of every kernel: the builders share one tuple among
    alike blocks, and a transformation that makes each block's anew (LoRA, freezing) gives them one again."""
    seen: dict[tuple, tuple] = {}
    modules = tuple(m if (kernels := seen.setdefault(m.kernels, m.kernels)) is m.kernels else replace(m, kernels=kernels)
                    for m in workload.modules)
    return replace(workload, modules=modules)
