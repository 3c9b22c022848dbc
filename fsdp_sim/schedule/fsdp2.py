"""The FSDP2 (`fully_shard`) runtime of one training step, as an op graph.

One method per hook, in the order PyTorch calls them, so it can be read beside
`torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py` (see docs/fsdp2-runtime.md for the
source references); the walk that calls them around the modules is `walk.py`'s, shared with FSDP1. Streams: `compute` (current stream), `all_gather_copy_in`, `all_gather`,
`reduce_scatter`, `all_reduce`; all collectives of one process group share one NCCL lane, so they
run in issue order whatever their stream. Process groups: `shard`, `replicate` (HSDP) and, for
`reshard_after_forward=k` (hpZ), `post_forward_<k>`: the DeviceMesh `_get_post_forward_mesh_info`
builds, groups of k consecutive ranks that the backward all-gathers run in.
"""

from __future__ import annotations

from fsdp_sim.dtypes import itemsize
from fsdp_sim.schedule.autograd import COMPUTE
from fsdp_sim.schedule.float8 import float8_unit_bytes
from fsdp_sim.schedule.fsdp2_reduce import SHARD_GROUP, GradientReduction
from fsdp_sim.schedule.ops import Buffer, Op, OpGraph
from fsdp_sim.schedule.optimizers import StepCost, state_bytes
from fsdp_sim.schedule.param_dtypes import gathered_itemsize, unit_shards
from fsdp_sim.schedule.settings import FSDPSettings, post_forward_group
from fsdp_sim.schedule.walk import FSDPWalk
from fsdp_sim.workload.model import Module, Workload
from fsdp_sim.wrap import Unit

COPY_IN, AG = "all_gather_copy_in", "all_gather"


