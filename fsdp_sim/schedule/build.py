"""The step's op graph for a scenario's runtime, and a sweep's shortcut: the last graph re-priced, when only
what its modules compute has changed.

Neighbouring points of a sweep (sweep.py `dispatch_order`) often differ only in how a micro-batch's tokens
are split: micro-batch 2 x 1024 tokens against 1 x 2048. Every byte the step allocates is then the same, and
so is every branch a runtime takes; only what each module pass computes differs (attention is quadratic in
the sequence). The runtimes read those values (the modules' `COMPUTE_FIELDS`) in one place,
`autograd.module_work`, for one compute op per module pass (`OpGraph.compute_sites`), and no branch of a
build reads them. So when a workload's other fields, its checkpoint plans' bytes, the units and the settings
equal the last build's, the last graph with those ops made again from the new modules is the graph a build
would give (tests/test_build.py compares them op by op over a grid). On the 10,000-point llama3-8b grid
that is 38 % of the points in a sweep's order; a re-priced graph costs 0.1 ms, a build 2 to 3 ms.

Not reused: plain training (its autocast rewrites the workload it reads, `plain.fp32_residual_stream`) and
tensor parallelism (its split of a pass around TP collectives reads the kernels, `tp.py`).
"""

from __future__ import annotations

import threading
from dataclasses import fields

from fsdp_sim.dtypes import itemsize
from fsdp_sim.schedule.autograd import module_work
from fsdp_sim.schedule.fsdp1 import build_fsdp1_step
from fsdp_sim.schedule.fsdp2 import build_fsdp2_step
from fsdp_sim.schedule.ops import OpGraph
from fsdp_sim.schedule.plain import build_plain_step
from fsdp_sim.schedule.settings import FSDPSettings
from fsdp_sim.workload.checkpointing import checkpoint_plans
from fsdp_sim.workload.model import Module, Workload, derived
from fsdp_sim.wrap import Unit

# no FSDP (one GPU) | FullyShardedDataParallel | fully_shard, by `FSDPSettings.version`
BUILDERS = {0: build_plain_step, 1: build_fsdp1_step, 2: build_fsdp2_step}

# what `module_work` reads from a module: the rest of a module is what a build's branches and bytes read
COMPUTE_FIELDS = frozenset({"kernels", "fwd_flops", "bwd_flops", "fwd_hbm_bytes", "fwd_time_s", "bwd_time_s"})
_MODULE_VIEW = tuple(f.name for f in fields(Module) if f.name not in COMPUTE_FIELDS)
# a workload's fields no FSDP runtime reads: its name, the FLOPs the results count, `meta` (only the TP split
# reads it); its modules are compared by their views
_UNREAD = frozenset({"name", "model_flops", "meta", "modules"})
_WORKLOAD_VIEW = tuple(f.name for f in fields(Workload) if f.name not in _UNREAD)

_last = threading.local()  # this thread's last build: (key, graph); a Dask worker may run points in threads


def build_step(workload: Workload, units: list[Unit], settings: FSDPSettings) -> OpGraph:
    """The op graph of one training step of `workload` wrapped as `units` under `settings`' runtime."""
    build = BUILDERS[settings.version]
    if settings.version == 0 or settings.tp > 1:
        return build(workload, units, settings)
    key = (settings, units, _view(workload), _plans_view(workload, settings))
    last = getattr(_last, "entry", None)
    if last is not None and last[0] == key:
        return _repriced(last[1], workload, settings)
    graph = build(workload, units, settings)
    _last.entry = (key, graph) if graph.compute_sites is not None else None
    return graph


def _view(workload: Workload) -> tuple:
    """What a build reads of `workload` but its modules' compute (remembered for the workload)."""
    def view() -> tuple:
        modules = tuple(tuple(getattr(m, f) for f in _MODULE_VIEW) for m in workload.modules)
        return tuple(getattr(workload, f) for f in _WORKLOAD_VIEW) + (modules,)
    return derived(workload, "build view", view)


def _plans_view(workload: Workload, settings: FSDPSettings) -> tuple:
    """The bytes of the checkpoint plans a build reads (their recompute kernels are `module_work`'s)."""
    plans = checkpoint_plans(workload, settings.ac_mode, settings.ac_every)
    return tuple((name, ck.cache_bytes, ck.shared_bytes) for name, ck in plans.items())


def _repriced(graph: OpGraph, workload: Workload, settings: FSDPSettings) -> OpGraph:
    """`graph` with the compute op of each module pass made again from `workload`'s module (`module_work`)."""
    modules = {m.name: m for m in workload.modules}
    plans = checkpoint_plans(workload, settings.ac_mode, settings.ac_every)
    compute_bytes, activation_bytes = settings.param_bytes, itemsize(workload.activation_dtype)
    ops = list(graph.ops)
    for i, name, kernel_pass in graph.compute_sites:
        ops[i] = ops[i].with_work(*module_work(modules[name], plans.get(name), kernel_pass, compute_bytes,
                                               activation_bytes))
    return graph.with_ops(ops)
