"""What autograd and the optimizer issue on the compute stream, whatever FSDP runtime wraps them.

A runtime subclasses `AutogradStep` (FSDP2 and FSDP1 through `walk.py`'s `FSDPWalk`, plain training
directly) and calls `forward_compute` / `backward_compute` for each module between its own hooks, and
`optimizer_step` at the end; this part allocates and frees the activations, the gradients autograd
produces and the optimizer's temporaries, and emits each module's compute op with its kernels. The
techniques the step uses are parts it is given (`techniques.py`), whose hooks it calls.
"""

from __future__ import annotations

from fsdp_sim.dtypes import itemsize
from fsdp_sim.schedule.clipping import clip_grad_norm
from fsdp_sim.schedule.offload import HostMemory
from fsdp_sim.schedule.ops import Buffer, Op, OpGraph
from fsdp_sim.schedule.optimizers import StepCost, step_cost
from fsdp_sim.schedule.float8 import FLOAT8_BYTES
from fsdp_sim.schedule.param_dtypes import gathered_itemsize, unit_shards
from fsdp_sim.schedule.settings import FSDPSettings
from fsdp_sim.schedule.techniques import techniques_of
from fsdp_sim.workload.checkpointing import Checkpoint, checkpoint_plans
from fsdp_sim.workload.model import Module, Workload
from fsdp_sim.wrap import Unit

COMPUTE = "compute"  # the current CUDA stream


