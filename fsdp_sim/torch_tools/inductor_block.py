"""What Inductor makes of one torchtitan Llama-3 block: its kernels, their bytes, and the saved set.

torchtitan compiles each `TransformerBlock` on its own (`apply_compile`: `torch.compile(block,
fullgraph=True)`) before `fully_shard`, so FSDP2's hooks, which run around the block's forward and
backward, stay outside the compiled region (they are `torch._dynamo.disable`d: a hook inside would
break the graph). One block is therefore one Dynamo graph, which AOTAutograd splits into a forward
and a backward graph with its min-cut partitioner, and Inductor lowers each into a list of scheduler
nodes: generated (fused) kernels and library calls (`mm`, SDPA) it does not generate.

`extract(cfg)` compiles a block (`llama_block.LlamaBlock`: its code and configurations) on the CPU
build of torch, forward and backward, and reads, after Inductor's fusion pass, every scheduler node
of both graphs: its kind (generated or library call), the ATen ops fused into it, and the bytes it
reads and writes (`get_read_buffer_sizes` / `get_write_buffer_sizes`, Inductor's own count: each
buffer at most once, intermediates that stay on chip not counted). The backward graph's inputs, less
the output's gradient, are what the partitioner saved: what the block keeps for backward under
torch.compile.

The CPU backend (`CppScheduling`) and the CUDA one (`TritonScheduling`) share the scheduler's fusion
pass (`Scheduler.fuse_nodes`: vertical fusion of producers into consumers, horizontal fusion of
nodes reading the same inputs, reductions with their pointwise prologue and epilogue). They differ
where a backend says `can_fuse` differently: the CPU backend can fuse a reduction with a following
reduction over the same outer loop ("outer loop fusion"), which Triton does in one persistent or
looped reduction kernel too, and CUDA has templates (matmul epilogues under `max-autotune`, flex
attention) the CPU default mode does not use, and from torch 2.10 mix-order reduction
(`MixOrderReduction.can_fuse` in scheduler.py: GPU Triton backends only), which folds a norm's
weight-gradient reduction into its input-gradient kernel; workload/compiled_block.py applies it where
Inductor's size rule takes it. Library calls are the same on both: `mm` is an extern kernel (cuBLAS on
CUDA without `max-autotune`), SDPA a fallback (`_scaled_dot_product_flash_attention` on CUDA,
`..._for_cpu` here). The saved set does not depend on the device: the min-cut partitioner
(torch/_functorch/partitioners.py) reads no device but for RNG state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("fsdp_sim.torch_tools needs PyTorch; pip install torch==2.13.0") from exc

from fsdp_sim.torch_tools.llama_block import BlockConfig, LlamaBlock, rope_table, torch_dtype

__all__ = ["Node", "Extraction", "extract"]


@dataclass
class Node:
    """One scheduler node after fusion: a generated kernel or a library call."""

    graph: str  # "forward" | "backward"
    kind: str  # "generated" | "library" | "view" (no kernel: a reinterpretation)
    name: str  # the kernel's name (generated: `cpp_fused_<ops>`), or the library op
    ops: tuple[str, ...]  # the ATen ops fused into it (Inductor's origins), sorted
    read_bytes: int
    write_bytes: int
    reads: dict[str, int] = field(default_factory=dict)  # buffer -> bytes read
    writes: dict[str, int] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # buffer -> its dtype ("bfloat16", "complex64", ...)


@dataclass
class Extraction:
    cfg: BlockConfig
    nodes: list[Node]
    saved: list[tuple[str, tuple[int, ...], str]]  # the backward graph's inputs (name, shape, dtype) but tangents
    graphs: int  # Dynamo graphs (1: no graph break)
    eager_saved_bytes: int = 0  # what eager autograd keeps for the same block (saved_tensors_hooks)
    compiled_saved_bytes: int = 0  # what the compiled block's autograd Function keeps, seen the same way
    inputs: dict[str, dict[str, int]] = field(default_factory=dict)  # graph -> its inputs' bytes
    outputs: dict[str, list[str]] = field(default_factory=dict)  # graph -> its output buffers

    def kernels(self, graph: str) -> list[Node]:
        """The kernels `graph` launches: generated ones and library calls, not views."""
        return [n for n in self.nodes if n.graph == graph and n.kind != "view"]

    def saved_bytes(self, *, activations_only: bool = True) -> int:
        """Bytes of the partitioner's saved set; `activations_only`: less the block's input and
        parameters (the forward graph's `primals`), which FSDP and the previous block own."""
        total = 0
        for name, shape, dtype in self.saved:
            if activations_only and name.startswith("primals"):
                continue
            total += math.prod(shape) * _dtype_size(dtype)
        return total

    def transient(self, graph: str) -> tuple[int, int]:
        """(peak, end): the graph's peak of live buffers above what it starts with, and the level it
        ends at (what it returns: the forward's output and saved set, the backward's gradients),
        Inductor's schedule played in
        order: each kernel's outputs allocated when it runs, a buffer freed after its last reader unless
        the graph returns it, an input of the backward (a saved tensor) freed after its last reader too
        (the compiled backward takes them boxed and drops each once dead)."""
        from fsdp_sim.workload.compiled_block import walk_schedule

        rows = [(n.graph, n.kind, n.name, tuple((b, b) for b in n.reads), tuple((b, b) for b in n.writes))
                for n in self.nodes if n.graph == graph]
        sizes = {b: v for n in self.nodes if n.graph == graph for b, v in {**n.reads, **n.writes}.items()}
        # the backward starts with its inputs (saved tensors, the output's gradient) and drops them as it goes
        start = {k: v for k, v in self.inputs.get(graph, {}).items() if not k.startswith("primals")} \
            if graph == "backward" else {}
        peak, end, _ = walk_schedule(rows, graph, sizes | start, start, set(self.outputs.get(graph, [])))
        return peak, end


# `aten.cat` (rotate_half's `cat((-x2, x1))`): Inductor's `cat` lowering (torch/_inductor/lowering.py, 2.13
# wheel) always makes a ConcatKernel on the CPU ("negative performance impact of pointwise_cat ... on CPU"),
# which materialises the rotated copy in two half-writes; on CUDA it takes `pointwise_cat` when the inputs
# are pointwise or views with a single consumer and every use is pointwise -- rotate_half's `-x2` and
# `x1` feed only the cat and it feeds only `* sin` -- so the slices, negation, concatenation and both
# multiplies fuse into one kernel per q and k. The extraction forces that choice
# (`config.force_pointwise_cat`), as CUDA's rule makes it here; no other block here has a cat.
CUDA_CAT = True

VIEW_OPS = ("view_as_complex", "view_as_real", "reshape", "_conj", "view", "permute", "expand", "squeeze",
            "unsqueeze", "transpose", "alias")  # a library call that only reinterprets: no kernel on CUDA


def _dtype_size(name: str) -> int:
    return getattr(torch, name).itemsize


def _origins(node) -> tuple[str, ...]:
    ops = set()
    for sn in node.get_nodes():
        for o in getattr(sn.node, "origins", ()) or ():
            if o.op == "call_function":
                ops.add(str(getattr(o.target, "__name__", o.target)).split(".")[0])
    return tuple(sorted(ops))


def _record(scheduler, graph: str, out: list[Node]) -> None:
    from torch._inductor import scheduler as sch

    from torch._inductor import ir

    by_buffer: dict[str, Node] = {}
    for node in scheduler.nodes:
        if isinstance(node, sch.ExternKernelSchedulerNode) and isinstance(node.node, ir.MultiOutput):
            # one output of a multi-output library call (SDPA's out, logsumexp, ...): that call's write
            _, writes = _extern_bytes(node)
            parent = by_buffer[node.node.inputs[0].get_name()]
            parent.writes.update(writes)
            parent.write_bytes = sum(parent.writes.values())
            parent.dtypes.update({b: _buffer_dtype(b) for b in writes})
            for w in writes:
                by_buffer[w] = parent
            continue
        if isinstance(node, sch.NopKernelSchedulerNode):
            kind, name = "view", "nop"
        elif isinstance(node, sch.ExternKernelSchedulerNode):
            kind = "library"
            op = getattr(node.node, "op_overload", None) or getattr(node.node, "python_kernel_name", None)
            name = str(op or type(node.node).__name__)
            if name.split(".")[1:2] and name.split(".")[1] in VIEW_OPS:
                kind = "view"
        else:
            kind, name = "generated", "fused_" + "_".join(_origins(node))[:120]
        reads = node.get_read_write_buffer_accesses(include_reads=True, include_writes=False)
        writes = node.get_read_write_buffer_accesses(include_reads=False, include_writes=True)
        if kind != "generated":  # Inductor does not count an extern kernel's bytes (it takes 1e9 elements)
            reads, writes = _extern_bytes(node)
        out.append(Node(graph, kind, name, _origins(node), sum(reads.values()), sum(writes.values()),
                        dict(reads), dict(writes), {b: _buffer_dtype(b) for b in {**reads, **writes}}))
        for b in node.get_outputs():
            by_buffer[b.get_name()] = out[-1]


def _buffer_dtype(name: str) -> str:
    from torch._inductor.virtualized import V

    try:
        return str(V.graph.get_dtype(name)).replace("torch.", "")
    except (KeyError, AttributeError):
        return "?"


def _extern_bytes(node) -> tuple[dict[str, int], dict[str, int]]:
    """An extern kernel's inputs and outputs, each whole: what a library call reads and writes."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    def size(buf) -> int:
        layout = buf.get_layout()
        numel = V.graph.sizevars.optimization_hint(math.prod(layout.size), fallback=0) if layout.size else 1
        return int(numel) * layout.dtype.itemsize

    reads = {}
    for inp in getattr(node.node, "inputs", ()) or ():
        for b in inp if isinstance(inp, (list, tuple)) else (inp,):
            if hasattr(b, "get_layout") and not isinstance(getattr(b, "layout", None), ir.MultiOutputLayout):
                reads[b.get_name()] = size(b)
    writes = {b.get_name(): size(b.node) for b in node.get_outputs()
              if not isinstance(b.node.layout, ir.MultiOutputLayout)}
    return reads, writes


def extract(cfg: BlockConfig = BlockConfig()) -> Extraction:
    """Compile `LlamaBlock(cfg)` as torchtitan does (fullgraph, default mode), run forward and backward
    once, and read Inductor's scheduler nodes of both graphs and the partitioner's saved set."""
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor import scheduler as sch
    from torch._inductor.virtualized import V

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = LlamaBlock(cfg).to(torch_dtype(cfg.dtype))
    x = torch.randn(cfg.batch, cfg.seq, cfg.hidden, dtype=torch_dtype(cfg.dtype), requires_grad=True)
    rope = rope_table(cfg)
    nodes: list[Node] = []
    saved: list = []
    graphs = []
    inputs: dict = {}
    outputs: dict = {}
    original = sch.Scheduler.codegen

    def codegen(self):
        graph = "backward" if V.graph.is_backward else "forward"
        _record(self, graph, nodes)
        inputs[graph] = {name: _size(box) for name, box in V.graph.graph_inputs.items() if hasattr(box, "get_size")}
        outputs[graph] = V.graph.get_output_names()
        if V.graph.is_backward:
            for n in V.graph.graph.nodes:
                if n.op == "placeholder" and not n.name.startswith("tangents"):
                    v = n.meta.get("val")
                    saved.append((n.name, tuple(int(d) for d in v.shape), str(v.dtype).replace("torch.", "")))
        return original(self)

    def count_graphs(gm, example_inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    sch.Scheduler.codegen = codegen
    try:  # no cache: a cached graph is not scheduled again; `aten.cat` lowered as on CUDA (CUDA_CAT)
        with torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False, force_pointwise_cat=CUDA_CAT), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(block, backend=count_graphs, fullgraph=True)
            compiled(x, rope).sum().backward()
            compiled_saved = _eager_saved_bytes(compiled, x, rope)
    finally:
        sch.Scheduler.codegen = original
    return Extraction(cfg, nodes, saved, len(graphs), _eager_saved_bytes(block, x, rope), compiled_saved, inputs, outputs)


def _size(box) -> int:
    from torch._inductor.virtualized import V

    size = box.get_size()
    numel = V.graph.sizevars.optimization_hint(math.prod(size), fallback=0) if size else 1
    return int(numel) * box.get_dtype().itemsize


def _eager_saved_bytes(block, x, rope) -> int:
    """Bytes autograd keeps for the block's backward, each storage once, the input and the parameters
    and the rotary table excluded (what fsdp-sim's `saved_bytes` counts), seen by `saved_tensors_hooks`: eager autograd's
    saves, or for a compiled block what AOTAutograd's Function saves (its `save_for_backward`)."""
    tables = rope if isinstance(rope, tuple) else (rope,) if rope is not None else ()  # the model's, not the block's
    skip = {t.untyped_storage().data_ptr() for t in (x, *tables)} | {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, rope)
    return sum(seen.values())
