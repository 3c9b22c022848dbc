"""The step's op graph for a scenario's runtime, and a sweep's shortcut: the last graph re-sized and re-priced,
when only what its modules allocate and compute has changed.

Neighbouring points of a sweep (sweep.py `dispatch_order`) often differ only in their tokens: micro-batch
2 x 1024 tokens after 1 x 2048, or 1 x 4096 after 1 x 2048, same settings. Every branch a runtime takes is
then the same, and only two kinds of value differ:
- what each module pass computes (attention is quadratic in the sequence): the modules' `COMPUTE_FIELDS`,
  which the runtimes read in one place, `autograd.module_work`, for one compute op per module pass
  (`OpGraph.compute_sites`);
- what it allocates from the modules' bytes (`SIZE_FIELDS`) and the batch's: sized in
  `autograd.forward_bytes` / `backward_bytes` and `Workload.input_bytes`, each allocation recorded where it
  is made (`OpGraph.memory_sites`).
No other read of those fields decides anything. So when a workload's other fields, its checkpoint plans,
the units and the settings equal the last build's, the last graph with those ops and buffers made again is
the graph a build would give, provided each pass allocates the same buffers (none sized zero where the last
had one: a branch). tests/test_build.py compares the two op by op over every shipped scenario and random
setups. A re-priced graph costs 0.1 ms and a re-sized one about 0.5 ms, against 2 to 3 ms for a build.

Settings under which other ops read those bytes (save_on_cpu's copies, FSDP2's output casts and the loss
they change) keep the bytes in the key: their graphs are only re-priced. Not reused at all: plain training
(its autocast rewrites the workload it reads, `plain.fp32_residual_stream`) and tensor parallelism (its
split of a pass around TP collectives reads the kernels, `tp.py`).

What the twins share, and why that is safe. A re-sized or re-priced graph is `OpGraph.with_ops` of the last
one: new op and buffer objects where bytes or work changed, everything else shared by reference (the memory
columns and sites, read-only once a graph is built). Each op keeps its id, kind, stream, group, phase, deps
and buffer id, so what only that structure decides is the same for both: the engine's stream queues, the
ledger's event columns, the compute stream's order. `OpGraph.derived` computes those once per build and
hands them to every twin, dated by the op count so that a graph that grew derives them anew. Nothing that
reads bytes or durations is shared: each twin is priced, played and replayed on its own.
"""

from __future__ import annotations

import threading
from dataclasses import fields

from fsdp_sim.dtypes import itemsize
from fsdp_sim.schedule.autograd import backward_bytes, forward_bytes, module_work
from fsdp_sim.schedule.fsdp1 import build_fsdp1_step
from fsdp_sim.schedule.fsdp2 import build_fsdp2_step
from fsdp_sim.schedule.ops import Buffer, OpGraph
from fsdp_sim.schedule.plain import build_plain_step
from fsdp_sim.schedule.settings import FSDPSettings
from fsdp_sim.workload.checkpointing import checkpoint_plans
from fsdp_sim.workload.model import Module, Workload, derived
from fsdp_sim.wrap import Unit

# no FSDP (one GPU) | FullyShardedDataParallel | fully_shard, by `FSDPSettings.version`
BUILDERS = {0: build_plain_step, 1: build_fsdp1_step, 2: build_fsdp2_step}

# what `module_work` reads from a module, and what `forward_bytes` / `backward_bytes` size buffers from; the
# rest of a module is what a build's branches read
COMPUTE_FIELDS = frozenset({"kernels", "fwd_flops", "bwd_flops", "fwd_hbm_bytes", "fwd_time_s", "bwd_time_s"})
SIZE_FIELDS = frozenset({"saved_bytes", "fwd_temp_bytes", "bwd_temp_bytes", "bwd_tail_bytes", "nosave_fwd_peak_bytes",
                         "output_bytes"})
_MODULE_VIEW = tuple(f.name for f in fields(Module) if f.name not in COMPUTE_FIELDS | SIZE_FIELDS)
_SIZES = tuple(sorted(SIZE_FIELDS))
# a workload's fields no FSDP runtime reads: its name, the FLOPs the results count, `meta` and `tokens` (only
# the TP split reads them); `input_bytes` sizes the batch (a memory site); its modules are compared by views
_UNREAD = frozenset({"name", "model_flops", "meta", "tokens", "modules", "input_bytes"})
_WORKLOAD_VIEW = tuple(f.name for f in fields(Workload) if f.name not in _UNREAD)

_last = threading.local()  # this thread's last builds, by micro-batch count: {count: (key, graph)}; Dask may use threads
# a folded step (results/folded.py) builds two graphs per point, of two and three micro-batches: one kept of each,
# so that the next point's pair is made from this one's instead of each from the other's, which never matches
MAX_LAST = 2