class FSDP2Runtime(FSDPWalk, GradientReduction):
    """The FSDP2 hooks the walk (`walk.py`) calls, and what they issue beneath: unshard, reshard, reduce."""

    def __init__(self, workload: Workload, units: list[Unit], settings: FSDPSettings) -> None:
        super().__init__(workload, units, settings)
        self.last_inner = self.inner[-1].name if self.inner else None
        # what each unit passed to fully_shard (True, False or an hpZ group size) and its output_dtype
        self.reshard_after_forward = {u.name: self._reshard_after_forward_arg(u) for u in units}
        self.output_dtype = {u.name: settings.output_dtype_of(u.name) for u in units}
        self.sharded_post_forward: dict[str, tuple[Buffer, ...]] = {}  # hpZ: the 1/k copies kept after forward
        self.reshard_after_forward_events: dict[str, Op] = {}  # PG._reshard_after_forward_event, by unit
        self.pending_all_gather: dict[str, tuple[Buffer, Op] | None] = {}  # None: shard group of one
        self.all_gather_state: tuple[Buffer, Op] | None = None
        self.all_gather_streams_wait: Op | None = None  # an event the next copy-in waits on
        self.reduce_scatter_state: tuple[Buffer, Op] | None = None  # reduce_scatter_states, at most one (K = 1)
        self.all_reduce_states: dict[str, Buffer] = {}  # HSDP: a group's _all_reduce_state, when it holds memory
        self.partial_reduce_outputs: dict[str, Buffer] = {}  # HSDP without all-reduce: PG._partial_reduce_output
        self.accumulated_grads: dict[str, Buffer] = {}  # kept across micro-batches without gradient sync
        # per-rank shard sizes (param_dtypes.py: mixed dtypes), looked up once: every hook asks for them
        self.shards = {u.name: unit_shards(u, settings) for u in units}
        self.trainable_shard = {name: sum(shards.trainable) for name, shards in self.shards.items()}
        # float8 weights all-gathered in fp8 (float8.py)
        self.unit_bytes = {u.name: float8_unit_bytes(u, settings, self.shards[u.name].bytes) for u in units}
        # per micro-batch (set_micro_batch_sync): set_requires_all_reduce, set_reshard_after_backward
        self.all_reduce_grads = True
        self.reshard_after_backward = True

    def optimizer_shards(self) -> list[int]:
        """The per-parameter dim-0 shards the optimizer steps, as `__init__` looked them up."""
        return [n for u in self.units for n in self.shards[u.name].trainable]

    def optimizer_temporaries(self, cost: StepCost) -> tuple[int, ...]:
        """One block: the per-parameter shards are 1/N of a parameter, and apart they would add two events
        per parameter to every step (+30 % or more a point on the 10,000-point llama3-8b grid) to move reserved by
        0 to 0.17 GiB on the shipped FSDP2 scenarios (llama3-8b on 8 H100, torchtitan's 8B and 70B runs)."""
        return (cost.temp_bytes,) if cost.temp_bytes else ()

    def _reshard_after_forward_arg(self, u: Unit) -> bool | int:
        """The unit's `reshard_after_forward` as its param group holds it after `_lazy_init`.

        The root keeps its parameters only when it was given None (`_auto_reshard_after_forward`);
        a policy may fix an inner unit's value (torchtitan's norm + head group: False).
        """
        s = self.s
        if u.is_root:
            return False if s.root_reshard_after_forward is None else s.root_reshard_after_forward
        if u.reshard_after_forward is not None:
            return u.reshard_after_forward
        if u.name == self.last_inner and not s.reshard_last_unit:
            return False
        return s.reshard_after_forward

    # ---- the step (the walk is walk.py's) ------------------------------------------------------
    def set_micro_batch_sync(self, last: bool) -> None:
        """The FSDP2 setters the training loop calls before each micro-batch: `set_requires_gradient_sync`,
        `set_requires_all_reduce`, `set_reshard_after_backward`; all but the last micro-batch get the
        scenario's values, the last one gets True (the gradients are reduced, all-reduced and the
        parameters resharded once the step's backward ends)."""
        super().set_micro_batch_sync(last)
        self.all_reduce_grads = self.s.requires_all_reduce or last
        self.reshard_after_backward = self.s.reshard_after_backward or last

    def optimizer_step(self, last_reduce: Op | None) -> None:
        """The optimizer step, then torchtitan's `precompute_float8_dynamic_scale_for_fsdp` right after it."""
        super().optimizer_step(last_reduce)
        if self.techniques.float8_all_gather:
            self.techniques.float8_all_gather.float8_precompute_scales(COMPUTE, SHARD_GROUP)

    def _persistent_state(self) -> None:
        """Sharded parameters (dim-0 padded, each in its stored dtype) and optimizer states exist before the
        step; the states are `zeros_like(param)` (torch.optim's `_init_group`), in the trainable ones' dtype."""
        s, g = self.s, self.g
        for u in self.units:
            g.unit = u.name
            if u.params:  # hold_state: on the host under CPUOffloadPolicy (offload.py)
                self.hold_state(f"{u.name} sharded params", "sharded_params", self.unit_bytes[u.name].sharded)
            shapes = self.shards[u.name].trainable_shapes
            states = state_bytes(s.optimizer, s.momentum, shapes, s.storage_bytes)  # optimizers.py
            if states:
                self.hold_state(f"{u.name} {s.optimizer} states", "optimizer_states", states)

    # ---- hooks (FSDPState / FSDPParamGroup) ----------------------------------------------------
    def pre_forward(self, u: Unit, inputs: Module | None = None) -> None:
        """ST:_pre_forward: cast the floating inputs, PG:pre_forward (unshard, wait), then the explicit
        forward prefetch: `set_modules_to_forward_prefetch` targets unshard after this unit's copy-out,
        before its compute (each all-gather output then waits its own copy-out, as in the implicit path)."""
        self.g.unit = u.name
        if inputs is not None:
            self.cast_forward_inputs(inputs)
        self.unshard(u)
        self.wait_for_unshard(u, in_forward=True)
        for target in self._forward_prefetch_targets(u):
            self.g.unit = target.name
            self.unshard(target)
        self.g.unit = u.name

    def _forward_prefetch_targets(self, u: Unit) -> list[Unit]:
        """`fsdp.forward_prefetch: k`: the next k units in forward order (none by default)."""
        if not self.s.forward_prefetch or u not in self.pre_forward_order:
            return []
        i = self.pre_forward_order.index(u)
        return self.pre_forward_order[i + 1:i + 1 + self.s.forward_prefetch]

    def post_forward(self, u: Unit, output: Module) -> None:
        """PG:post_forward (reshard, record the post-forward order), then ST:_post_forward: the unit's
        output is cast to its output_dtype, and the root releases the last forward all-gather output.

        Reshard: True frees the unsharded parameters; an int k keeps this rank's 1/k of them (hpZ);
        False (and the root given None) keeps them all: its parameters are needed first in backward.
        """
        self.g.unit = u.name
        reshard = self.reshard_after_forward[u.name]
        if reshard is True:
            self.reshard(u)
        elif reshard:
            self.reshard_to_post_forward(u, reshard)
        if u.params:
            self.post_forward_index[u.name] = len(self.post_forward_order)
            self.post_forward_order.append(u)
        self.cast_output_dtype(u, output)
        if u.is_root and self.all_gather_state is not None:
            # the root's post-forward releases the last forward all-gather output; its walrus local
            # keeps the output alive until _post_forward returns, after the output cast
            self.g.free(COMPUTE, self.all_gather_state[0])
            self.all_gather_state = None

    def pre_backward(self, u: Unit) -> None:
        """PG:pre_backward: unshard unless prefetched, then the backward prefetch.

        `_backward_prefetch` all-gathers the unit before this one in post-forward order, issued
        before this unit's gradient kernels (FSDP1's BACKWARD_PRE); `backward_prefetch: k` is
        `set_modules_to_backward_prefetch` with the k units before it (ST:_pre_backward prefetches them
        in list order; the ones already pending or unsharded are no-ops). `backward_prefetch=False`
        is `m.set_modules_to_backward_prefetch([m])` on every FSDP module m: a non-empty list turns
        `default_prefetch` off (ST:_pre_backward) and prefetching itself is a no-op (PG:unshard
        returns when already unsharded). An empty list would keep the default.
        """
        if u.name not in self.post_forward_index:  # no param group
            return
        self.g.unit = u.name
        if self.unsharded[u.name] is None:
            self.unshard(u)
            self.wait_for_unshard(u, in_forward=False)
        index = self.post_forward_index[u.name]
        for target in reversed(self.post_forward_order[max(0, index - self.s.backward_prefetch):index]):
            self.g.unit = target.name
            self.unshard(target)
        self.g.unit = u.name

    def post_backward(self, u: Unit) -> None:
        """PG:post_backward: accumulate, reshard, recycle the previous reduce-scatter input, reduce.

        Reshard only if `reshard_after_backward` (`set_reshard_after_backward(False)` keeps the
        parameters for the next micro-batch's forward). The compute stream waits the previous
        group's *reduce-scatter* event, not its all-reduce nor its post-reduce ops, then drops that
        group's input (`reduce_scatter_states` drained to K - 1 = 0), before this group's input is
        allocated. `_wait_for_post_backward` (a group's own earlier reduction) never waits here:
        `finalize_backward` clears it at the end of every backward (`is_last_backward` stays True).
        A module without parameters has no param group.
        """
        if not u.params:
            return
        self.g.unit = u.name
        self.accumulate_unsharded_grads(u)
        if self.reduce_grads and self.techniques.tensor_parallel:  # Partial -> Replicate (tp.py)
            self.techniques.tensor_parallel.all_reduce_partial_grads(u)
        if self.reshard_after_backward:
            self.reshard(u)
        if not self.reduce_grads:
            self.to_accumulated_grads(u)
            return
        if self.reduce_scatter_state is not None:
            prev, reduce_scatter_event = self.reduce_scatter_state
            self.g.free(COMPUTE, prev, deps=(reduce_scatter_event,))
            self.reduce_scatter_state = None
        if any(p.trainable for p in u.params):
            self.foreach_reduce(u)

    # ---- end of backward (FSDPState) ----------------------------------------------------------
    def root_post_backward_final_callback(self) -> Op | None:
        """ST:_root_post_backward_final_callback, queued on the autograd engine by the first pre-backward.

        The groups autograd never reached run `post_backward` now, in `all_states` order: the root's,
        whose inputs (token ids) need no gradient, then those of the frozen prefix (FSDPWalk.unreached):
        no gradient, a reshard where still unsharded (a prefetched or unresharded group). Then every group's `finalize_backward` (root first, `all_states`
        order), which also forgets the post-forward order (`is_last_backward`: every backward, so a
        micro-batch prefetches only within itself), then the compute stream waits the retained
        reduce-scatter event and drops the last input. Returns the last op the compute stream
        waited, for the optimizer step to follow.
        """
        for u in (self.root, *self.unreached):
            self.post_backward(u)
        self.g.unit = self.root.name
        waits = self.finalize_backward()
        self.post_forward_order.clear()
        self.post_forward_index.clear()
        if self.reduce_scatter_state is None:  # a frozen unit recycled it after the last reduction
            return waits[-1] if waits else None  # one post-reduce stream per run
        buf, reduce_scatter_event = self.reduce_scatter_state
        self.reduce_scatter_state = None
        return self.g.free(COMPUTE, buf, deps=(*waits, reduce_scatter_event))

    def finalize_backward(self) -> tuple[Op, ...]:
        """PG:finalize_backward for every group: wait the last post-reduce events, drop `_all_reduce_state`.

        The compute stream waits the last post-reduce event of each stream (the reduce-scatter
        stream, or the all-reduce stream under HSDP): later events on a stream subsume earlier ones,
        so the first group's wait covers every group's reduction, all-reduces included. Only then
        do the groups drop their `_all_reduce_state`, which under HSDP holds each group's
        reduce-dtype output whenever it is not itself the sharded gradient. As everywhere in the
        graph, a wait is the deps of the compute-stream ops that follow it: these frees, and the
        callback's free of the last reduce-scatter input (the events are returned for it).
        """
        waits = tuple(self.last_post_reduce_events.values())
        self.last_post_reduce_events.clear()
        for buf in self.all_reduce_states.values():
            self.g.free(COMPUTE, buf, deps=waits)
        self.all_reduce_states.clear()
        # "a mistargeted unshard without a corresponding wait": a group prefetched in backward that autograd
        # never reached (the frozen prefix); the compute stream waits its all-gather and drops the output
        for pending in self.pending_all_gather.values():
            if pending is not None:
                self.g.free(COMPUTE, pending[0], deps=(pending[1],))
        self.pending_all_gather.clear()
        return waits

    # ---- gradient accumulation without sync (set_requires_gradient_sync(False)) ---------------
    def accumulate_unsharded_grads(self, u: Unit) -> None:
        """FSDPParam.accumulate_unsharded_grad_if_needed: add this backward's grad into the kept one."""
        if not self.accumulated_grads:  # nothing kept (every micro-batch syncs): skip the walk over the params
            return
        for p in u.params:
            if p.name in self.accumulated_grads and p.name in self.unsharded_grads:
                grad = self.unsharded_grads.pop(p.name)
                acc = self.accumulated_grads[p.name]
                self.g.add("copy", COMPUTE, f"{p.name} accumulate grad", hbm_bytes=2 * acc.nbytes + grad.nbytes)
                self.g.free(COMPUTE, grad)

    def to_accumulated_grads(self, u: Unit) -> None:
        """FSDPParam.to_accumulated_grad_if_needed: keep the grad, upcast to reduce_dtype if it differs."""
        s, g = self.s, self.g
        for p in u.params:
            grad = self.unsharded_grads.pop(p.name, None)
            if grad is None:
                continue
            if s.reduce_dtype == s.param_dtype:
                self.accumulated_grads[p.name] = grad
                continue
            acc = g.alloc(COMPUTE, f"{p.name} accumulated grad", "unsharded_grads", p.numel * s.reduce_bytes)
            g.add("copy", COMPUTE, f"{p.name} grad to {s.reduce_dtype}", hbm_bytes=grad.nbytes + acc.nbytes)
            g.free(COMPUTE, grad)
            self.accumulated_grads[p.name] = acc

    # ---- mixed precision at unit boundaries (ST:_cast_forward_inputs, ST:_cast_output_dtype) -------
    def cast_forward_inputs(self, inputs: Module) -> None:
        """A unit's floating input (the previous module's output) cast to param_dtype, a new tensor,
        only if `cast_forward_inputs` and a param_dtype is set (not fp32 = the storage dtype, which
        FSDP2 clamps to None) and the input is in another dtype (an earlier unit's output_dtype)."""
        s = self.s
        if not s.cast_forward_inputs or s.param_dtype == s.storage_dtype or inputs.name not in self.outputs:
            return
        if self.output_dtypes.get(inputs.name, s.param_dtype) != s.param_dtype:
            self._cast_output(inputs.name, s.param_dtype)

    def cast_output_dtype(self, u: Unit, output: Module) -> None:
        """The unit's output (its last module's) cast to the policy's output_dtype, if set and different."""
        dtype = self.output_dtype[u.name]
        if dtype is not None and output.name in self.outputs \
                and self.output_dtypes.get(output.name, self.s.param_dtype) != dtype:
            self._cast_output(output.name, dtype)

    def _cast_output(self, module: str, dtype: str) -> None:
        """`_cast_fp_tensor`: a copy in `dtype` on the compute stream; the original, which autograd does not
        keep (a dtype cast saves nothing for backward), is freed once the copy exists."""
        g, s = self.g, self.s
        buf = self.outputs[module]
        current = self.output_dtypes.get(module, s.param_dtype)
        new = g.alloc(COMPUTE, f"{module} output in {dtype}", "activations",
                      buf.nbytes * itemsize(dtype) // itemsize(current))
        g.add("copy", COMPUTE, f"{module} output cast to {dtype}", hbm_bytes=buf.nbytes + new.nbytes)
        g.free(COMPUTE, buf)
        self.outputs[module] = new
        if dtype == s.param_dtype:
            self.output_dtypes.pop(module, None)
        else:
            self.output_dtypes[module] = dtype

    # ---- unshard / reshard (all-gather copy-in, collective, copy-out) -------------------------
    def unshard(self, u: Unit) -> None:
        """PG:unshard: foreach_all_gather on the copy-in and all-gather streams.

        From the sharded state the input is this rank's padded fp32 shard, over the shard group; after
        an hpZ reshard (`is_sharded_post_forward`) it is the 1/k copy kept after forward, over the
        post-forward group of k (`_all_gather_process_group`), and the streams first wait the
        `_reshard_after_forward_event`. Either way the output is the padded unsharded size. Under
        CPUOffloadPolicy the sharded inputs are first copied H2D per parameter (offload.py).
        """
        if not u.params or self.unsharded[u.name] is not None or u.name in self.pending_all_gather:
            return
        s, g = self.s, self.g
        post_forward = self.sharded_post_forward.get(u.name)
        reshard_event = self.reshard_after_forward_events.pop(u.name, None)
        if s.shard_size == 1:
            # nothing to gather: wait_for_unshard copies each shard straight into its unsharded storage
            self.pending_all_gather[u.name] = None
            return
        world = self.reshard_after_forward[u.name] if post_forward else s.shard_size
        ub = self.unit_bytes[u.name]
        in_bytes = ub.gathered * s.shard_size // world  # this rank's all-gather input
        source_bytes = in_bytes if post_forward else ub.sharded
        # with a param_dtype the inputs it casts are first copied into one flat low-precision temporary
        cast = ub.cast * s.shard_size // world
        waits = (self.all_gather_streams_wait, reshard_event)
        float8, offload = self.techniques.float8_all_gather, self.techniques.cpu_offload
        if float8 and not post_forward:  # torchao's fsdp_pre_all_gather: the float8 weights' amaxes (float8.py)
            waits = float8.float8_pre_all_gather(u, COPY_IN, SHARD_GROUP, waits)
        if offload and not post_forward:  # CPUOffloadPolicy: per-parameter H2D and cast first (offload.py)
            temps, source_bytes = offload.all_gather_inputs_from_host(u, waits), in_bytes
        else:
            temps = [g.alloc(COPY_IN, f"{u.name} all-gather copy-in cast", "temporaries", cast)] if cast else []
        out = g.alloc(COPY_IN, f"{u.name} all-gather output", "all_gather_buffers", ub.gathered * s.shard_size)
        copy_in = g.add("copy", COPY_IN, f"{u.name} all-gather copy-in", deps=waits, hbm_bytes=source_bytes + in_bytes)
        self.all_gather_streams_wait = None
        if post_forward:
            ag = g.add("all_gather", AG, f"{u.name} all-gather in groups of {world}", deps=(copy_in,),
                       group=post_forward_group(world), comm_bytes=out.nbytes)
        else:
            ag = g.add("all_gather", AG, f"{u.name} all-gather", deps=(copy_in,), group=SHARD_GROUP, comm_bytes=out.nbytes)
        for temp in temps:
            g.free(COPY_IN, temp)  # dropped when the all-gather call returns
        self.pending_all_gather[u.name] = (out, ag)

    def wait_for_unshard(self, u: Unit, *, in_forward: bool) -> None:
        """PG:wait_for_unshard (torch 2.13 `_fsdp_param_group.py`): the copy-out into the padded per-parameter
        storages and `_to_unsharded` (which drops an hpZ unit's post-forward copies). In FORWARD the previous
        unit's all-gather state is taken first (`if prev_all_gather_state := self.comm_ctx.all_gather_state:`,
        the all-gather streams wait its copy-out, `comm_ctx.all_gather_state = None`), but the walrus local
        `prev_all_gather_state` still holds its result until the method returns, after this copy-out: so the
        previous output is freed after this unit's unsharded parameters are allocated (FSDPMemTracker sees
        both at its forward peak: tests/test_lora.py's small-batch referee cases). This unit's output is
        then kept as the new `all_gather_state` until the next unit's copy-out; outside forward it is freed
        at once and the copy-in and all-gather streams wait this copy-out's event."""
        if u.name not in self.pending_all_gather:
            return
        g = self.g
        previous = self.all_gather_state if in_forward else None
        if previous is not None:
            self.all_gather_streams_wait = previous[1]
            self.all_gather_state = None
        pending = self.pending_all_gather.pop(u.name)
        if pending is None:
            nbytes = self.unit_bytes[u.name].gathered
            self.unsharded[u.name] = g.alloc(COMPUTE, f"{u.name} unsharded params", "unsharded_params", nbytes)
            g.add("copy", COMPUTE, f"{u.name} copy shards to unsharded params", hbm_bytes=2 * nbytes)
            if previous is not None:
                g.free(COMPUTE, previous[0])
            return
        out, ag = pending
        # each parameter gets its own storage of its padded size, viewed at its true shape
        self.unsharded[u.name] = g.alloc(COMPUTE, f"{u.name} unsharded params", "unsharded_params", out.nbytes, deps=(ag,))
        copy_out = g.add("copy", COMPUTE, f"{u.name} all-gather copy-out", deps=(ag,), hbm_bytes=2 * out.nbytes)
        for buf in self.sharded_post_forward.pop(u.name, ()):
            g.free(COMPUTE, buf)
        if previous is not None:  # `prev_all_gather_state` goes out of scope as the method returns
            g.free(COMPUTE, previous[0])
        if in_forward:  # kept so that the next copy-in / all-gather never overwrite memory being copied out
            self.all_gather_state = (out, copy_out)
        else:
            self.all_gather_streams_wait = copy_out
            g.free(COMPUTE, out)

    def reshard(self, u: Unit) -> None:
        buf = self.unsharded[u.name]
        if buf is not None:
            self.g.free(COMPUTE, buf)
            self.unsharded[u.name] = None

    def reshard_to_post_forward(self, u: Unit, k: int) -> None:
        """PG:_to_sharded_post_forward (hpZ): per parameter, FSDPParam.to_sharded_post_forward clones this
        rank's 1/k slice of the padded unsharded storage on the compute stream, then frees that storage;
        `_reshard_after_forward_event` is recorded for the next all-gather's streams.

        The unit's unsharded parameters are one buffer here, so the clones are two: the first
        parameter's, made while every storage still exists (the most memory PyTorch's sequence ever
        holds), and the rest after the storages are freed (the same final level)."""
        buf = self.unsharded[u.name]
        if buf is None:
            return
        s, g = self.s, self.g
        sizes = [p.padded_shard_numel(s.shard_size) * s.shard_size // k * gathered_itemsize(p, s) for p in u.params]
        kept = [g.alloc(COMPUTE, f"{u.name} params resharded to {k} after forward", "unsharded_params", sizes[0])]
        clone = g.add("copy", COMPUTE, f"{u.name} reshard to groups of {k} (clone 1/{k})", hbm_bytes=2 * sum(sizes))
        self.reshard(u)
        if len(sizes) > 1:
            kept.append(g.alloc(COMPUTE, f"{u.name} params resharded to {k} after forward (rest)", "unsharded_params",
                                sum(sizes[1:])))
        self.sharded_post_forward[u.name] = tuple(kept)
        self.reshard_after_forward_events[u.name] = clone


def build_fsdp2_step(workload: Workload, units: list[Unit], settings: FSDPSettings) -> OpGraph:
    return FSDP2Runtime(workload, units, settings).build()
