"""The walk over one FSDP training step that FSDP1 and FSDP2 share: which hook fires around which module.

Both runtimes hook the same module boundaries: the root's pre-forward before the model's first module and
its post-forward after the last, an inner unit's around its own modules, and in backward the reverse
(pre-backward before a unit's last module's gradient, post-backward after its first's), then the root's
final callback and the optimizer step. `FSDPWalk` owns that order once and the state both runtimes' hooks
read (the units' unsharded parameters, the post-forward order, whether this micro-batch reduces); each
runtime (`fsdp2.py`, `fsdp1.py`) is the module of hooks beside its PyTorch source.
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_sim.schedule.autograd import COMPUTE, AutogradStep
from fsdp_sim.schedule.ops import Buffer, Op, OpGraph
from fsdp_sim.schedule.settings import FSDPSettings
from fsdp_sim.workload.model import Module, Workload
from fsdp_sim.wrap import Unit


class FSDPWalk(AutogradStep):
    """Walks one step (forward, backward, optimizer step) and calls the FSDP hooks in PyTorch's order."""

    def __init__(self, workload: Workload, units: list[Unit], settings: FSDPSettings) -> None:
        super().__init__(workload, units, settings)
        # the root's hooks run around the whole model, an inner unit's around its own modules
        self.root = units[0]
        model = [m.name for m in workload.modules if m.in_model]
        self.model_first, self.model_last = model[0], model[-1]
        self.inner = [u for u in units if not u.is_root]
        self.unit_of = {name: u for u in self.inner for name in u.modules}
        self.first = {u.name: u.modules[0] for u in self.inner}
        self.last = {u.name: u.modules[-1] for u in self.inner}
        # a unit without parameters has no param group (FSDP1: no handle): no all-gather, no prefetch order
        self.pre_forward_order = [u for u in units if u.params]
        self.unsharded: dict[str, Buffer | None] = {u.name: None for u in units}
        self.post_forward_order: list[Unit] = []  # FSDP1's execution order, FSDP2's `_post_forward_indices`
        self.post_forward_index: dict[str, int] = {}
        # the last reduction op by stream, what the end of backward waits: FSDP2's
        # FSDPCommContext._last_post_reduce_events, FSDP1's post-backward and all-reduce streams
        self.last_post_reduce_events: dict[str, Op] = {}
        # a module's output cast away from the compute dtype, by module: only FSDP2's output_dtype casts
        self.output_dtypes: dict[str, str] = {}
        self.reduce_grads = True  # this micro-batch reduces (not set_requires_gradient_sync(False), not no_sync)
        # units whose inputs need no gradient (their first module records no graph): autograd never reaches
        # their post-backward hook, which the root's final callback runs instead, after the root's
        records = {m.name: m.records_graph for m in workload.modules}
        self.unreached = [u for u in self.inner if not records[self.first[u.name]]]
        self.inputs: Buffer | None = None  # the current batch: replaced by the next, kept through the step

    # ---- the step -------------------------------------------------------------------------
    def build(self) -> OpGraph:
        """Forward and backward of every micro-batch, then the optimizer step."""
        s = self.s
        self._persistent_state()
        last_reduce = None
        for micro_batch in range(s.grad_accumulation):
            self.set_micro_batch_sync(micro_batch == s.grad_accumulation - 1)
            last_reduce = self.micro_batch(micro_batch) or last_reduce
        self.optimizer_step(last_reduce)
        self.g.free(COMPUTE, self.inputs)
        return self.g

    def set_micro_batch_sync(self, last: bool) -> None:
        """What the training loop sets before a micro-batch: all but the last get the scenario's values, the
        last reduces (FSDP2's `set_requires_gradient_sync`, FSDP1's leaving `no_sync()`)."""
        self.reduce_grads = self.s.requires_gradient_sync or last

    def micro_batch(self, index: int) -> Op | None:
        """One forward and backward; returns the event of its last gradient reduction, if any."""
        g = self.g
        suffix = f" #{index + 1}" if self.s.grad_accumulation > 1 else ""
        g.phase = "forward" + suffix
        previous, self.inputs = self.inputs, g.alloc(COMPUTE, f"batch (input ids, labels){suffix}", "inputs",
                                                     self.wl.input_bytes)
        g.memory_site("inputs", "", "", (self.inputs,))
        if previous is not None:  # the loop variable now holds the new batch
            g.free(COMPUTE, previous)
        prev: Module | None = None
        for m in self.wl.modules:
            unit = self.unit_of.get(m.name)
            if m.name == self.model_first:
                self.pre_forward(self.root, prev)
            if unit is not None and self.first[unit.name] == m.name:
                self.pre_forward(unit, prev)
            g.unit = self._owner(m, unit)
            self.forward_compute(self._as_consumed(m, prev), prev)
            if unit is not None and self.last[unit.name] == m.name:
                self.post_forward(unit, m)
            if m.name == self.model_last:
                self.post_forward(self.root, m)
            prev = m
        g.phase = "backward" + suffix
        modules = list(self.wl.modules)
        for i in range(len(modules) - 1, -1, -1):
            m = modules[i]
            if not m.records_graph:  # autograd recorded nothing from here back (frozen.py: a prefix of the model)
                break
            unit = self.unit_of.get(m.name)
            if m.name == self.model_last:
                self.pre_backward(self.root)
            if unit is not None and self.last[unit.name] == m.name:
                self.pre_backward(unit)
            g.unit = self._owner(m, unit)
            self.backward_compute(m, modules[i - 1] if i else None, modules[i + 1] if i + 1 < len(modules) else None)
            if unit is not None and self.first[unit.name] == m.name:
                self.post_backward(unit)
        return self.root_post_backward_final_callback()

    def _owner(self, m: Module, unit: Unit | None) -> str:
        """The unit whose parameters a module's compute uses: its own, the root's, or none (the loss)."""
        if unit is not None:
            return unit.name
        return self.root.name if m.in_model else ""

    def _as_consumed(self, m: Module, prev: Module | None) -> Module:
        """The loss as it runs on its input: it upcasts the logits with `.float()` (torchtitan's
        `cross_entropy_loss`, the referee's `loss_fn`), a no-op on logits a unit's `output_dtype` already
        made fp32, so the fp32 copy among its forward temporaries is not made."""
        if m.in_model or m.kind != "loss" or prev is None or self.output_dtypes.get(prev.name) != "fp32":
            return m
        if self.s.param_bytes == 4:  # fp32 compute: the workload already has no copy
            return m
        return replace(m, fwd_temp_bytes=max(0, m.fwd_temp_bytes - prev.output_bytes * 4 // self.s.param_bytes))

    # ---- the hooks each runtime defines, in the order the walk calls them ----------------------
    def _persistent_state(self) -> None:
        """The sharded parameters and optimizer states that exist before the step (`fully_shard` / FSDP init)."""
        raise NotImplementedError

    def pre_forward(self, u: Unit, inputs: Module | None = None) -> None:
        """The unit's forward pre-hook (FSDP2's `FSDPState._pre_forward`, FSDP1's `_pre_forward`)."""
        raise NotImplementedError

    def post_forward(self, u: Unit, output: Module) -> None:
        """The unit's forward hook (FSDP2's `FSDPState._post_forward`, FSDP1's `_post_forward`)."""
        raise NotImplementedError

    def pre_backward(self, u: Unit) -> None:
        """The unit's pre-backward hook (FSDP2's `FSDPState._pre_backward`, FSDP1's `_pre_backward_hook`)."""
        raise NotImplementedError

    def post_backward(self, u: Unit) -> None:
        """The unit's post-backward hook (FSDP2's `FSDPParamGroup.post_backward`, FSDP1's `_post_backward_hook`)."""
        raise NotImplementedError

    def root_post_backward_final_callback(self) -> Op | None:
        """The root's end-of-backward callback (FSDP2's `_root_post_backward_final_callback`, FSDP1's
        `_post_backward_final_callback`): returns the op the optimizer step follows."""
        raise NotImplementedError
