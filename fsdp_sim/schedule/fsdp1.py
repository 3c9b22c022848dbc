"""The FSDP1 (`FullyShardedDataParallel`) runtime of one training step, as an op graph.

One method per hook of torch/distributed/fsdp/_runtime_utils.py (torch 2.13), in the order PyTorch
calls them: `pre_forward` (`_pre_forward_unshard`), `post_forward` (`_post_forward_reshard`),
`pre_backward` (`_pre_backward_hook`), `post_backward` (`_post_backward_hook`), the root's
`_post_backward_final_callback`, and beneath them `unshard` (`_unshard`), `reshard` (`_reshard`) and
`prefetch` (`_prefetch_handle` with `_get_handle_to_prefetch`). The gradient reduction is in
`fsdp1_reduce.py`. Which hook runs around which module is the same walk as FSDP2's (both hook the
same module boundaries): `walk.py`'s `FSDPWalk`, which both runtimes subclass.

Each unit is one FlatParameter (`fsdp1_flat.py`: checked as torch checks it, in its own dtype): its
parameters flattened (with `use_orig_params`, each aligned to 16 bytes of the compute dtype and the total
padded to a multiple of the world size, `_init_flat_param_and_metadata`), sharded with `torch.chunk`
semantics and padded to the first chunk (`_get_shard`): S = ceil(N / W) elements per rank. The all-gather
writes the padded unsharded flat parameter (S x W) on the unshard stream and the parameters are views of
it: no copy-out. A unit whose FlatParameter does not require grad (frozen) gets no gradient, no
reduce-scatter and no optimizer state; with `use_orig_params` a FlatParameter that mixes trained and
frozen parameters requires grad, autograd runs the workload as `lora.autograd_view` derives it (the frozen
views' gradients computed) and the optimizer steps only the trained parameters. Units the policy nested in
a block (`wrap.py`, peft's adapters) run their hooks inside the block's (`nested_forward`,
`backward_compute`).

Streams (`_init_streams`): `compute` (the default stream), `pre_unshard` (the low-precision `_mp_shard`
cast), `unshard` (allocation of the unsharded flat parameter and the all-gather), `post_backward`
(the reduce-scatter and the gradient casts) and, under HSDP only, `all_reduce`. A tensor used on another
stream than the one it was allocated on is freed after `record_stream`: the free sits on its allocation
stream (its block's pool) and names the stream that used it (`Op.record_stream`), whose queued work the
caching allocator waits for before it reuses the block.
"""

from __future__ import annotations

from collections import deque

from fsdp_sim.dtypes import itemsize
from fsdp_sim.hardware.host_link import H2D
from fsdp_sim.schedule.autograd import COMPUTE
from fsdp_sim.schedule.fsdp1_flat import (all_units, autograd_requires_grad, compute_dtype, flat_param_numel,
                                          flat_params, quant_state_bytes)
from fsdp_sim.schedule.fsdp1_reduce import FlatGradientReduction
from fsdp_sim.schedule.fsdp2_reduce import SHARD_GROUP
from fsdp_sim.schedule.ops import Buffer, Op, OpGraph
from fsdp_sim.schedule.optimizers import state_bytes
from fsdp_sim.schedule.settings import FSDPSettings
from fsdp_sim.schedule.walk import FSDPWalk
from fsdp_sim.workload.lora import autograd_view
from fsdp_sim.workload.model import Module, Workload, derived
from fsdp_sim.wrap import Unit

__all__ = ["FSDP1Runtime", "build_fsdp1_step", "flat_param_numel"]

PRE_UNSHARD, UNSHARD = "pre_unshard", "unshard"
# _flat_param.py: RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES (the others keep the parameters until backward)
RESHARD_AFTER_FORWARD = ("FULL_SHARD", "HYBRID_SHARD")
MAX_INFLIGHT_ALL_GATHERS = 2  # _limiter_utils._FreeEventQueue._max_num_inflight_all_gathers ("empirically chosen")


