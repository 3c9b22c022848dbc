"""The recording behind `trace_module`: an event log of one forward and backward, and its reading.

`Recorder` is driven by the unit hooks and three modes: a `TorchFunctionMode` above autograd that
tags each new autograd node with the running segment (and swaps in CUDA stand-ins), a
`TorchDispatchMode` below it that registers every new storage (with a weakref whose callback logs the
free) and the forward's traffic, and `FlopCounterMode`, whose running total is read at every change
of segment or phase. `saved_tensors_hooks` log which storages autograd keeps. `read_modules` turns the
log into one `Module` per segment (see `trace.py` for what each field measures).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from fsdp_sim.torch_tools.cuda_kernels import cuda_stand_ins
from fsdp_sim.workload.model import Module

__all__ = ["Recorder", "Segment", "modes", "flop_counter", "read_modules"]

NODE_KEY = "fsdp_sim_unit"  # autograd node metadata: the segment whose forward created the node


@dataclass
class Segment:
    """One call of one unit: from its forward pre-hook to the next unit's (or the loss's)."""

    unit: int | None  # index into the units list; None: the loss, or not yet known (work before the first unit)
    name: str = ""
    inputs: set[int] = field(default_factory=set)
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_traffic: float = 0.0


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

    def enter(self, unit: int | None, name: str, tensors) -> None:
        """A unit's (or the loss's) forward begins: a new segment, unless only prologue work came before."""
        seg = self.segments[-1]
        if not (len(self.segments) == 1 and seg.unit is None and not seg.name):
            self.segments.append(seg := Segment(unit=unit))
            self.events.append(("seg", len(self.segments) - 1))
        seg.unit, seg.name = unit, name
        seg.inputs = {self.sid(t) for t in tensors}
        self.switch(("forward", len(self.segments) - 1))

    def claim(self, node) -> None:
        """Tag the autograd nodes this segment's forward created (all new nodes reachable from `node`)."""
        seg = self.ctx[1]
        stack = [node]
        while stack:
            n = stack.pop()
            if n is None or NODE_KEY in n.metadata:
                continue
            n.metadata[NODE_KEY] = seg
            stack.extend(nxt for nxt, _ in n.next_functions)

    def backward_ctx(self) -> tuple[str, int]:
        node = self.torch._C._current_autograd_node()
        if node is not None and NODE_KEY in node.metadata:
            return ("backward", node.metadata[NODE_KEY])
        return self.ctx  # engine bookkeeping: stays with the unit that ran last

    # hooks called by the modes
    def on_op(self, func, inputs: list, outputs: list, *, reads: str = "inputs", flop_timed: bool = False) -> None:
        """An op ran: register its new storages; in forward, its parameter reads and, unless its time comes
        from its FLOPs (matmuls, attention), its HBM traffic: what it `reads` ("inputs"; "outputs" for a
        gather, which reads only the rows it returns; "nothing" for a `*_like` / `new_*` factory;
        "none" for an allocation, which moves no data at all) plus what it writes."""
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
        if ctx[0] != "forward":
            return
        for t in inputs:
            name = self.param_sids.get(self.sid(t))
            if name is not None and name not in self.first_use:
                self.first_use[name] = ctx[1]
        aliases = not fresh and not func._schema.is_mutable  # a view, whatever its schema says (_unsafe_view)
        if not (func.is_view or aliases or flop_timed or reads == "none"):
            read = {"inputs": inputs, "outputs": outputs}.get(reads, [])
            self.segments[ctx[1]].fwd_traffic += sum(t.numel() * t.element_size() for t in read + outputs)

    def on_pack(self, t) -> None:
        if self.phase == "forward":
            self.events.append(("pack", self.sid(t), self.ctx[1]))


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
        """Above autograd: tags the nodes each torch call creates with the running segment (and swaps
        in the CUDA kernels whose CPU decompositions save other tensors)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            func = substitutes.get(func, func)
            out = func(*args, **(kwargs or {}))
            if rec.phase == "forward":
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                        rec.claim(t.grad_fn)
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
                rec.on_op(func, tensors, outs, reads=reads.get(packet, "inputs"), flop_timed=packet in flop_ops)
            return out

    return Claim(), Memory()


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


def _kind(module, is_block: bool, last: bool) -> str:
    from torch import nn
    if is_block:
        return "block"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if "norm" in type(module).__name__.lower():
        return "norm"
    if isinstance(module, nn.Linear) and last:
        return "head"
    return type(module).__name__.lower()


def read_modules(rec: Recorder, units, unit_params, params_meta, param_grads: set[int], executed: set[int],
                 has_loss: bool) -> tuple[list[Module], list[str]]:
    """Read the event log: one `Module` per segment, in execution order."""
    segs = rec.segments
    n = len(segs)
    notes: list[str] = []
    free_at: dict[int, int] = {}
    packed: dict[int, set[int]] = {}
    seg_start: dict[int, int] = {}
    bwd_at = len(rec.events)
    for idx, ev in enumerate(rec.events):
        if ev[0] == "free":
            free_at.setdefault(ev[1], idx)
        elif ev[0] == "pack":
            packed.setdefault(ev[1], set()).add(ev[2])
        elif ev[0] == "seg":
            seg_start[ev[1]] = idx
        elif ev[0] == "bwd" and bwd_at == len(rec.events):
            bwd_at = idx
    seg_end = [seg_start[i + 1] if i + 1 < n else bwd_at for i in range(n)]

    def owner(sid: int) -> int | None:
        ctx = rec.alloc_ctx[sid]
        return ctx[1] if ctx is not None and ctx[0] == "forward" else None

    # storages passed on: the next segment's inputs (the backward's roots after the last) owned here
    outputs = [set() for _ in range(n)]
    for i in range(n):
        nxt = segs[i + 1].inputs if i + 1 < n else rec.final
        outputs[i] = {sid for sid in nxt if owner(sid) == i}

    saved = [0] * n
    out_bytes = [0] * n
    carried: dict[int, int] = {}
    carried_sids: list[set[int]] = [set() for _ in range(n)]
    held: dict[int, int] = {}
    for sid, ctx in enumerate(rec.alloc_ctx):
        i = owner(sid)
        if i is None or (sid in free_at and free_at[sid] <= seg_end[i]):
            continue
        if sid in outputs[i]:
            out_bytes[i] += rec.nbytes[sid]
            if i in packed.get(sid, ()):
                notes.append(f"{segs[i].name}: its forward saves its own output ({rec.nbytes[sid]} bytes), "
                             "counted once, in output_bytes")
        elif sid in packed or not (sid in free_at and free_at[sid] < bwd_at):
            saved[i] += rec.nbytes[sid]  # saved for backward, or held to the backward anyway (a cache)
            if sid not in packed:
                held[i] = held.get(i, 0) + rec.nbytes[sid]
        else:
            out_bytes[i] += rec.nbytes[sid]  # used later in the forward, by a module after the next
            carried[i] = carried.get(i, 0) + rec.nbytes[sid]
            carried_sids[i].add(sid)
    for i, nbytes in carried.items():
        notes.append(f"{segs[i].name}: {nbytes} bytes outlive its forward unsaved and are not passed to the "
                     "next module; counted in output_bytes")
    for i, nbytes in held.items():
        notes.append(f"{segs[i].name}: {nbytes} bytes are not saved for backward but held until it begins "
                     "(a cache?); counted in saved_bytes")

    # transient peaks: each segment's own live storages, forward window / backward windows
    # backward: the net rise of everything alive (activation and parameter gradients, the input
    # gradient, minus the saved tensors autograd releases meanwhile) over the level when the unit's
    # backward began, which is how the simulator applies `bwd_temp_bytes`
    fwd_peak, fwd_live = [0] * n, [0] * n
    bwd_peak, bwd_base = [0] * n, [None] * n
    cur, total = None, 0
    for idx, ev in enumerate(rec.events):
        kind = ev[0]
        if kind == "bwd":
            cur = ev[1]
            if cur is not None and bwd_base[cur] is None:
                bwd_base[cur] = total
            continue
        if kind not in ("alloc", "free"):
            continue
        sid = ev[1]
        sign = rec.nbytes[sid] if kind == "alloc" else -rec.nbytes[sid]
        total += sign
        if cur is not None and bwd_base[cur] is not None:
            bwd_peak[cur] = max(bwd_peak[cur], total - bwd_base[cur])
        ctx = rec.alloc_ctx[sid]
        if ctx is None or sid in param_grads:
            continue
        i = ctx[1]
        if ctx[0] == "forward":
            fwd_live[i] += sign
            if idx < seg_end[i]:
                fwd_peak[i] = max(fwd_peak[i], fwd_live[i])
    fwd_end_live = [0] * n
    for sid, ctx in enumerate(rec.alloc_ctx):
        i = owner(sid)
        if i is not None and not (sid in free_at and free_at[sid] <= seg_end[i]):
            fwd_end_live[i] += rec.nbytes[sid]

    # parameters: units own theirs, first executed user first; the rest go to their first reader
    owner_of: dict[str, int] = {}
    for i, s in enumerate(segs):
        if s.unit is not None and s.name == (units[s.unit][0] or s.name):
            for p in unit_params[s.unit]:
                owner_of.setdefault(p, i)
    for p in params_meta:
        if p not in owner_of:
            owner_of[p] = rec.first_use.get(p, 0)
            if p not in rec.first_use:
                notes.append(f"parameter {p} is never used by the forward; given to {segs[0].name}")
    unexecuted = [units[u][0] for u in range(len(units)) if u not in executed and unit_params[u]]
    if unexecuted:
        notes.append(f"modules never called as modules (their parameters go to their first reader): {unexecuted}")

    # the previous module's output lives on if this one saves it; when only part of it is saved (a chain
    # convention meets a graph), the larger part decides, and a smaller saved part becomes the previous
    # module's saved bytes (it then lives one module's backward too long, not the whole step too short)
    saves_input = [False] * n  # the first module's input is the batch, not an activation
    for i in range(1, n):
        prev_out = outputs[i - 1] | carried_sids[i - 1]
        passed = sum(rec.nbytes[sid] for sid in prev_out)
        kept = sum(rec.nbytes[sid] for sid in prev_out if i in packed.get(sid, ()))
        saves_input[i] = kept > 0 and 2 * kept >= passed
        if 0 < kept < passed:
            if not saves_input[i]:
                out_bytes[i - 1] -= kept
                saved[i - 1] += kept
            notes.append(f"{segs[i].name}: saves {kept} of the {passed} bytes its predecessor passes on; "
                         f"saves_input={saves_input[i]}")

    last_model = max((i for i, s in enumerate(segs) if s.unit is not None), default=0)
    modules: list[Module] = []
    for i, s in enumerate(segs):
        own = tuple(params_meta[p] for p, o in owner_of.items() if o == i)
        used = unit_params[s.unit] if s.unit is not None else []
        tied = tuple(p for p in used if owner_of[p] != i)
        if s.unit is None:
            kind, is_block = "loss", False
        else:
            _, mod, is_block = units[s.unit]
            kind = _kind(mod, is_block, i == last_model)
        modules.append(Module(
            name=s.name, kind=kind, params=own, tied_params=tied, fwd_flops=s.fwd_flops, bwd_flops=s.bwd_flops,
            fwd_hbm_bytes=s.fwd_traffic, saved_bytes=saved[i],
            fwd_temp_bytes=max(0, fwd_peak[i] - fwd_end_live[i]), bwd_temp_bytes=bwd_peak[i],
            output_bytes=out_bytes[i], saves_input=saves_input[i], is_block=is_block,
            in_model=not (has_loss and s.unit is None)))
    return modules, notes


