"""The recording behind `trace_module`: an event log of one forward and backward, and its reading.

`Recorder` is driven by the unit hooks and three modes: a `TorchFunctionMode` above autograd that
tags each new autograd node with the running segment (and swaps in CUDA stand-ins), a
`TorchDispatchMode` below it that registers every new storage (with a weakref whose callback logs the
free) and the forward's traffic, and `FlopCounterMode`, whose running total is read at every change
of segment or phase. `saved_tensors_hooks` log which storages autograd keeps. `read_log.read_modules`
turns the log into one `Module` per segment (see `trace.py` for what each field measures).

Kernels. The dispatch mode also lists, per segment, the kernels the forward launches (`KernelRecord`):
one per dispatched op that is not a view or a bare allocation. Matmuls and convolutions are GEMMs
(m, n, k) (a batched matmul's batch folded into m), SDPA is an attention kernel; every other op is
memory-bound with the bytes it reads and writes (`_log_softmax` as a `cross_entropy` kernel, the CUDA
stand-ins of `cuda_kernels.py` as the kernel they stand for: a fused norm, a fused dropout). The
backward's memory-bound ops are added to the forward kernel whose torch call created the autograd node
running them (its largest memory-bound kernel); those with none (a bias gradient's sum in
`AddmmBackward0`) are listed as backward-only kernels of the segment. Backward matmuls and attention are
not listed: a forward GEMM's price includes its two backward GEMMs, attention's its backward kernel.
Kernels after the segment's last tensor saved for backward are `recompute=False`.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

from fsdp_sim.torch_tools.cuda_kernels import cuda_stand_ins
from fsdp_sim.workload import kernels as wk
from fsdp_sim.workload.model import Kernel

__all__ = ["Recorder", "Segment", "KernelRecord", "modes", "flop_counter"]

NODE_KEY = "fsdp_sim_unit"  # autograd node metadata: the segment whose forward created the node
RANGE_KEY = "fsdp_sim_kernels"  # autograd node metadata: (segment, first, end) of the kernels its torch call launched


@dataclass(slots=True)
class KernelRecord:
    """A `Kernel` being recorded: forward fields set when the op runs, backward ones added as the backward runs."""

    name: str
    kind: str
    shape: tuple[int, ...] = ()
    bytes: float = 0.0
    bwd_bytes: float = 0.0
    launches: int = 1
    bwd_launches: int = 0
    causal: bool = False

    @property
    def memory_bound(self) -> bool:
        return self.kind not in ("gemm", "attention")

    def kernel(self, recompute: bool) -> Kernel:
        if not self.memory_bound:  # priced by shape: two backward GEMMs, or attention's backward kernel
            return Kernel(self.name, self.kind, self.shape, launches=self.launches,
                          bwd_launches=2 if self.kind == "gemm" else 1, causal=self.causal, recompute=recompute)
        return Kernel(self.name, self.kind, self.shape, bytes=float(self.bytes), bwd_bytes=float(self.bwd_bytes),
                      launches=self.launches, bwd_launches=self.bwd_launches, recompute=recompute)


@dataclass
class Segment:
    """One call of one unit: from its forward pre-hook to the next unit's (or the loss's)."""

    unit: int | None  # index into the units list; None: the loss, or not yet known (work before the first unit)
    name: str = ""
    inputs: set[int] = field(default_factory=set)
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_traffic: float = 0.0
    prefix: str = ""  # the unit's fqn: kernel names are module paths below it
    kernels: list[KernelRecord] = field(default_factory=list)
    bwd_only: list[KernelRecord] = field(default_factory=list)  # backward kernels no forward kernel caused
    recompute_from: int = 0  # kernels[recompute_from:] come after the segment's last saved tensor


class Recorder:
    """The event log of one forward and backward: storages allocated, freed and saved, per segment."""

    def __init__(self, torch, flop_counter) -> None:
        from torch.utils.weak import WeakIdKeyDictionary
        self.torch = torch
        self.counter = flop_counter
        self.segments: list[Segment] = [Segment(unit=None)]
        self.events: list[tuple] = [("seg", 0)]
        self.sid_of = WeakIdKeyDictionary()
        self.nbytes: list[int] = []
        self.alloc_ctx: list[tuple[str, int] | None] = []
        self.refs: list[weakref.ref] = []
        self.phase = "forward"
        self.ctx: tuple[str, int] = ("forward", 0)
        self.flops_mark = 0.0
        self.param_sids: dict[int, str] = {}  # parameter storage -> canonical name
        self.first_use: dict[str, int] = {}  # parameter name -> first segment reading it
        self.final: set[int] = set()  # storages the backward starts from
        self.path: list[str] = []  # fqns of the modules whose forward is running (innermost last)
        self.fused: KernelRecord | None = None  # a CUDA stand-in's kernel: the ops it dispatches are folded in

    # storages
    def sid(self, t, *, new_ctx: tuple[str, int] | None = None) -> int:
        st = t.untyped_storage()
        sid = self.sid_of.get(st)
        if sid is None:
            sid = len(self.nbytes)
            self.sid_of[st] = sid
            self.nbytes.append(st.nbytes())
            self.alloc_ctx.append(new_ctx)
            self.refs.append(weakref.ref(st, lambda _r, sid=sid: self.events.append(("free", sid))))
            if new_ctx is not None:
                self.events.append(("alloc", sid))
        return sid

    # where we are
    def switch(self, ctx: tuple[str, int]) -> None:
        """Close the FLOP count of the current context and enter `ctx`."""
        total = float(self.counter.get_total_flops())
        seg = self.segments[self.ctx[1]]
        if self.ctx[0] == "forward":
            seg.fwd_flops += total - self.flops_mark
        else:
            seg.bwd_flops += total - self.flops_mark
        self.flops_mark = total
        if ctx != self.ctx and ctx[0] == "backward":
            self.events.append(("bwd", ctx[1]))
        self.ctx = ctx

    def enter(self, unit: int | None, name: str, tensors, prefix: str = "") -> None:
        """A unit's (or the loss's) forward begins: a new segment, unless only prologue work came before."""
        seg = self.segments[-1]
        if not (len(self.segments) == 1 and seg.unit is None and not seg.name):
            self.segments.append(seg := Segment(unit=unit))
            self.events.append(("seg", len(self.segments) - 1))
        seg.unit, seg.name, seg.prefix = unit, name, prefix
        seg.inputs = {self.sid(t) for t in tensors}
        self.switch(("forward", len(self.segments) - 1))

    def claim(self, node, start: tuple[int, int] | None = None) -> None:
        """Tag the autograd nodes this segment's forward created (all new nodes reachable from `node`), and
        with the kernels their torch call launched (from `start`, `begin_call`'s mark, to now)."""
        seg = self.ctx[1]
        span = (start[0], start[1], len(self.segments[start[0]].kernels)) if start is not None else None
        stack = [node]
        while stack:
            n = stack.pop()
            if n is None or NODE_KEY in n.metadata:
                continue
            n.metadata[NODE_KEY] = seg
            if span is not None:
                n.metadata[RANGE_KEY] = span
            stack.extend(nxt for nxt, _ in n.next_functions)

    # kernels
    def begin_call(self, fused: KernelRecord | None) -> tuple[int, int] | None:
        """A torch call begins in forward: mark where its kernels start; `fused` is a CUDA stand-in's one
        kernel, listed now (before what it saves) with the ops it dispatches folded into it."""
        if self.phase != "forward":
            return None
        seg = self.segments[self.ctx[1]]
        mark = (self.ctx[1], len(seg.kernels))
        if fused is not None and self.fused is None:
            fused.name = self._label(seg, fused.name)
            seg.kernels.append(fused)
            self.fused, fused.launches = fused, 0
        return mark

    def end_call(self, fused: KernelRecord | None, mark: tuple[int, int] | None) -> None:
        """The torch call `begin_call` marked returned: a stand-in that ran nothing (dropout with p=0) is unlisted."""
        if fused is None or mark is None or self.fused is not fused:
            return
        self.fused = None
        if fused.launches:
            fused.launches = 1
            return
        seg = self.segments[mark[0]]
        seg.kernels.remove(fused)
        seg.recompute_from = min(seg.recompute_from, len(seg.kernels))

    def _label(self, seg: Segment, op: str) -> str:
        """`op` named by the module running it, relative to the segment's unit (`attention.wq: mm`)."""
        path = self.path[-1] if self.path else ""
        if seg.prefix and (path == seg.prefix or path.startswith(seg.prefix + ".")):
            path = path[len(seg.prefix) + 1:]
        return f"{path}: {op}" if path else op

    def _forward_kernel(self, seg: Segment, func, traffic: float, compute: tuple | None, outputs: list) -> None:
        if self.fused is not None:
            self.fused.launches += 1  # the stand-in's own ops: its kernel is already listed
            return
        packet = func._overloadpacket
        op = packet.__name__
        if compute is not None:
            kind, shape, causal = compute
            seg.kernels.append(KernelRecord(self._label(seg, op), kind, shape, causal=causal))
        elif packet is self.torch.ops.aten._log_softmax and outputs and outputs[0].dim():
            out = outputs[0]
            width = out.shape[-1]
            seg.kernels.append(KernelRecord(self._label(seg, op), "cross_entropy", (out.numel() // max(width, 1), width),
                                            bytes=traffic))
        else:
            seg.kernels.append(KernelRecord(self._label(seg, op), "elementwise", bytes=traffic))

    def _backward_kernel(self, func, traffic: float) -> None:
        """A memory-bound backward op: added to the forward kernel that caused it, else listed on its own."""
        node = self.torch._C._current_autograd_node()
        span = node.metadata.get(RANGE_KEY) if node is not None else None
        if span is not None:
            seg, lo, hi = span
            candidates = [k for k in self.segments[seg].kernels[lo:hi] if k.memory_bound]
            if candidates:
                target = max(reversed(candidates), key=lambda k: k.bytes)  # the largest; the last of equals
                target.bwd_bytes += traffic
                target.bwd_launches += 1
                return
        where = node.name() if node is not None else "autograd"
        self.segments[self.ctx[1]].bwd_only.append(
            KernelRecord(f"{where}: {func._overloadpacket.__name__}", "elementwise", bwd_bytes=traffic, launches=0,
                         bwd_launches=1))

    def backward_ctx(self) -> tuple[str, int]:
        node = self.torch._C._current_autograd_node()
        if node is not None and NODE_KEY in node.metadata:
            return ("backward", node.metadata[NODE_KEY])
        return self.ctx  # engine bookkeeping: stays with the unit that ran last

    # hooks called by the modes
    def on_op(self, func, inputs: list, outputs: list, *, reads: str = "inputs", flop_timed: bool = False,
              compute: tuple | None = None) -> None:
        """An op ran: register its new storages; in forward, its parameter reads and, unless its time comes
        from its FLOPs (matmuls, attention), its HBM traffic: what it `reads` ("inputs"; "outputs" for a
        gather, which reads only the rows it returns; "nothing" for a `*_like` / `new_*` factory;
        "none" for an allocation, which moves no data at all) plus what it writes. Every op that is not
        a view or an allocation is a kernel (`compute`: its (kind, shape, causal) when it is a GEMM or
        attention); in backward the memory-bound ones are added to the kernels (module docstring)."""
        if self.phase not in ("forward", "backward"):  # our own setup between the phases: not the model's
            for t in outputs:
                self.sid(t)
            return
        if self.phase == "backward":
            ctx = self.backward_ctx()
            if ctx != self.ctx:
                self.switch(ctx)
        ctx = self.ctx
        fresh = any(self.sid_of.get(t.untyped_storage()) is None for t in outputs)
        for t in outputs:
            self.sid(t, new_ctx=ctx)
        aliases = not fresh and not func._schema.is_mutable  # a view, whatever its schema says (_unsafe_view)
        launches = not (func.is_view or aliases or reads == "none")
        read = {"inputs": inputs, "outputs": outputs}.get(reads, [])
        traffic = sum(t.numel() * t.element_size() for t in read + outputs) if launches and not flop_timed else 0
        if ctx[0] != "forward":
            if launches and not flop_timed:
                self._backward_kernel(func, traffic)
            return
        for t in inputs:
            name = self.param_sids.get(self.sid(t))
            if name is not None and name not in self.first_use:
                self.first_use[name] = ctx[1]
        if launches:
            seg = self.segments[ctx[1]]
            seg.fwd_traffic += traffic
            if not flop_timed or compute is not None:
                self._forward_kernel(seg, func, traffic, compute, outputs)

    def on_pack(self, t) -> None:
        if self.phase == "forward":
            self.events.append(("pack", self.sid(t), self.ctx[1]))
            seg = self.segments[self.ctx[1]]
            seg.recompute_from = len(seg.kernels)


def modes(torch, rec: Recorder, *, emulate_cuda: bool, flop_ops=()):
    """The function mode (node tags, CUDA stand-ins) and the dispatch mode (storages, traffic) of a trace;
    `flop_ops` are the op packets timed by their FLOPs, whose traffic is not counted."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    skip = {torch.ops.prim.device.default, torch.ops.aten.detach.default}
    aten = torch.ops.aten
    reads = {op: "outputs" for op in (aten.embedding, aten.index_select, aten.gather, aten.nll_loss_forward,
                                      aten.nll_loss2d_forward)}  # they read only the rows they return
    reads.update({op: "nothing" for op in (aten.new_zeros, aten.new_ones, aten.new_full, aten.zeros_like,
                                           aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like)})
    reads.update({op: "none" for op in (aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.empty,
                                        aten.empty_strided)})
    flop_ops = set(flop_ops)
    substitutes = cuda_stand_ins(torch) if emulate_cuda else {}

    class Claim(TorchFunctionMode):
        """Above autograd: tags the nodes each torch call creates with the running segment and the kernels
        it launched (and swaps in the CUDA kernels whose CPU decompositions save other tensors)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            fused = _stand_in_kernel(torch, func, args, kwargs) if func in substitutes else None
            start = rec.begin_call(fused)
            try:
                out = substitutes.get(func, func)(*args, **kwargs)
            finally:
                rec.end_call(fused, start)
            if rec.phase == "forward":
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                        rec.claim(t.grad_fn, start)
            return out

    class Memory(TorchDispatchMode):
        """Below autograd: every op's new storages (allocations), its traffic, its parameter reads."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func not in skip:
                tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
                outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                packet = func._overloadpacket
                timed = packet in flop_ops
                compute = _compute_kernel(aten, func, args, kwargs, outs) if timed and rec.phase == "forward" else None
                rec.on_op(func, tensors, outs, reads=reads.get(packet, "inputs"), flop_timed=timed, compute=compute)
            return out

    return Claim(), Memory()


def _arg(func, args, kwargs, name: str, default=None):
    """The value of `func`'s argument `name` in a call (positional or keyword, else its default)."""
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else (a.default_value if a.has_default_value() else default)
    return default


def _compute_kernel(aten, func, args, kwargs, outputs) -> tuple | None:
    """(kind, shape, causal) of a FLOP-counted forward op: a GEMM (m, n, k), a convolution as its implicit
    GEMM (m = images x output positions, n = output channels, k = input channels / groups x kernel size,
    the count `flop_counter` uses), or SDPA (batch, heads, query length, head dim)."""
    packet = func._overloadpacket
    if packet in (aten.mm, aten._scaled_mm):
        (m, k), n = args[0].shape, args[1].shape[-1]
    elif packet is aten.addmm:
        (m, k), n = args[1].shape, args[2].shape[-1]
    elif packet in (aten.bmm, aten.baddbmm):
        a, b = (args[0], args[1]) if packet is aten.bmm else (args[1], args[2])
        batch, m, k = a.shape
        m, n = batch * m, b.shape[-1]
    elif "conv" in packet.__name__:
        x, w = args[0], args[1]
        transposed = bool(_arg(func, args, kwargs, "transposed", False))
        spatial = (x.shape if transposed else outputs[0].shape)[2:]
        m, n, k = x.shape[0] * math.prod(spatial), w.shape[0], math.prod(w.shape[1:])
    elif "scaled_dot_product" in packet.__name__ and "backward" not in packet.__name__:
        b, h, s, d = args[0].shape
        return "attention", (b, h, s, d), bool(_arg(func, args, kwargs, "is_causal", False))
    else:  # flex attention and the like: FLOPs without a kernel shape
        return None
    return "gemm", (int(m), int(n), int(k)), False


def _stand_in_kernel(torch, func, args, kwargs) -> KernelRecord | None:
    """The kernel a CUDA stand-in (`cuda_kernels.py`) stands for: a fused norm (`kernels.norm`) or a fused
    dropout (reads x, writes y and a one-byte mask; backward reads the gradient and the mask)."""
    F = torch.nn.functional
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor):
        return None
    if func in (F.rms_norm, torch.rms_norm, F.layer_norm, torch.layer_norm):
        shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
        width = math.prod([shape] if isinstance(shape, int) else shape)
        name = "rms_norm" if func in (F.rms_norm, torch.rms_norm) else "layer_norm"
        k = wk.norm(name, x.numel() // max(width, 1), width, x.element_size(), fused=True)
        return KernelRecord(name, k.kind, k.shape, bytes=k.bytes, bwd_bytes=k.bwd_bytes, bwd_launches=k.bwd_launches)
    if func is F.dropout:
        nbytes = 2 * x.numel() * x.element_size() + x.numel()
        return KernelRecord("dropout", "elementwise", bytes=nbytes, bwd_bytes=nbytes, bwd_launches=1)
    return None  # SDPA's stand-in only drops the dropout: its ops are the kernels


def flop_counter(torch):
    """FlopCounterMode, plus the CPU flash-attention kernels the fake run dispatches to (not in its
    registry; causal attention counts half, as the flash kernels skip the masked blocks)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    def fwd(q, k, v, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(q, k, v) // (2 if is_causal else 1)

    def bwd(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, q, k, v) // (2 if is_causal else 1)

    aten = torch.ops.aten
    mapping = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = fwd
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = bwd
    return FlopCounterMode(display=False, custom_mapping=mapping)
