"""The op graph a runtime emits: what each stream does, in CPU issue order, and what waits on what.

Ops carry work (FLOPs, HBM bytes, collective bytes), not durations: the engine prices them with the
hardware model. The one exception is a compute op whose module was timed by a profiler
(`measured_s`, from `compute: {trace: ...}`): that measurement replaces the FLOP-based estimate. Memory is part of the graph: `alloc` and `free` ops sit on the stream where PyTorch's
caching allocator sees them, so the ledger can replay them in issue order (what
`torch.cuda.max_memory_allocated` and FSDPMemTracker count) and stamp them with the time the stream
reaches them.

The ops are a list in issue order and each op lists the earlier ops it waits on; that list *is* the DAG.
`to_networkx()` builds the networkx view for analysis; the hot path never needs it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where a graph is built: networkx takes ~0.2 s to import, and most steps build none
    import networkx as nx

CATEGORIES = ("sharded_params", "unsharded_params", "sharded_grads", "unsharded_grads", "optimizer_states",
              "activations", "temporaries", "all_gather_buffers", "reduce_scatter_buffers", "inputs", "buffers")
TIMED_KINDS = ("compute", "copy", "all_gather", "reduce_scatter", "all_reduce")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(slots=True)
class Buffer:
    """One device allocation: its name, memory category, size and the FSDP unit it belongs to."""

    id: int
    name: str
    category: str
    nbytes: int
    unit: str


@dataclass(slots=True)
class Op:
    """One entry of a stream's queue. `deps` are ids of earlier ops this one waits on (CUDA events)."""

    id: int
    kind: str
    stream: str
    name: str
    unit: str
    phase: str
    deps: tuple[int, ...] = ()
    flops: float = 0.0
    hbm_bytes: float = 0.0
    comm_bytes: float = 0.0
    group: str = ""
    buffer: Buffer | None = None
    measured_s: float | None = None
    kernels: tuple = ()  # a module's `Kernel`s, run as `kernel_pass` (forward | backward | recompute)
    kernel_pass: str = ""
    launches: int = 1  # kernels the CPU launches for an op priced from FLOPs and bytes (a copy, a foreach pass)
    record_stream: str = ""  # a free: the stream `Tensor.record_stream` named (FSDP1); the block waits for it
    cpu_wait: int = -1  # the op whose end the CPU issue thread waits for before issuing this one (Event.synchronize)

    def with_work(self, kernels: tuple, flops: float, hbm_bytes: float, measured_s: float | None) -> Op:
        """This op doing other work (schedule/build.py re-prices a module pass), every other field kept; made
        positionally, as a re-priced graph makes a hundred of them (`dataclasses.replace` takes 7.5x as long)."""
        return Op(self.id, self.kind, self.stream, self.name, self.unit, self.phase, self.deps, flops, hbm_bytes,
                  self.comm_bytes, self.group, self.buffer, measured_s, kernels, self.kernel_pass, self.launches,
                  self.record_stream, self.cpu_wait)


@dataclass(slots=True)
class MemoryOp:
    """An alloc or free: an `Op` that does no work, so the fields only work has are constants of the class
    (two of every three ops are these, and a graph builds them at every point of a sweep)."""

    id: int
    kind: str  # "alloc" | "free"
    stream: str
    name: str
    unit: str
    phase: str
    deps: tuple[int, ...]
    buffer: Buffer
    record_stream: str = ""  # a free: the stream `Tensor.record_stream` named (FSDP1); the block waits for it
    cpu_wait: int = -1
    flops = hbm_bytes = comm_bytes = 0.0
    group = kernel_pass = ""
    measured_s = None
    kernels = ()
    launches = 1

    def with_buffer(self, buffer: Buffer) -> MemoryOp:
        """This alloc or free of `buffer` (the same buffer, re-sized: schedule/build.py), made positionally."""
        return MemoryOp(self.id, self.kind, self.stream, self.name, self.unit, self.phase, self.deps, buffer,
                        self.record_stream, self.cpu_wait)