def build_step(workload: Workload, units: list[Unit], settings: FSDPSettings) -> OpGraph:
    """The op graph of one training step of `workload` wrapped as `units` under `settings`' runtime."""
    build = BUILDERS[settings.version]
    if settings.version == 0 or settings.tp > 1:
        return build(workload, units, settings)
    fixed = _bytes_read_elsewhere(settings)
    key = (settings, units, _view(workload, fixed), _plans_view(workload, settings, fixed))
    entries = _last.__dict__.setdefault("entries", {})
    count = settings.grad_accumulation
    last = entries.get(count)
    if last is not None and last[0] == key:
        graph = _rebuilt(last, workload, settings, resize=not fixed)
        if graph is not None:
            return graph
    graph = build(workload, units, settings)
    entries.pop(count, None)
    if graph.compute_sites is not None:
        if len(entries) >= MAX_LAST:
            del entries[next(iter(entries))]  # the oldest
        entries[count] = (key, graph)
    return graph


def _bytes_read_elsewhere(settings: FSDPSettings) -> bool:
    """Whether ops other than the memory sites read activation bytes: save_on_cpu's copies and host memory
    (offload.py), FSDP2's output casts (and the loss, which skips its upcast of fp32 logits: walk.py)."""
    return settings.activation_offload or settings.output_dtype is not None or bool(settings.unit_output_dtype)


def _view(workload: Workload, with_sizes: bool) -> tuple:
    """What a build reads of `workload` but its modules' compute and, unless `with_sizes`, the bytes it sizes
    buffers from (remembered for the workload)."""
    def view() -> tuple:
        names = _MODULE_VIEW + (_SIZES if with_sizes else ())
        modules = tuple(tuple(getattr(m, f) for f in names) for m in workload.modules)
        return tuple(getattr(workload, f) for f in _WORKLOAD_VIEW) + (modules,) + (
            (workload.input_bytes,) if with_sizes else ())
    return derived(workload, ("build view", with_sizes), view)


def _plans_view(workload: Workload, settings: FSDPSettings, with_sizes: bool) -> tuple:
    """The checkpointed blocks and, with `with_sizes`, their plans' bytes (`forward_bytes` sizes from them;
    their recompute kernels are `module_work`'s)."""
    plans = checkpoint_plans(workload, settings.ac_mode, settings.ac_every)
    if with_sizes:
        return tuple((name, ck.cache_bytes, ck.shared_bytes) for name, ck in plans.items())
    return tuple(plans)


def _rebuilt(last: tuple, workload: Workload, settings: FSDPSettings, *, resize: bool) -> OpGraph | None:
    """The last build's graph with each module pass's compute op made again from `workload`'s module
    (`module_work`) and, with `resize`, each buffer a memory site sized made again at its new size; None
    when a pass would allocate other buffers than it did (a size that is now zero, or no longer)."""
    graph = last[1]
    modules = {m.name: m for m in workload.modules}
    plans = checkpoint_plans(workload, settings.ac_mode, settings.ac_every)
    compute_bytes, activation_bytes = settings.param_bytes, itemsize(workload.activation_dtype)
    ops, buffers, memory_bytes = list(graph.ops), graph.buffers, graph.memory_bytes
    if resize:
        sizes = _new_sizes(graph, workload, modules, plans, compute_bytes, activation_bytes)
        if sizes is None:
            return None
        if sizes:
            events = graph.derived("events by buffer", lambda: _events_by_buffer(graph))
            buffers, memory_bytes = list(buffers), list(memory_bytes)
            for b, nbytes in sizes.items():
                old = buffers[b]
                new = buffers[b] = Buffer(old.id, old.name, old.category, nbytes, old.unit)
                for k, i, sign in events[b]:
                    ops[i] = ops[i].with_buffer(new)
                    memory_bytes[k] = sign * nbytes
    for i, name, kernel_pass in graph.compute_sites:
        ops[i] = ops[i].with_work(*module_work(modules[name], plans.get(name), kernel_pass, compute_bytes,
                                               activation_bytes))
    return graph.with_ops(ops, buffers, memory_bytes)


def _new_sizes(graph: OpGraph, workload: Workload, modules: dict[str, Module], plans: dict, compute_bytes: int,
               activation_bytes: int) -> dict[int, int] | None:
    """{buffer id: its new bytes} for each memory site's buffer whose size changes; None when a site would
    allocate other buffers."""
    changed = {}
    for kind, module, prev, ids in graph.memory_sites:
        if kind == "inputs":
            sizes = (workload.input_bytes,)
        elif kind == "backward":
            sizes = backward_bytes(modules[module], modules[prev] if prev else None, compute_bytes, activation_bytes)
        else:
            sizes = forward_bytes(modules[module], plans.get(module), kind == "recompute", compute_bytes,
                                  activation_bytes)
        if len(sizes) != len(ids):
            return None
        for b, nbytes in zip(ids, sizes):
            if (b is None) != (nbytes is None):
                return None
            if b is not None and graph.buffers[b].nbytes != nbytes:
                changed[b] = int(nbytes)
    return changed


def _events_by_buffer(graph: OpGraph) -> dict[int, list[tuple[int, int, int]]]:
    """Each buffer's alloc and free as (index among the graph's memory events, op id, +1 alloc / -1 free)."""
    events: dict[int, list[tuple[int, int, int]]] = {}
    for k, (b, i) in enumerate(zip(graph.memory_buffers, graph.memory_ops)):
        events.setdefault(b, []).append((k, i, 1 if graph.ops[i].kind == "alloc" else -1))
    return events
