"""The simulated step as a `torch.cuda.memory._snapshot()` dict, for PyTorch's memory visualiser.

Pickle it (`run --memory-snapshot FILE.pickle`) and drop the file on https://pytorch.org/memory_viz, or
render it with `torch.cuda._memory_viz` (`trace_plot`, `segment_plot`, `segsum`, `trace`), beside a real
snapshot taken with `torch.cuda.memory._record_memory_history()` and `_dump_snapshot()`.

The format is the one `torch/cuda/memory.py::_snapshot` documents (torch 2.13): `segments` (the
allocator's state when the snapshot is taken: one entry per cudaMalloc'd segment with its blocks) and
`device_traces` (one list per device of `alloc`, `free_requested`, `free_completed` and `segment_alloc`
entries with `addr`, `size`, `stream`, `frames`, and `time_us`). Here:

- every buffer of the ledger, in its order: the persistent state (sharded parameters and gradients,
  optimizer states, buffers) is allocated at t=0, as if recording began before the model was built, so the
  allocated curve is the ledger's, to the byte (`size` is the requested size, as PyTorch records it);
- a free is `free_requested` then `free_completed` at once (FSDP2 frees after the waits; no record_stream);
- addresses come from a small model of the caching allocator (c10/cuda/CUDACachingAllocator.cpp): one
  small (<= 1 MiB) and one large pool per stream; requests rounded to 512 B; best fit among the pool's
  free blocks, split when the rest exceeds 512 B (small) or 1 MiB (large); else a new segment of 2 MiB
  (small), 20 MiB (large requests under 10 MiB) or the request rounded to 2 MiB; freed neighbours merge;
  segments are never returned (no empty_cache). Its segments are therefore a placement with
  fragmentation, which the summary's reserved figure (per-stream high-water marks) leaves out.
- a block's one frame names the buffer: `filename` its category, `name` the buffer, its unit and phase.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from fsdp_sim.engine.allocator import MIN_BLOCK, SMALL_SIZE, round_size, segment_size
from fsdp_sim.results.analysis import StepResult

SEGMENT_ALIGN = 1 << 30  # fictional device addresses: each segment starts on its own GiB boundary


@dataclass(slots=True)
class _Segment:
    address: int
    size: int
    stream: int
    small: bool
    blocks: dict[int, list] = field(default_factory=dict)  # offset -> [size, requested or None (free), frames]


class _Allocator:
    """Best-fit placement over per-(stream, small/large) pools of segments."""

    def __init__(self):
        self.segments: list[_Segment] = []
        self.free: dict[tuple[int, bool], list[tuple[int, int, int]]] = {}  # pool -> sorted (size, addr, seg)
        self.where: dict[int, tuple[int, int]] = {}  # addr -> (segment index, offset)
        self.next_address = SEGMENT_ALIGN

    def malloc(self, requested: int, stream: int, frames: list, trace: list, time_us: float) -> int:
        size = round_size(requested)
        pool = (stream, size <= SMALL_SIZE)
        free = self.free.setdefault(pool, [])
        i = bisect.bisect_left(free, (size, -1, -1))
        if i == len(free):  # nothing cached fits: a new segment
            seg = _Segment(self.next_address, segment_size(size), stream, pool[1])
            self.next_address += -(-seg.size // SEGMENT_ALIGN) * SEGMENT_ALIGN
            self.segments.append(seg)
            seg.blocks[0] = [seg.size, None, []]
            trace.append({"action": "segment_alloc", "addr": seg.address, "size": seg.size, "stream": stream,
                          "frames": frames, "time_us": time_us})
            free_size, addr, s = seg.size, seg.address, len(self.segments) - 1
        else:
            free_size, addr, s = free.pop(i)
        seg = self.segments[s]
        offset = addr - seg.address
        rest = free_size - size
        if rest > (MIN_BLOCK if pool[1] else SMALL_SIZE):  # split: the rest stays cached
            seg.blocks[offset + size] = [rest, None, []]
            bisect.insort(free, (rest, addr + size, s))
            free_size = size
        seg.blocks[offset] = [free_size, requested, frames]
        self.where[addr] = (s, offset)
        return addr

    def release(self, addr: int) -> None:
        s, offset = self.where.pop(addr)
        seg = self.segments[s]
        free = self.free[(seg.stream, seg.small)]
        block = seg.blocks[offset]
        block[1], block[2] = None, []
        offsets = sorted(seg.blocks)
        k = offsets.index(offset)
        if k + 1 < len(offsets) and seg.blocks[offsets[k + 1]][1] is None:  # merge with the next free block
            nxt = offsets[k + 1]
            free.remove((seg.blocks[nxt][0], seg.address + nxt, s))
            block[0] += seg.blocks.pop(nxt)[0]
        if k > 0 and seg.blocks[offsets[k - 1]][1] is None:  # and with the previous one
            prev = offsets[k - 1]
            free.remove((seg.blocks[prev][0], seg.address + prev, s))
            seg.blocks[prev][0] += seg.blocks.pop(offset)[0]
            offset = prev
        bisect.insort(free, (seg.blocks[offset][0], seg.address + offset, s))

    def state(self) -> list[dict]:
        """`segments` as `_snapshot()` gives them (device 0)."""
        out = []
        for seg in self.segments:
            blocks = []
            for offset in sorted(seg.blocks):
                size, requested, frames = seg.blocks[offset]
                active = requested is not None
                blocks.append({"address": seg.address + offset, "size": size, "requested_size": requested or 0,
                               "state": "active_allocated" if active else "inactive", "frames": frames})
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            out.append({"device": 0, "address": seg.address, "total_size": seg.size, "stream": seg.stream,
                        "segment_type": "small" if seg.small else "large", "segment_pool_id": (0, 0),
                        "allocated_size": allocated, "active_size": allocated,
                        "requested_size": sum(b["requested_size"] for b in blocks), "blocks": blocks})
        return out


def _frames(buf, phase: str) -> list[dict]:
    where = f" (unit {buf.unit}, {phase})" if buf.unit else f" ({phase})"
    return [{"filename": f"fsdp-sim/{buf.category}", "line": 0, "name": buf.name + where}]


def memory_snapshot(result: StepResult) -> dict:
    """The step's memory as `torch.cuda.memory._snapshot()` returns it after the step (see the module)."""
    memory = result.memory
    streams = {"compute": 0}
    for op, _, _ in memory.events:
        streams.setdefault(op.stream, len(streams))
    alloc, trace = _Allocator(), []
    addr: dict[int, tuple[int, int]] = {}  # buffer id -> (address, the stream whose pool holds it)

    def allocate(buf, stream: int, phase: str, time_us: float) -> None:
        frames = _frames(buf, phase)
        a = alloc.malloc(buf.nbytes, stream, frames, trace, time_us)
        addr[buf.id] = (a, stream)
        trace.append({"action": "alloc", "addr": a, "size": buf.nbytes, "stream": stream, "frames": frames,
                      "time_us": time_us})

    for buf in memory.persistent:
        allocate(buf, 0, "before the step", 0.0)
    for (op, buf, sign), t in zip(memory.events, memory.time[1:].tolist()):
        time_us = t * 1e6
        if sign > 0:
            allocate(buf, streams[op.stream], op.phase, time_us)
            continue
        a, stream = addr.pop(buf.id)
        for action in ("free_requested", "free_completed"):
            trace.append({"action": action, "addr": a, "size": buf.nbytes, "stream": stream,
                          "frames": _frames(buf, op.phase), "time_us": time_us})
        alloc.release(a)
    return {"segments": alloc.state(), "device_traces": [trace],
            "fsdp_sim": {"scenario": result.scenario.name, "streams": streams}}  # ignored by the visualiser