class AutogradStep:
    """The state autograd keeps across modules: outputs, saved tensors, gradients; and the techniques the
    step is given (`self.techniques`)."""

    def __init__(self, workload: Workload, units: list[Unit], settings: FSDPSettings) -> None:
        self.wl, self.units, self.s = workload, units, settings
        self.g = OpGraph()
        self.outputs: dict[str, Buffer] = {}
        self.saved: dict[str, Buffer] = {}
        self.grad_output: Buffer | None = None
        self.unsharded_grads: dict[str, Buffer] = {}  # this backward's, by parameter
        self.sharded_grads: dict[str, Buffer] = {}  # by unit
        self.activation_bytes = itemsize(workload.activation_dtype)
        # looked up only by a module's tied_params: without any, the map over every parameter is not built
        tied = any(m.tied_params for m in workload.modules)
        self.params_by_name = {p.name: p for p in workload.params} if tied else {}
        self.checkpoints = checkpoint_plans(workload, settings.ac_mode, settings.ac_every)
        self.cached: dict[str, Buffer] = {}  # what a selective policy keeps from forward to backward
        # pinned host memory (offload.py): CPU-offloaded state and gradients, save_on_cpu's activations
        self.host = HostMemory()
        self.g.host = self.host if settings.offload_params or settings.activation_offload else None
        self.techniques = techniques_of(self)  # the parts this step uses (techniques.py)

    # ---- autograd: what each module's forward and backward allocate -----------------------------
    def forward_compute(self, m: Module, prev: Module | None, *, recompute: bool = False) -> None:
        """A module's forward, or (`recompute`) a checkpointed block's rerun at the start of its backward,
        allocating what `forward_bytes` sizes (`workload/checkpointing.py` says what a policy caches)."""
        g = self.g
        ck = self.checkpoints.get(m.name)
        cache, temp, saved, output = forward_bytes(m, ck, recompute, self.s.param_bytes, self.activation_bytes)
        cached = None if cache is None else g.alloc(COMPUTE, f"{m.name} saved by the checkpoint policy", "activations", cache)
        transient = None if temp is None else g.alloc(COMPUTE, f"{m.name} forward temporaries",
                                                      "temporaries" if not recompute else "activations", temp)
        kept = None if saved is None else g.alloc(COMPUTE, f"{m.name} saved activations", "activations", saved)
        out = None if output is None else g.alloc(COMPUTE, f"{m.name} output", "activations", output)
        g.memory_site("recompute" if recompute else "forward", m.name, "", (cached, transient, kept, out))
        if cached is not None:
            self.cached[m.name] = cached
        if kept is not None:
            self.saved[m.name] = kept
        if out is not None:
            self.outputs[m.name] = out
        self._module_pass(m, ck, "recompute" if recompute else "forward")
        if transient is not None:
            g.free(COMPUTE, transient)
        if not recompute and prev is not None and not (m.saves_input or ck is not None):
            g.free(COMPUTE, self.outputs.pop(prev.name))
        if not recompute and self.techniques.activation_offload:
            self.techniques.activation_offload.offload_saved(m, prev)  # save_on_cpu (offload.py)

    def backward_compute(self, m: Module, prev: Module | None, nxt: Module | None) -> None:
        g, s = self.g, self.s
        if self.techniques.activation_offload:
            self.techniques.activation_offload.reload_saved(m, prev)  # save_on_cpu's unpack (offload.py)
        if m.name in self.checkpoints:
            self.forward_compute(m, prev, recompute=True)
        # the transient moment first (it holds whatever gradients exist then); autograd releases
        # each op's saved tensors as its backward runs, so by the end only what the backward leaves
        # remains: the gradient w.r.t. the input and the parameters' unsharded gradients
        *parts, grad_bytes, tail_bytes = backward_bytes(m, prev, s.param_bytes, self.activation_bytes)
        temps = [g.alloc(COMPUTE, f"{m.name} backward temporaries", "temporaries", part) for part in parts]
        self._module_pass(m, None, "backward")
        for temp in temps:
            g.free(COMPUTE, temp)
        if self.techniques.activation_offload:
            self.techniques.activation_offload.release_weights(m)
        if m.name in self.saved:
            g.free(COMPUTE, self.saved.pop(m.name))
        if m.name in self.cached:
            g.free(COMPUTE, self.cached.pop(m.name))
        grad_input = None if grad_bytes is None else g.alloc(COMPUTE, f"{m.name} grad input", "temporaries", grad_bytes)
        grads = self.unsharded_grads
        for p in m.params + tuple(self.params_by_name[n] for n in m.tied_params) if m.tied_params else m.params:
            if p.trainable and p.name not in grads:
                grads[p.name] = self.new_grad(p)
        tail = None if tail_bytes is None else g.alloc(COMPUTE, f"{m.name} backward, last moment", "temporaries", tail_bytes)
        if tail is not None:
            g.free(COMPUTE, tail)
        g.memory_site("backward", m.name, prev.name if prev is not None else "", (*temps, grad_input, tail))
        if self.grad_output is not None:
            g.free(COMPUTE, self.grad_output)
        if nxt is None:
            g.free(COMPUTE, self.outputs.pop(m.name))  # the loss value
        if prev is not None and prev.name in self.outputs:
            g.free(COMPUTE, self.outputs.pop(prev.name))  # this module's saved input
        self.grad_output = grad_input

    def saved_weight_itemsize(self, p) -> int:
        """Bytes per element of parameter `p` as the ops that save it see it: the unsharded parameter (one
        byte where torchao's float8 all-gather gathered it in float8; plain training overrides it)."""
        if self.s.float8_all_gather and p.name in self.s.float8_weights:
            return FLOAT8_BYTES
        return gathered_itemsize(p, self.s)

    def new_grad(self, p) -> Buffer:
        """The gradient autograd computes for parameter `p`, in the compute dtype (plain training's autocast
        overrides it: a weight autocast does not cast gets its gradient in its own dtype)."""
        return self.g.alloc(COMPUTE, f"{p.name} unsharded grad", "unsharded_grads", p.numel * self.s.param_bytes)

    def _module_pass(self, m: Module, ck: Checkpoint | None, kernel_pass: str) -> None:
        """The compute op of one pass of `m` (forward | recompute | backward), with what `module_work` reads
        from the module; recorded in the graph (`OpGraph.compute_site`) so a build can be re-priced. Under
        tensor parallel, ops split around its collectives (tp.py; a measured module is not split: its
        collectives are unknown), recorded as None: never re-priced."""
        kernels, flops, hbm_bytes, measured_s = module_work(m, ck, kernel_pass, self.s.param_bytes, self.activation_bytes)
        name, tp = f"{m.name} {kernel_pass}", self.techniques.tensor_parallel
        if tp is not None and kernels and measured_s is None:
            op = tp.module_compute(COMPUTE, name, kernels, kernel_pass, flops=flops, hbm_bytes=hbm_bytes)
        else:
            op = self.g.add("compute", COMPUTE, name, flops=flops, hbm_bytes=hbm_bytes, measured_s=measured_s,
                            kernels=kernels, kernel_pass=kernel_pass)
        self.g.compute_site(op, m.name, kernel_pass)

    def hold_state(self, name: str, category: str, nbytes: int) -> None:
        """Sharded parameters and optimizer states that exist before the step: in pinned host memory under
        CPU offload, else on the GPU."""
        if self.techniques.cpu_offload:
            self.host.hold(category, nbytes)
        else:
            self.g.persistent_alloc(name, category, nbytes)

    # ---- optimizer ------------------------------------------------------------------------------
    def optimizer_shards(self) -> list[int]:
        """The local elements of each tensor the optimizer steps: plain training's whole parameters (FSDP2
        overrides it with its per-parameter dim-0 shards, FSDP1 with one flat shard per unit)."""
        return [n for u in self.units for n in unit_shards(u, self.s).trainable]

    def optimizer_temporaries(self, cost: StepCost) -> tuple[int, ...]:
        """The step's temporaries as the allocator gets them: one tensor per stepped tensor, as
        `_foreach_sqrt` returns them (plain training's whole parameters, FSDP1's flat shards)."""
        return cost.temp_tensors

    def optimizer_step(self, last_reduce: Op | None) -> None:
        """`clip_grad_norm_` (clipping.py, unless `max_norm` is None), the optimizer step on the sharded
        parameters in their storage dtype (see `optimizers.py`), then zero_grad(set_to_none=True): the
        gradients dropped, no kernel (torch.optim's default since 2.0). Its CPU time (~1 us a parameter,
        in-situ.md 8 [est]) is not charged: the issue thread pays kernel launches only, and torchtitan
        calls it at the top of the next step, before the blocking batch copy, while the GPU still runs."""
        g, s = self.g, self.s
        g.phase, g.unit = "optimizer", ""
        shards = self.optimizer_shards()
        last_reduce = clip_grad_norm(self, last_reduce, shards)
        if self.techniques.cpu_offload:  # CPUOffloadPolicy: torch.optim steps the host shards on the CPU
            return self.techniques.cpu_offload.cpu_optimizer_step(last_reduce, shards)
        cost = step_cost(s.optimizer, s.optimizer_impl, s.momentum, shards, s.storage_bytes)
        temps = [g.alloc(COMPUTE, f"{s.optimizer}.step temporaries", "optimizer_states", nbytes, deps=(last_reduce,))
                 for nbytes in self.optimizer_temporaries(cost)]
        g.add("compute", COMPUTE, f"{s.optimizer}.step", deps=(last_reduce,), hbm_bytes=cost.traffic_bytes,
              launches=cost.launches)
        for temp in temps:
            g.free(COMPUTE, temp)
        for buf in self.sharded_grads.values():
            g.free(COMPUTE, buf)
        self.sharded_grads.clear()