class OpGraph:
    """Builder and container of ops; the runtime sets `phase` and `unit` as it walks the step."""

    def __init__(self) -> None:
        self.ops: list[Op | MemoryOp] = []  # by id
        self.buffers: list[Buffer] = []
        self.persistent: list[Buffer] = []
        self.host = None  # pinned host memory of the rank (schedule/offload.py HostMemory) when anything is offloaded
        self.phase = "forward"
        self.unit = ""
        # the allocs and frees in issue order as columns, what the ledger reads without a pass over the ops:
        # each one's op id, buffer id, signed bytes (+ alloc, - free) and stream
        self.memory_ops: list[int] = []
        self.memory_buffers: list[int] = []
        self.memory_bytes: list[int] = []
        self.memory_streams: list[str] = []
        self.recorded_frees = False  # some free names a recorded stream (`record_stream`)
        # each module pass's compute op as (op id, module, pass), what schedule/build.py re-prices; None
        # once a pass became several ops (split around tensor-parallel collectives)
        self.compute_sites: list[tuple[int, str, str]] | None = []
        # what each module pass (and each batch) allocated from the workload's bytes, as (pass, module, the
        # module before it, the ids of its buffers in `autograd.forward_bytes` / `backward_bytes` order,
        # None where it allocated none): what schedule/build.py re-sizes
        self.memory_sites: list[tuple[str, str, str, tuple[int | None, ...]]] = []
        self._stream_waits: dict[str, list[Op]] = {}  # wait_event: deps for the next op on a stream
        self._synchronize: Op | None = None  # synchronize: the CPU waits it before issuing the next op
        self._derived: dict[str, tuple[int, object]] = {}  # `derived`'s: shared with the graphs `with_ops` makes

    def wait_event(self, stream: str, event: Op | None) -> None:
        """`stream.wait_event(event)` / `wait_stream`: the next op queued on `stream` (whatever adds it)
        waits `event`. A runtime uses it where the op that follows belongs to another layer (autograd's)."""
        if event is not None:
            self._stream_waits.setdefault(stream, []).append(event)

    def synchronize(self, event: Op) -> None:
        """`event.synchronize()` on the CPU: the issue thread blocks until `event` ends, before the next op."""
        self._synchronize = event

    def add(self, kind: str, stream: str, name: str, *, deps=(), flops=0.0, hbm_bytes=0.0,
            comm_bytes=0.0, group="", buffer=None, measured_s=None, kernels=(), kernel_pass="", launches=1) -> Op:
        op = Op(len(self.ops), kind, stream, name, self.unit, self.phase, _event_ids(deps) if deps else (), flops,
                hbm_bytes, comm_bytes, group, buffer, measured_s, kernels, kernel_pass, launches)
        if self._stream_waits or self._synchronize is not None:
            self._take_waits(op)
        self.ops.append(op)
        return op

    def _take_waits(self, op: Op) -> None:
        """Give `op` what `wait_event` left for its stream and what `synchronize` left for the CPU."""
        if op.stream in self._stream_waits:
            op.deps += tuple(e.id for e in self._stream_waits.pop(op.stream))
        if self._synchronize is not None:
            op.cpu_wait, self._synchronize = self._synchronize.id, None

    # alloc and free make their Buffer and MemoryOp directly, each field stored here rather than by the
    # dataclass's __init__ (half the time: its call is most of it), and not through `add`: four of every five
    # ops are theirs (3,890 of Llama 3 70B's 4,789), and each keyword call costs more than the op itself
    def alloc(self, stream: str, name: str, category: str, nbytes: int, *, deps=()) -> Buffer:
        buf = _new(Buffer)
        buf.id = len(self.buffers)
        buf.name = name
        buf.category = category
        buf.nbytes = int(nbytes)
        buf.unit = self.unit
        self.buffers.append(buf)
        self._memory("alloc", stream, name, buf, buf.nbytes, deps, "")
        return buf

    def free(self, stream: str, buf: Buffer, *, deps=(), record_stream: str = "") -> MemoryOp:
        """Free `buf` on `stream`. `record_stream`: the tensor was recorded on that stream
        (`Tensor.record_stream`, as FSDP1 frees), so the caching allocator may reuse its block only once
        that stream has passed the work it had queued when the free was issued."""
        if record_stream:
            self.recorded_frees = True
        return self._memory("free", stream, buf.name, buf, -buf.nbytes, deps, record_stream)

    def _memory(self, kind: str, stream: str, name: str, buf: Buffer, nbytes: int, deps, record_stream: str) -> MemoryOp:
        """The alloc or free of `buf` (`nbytes` signed), queued and recorded in the memory columns."""
        op = _new(MemoryOp)
        op.id = len(self.ops)
        op.kind = kind
        op.stream = stream
        op.name = name
        op.unit = self.unit
        op.phase = self.phase
        op.deps = _event_ids(deps) if deps else ()
        op.buffer = buf
        op.record_stream = record_stream
        op.cpu_wait = -1
        if self._stream_waits or self._synchronize is not None:
            self._take_waits(op)
        self.ops.append(op)
        self.memory_ops.append(op.id)
        self.memory_buffers.append(buf.id)
        self.memory_bytes.append(nbytes)
        self.memory_streams.append(stream)
        return op

    def compute_site(self, op: Op | None, module: str, kernel_pass: str) -> None:
        """Record that `op` is the compute op of `module`'s `kernel_pass` (None: that pass is several ops)."""
        if op is None:
            self.compute_sites = None
        elif self.compute_sites is not None:
            self.compute_sites.append((op.id, module, kernel_pass))

    def memory_site(self, kind: str, module: str, prev: str, buffers: tuple[Buffer | None, ...]) -> None:
        """Record that `module`'s `kind` pass (after module `prev`) allocated `buffers` from its bytes."""
        self.memory_sites.append((kind, module, prev, tuple(None if b is None else b.id for b in buffers)))

    def derived(self, name: str, derive: Callable[[], Any]) -> Any:
        """`derive()`, remembered under `name` for this graph's structure: the order of its ops, their kinds,
        streams, groups, phases, deps and buffer ids, the memory columns but their bytes, and the persistent
        buffers. The graphs `with_ops` makes keep all of that and share what is remembered, so a sweep's
        re-sized and re-priced steps (schedule/build.py) derive their stream queues and ledger columns once
        per build. A graph only grows, so its op count dates what was derived: one that grew since derives
        anew. Read-only, but for a slot a caller derives to keep as its own one-entry cache (the ledger's
        levels, for the bytes it summed last)."""
        entry = self._derived.get(name)
        if entry is None or entry[0] != len(self.ops):
            entry = self._derived[name] = (len(self.ops), derive())
        return entry[1]

    def with_ops(self, ops: list[Op | MemoryOp], buffers: list[Buffer] | None = None,
                 memory_bytes: list[int] | None = None) -> OpGraph:
        """This graph with `ops` in place of its own and, if given, `buffers` and the memory events' bytes
        (the same buffer ids, sizes changed: schedule/build.py), sharing everything else: the memory columns
        and sites are read-only once a graph is built. Each op keeps its id, kind, stream, group, phase, deps,
        buffer id, `record_stream` and `cpu_wait` (only what it computes or allocates changes), so the two
        graphs share what `derived` remembers."""
        graph = copy.copy(self)
        graph.ops = ops
        if buffers is not None:
            graph.buffers = buffers
        if memory_bytes is not None:
            graph.memory_bytes = memory_bytes
        return graph

    def persistent_alloc(self, name: str, category: str, nbytes: int) -> Buffer:
        """State alive before the step starts and after it ends (sharded params, optimizer states)."""
        buf = Buffer(len(self.buffers), name, category, int(nbytes), self.unit)
        self.buffers.append(buf)
        self.persistent.append(buf)
        return buf

    def to_networkx(self) -> nx.DiGraph:
        """The DAG with stream-order edges and event edges, for analysis and tests."""
        import networkx as nx
        g = nx.DiGraph()
        last: dict[str, int] = {}
        for op in self.ops:
            g.add_node(op.id, kind=op.kind, stream=op.stream, name=op.name)
            if op.stream in last:
                g.add_edge(last[op.stream], op.id, why="stream")
            last[op.stream] = op.id
            for d in op.deps:
                g.add_edge(d, op.id, why="event")
        return g


_new = object.__new__  # an instance of a slots dataclass with no field set: the caller sets every one


def _event_ids(deps) -> tuple[int, ...]:
    """The ids of the events an op waits on (None: no event)."""
    return tuple([d.id for d in deps if d is not None])
