"""Reading the recorder's event log (recorder.py): one `Module` per segment, in execution order.

What each field measures is `trace.py`'s to say; this module counts it off the log. A storage belongs
to the segment whose forward allocated it. Freed inside that forward, it is a transient (the forward's
peak over what the forward leaves alive is `fwd_temp_bytes`). Outliving it, it is the segment's output
when the next segment (after the last: the backward's roots) takes it as input; its saved bytes when
autograd packed it or it lives until the backward anyway (a cache); and output bytes again when a later
forward frees it (a tensor passed past the next module). Parameters go to the unit that owns them, the
rest to their first reader; every convention applied is returned as a note."""

from __future__ import annotations

from fsdp_sim.torch_tools.recorder import Recorder
from fsdp_sim.workload.model import Module

__all__ = ["read_modules"]


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
        kernels = tuple(k.kernel(recompute=j < s.recompute_from) for j, k in enumerate(s.kernels))
        kernels += tuple(k.kernel(recompute=False) for k in s.bwd_only)
        modules.append(Module(
            name=s.name, kind=kind, params=own, tied_params=tied, fwd_flops=s.fwd_flops, bwd_flops=s.bwd_flops,
            fwd_hbm_bytes=s.fwd_traffic, saved_bytes=saved[i],
            fwd_temp_bytes=max(0, fwd_peak[i] - fwd_end_live[i]), bwd_temp_bytes=bwd_peak[i],
            output_bytes=out_bytes[i], saves_input=saves_input[i], is_block=is_block,
            in_model=not (has_loss and s.unit is None), kernels=kernels))
    return modules, notes


