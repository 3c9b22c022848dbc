"""From the op timings and the memory ledger to the numbers a user asks for.

Allocated = bytes of live tensors in issue order (what `torch.cuda.max_memory_allocated` reports).
Reserved = what the caching allocator model predicts it holds from the driver in the steady state
(engine/allocator.py, engine/reserved.py); reserved - allocated is memory it keeps cached, not allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from collections.abc import Callable

from fsdp_sim.engine import MemoryTrace, Timing
from fsdp_sim.engine.reserved import CappedReplay
from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.kernels import KernelTimes, select_sdpa_backend
from fsdp_sim.hardware.software import nccl_buffer_bytes, nccl_version, stack
from fsdp_sim.hardware.topology import job_nic_homes
from fsdp_sim.hardware.variation import pace_factor, paced_by, weakest_nic_node
from fsdp_sim.scenario import Scenario
from fsdp_sim.schedule.ops import CATEGORIES, COLLECTIVES, Op, OpGraph
from fsdp_sim.schedule.settings import post_forward_group
from fsdp_sim.schedule.tp import tp_pricing
from fsdp_sim.deepspeed_words import ZERO_NOTES
from fsdp_sim.results.host import host_memory
from fsdp_sim.schedule.param_dtypes import unit_bytes
from fsdp_sim.workload.frozen import trainable_counts

Intervals = tuple[np.ndarray, np.ndarray]  # sorted disjoint intervals: their starts, their ends


def _merge(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    """The union of the intervals [starts[i], ends[i]] as sorted disjoint intervals: empty ones dropped,
    overlapping or touching ones joined. In numpy (a fifth of the time of a sort-and-walk in Python); only
    comparisons, so the figures are those of the walk."""
    keep = ends > starts
    a, b = starts[keep], ends[keep]
    if not len(a):
        return a, b
    order = np.lexsort((b, a))  # by start, then end: the order `sorted` gives the pairs
    a, b = a[order], b[order]
    reach = np.maximum.accumulate(b)  # the end of the union so far
    first = np.empty(len(a), dtype=bool)  # an interval starting past that reach begins a new piece
    first[0] = True
    np.greater(a[1:], reach[:-1], out=first[1:])
    last = np.append(first[1:], True)
    return a[first], reach[last]


def _stream_order(ops: list[Op]) -> tuple[np.ndarray, ...]:
    """What `StepResult._activity` reads of a step's structure (remembered per build: `OpGraph.derived`):
    the compute stream's ops in order but the collectives queued there (the ops it reaches: allocs, frees
    and kernels), its kernels, every collective, and of the ops of that order waiting on events, their
    positions, the events' ids flattened and where each op's start (`np.maximum.reduceat`'s offsets)."""
    chain, kernels, collectives, with_deps, deps, firsts = [], [], [], [], [], []
    for op in ops:
        kind = op.kind
        if kind in COLLECTIVES:  # queued on the compute stream, a collective is communication all the same
            collectives.append(op.id)
            continue
        if op.stream != "compute":
            continue
        if kind != "alloc" and kind != "free":
            kernels.append(op.id)
        if op.deps:
            with_deps.append(len(chain))
            firsts.append(len(deps))
            deps.extend(op.deps)
        chain.append(op.id)
    arrays = tuple(np.array(x, dtype=np.intp) for x in (chain, kernels, collectives, with_deps, deps, firsts))
    for array in arrays:
        array.flags.writeable = False
    return arrays


def _length(intervals: Intervals) -> float:
    starts, ends = intervals
    return sum((ends - starts).tolist())  # added in order, as a walk over the pairs adds (0, an int, when none)


def _intersection(a: Intervals, b: Intervals) -> float:
    """Length of the overlap of two merged interval lists: the pieces of the pairs that overlap, added in the
    order a two-pointer walk over both lists meets them (by a's interval, then b's). Each interval of a
    overlaps the run of b's from the first that ends after it starts to the last that starts before it ends
    (disjoint sorted lists: those runs are found by `searchsorted` and are in both lists' order)."""
    (a_start, a_end), (b_start, b_end) = a, b
    first = np.searchsorted(b_end, a_start, side="right")  # the first of b's ending after a's start
    stop = np.searchsorted(b_start, a_end, side="left")  # past the last of b's starting before a's end
    counts = stop - first  # never negative: b's before `first` end, so start, before a's start
    if not counts.any():
        return 0.0
    i = np.repeat(np.arange(len(a_start)), counts)
    j = np.arange(len(i)) + np.repeat(first - (np.cumsum(counts) - counts), counts)
    pieces = np.minimum(a_end[i], b_end[j]) - np.maximum(a_start[i], b_start[j])  # each > 0
    return sum(pieces.tolist(), 0.0)


@dataclass(slots=True)
class StepResult:
    """Everything one simulated step produced, and the figures derived from it."""

    scenario: Scenario
    graph: OpGraph
    timing: Timing
    memory: MemoryTrace
    alone_s: Callable[[Op], KernelTimes]  # a compute-stream op's GPU time by class when it runs alone
    alone_duration: Callable[[Op], float]  # any timed op's duration alone (no interference)
    collective_pricing: dict | None = None  # priced on the topology graph (OpCosts.pricing); None: closed forms
    _activity_cache: tuple | None = field(default=None, init=False, repr=False)

    # ---- time ------------------------------------------------------------------------
    @property
    def step_time_s(self) -> float:
        return self.timing.makespan

    def _activity(self) -> tuple[Intervals, np.ndarray, np.ndarray, float]:
        """(merged compute-stream kernel intervals, the collectives' ids, the compute-stream kernels' ids,
        seconds the compute stream idled for the CPU): all a sweep row needs, from the step's `_stream_order`
        and its times in numpy. `communication()` and `compute()` walk the collectives and kernels' ops for
        what only a full result shows (bytes moved, exposure by kind, time by cause).

        The compute stream idled for the CPU where an op was ready (the stream done with the op before it,
        its events done) before the CPU issued it: it starts at its issue time, so that wait is its start
        less the time it was ready."""
        if self._activity_cache is None:
            timing = self.timing
            chain, kernels, collectives, with_deps, deps, firsts = self.graph.derived(
                "stream order", lambda: _stream_order(self.graph.ops))
            ready = np.empty(len(chain))  # when the stream was done with the op before
            if len(chain):
                ready[0] = 0.0
                ready[1:] = timing.end[chain[:-1]]
            if len(with_deps):
                ready[with_deps] = np.maximum(ready[with_deps], np.maximum.reduceat(timing.end[deps], firsts))
            idle = timing.issued[chain] > ready
            cpu_bound = sum((timing.start[chain][idle] - ready[idle]).tolist(), 0.0)  # in stream order, as a loop adds
            self._activity_cache = (_merge(timing.start[kernels], timing.end[kernels]), collectives, kernels, cpu_bound)
        return self._activity_cache

    def _union(self, ids: np.ndarray) -> Intervals:
        """The merged intervals the ops `ids` run in."""
        return _merge(self.timing.start[ids], self.timing.end[ids])

    def _exposure(self) -> tuple[float, float]:
        """(seconds some collective runs while no compute-stream kernel does, seconds some collective runs)."""
        busy, collectives, _, _ = self._activity()
        comm = self._union(collectives)
        active = _length(comm)
        return max(0.0, active - _intersection(comm, busy)), active

    def exposed_communication(self) -> tuple[float, float]:
        """(seconds some collective runs while no compute-stream kernel does, the share of the time some
        collective runs that compute runs too): `communication()`'s exposed_s and overlap_fraction."""
        exposed, active = self._exposure()
        exposed = max(0.0, exposed)
        return exposed, min(1.0, max(0.0, 1 - exposed / active)) if active > 0 else 1.0

    def communication(self) -> dict:
        busy, collectives, _, _ = self._activity()
        s = self.scenario.settings
        ring = {"shard": (s.shard_size - 1) / s.shard_size,
                "replicate": 2 * (s.replicate_size - 1) / s.replicate_size}
        ring |= {post_forward_group(k): (k - 1) / k for k in s.post_forward_sizes}  # hpZ all-gathers
        ring |= tp_pricing(s, self.scenario.cluster).get("ring_factors", {})  # the TP group's (schedule/tp.py)
        by_kind: dict[str, list[Op]] = {k: [] for k in COLLECTIVES}
        moved = {k: 0.0 for k in COLLECTIVES}
        for op in map(self.graph.ops.__getitem__, collectives.tolist()):
            by_kind[op.kind].append(op)
            moved[op.kind] += op.comm_bytes * ring[op.group]
        start, end = self.timing.start.tolist(), self.timing.end.tolist()
        total = sum(end[op.id] - start[op.id] for ops in by_kind.values() for op in ops)
        exposed, overlap = self.exposed_communication()
        exposed_by_kind = {}
        for kind, ops in by_kind.items():
            merged = self._union(np.array([op.id for op in ops], dtype=np.intp))
            exposed_by_kind[kind] = max(0.0, _length(merged) - _intersection(merged, busy))
        return {"all_gather_bytes": int(moved["all_gather"]), "reduce_scatter_bytes": int(moved["reduce_scatter"]),
                "all_reduce_bytes": int(moved["all_reduce"]), "total_s": total, "exposed_s": exposed,
                "exposed_by_collective_s": exposed_by_kind, "overlap_fraction": overlap}

    def pace_factor(self) -> float:
        """The factor the representative rank's compute-bound kernels were slowed by (hardware/variation.py)."""
        c = self.scenario.cluster
        return pace_factor(self.scenario.variation, c.world_size, c.gpus_per_node)

    def variation_facts(self) -> dict:
        """The `hardware` keys on variation and faults, each only when it applies (a plain scenario's JSON is
        unchanged): `paced_by`, what sets the paced compute (a named rank or node, or the spread); `variation`,
        the stragglers, slow nodes and NICs named, with the node whose NICs keep the least; and
        `collective_pricing`, present when the topology graph priced the collectives (absent: closed forms)."""
        sc = self.scenario
        var, world = sc.variation, sc.cluster.world_size
        named = var.named()
        if var.links and sc.cluster.nodes > 1:  # among the NICs beside the job's GPUs: the only ones its rings use
            c = sc.cluster
            used = [j for j, home in enumerate(job_nic_homes(c.fabric.gpus_per_node, c.gpus_per_node,
                                                             c.fabric.network.nics_per_node)) if home]
            weakest = weakest_nic_node(tuple(f for f in var.links if f.nic in used), len(used))
            named |= {"weakest_nic_node": weakest} if weakest else {}
        paced = (var.stragglers or var.nodes) and self.pace_factor() != 1  # --per-rank paces nothing
        pacer = {"paced_by": paced_by(var, world, sc.cluster.gpus_per_node)} if paced else {}
        return pacer | ({"variation": named} if named else {}) \
            | ({"collective_pricing": self.collective_pricing} if self.collective_pricing else {})

    def _model_flops(self) -> float:
        return self.scenario.workload.model_flops * self.scenario.settings.grad_accumulation

    def mfu(self) -> float:
        """Model FLOPs utilisation: see `compute()`."""
        sc = self.scenario
        peak = sc.cluster.gpu.matmul_peak(sc.settings.param_dtype, sc.compute.allow_tf32)
        flops = self._model_flops()
        mfu = flops / (self.step_time_s * peak) if self.step_time_s > 0 else 0.0
        if mfu > 1 + 1e-9:  # cannot be true: FLOPs no kernel was priced for, or measured times faster than peak
            raise ScenarioError(f"model: {flops:.3g} model FLOPs in a {self.step_time_s * 1e3:.3g} ms step would be "
                                f"an MFU of {100 * mfu:.0f} % on {sc.cluster.gpu.name}; the workload's model_flops "
                                "exceed what its modules' kernels and times run")
        return min(mfu, 1.0)

    def cpu_bound_s(self) -> float:
        """Seconds the compute stream idled for the CPU: ready (stream free, events done), not yet issued."""
        return self._activity()[3]

    def compute(self) -> dict:
        """Busy time, the step's compute-stream time by cause, and MFU.

        MFU counts what the time model counts (`Workload.model_flops`: the kernels of one forward and
        backward, causal attention at half the scores, no recompute) against the peak of the rate the
        matmuls run at, so it cannot pass 1 while every kernel runs at or below its peak.
        """
        busy, _, kernels, cpu_bound = self._activity()
        mfu = self.mfu()
        start, end = self.timing.start.tolist(), self.timing.end.tolist()
        matmul = attention = memory = interference = 0.0
        for op in map(self.graph.ops.__getitem__, kernels.tolist()):
            i = op.id
            t = self.alone_s(op)
            matmul += t.matmul
            attention += t.attention
            memory += t.memory
            interference += max(0.0, end[i] - start[i] - t.total)
        return {"busy_s": _length(busy), "mfu": mfu, "model_flops": self._model_flops(),
                "breakdown": {"matmul_s": matmul, "attention_s": attention, "memory_bound_s": memory,
                              "interference_s": interference, "cpu_bound_s": cpu_bound}}

    def throughput(self) -> dict:
        sc = self.scenario
        per_rank = sc.workload.tokens * sc.settings.grad_accumulation
        per_step = per_rank * sc.settings.replicate_size * sc.settings.shard_size
        step = self.step_time_s
        return {"tokens_per_step": per_step, "tokens_per_s": per_step / step if step > 0 else 0.0,
                "tokens_per_s_per_gpu": per_rank / sc.settings.tp / step if step > 0 else 0.0}  # a TP group shares its batch

    # ---- memory ------------------------------------------------------------------------
    @property
    def peak_row(self) -> int:
        return int(np.argmax(self.memory.total))

    def peak(self, top: int = 10) -> dict:
        row = self.peak_row
        levels = self.memory.levels[row]
        allocated = int(levels.sum())
        op = self.memory.op_at(row)
        reserved = self.memory.reserved_bytes
        by_category = {c: int(v) for c, v in zip(CATEGORIES, levels)}  # sums to allocated; overheads: memory_summary
        live = sorted(self.memory.live_at(row), key=lambda b: (-b.nbytes, b.id))[:top]
        return {"allocated_bytes": allocated, "reserved_bytes": reserved, "time_s": float(self.memory.time[row]),
                "phase": op.phase if op else "before step", "unit": (op.unit or None) if op else None,
                "op": op.name if op else None, "by_category": by_category,
                "live_buffers": [{"name": b.name, "category": b.category, "bytes": b.nbytes, "unit": b.unit or None} for b in live]}

    def nccl_groups(self) -> dict[str, int]:
        """NCCL's buffers per process group the step's collectives run in (communicators are created at
        their first collective; HSDP has two, hpZ adds its post-forward groups): the profile's figure each."""
        # measured per PyTorch process group (profile comment), for the NCCL the run's torch ships
        nccl = nccl_buffer_bytes(self.scenario.cluster.gpu, nccl_version(self.scenario.compute.torch_version))
        ops = self.graph.ops  # the collectives' groups are the graph's structure: found once per build
        groups = self.graph.derived("collective groups", lambda: sorted({ops[i].group for i in self._activity()[1].tolist()}))
        return dict.fromkeys(groups, nccl)

    def allocator(self, peak: dict) -> dict:
        """The caching allocator model beside the peak: what it keeps cached, not allocated; per stream;
        what `empty_cache` would return after the step; the first step (no optimizer states before its
        optimizer step) beside the steady state."""
        model, config = self.memory.allocator, self.scenario.allocator
        first = self.memory.op_at(model.first_step_row)
        capped = self.capped_replay()
        split = {} if config.max_split_size is None else {"max_split_size_bytes": config.max_split_size}  # None: unlimited
        return {"expandable_segments": config.expandable_segments, **split,
                "limit_bytes": self.allocator_limit(), "out_of_memory": capped is not None and capped.oom,
                "reserved_under_limit_bytes": capped.reserved_bytes if capped else peak["reserved_bytes"],
                "retries_per_step": capped.retries_per_step if capped else 0, "retries": capped.retries if capped else 0,
                "steps_under_limit": capped.steps if capped else 0,
                "cached_not_allocated_bytes": peak["reserved_bytes"] - peak["allocated_bytes"],
                "reserved_by_stream_bytes": dict(model.by_stream), "empty_cache_releasable_bytes": model.releasable_bytes,
                "steps_to_steady_state": model.steps,
                "first_step": {"allocated_bytes": model.first_step_allocated_bytes,
                               "reserved_bytes": model.first_step_reserved_bytes,
                               "phase": first.phase if first else "before step"}}

    def allocator_limit(self) -> int:
        """What the GPU leaves the caching allocator, where cudaMalloc starts to refuse: capacity - CUDA
        context - NCCL buffers (the safety margin is advice, not a wall the allocator meets)."""
        gpu = self.scenario.cluster.gpu
        return gpu.memory_bytes - gpu.cuda_context_bytes - sum(self.nccl_groups().values())

    def _budget(self) -> int:
        return int(self.scenario.cluster.gpu.memory_bytes * (1 - self.scenario.safety_margin))  # whole bytes

    def capped_replay(self, limit: int | None = None) -> CappedReplay | None:
        """The allocator's steps replayed under `allocator_limit` (free-and-retry, engine/reserved.py; `limit`:
        that limit, when the caller has it), or None when the unconstrained reserved is within it: nothing
        would be refused, so both agree."""
        model = self.memory.allocator
        limit = self.allocator_limit() if limit is None else limit
        return model.capped(limit) if model.reserved_bytes > limit else None

    def memory_verdict(self, allocated: int, unconstrained: int) -> tuple[dict, int, CappedReplay | None]:
        """`memory_summary`'s verdict from the peak's allocated bytes and the unconstrained reserved bytes:
        ({required_bytes, fits, within_budget, headroom_bytes, knife_edge}, the reserved figure required
        counts, the capped replay that gave it or None); all a sweep row keeps of the memory."""
        gpu = self.scenario.cluster.gpu
        overhead = gpu.cuda_context_bytes + sum(self.nccl_groups().values())
        limit = self.allocator_limit()
        # allocated past the limit: the capped replay must run out of memory (its steady step holds the
        # same live blocks, each at least its request, and it replays that step unless it fails first),
        # so its verdict is known without playing it; `allocator()` still plays it for its own figures
        capped = self.capped_replay(limit) if allocated <= limit else None
        reserved = capped.reserved_bytes if capped and not capped.oom else unconstrained
        required = reserved + overhead
        budget = self._budget()  # whole bytes, so headroom = budget - required exactly
        # a knife edge: the live tensors fit the GPU, but what the allocator reserves with room to spare would
        # not, so its placement under the GPU's limit (release the cache and retry, or run out with the free
        # blocks too fragmented for a request: engine/allocator.py, as c10's malloc) decides the verdict
        knife_edge = allocated + overhead <= gpu.memory_bytes < unconstrained + overhead
        return ({"required_bytes": required, "fits": required <= gpu.memory_bytes, "within_budget": required <= budget,
                 "headroom_bytes": budget - required, "knife_edge": knife_edge}, reserved, capped)

    def memory_summary(self, peak: dict) -> dict:
        """Capacity, budget, required = reserved + CUDA context + NCCL per process group, fits (the step
        runs without an out-of-memory error: required <= capacity), within_budget (required <= budget, the
        capacity less the safety margin: the advice) and headroom = budget - required;
        reserved is the unconstrained figure unless it passes what the GPU leaves the allocator: then the
        replay under that limit decides (its peak reserved when it releases, retries and gets by; the
        unconstrained figure when it runs out of memory even so): `memory_verdict`;
        the overheads beside the peak's categories (`overheads_bytes`); the model state per rank
        (`persistent_bytes`: what persists across steps, plus the sharded gradients, held from their
        reduce-scatter to zero_grad; under FSDP2's CPUOffloadPolicy they live on the host, `host` says; FSDP1's
        CPUOffload keeps `_saved_grad_shard` on the GPU to the end of backward)."""
        gpu = self.scenario.cluster.gpu
        groups = self.nccl_groups()
        nccl = sum(groups.values())
        allocated = peak.get("allocated_bytes")
        if allocated is None:
            allocated = int(self.memory.levels[self.peak_row].sum())
        verdict, reserved, _ = self.memory_verdict(allocated, int(peak["reserved_bytes"]))
        persistent = {c: 0 for c in CATEGORIES}
        for b in self.memory.persistent:
            persistent[b.category] += b.nbytes
        s = self.scenario.settings
        if not (s.offload_params and s.version == 2):  # CPUOffloadPolicy keeps no sharded gradient on the GPU
            grads = CATEGORIES.index("sharded_grads")
            persistent["sharded_grads"] = max(persistent["sharded_grads"], int(self.memory.levels[:, grads].max()))
        return {"capacity_bytes": gpu.memory_bytes, "safety_margin": self.scenario.safety_margin,
                "budget_bytes": self._budget(), **verdict,
                "persistent_bytes": {c: v for c, v in persistent.items() if v},
                "nccl_groups_bytes": groups,
                "overheads_bytes": {"cuda_context": gpu.cuda_context_bytes, "nccl": nccl,
                                    "reserved_minus_allocated": reserved - allocated}}

    def to_dict(self) -> dict:
        sc = self.scenario
        s = sc.settings
        peak = self.peak()
        wl = sc.workload
        return {
            "scenario": sc.name,
            "step_time_s": self.step_time_s,
            "peak": peak,
            "memory": self.memory_summary(peak),
            "allocator": self.allocator(peak),
            "communication": self.communication(),
            "compute": self.compute(),
            "throughput": self.throughput(),
            "model": {"name": wl.name, "params": sum(trainable_counts(wl)), "tokens_per_rank": wl.tokens * s.grad_accumulation,
                      "trainable_params": trainable_counts(wl)[0], "frozen_params": trainable_counts(wl)[1],
                      "param_storage_dtype": s.storage_dtype},
            "hardware": {"profile": sc.cluster.gpu.name, "nodes": sc.cluster.nodes,
                         "gpus_per_node": sc.cluster.gpus_per_node, "world_size": sc.cluster.world_size,
                         # through a long step at the power limit (profiles.Sustained): x the benchmark rates
                         "sustained_compute": sc.cluster.gpu.sustained.compute,
                         "sustained_memory": sc.cluster.gpu.sustained.memory,
                         # the step at its slowest rank's pace (hardware/variation.py): compute-bound x this
                         "gpu_speed_spread": sc.gpu_speed_spread,
                         "slowest_rank_factor": self.pace_factor(),
                         # the slowest rank named slow in `variation:` (hardware/variation.py), when one is
                         **({"slowest_named_speed": named} if (named := sc.variation.slowest_named(
                             sc.cluster.gpus_per_node)) is not None and named < 1.0 else {}),
                         **self.variation_facts()},
            "software": stack(sc.compute, select_sdpa_backend(sc.cluster.gpu.arch, sc.compute),  # hardware/software.py
                              wl.meta.get("norm_impl"), wl.meta.get("compiled_blocks")),
            "fsdp": {"runtime": f"fsdp{s.version}" if s.version else "none", "wrap": sc.wrap, "sharding_strategy": sc.sharding_strategy,
                     "zero_stage": sc.zero_stage, "zero_stage_note": ZERO_NOTES.get(sc.zero_stage),
                     "shard_size": s.shard_size, "replicate_size": s.replicate_size,
                     "reshard_after_forward": s.reshard_after_forward, "reshard_last_block": s.reshard_last_unit,
                     "param_dtype": s.param_dtype,
                     "reduce_dtype": s.reduce_dtype, "optimizer": s.optimizer,
                     "grad_accumulation": s.grad_accumulation, "requires_gradient_sync": s.requires_gradient_sync,
                     "activation_checkpointing": s.ac_mode + (f" every {s.ac_every}" if s.ac_mode == "selective_layer" else ""),
                     **({"backward_prefetch": s.fsdp1_backward_prefetch or "none", "forward_prefetch": bool(s.forward_prefetch),
                         "limit_all_gathers": s.limit_all_gathers, "use_orig_params": s.use_orig_params}
                        if s.version == 1 else {}),  # FullyShardedDataParallel's arguments
                     # tensor parallel and torchao float8 (schedule/tp.py, schedule/float8.py), when in use
                     **({"tp": s.tp, "sequence_parallel": s.sequence_parallel} if s.tp > 1 else {}),
                     **({"float8_linears": len(s.float8_weights), "float8_all_gather": s.float8_all_gather,
                         "float8_precompute_scale": s.float8_precompute_scale} if s.float8_weights else {})},
            "units": [{"name": u.name, "params": u.numel, "modules": len(u.modules), "root": u.is_root,
                       "sharded_bytes": unit_bytes(u, s).sharded} for u in sc.units],
        } | host_memory(self)  # host memory per node when the step offloads (host.py)