def module_work(m: Module, ck: Checkpoint | None, kernel_pass: str, compute_bytes: int,
                activation_bytes: int) -> tuple[tuple, float, float, float | None]:
    """(kernels, FLOPs, HBM bytes, measured seconds) of the compute op of one pass of `m`: forward,
    recompute (`ck`, its checkpoint plan) or backward, bytes scaled from the workload's activation dtype
    to the run's compute dtype. The only place an FSDP build reads a module's `COMPUTE_FIELDS` but the TP split
    of a pass (schedule/tp.py), which schedule/build.py therefore never re-prices.

    A non-reentrant checkpoint's recompute stops at the block's last saved tensor (early_stop) and pops
    what the policy cached instead of rerunning it."""
    hbm_bytes = _scaled(m.fwd_hbm_bytes, compute_bytes, activation_bytes)
    if kernel_pass == "backward":
        return m.kernels, m.bwd_flops, 2 * hbm_bytes, m.bwd_time_s
    if kernel_pass == "recompute":
        return ck.recompute_kernels, ck.recompute_flops if m.kernels else m.fwd_flops, hbm_bytes, m.fwd_time_s
    return m.kernels, m.fwd_flops, hbm_bytes, m.fwd_time_s


def forward_bytes(m: Module, ck: Checkpoint | None, recompute: bool, compute_bytes: int,
                  activation_bytes: int) -> tuple[int | None, int | None, int | None, int | None]:
    """What a forward (or a checkpointed block's recompute) of `m` allocates, in the run's compute dtype:
    (the policy's cache, the transient, the saved activations, the output), None where it allocates none.
    The one place a build sizes them from the module's bytes (schedule/build.py re-sizes a graph with it).

    A checkpointed block's forward keeps only its input and what its policy caches; the recompute
    re-creates the rest. Without a cache it holds what its code refers to (`Module.nosave_fwd_peak_bytes`,
    the output allocated on top of the transient); with one, or where that is not known, at most every
    tensor it would save and its transients."""
    def scaled(nbytes: int) -> int:
        return _scaled(nbytes, compute_bytes, activation_bytes)
    shared = scaled(ck.shared_bytes) if ck is not None else 0
    saved = scaled(m.saved_bytes) - shared
    temp = scaled(m.fwd_temp_bytes)
    cache = None
    if ck is not None and not recompute:
        if m.nosave_fwd_peak_bytes and not ck.cache_bytes:
            temp = scaled(m.nosave_fwd_peak_bytes - m.output_bytes)
        else:
            temp += saved
        if ck.cache_bytes:
            cache = scaled(ck.cache_bytes)
    return (cache, temp if temp else None, saved if saved and (recompute or ck is None) else None,
            None if recompute else scaled(m.output_bytes))


def backward_bytes(m: Module, prev: Module | None, compute_bytes: int, activation_bytes: int) -> tuple:
    """What `m`'s backward allocates from its bytes, in the run's compute dtype: each part of its transient
    moment, then the gradient w.r.t. its input (None: an input from the frozen prefix needs none) and its
    last moment (None: it has none). The parameters' gradients are sized by their shapes."""
    def scaled(nbytes: int) -> int:
        return _scaled(nbytes, compute_bytes, activation_bytes)
    return (*_parts(scaled(m.bwd_temp_bytes), m.bwd_temp_parts),
            scaled(prev.output_bytes) if prev is not None and prev.records_graph else None,
            scaled(m.bwd_tail_bytes) if m.bwd_tail_bytes else None)


def _scaled(nbytes, compute_bytes: int, activation_bytes: int):
    """Activation bytes (or HBM traffic) in the run's compute dtype: the workload may be traced in another."""
    return nbytes * compute_bytes // activation_bytes


def _parts(nbytes: int, parts: int) -> list[int]:
    """`nbytes` as `parts` tensors of equal size (the first takes the remainder); none when it is 0."""
    if not nbytes:
        return []
    size = nbytes // parts
    return [nbytes - size * (parts - 1)] + [size] * (parts - 1)