class FSDP1Runtime(FlatGradientReduction, FSDPWalk):
    """The FullyShardedDataParallel hooks the walk (`walk.py`) calls, and what they issue beneath."""

    def __init__(self, workload: Workload, units: list[Unit], settings: FSDPSettings) -> None:
        s = settings
        # what the FlatParameters are, and the workload autograd runs with them: the same for every point of
        # a sweep that shares the workload, the units and these settings
        key = ("fsdp1 flat params", tuple(units), s.storage_dtype, s.param_dtype, s.cast_params, s.use_orig_params,
               s.shard_size, s.replicate_size, s.sharding_strategy)
        self.flats, view = derived(workload, key, lambda: _flats_and_view(workload, units, s))
        super().__init__(view, units, settings)
        self.rederived = view is not workload  # schedule/build.py re-prices from the scenario's workload: not this one
        # FSDP1 turns a sharded strategy on a group of one into NO_SHARD (`_init_core_state`)
        self.sharded = s.shard_size > 1 and s.sharding_strategy != "NO_SHARD"
        self.flat_numel = {name: f.numel for name, f in self.flats.items()}
        # the local flat shard: ceil(N / W) (padded), or the whole flat parameter under NO_SHARD
        self.local = {name: -(-n // s.shard_size) if self.sharded else n for name, n in self.flat_numel.items()}
        self.requires_grad = {name for name, f in self.flats.items() if f.requires_grad}  # flat_param.requires_grad
        self.stored_bytes = {name: itemsize(f.dtype) for name, f in self.flats.items()}  # the FlatParameter's dtype
        self.gathered_bytes = {name: itemsize(compute_dtype(f.dtype, s)) for name, f in self.flats.items()}
        self.pre_forward_order = [u for u in all_units(units) if u.name in self.local]
        self.pre_forward_index = {u.name: i for i, u in enumerate(self.pre_forward_order)}
        self.nested_in = {v.name: u for u in units for v in u.nested}
        self.unsharded.update({name: None for name in self.nested_in})
        records = {m.name: m.records_graph for m in self.wl.modules}
        model = [m.name for m in self.wl.modules if m.in_model]
        # `_register_pre_backward_hooks` marks a handle for its pre-backward unshard only when its forward
        # output requires grad (the unit's last module recorded a graph); an adapter's always does
        self.output_requires_grad = {u.name: u.name in self.nested_in or records[model[-1] if u.is_root else u.modules[-1]]
                                     for u in all_units(units)}
        # the reshard-only hook of a frozen FlatParameter is a multi-grad hook on the unit's inputs that
        # require grad (`_register_post_backward_reshard_only_hook`): none when its input needs no gradient
        before = {name: model[i - 1] if i else None for i, name in enumerate(model)}
        self.input_requires_grad = {u.name: not u.is_root and before[u.modules[0]] is not None
                                    and records[before[u.modules[0]]] for u in all_units(units)}
        self.resharded_at_end: list[Unit] = []  # frozen units left to `_catch_all_reshard`
        self.deferred_prefetch: list[Unit] | None = None  # prefetches out of a block, issued after its backward
        self.mp_shards: dict[str, Buffer] = {}  # flat_param._mp_shard while allocated
        self.flat_grads: dict[str, Buffer] = {}  # flat_param.grad, unsharded (kept under no_sync)
        self.free_event_queue: deque[Op] = deque()  # state._free_event_queue (the rate limiter)
        self.unshard_stream_tail: Op | None = None  # what a wait_stream(unshard stream) waits
        self.prefetched: set[str] = set()  # handle._prefetched
        self.needs_pre_forward_unshard: set[str] = set()
        self.needs_pre_backward_unshard: set[str] = set()
        self.delayed_post_backward: Unit | None = None  # a forward-prefetched unit's hook, run one unit late

    def build(self) -> OpGraph:
        """The step; a graph built from a workload this runtime re-derived is not re-priced from the
        scenario's (schedule/build.py re-prices compute sites from the workload it was given)."""
        g = super().build()
        if self.rederived:
            g.compute_sites = None
        return g

    # ---- persistent state and the optimizer ----------------------------------------------------
    def _persistent_state(self) -> None:
        """The sharded flat parameter in its dtype (`_local_shard`, padded) and the optimizer's states (one
        1-D tensor per FlatParameter, or per trained parameter with use_orig_params: `optimizer_shards`);
        under CPUOffload both in pinned host memory, beside the `_cpu_grad` every FlatParameter gets
        (`init_flat_param_attributes`, whether or not it requires grad). bitsandbytes' scales stay whole on
        every GPU (`fsdp1_flat.quant_state_bytes`)."""
        s, g = self.s, self.g
        for name, local in self.local.items():
            g.unit = name
            self.hold_state(f"{name} sharded flat param", "sharded_params", local * self.stored_bytes[name])
            if name in self.requires_grad:
                if states := state_bytes(s.optimizer, s.momentum, [(n,) for n in self._optimizer_tensors(name)],
                                         s.storage_bytes):
                    self.hold_state(f"{name} {s.optimizer} states", "optimizer_states", states)
            if s.offload_params:  # init_flat_param_attributes: _cpu_grad = zeros_like(_local_shard).pin_memory()
                self.host.hold("sharded_grads", local * self.stored_bytes[name])
        g.unit = ""
        if scales := quant_state_bytes(self.units):
            g.persistent_alloc("bitsandbytes QuantState (4-bit scales, whole on every rank)", "buffers", scales)

    def _optimizer_tensors(self, name: str) -> list[int]:
        """What the optimizer steps of one FlatParameter: the flat shard, or with use_orig_params the trained
        parameters' views into it (`_use_sharded_grad_views`: only those get a `.grad`)."""
        if not self.s.use_orig_params:
            return [self.local[name]]
        return list(self.flats[name].trained_shards(self.s.shard_size if self.sharded else 1))

    def optimizer_shards(self) -> list[int]:
        """The tensors the optimizer steps, over every FlatParameter that requires grad."""
        return [n for name in self.local if name in self.requires_grad for n in self._optimizer_tensors(name)]

    # ---- forward (_pre_forward, _post_forward) --------------------------------------------------
    def pre_forward(self, u: Unit, inputs: Module | None = None) -> None:
        """`_root_pre_forward` (the root: the unshard streams wait the compute stream; with forward_prefetch
        every handle needs a pre-forward unshard), then `_pre_forward_unshard`: unshard unless prefetched,
        the compute stream waits the unshard stream, then the forward prefetch of the next unit in
        pre-forward order (recorded in the first iteration: this is a later step)."""
        g = self.g
        g.unit = u.name
        if u.is_root:
            last = self._last_compute_op()
            g.wait_event(UNSHARD, last)
            g.wait_event(PRE_UNSHARD, last)
            if self.s.forward_prefetch:
                self.needs_pre_forward_unshard = set(self.local)
        if u.name not in self.local:  # no FlatParameter: no handle
            self.nested_forward(u)
            return
        if u.name not in self.prefetched:
            self.unshard(u)
        self.needs_pre_forward_unshard.discard(u.name)
        g.wait_event(COMPUTE, self.unshard_stream_tail)
        order = self.pre_forward_order
        i = self.pre_forward_index[u.name]
        if self.s.forward_prefetch and i + 1 < len(order):
            target = order[i + 1]
            if target.name in self.needs_pre_forward_unshard and target.name not in self.prefetched:
                self._prefetch(target)
        g.unit = u.name
        self.nested_forward(u)

    def nested_forward(self, u: Unit, *, recompute: bool = False) -> None:
        """The forward hooks of the units nested in `u` (peft's adapters in a block), in their order, run
        before the block's compute: each all-gathers its flat parameter, is used, and (FULL_SHARD) frees it.
        In a checkpointed block's recompute they run again, in full: the adapters' handles are idle then
        (`_pre_forward` skips only a handle in BACKWARD_PRE), so each is all-gathered (unless prefetched),
        freed and marked for its pre-backward unshard once more; the post-forward order keeps its indices
        (`record_post_forward` appends, `_post_forward_index` stays)."""
        for v in u.nested:
            self.pre_forward(v)
            self.post_forward(v, None, record=not recompute)
        self.g.unit = u.name

    def post_forward(self, u: Unit, output: Module | None, *, record: bool = True) -> None:
        """`_post_forward`: record the post-forward order, `_post_forward_reshard` (the root and the
        strategies that keep parameters after forward do not free), `_register_pre_backward_hooks`, which
        marks the handle for its pre-backward unshard only if an output tensor requires grad."""
        if u.name not in self.local:
            return
        self.g.unit = u.name
        if record:
            self.post_forward_index[u.name] = len(self.post_forward_order)
            self.post_forward_order.append(u)
        self.reshard(u, free=not u.is_root and self.s.sharding_strategy in RESHARD_AFTER_FORWARD and self.sharded)
        if self.output_requires_grad[u.name]:
            self.needs_pre_backward_unshard.add(u.name)

    # ---- backward (_pre_backward_hook, _post_backward_hook) -------------------------------------
    def pre_backward(self, u: Unit) -> None:
        """`_pre_backward_hook`: unshard unless prefetched, the compute stream waits the unshard stream,
        then `_prefetch_handle(BACKWARD)`, which with BACKWARD_PRE all-gathers the unit before this one
        in post-forward order now, before this unit's gradient kernels."""
        if u.name not in self.local:
            return
        g = self.g
        g.unit = u.name
        if u.name in self.needs_pre_backward_unshard:
            if u.name not in self.prefetched:
                self.unshard(u)
            g.wait_event(COMPUTE, self.unshard_stream_tail)
        self.needs_pre_backward_unshard.discard(u.name)
        self.prefetch(u, "BACKWARD_PRE")
        g.unit = u.name

    def backward_compute(self, m: Module, prev: Module | None, nxt: Module | None) -> None:
        """A block's backward with the units nested in it: a checkpointed block's recompute runs their
        forward hooks again (`nested_forward`), then their pre-backward hooks fire in reverse order (each
        all-gathers its adapter, unless prefetched, and prefetches the one before it), the block's gradient
        kernels run, and each adapter's AccumulateGrad hook reduce-scatters its gradient. A prefetch that
        leaves the block (the first adapter's, of the block before) is issued after the block's backward:
        the first adapter's pre-backward fires at the end of it, after the Linears it sits beside."""
        u = self.unit_of.get(m.name)
        if u is None or not u.nested:
            return super().backward_compute(m, prev, nxt)
        if m.name in self.checkpoints:
            self.nested_forward(u, recompute=True)
        self.deferred_prefetch = []
        for v in reversed(u.nested):
            self.pre_backward(v)
        deferred, self.deferred_prefetch = self.deferred_prefetch, None
        self.g.unit = u.name
        super().backward_compute(m, prev, nxt)
        for target in deferred:
            self._prefetch(target)
        for v in reversed(u.nested):
            self.post_backward(v)
        self.g.unit = u.name

    def post_backward(self, u: Unit) -> None:
        """Where autograd runs the unit's flat-parameter split backward and AccumulateGrad, which fires
        `_post_backward_hook`: right after the unit's gradient kernels, except for a unit the forward
        prefetch unsharded. Its views (and the split node) were then made in the previous unit's
        pre-forward, before that unit's forward ops, and the engine runs ready nodes latest-created first,
        so the split waits until the previous unit's backward has run: each prefetched unit's hook comes
        one unit late, after the next unit's gradient kernels and before that next-but-one's pre-backward
        (seen under MemTracker and in the hook order)."""
        pending, self.delayed_post_backward = self.delayed_post_backward, None
        if pending is not None:
            self.post_backward_hook(pending)
        if u.name not in self.local:
            return
        if u.name not in self.requires_grad:
            self.post_backward_reshard_only(u)
            return
        if self.s.forward_prefetch and self.pre_forward_index[u.name] > 0:
            self.delayed_post_backward = u
            return
        self.post_backward_hook(u)

    def post_backward_hook(self, u: Unit) -> None:
        """`_post_backward_hook`, once autograd has concatenated the parameters' gradients into the flat
        gradient (the split's backward is a cat).

        `_post_backward_reshard` frees the parameters unless NO_SHARD, or no_sync with a strategy that keeps
        them after forward (`_should_free_in_backward`), then `_prefetch_handle(BACKWARD)`: BACKWARD_POST
        all-gathers the previous unit here, before this unit's reduce-scatter is issued. Inside no_sync
        the unsharded flat gradient stays in `.grad`; otherwise it is reduced (`fsdp1_reduce.py`).
        """
        g = self.g
        g.unit = u.name
        self.accumulate_flat_grad(u)
        self.post_backward_reshard(u)
        g.unit = u.name
        if self.reduce_grads:
            self.reduce_grad(u)

    def post_backward_reshard(self, u: Unit) -> None:
        """`_post_backward_reshard`: free the parameters unless `_should_free_in_backward` keeps them, then
        `_prefetch_handle(BACKWARD)` (BACKWARD_POST)."""
        self.reshard(u, free=self.sharded and (self.reduce_grads or self.s.sharding_strategy in RESHARD_AFTER_FORWARD))
        self.prefetch(u, "BACKWARD_POST")

    def post_backward_reshard_only(self, u: Unit) -> None:
        """A FlatParameter that requires no grad has no AccumulateGrad hook; `_register_post_backward_
        reshard_only_hook` reshards it from a multi-grad hook on its unit's inputs that require grad, once
        their gradients exist (after the unit's backward). A unit whose inputs need none (the first block
        after a frozen embedding) has no such hook: `_catch_all_reshard` frees it in the final callback."""
        self.g.unit = u.name
        if self.input_requires_grad[u.name]:
            self.post_backward_reshard(u)
        elif u not in self.resharded_at_end:
            self.resharded_at_end.append(u)

    def accumulate_flat_grad(self, u: Unit) -> None:
        """Autograd's end of the unit: `split_with_sizes_backward` cats the parameters' gradients into one
        flat gradient of the unpadded size (both exist at that moment), then AccumulateGrad keeps it as
        `.grad` or, under no_sync, adds it into the one kept from the earlier micro-batch."""
        g, s = self.g, self.s
        grads = [self.unsharded_grads.pop(p.name) for p in u.params if p.name in self.unsharded_grads]
        flat = g.alloc(COMPUTE, f"{u.name} flat grad", "unsharded_grads", self.flat_numel[u.name] * s.param_bytes)
        g.add("copy", COMPUTE, f"{u.name} cat grads into the flat grad", hbm_bytes=2 * flat.nbytes)
        for buf in grads:
            g.free(COMPUTE, buf)
        kept = self.flat_grads.get(u.name)
        if kept is None:
            self.flat_grads[u.name] = flat
            return
        g.add("copy", COMPUTE, f"{u.name} accumulate flat grad", hbm_bytes=3 * flat.nbytes)
        g.free(COMPUTE, flat)

    def root_post_backward_final_callback(self) -> Op | None:
        """The root's AccumulateGrad hook runs last (its flat parameter holds the embedding, whose gradient
        autograd computes last), then `_post_backward_final_callback`: the compute stream waits the
        post-backward stream (and the all-reduce stream under HSDP) when gradients were synchronised;
        every handle forgets its prefetch and pre-backward state, the execution order its post-forward
        order. Returns the op the compute stream waited, for the optimizer step."""
        if self.root.name in self.requires_grad:
            self.post_backward(self.root)
        pending, self.delayed_post_backward = self.delayed_post_backward, None
        if pending is not None:  # autograd runs every node before the final callback
            self.post_backward_hook(pending)
        for u in (*self.unreached, *self.resharded_at_end):  # `_catch_all_reshard`: what is still unsharded
            self.g.unit = u.name
            self.reshard(u, free=self.sharded and (self.reduce_grads or self.s.sharding_strategy in RESHARD_AFTER_FORWARD))
        if self.root.name not in self.requires_grad and self.root.name in self.local:
            self.g.unit = self.root.name  # a frozen root: its inputs (token ids) need no gradient
            self.reshard(self.root, free=self.sharded and (self.reduce_grads or self.s.sharding_strategy in RESHARD_AFTER_FORWARD))
        self.resharded_at_end.clear()
        self.g.unit = self.root.name
        self.prefetched.clear()
        self.needs_pre_backward_unshard.clear()
        self.post_forward_order.clear()
        self.post_forward_index.clear()
        return self.final_reduction_wait() if self.reduce_grads else None

    # ---- unshard / reshard / prefetch (_unshard, _reshard, _prefetch_handle) ---------------------
    def unshard(self, u: Unit) -> None:
        """`_unshard`: `pre_unshard` on the pre-unshard stream, the rate limiter, then on the unshard
        stream `unshard` (allocate the padded unsharded flat parameter, all-gather into it) and
        `post_unshard` (free `_mp_shard`, recorded on the unshard stream).

        `pre_unshard` casts the fp32 shard into `_mp_shard` when the flat parameter must be gathered
        (or always under NO_SHARD, where `_mp_shard` is the compute parameter, and under CPUOffload,
        whose check skips `needs_unshard`); CPUOffload first copies the host shard to the GPU
        (`_local_shard.to(device, non_blocking=True)`, an fp32 temporary), or without a param_dtype makes
        that copy the all-gather input (`flat_param_to`). The rate limiter pops the oldest free event once
        two are queued and the CPU blocks on it (`event.synchronize()`), whether or not this handle then
        all-gathers.
        """
        g, s = self.g, self.s
        local = self.local[u.name]
        stored, gathered = self.stored_bytes[u.name], self.gathered_bytes[u.name]
        needs_unshard = self.sharded and self.unsharded[u.name] is None  # handle.needs_unshard()
        offload = s.offload_params
        if needs_unshard or not self.sharded or offload:
            last = None
            if offload:
                host_copy = g.alloc(PRE_UNSHARD, f"{u.name} shard on the GPU", "temporaries" if self.sharded
                                    else "unsharded_params", local * stored)
                last = g.add("copy", PRE_UNSHARD, f"{u.name} shard H2D", comm_bytes=host_copy.nbytes, group=H2D)
                self.mp_shards[u.name] = host_copy
            if compute_dtype(self.flats[u.name].dtype, s) != self.flats[u.name].dtype:  # _uses_param_mixed_precision
                self.mp_shards[u.name] = g.alloc(PRE_UNSHARD, f"{u.name} _mp_shard", "temporaries" if self.sharded
                                                 else "unsharded_params", local * gathered)
                last = g.add("copy", PRE_UNSHARD, f"{u.name} cast shard to {s.param_dtype}",
                             hbm_bytes=local * (stored + gathered))
                if offload:
                    g.free(PRE_UNSHARD, host_copy)
            if last is not None:
                g.wait_event(UNSHARD, last)  # unshard_stream.wait_stream(pre_unshard_stream)
                self.unshard_stream_tail = last
        if s.limit_all_gathers and len(self.free_event_queue) >= MAX_INFLIGHT_ALL_GATHERS:
            g.synchronize(self.free_event_queue.popleft())
        if needs_unshard:
            out = self.unsharded[u.name] = g.alloc(UNSHARD, f"{u.name} unsharded flat param", "unsharded_params",
                                                   local * s.shard_size * gathered)
            self.unshard_stream_tail = g.add("all_gather", UNSHARD, f"{u.name} all-gather", group=SHARD_GROUP,
                                             comm_bytes=out.nbytes)
        if self.sharded and u.name in self.mp_shards:  # post_unshard: _free_low_precision_sharded_param
            g.free(PRE_UNSHARD, self.mp_shards.pop(u.name), record_stream=UNSHARD)  # (or the dropped H2D copy)

    def reshard(self, u: Unit, free: bool = True) -> None:
        """`_reshard`: point the flat parameter at its shard and, if `free`, free the unsharded flat
        parameter (recorded on the compute stream, `_free_unsharded_flat_param`); the rate limiter queues
        an event recorded right after that free. `post_reshard` frees NO_SHARD's `_mp_shard`. The handle is
        no longer prefetched."""
        g = self.g
        buf = self.unsharded[u.name]
        if free and buf is not None:
            g.free(UNSHARD, buf, record_stream=COMPUTE)
            self.unsharded[u.name] = None
            if self.s.limit_all_gathers:  # free_event.record() on the current stream
                self.free_event_queue.append(self._last_compute_op())
        if not self.sharded and u.name in self.mp_shards:
            g.free(PRE_UNSHARD, self.mp_shards.pop(u.name), record_stream=COMPUTE)
        self.prefetched.discard(u.name)

    def prefetch(self, u: Unit, mode: str) -> None:
        """`_prefetch_handle(BACKWARD)` in the training state `mode` (BACKWARD_PRE in the pre-backward
        hook, BACKWARD_POST in the post-backward one): `_get_handle_to_prefetch` returns the unit before
        this one in post-forward order (`backward_prefetch_limit = 1`) if the policy matches the state
        and that unit still needs its pre-backward unshard and is not prefetched."""
        if self.s.fsdp1_backward_prefetch != mode:
            return
        index = self.post_forward_index.get(u.name)
        if not index:  # None, or the first unit in post-forward order: nothing before it
            return
        target = self.post_forward_order[index - 1]
        if target.name in self.needs_pre_backward_unshard and target.name not in self.prefetched:
            if self.deferred_prefetch is not None and self.nested_in.get(target.name) is not self.nested_in.get(u.name):
                if all(t.name != target.name for t in self.deferred_prefetch):  # out of the block whose adapters' hooks run now
                    self.deferred_prefetch.append(target)
                return
            self._prefetch(target)

    def _prefetch(self, target: Unit) -> None:
        self.g.unit = target.name
        self.unshard(target)
        self.prefetched.add(target.name)

    def _last_compute_op(self) -> Op | None:
        """The last op queued on the compute stream (what `wait_stream(current_stream)` waits)."""
        for op in reversed(self.g.ops):
            if op.stream == COMPUTE:
                return op
        return None


def _flats_and_view(workload: Workload, units: list[Unit], s: FSDPSettings) -> tuple[dict, Workload]:
    """Each unit's FlatParameter (refusing what `_validate_tensors_to_flatten` refuses) and the workload as
    autograd runs it: with use_orig_params every view of a FlatParameter that requires grad gets a gradient."""
    flats = flat_params(units, s)
    requires_grad = autograd_requires_grad(units, flats, s) if s.use_orig_params else None
    trained = frozenset(p.name for p in workload.params if p.trainable)
    if not requires_grad or requires_grad == trained:
        return flats, workload
    return flats, derived(workload, ("autograd view", requires_grad), lambda: autograd_view(workload, requires_grad))


def build_fsdp1_step(workload: Workload, units: list[Unit], settings: FSDPSettings) -> OpGraph:
    return FSDP1Runtime(workload, units, settings).build()
