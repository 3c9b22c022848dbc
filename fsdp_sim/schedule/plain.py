"""Training on one GPU without FSDP (`fsdp.version: none`): a plain PyTorch step under autocast.

What a single-GPU fine-tune runs: `with torch.autocast("cuda", dtype=bf16): loss = model(x)`,
`loss.backward()`, `opt.step()`, `opt.zero_grad()` (set_to_none=True, torch 2.x's default). No process
group, no all-gather, no reduce-scatter, no NCCL buffers. What differs from FSDP2 on one rank:
- the parameters stay whole in their storage dtype (fp32 master weights, or bf16 for pure bf16
  training, `training.param_storage_dtype`), so the copy the optimizer updates is the model itself
  (reported as `sharded_params`: a shard of one);
- autocast casts each Linear's (and conv's, expert GEMM's) weight and bias to the compute dtype when the
  forward first uses it and caches the cast while the autocast region is open
  (`cached_cast` in aten/src/ATen/autocast_mode.cpp: fp32 leaves that require grad are cached); the
  matmul's autograd node saves the cast for its input gradient, so each copy lives from its forward
  until its module's backward (as `unsharded_params`). Embeddings and norms are not on autocast's
  lower-precision list and use their fp32 weights directly;
- the gradient of a cast weight is computed in the compute dtype and cast back by `ToCopyBackward`
  before `AccumulateGrad` keeps it as `.grad` in the parameter's dtype (reported as `sharded_grads`),
  alive until `zero_grad` after the optimizer step; with gradient accumulation it accumulates in place.
Activations follow the compute dtype as under FSDP2's MixedPrecisionPolicy, except the residual stream
(`fp32_residual_stream`): an embedding looked up in an fp32 weight is fp32 (embedding is on none of
autocast's lists), and `x + attention(...)` of fp32 and bf16 promotes to fp32, so every block's output
is fp32. Inside a block the residual kept by the second norm and the norms' own fp32 tensors are not
separated (the eager referee, `torch_tools/eager_referee.py`, measures what that leaves: without
checkpointing the peak is up to 2.4 % low; with it, where a block keeps only its input, exact).
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_sim.errors import ScenarioError
from fsdp_sim.schedule.autograd import COMPUTE, AutogradStep
from fsdp_sim.schedule.ops import Buffer, OpGraph
from fsdp_sim.schedule.optimizers import state_bytes
from fsdp_sim.schedule.param_dtypes import casts, stored_itemsize
from fsdp_sim.schedule.settings import FSDPSettings
from fsdp_sim.workload.lora import peft_input_casts
from fsdp_sim.workload.model import Module, Param, Workload, derived
from fsdp_sim.wrap import Unit

# the fsdp: keys that still mean something without FSDP: the autocast dtype (MixedPrecisionPolicy's
# param_dtype is autocast's dtype here) and the version itself
PLAIN_KEYS = ("version", "mixed_precision")


def plain_version(fsdp: dict, world_size: int) -> int | None:
    """0 for `fsdp.version: none` (checked: one GPU, no FSDP key but the compute dtype), else None (the
    caller reads the FSDP version)."""
    version = fsdp.get("version")
    if isinstance(version, str) and version != "none":
        raise ScenarioError(f"fsdp.version: {version[:40]!r} is not one of [1, 2, 'none']")
    if version != "none":
        return None
    if world_size != 1:
        raise ScenarioError(f"fsdp.version: none (plain training, no FSDP) runs on one GPU, not {world_size}; "
                            "use version 2 (fully_shard) or 1 across GPUs")
    for key in fsdp:
        if key not in PLAIN_KEYS:
            raise ScenarioError(f"fsdp.{key}: an FSDP setting, but fsdp.version is none (plain training on one GPU)")
    mp = fsdp.get("mixed_precision")
    for key in mp if isinstance(mp, dict) else ():
        if key != "param_dtype":
            raise ScenarioError(f"fsdp.mixed_precision.{key}: without FSDP only param_dtype (autocast's dtype) applies")
    return 0


def autocast_params(m: Module, params_by_name: dict[str, Param], s: FSDPSettings) -> tuple[Param, ...]:
    """The parameters autocast casts for module `m`: the weights of its GEMM layers (two or more dims)
    with their biases, and a tied head's weight, when stored in a floating dtype other than the compute
    dtype (`casts`); an embedding's lookup and a norm run on the stored weight, and a 4-bit base is
    dequantized by its own kernel (workload/lora.py)."""
    if m.kind == "embedding":
        return ()
    gemm = {p.name.rsplit(".", 1)[0] for p in m.params if len(p.shape) >= 2}
    own = tuple(p for p in m.params if p.name.rsplit(".", 1)[0] in gemm)
    return tuple(p for p in own + tuple(params_by_name[n] for n in m.tied_params) if casts(p, s))


def fp32_residual_stream(workload: Workload, s: FSDPSettings) -> Workload:
    """The workload under autocast: the embedding's and the blocks' outputs in the embedding weight's
    dtype when that is wider than the compute dtype (see the module docstring); unchanged otherwise (a
    frozen bf16 base's embedding gives bf16)."""
    embedding = next((m for m in workload.modules if m.kind == "embedding" and m.params), None)
    if embedding is None:
        return workload
    widen = stored_itemsize(embedding.params[0], s) // s.param_bytes
    if widen <= 1:
        return workload
    modules = tuple(replace(m, output_bytes=m.output_bytes * widen) if m is embedding or m.is_block else m
                    for m in workload.modules)
    return replace(workload, modules=modules)


class PlainRuntime(AutogradStep):
    """One GPU, no FSDP: forward under autocast, backward, optimizer step, zero_grad."""

    def build(self) -> OpGraph:
        s, g = self.s, self.g
        self.autocast = s.param_dtype != s.storage_dtype
        if self.autocast:
            widened = fp32_residual_stream(self.wl, s)
            if widened is self.wl and s.storage_bytes != s.param_bytes:  # activations in the compute dtype
                # fp32 adapters cast their input; once per workload (a sweep's points share it, read-only)
                widened = derived(self.wl, ("peft input casts", s.storage_bytes),
                                  lambda: peft_input_casts(self.wl, s.storage_bytes))
            self.wl = widened
        self.grads: dict[str, Buffer] = {}  # .grad, by parameter, kept across micro-batches
        self.casts: dict[str, tuple[Buffer, ...]] = {}  # autocast's copies saved for backward, by module
        self.cast_names = {p.name for m in self.wl.modules for p in autocast_params(m, self.params_by_name, s)} \
            if self.autocast else set()
        for m in self.wl.modules:
            g.unit = m.name
            if m.params:  # trainable in the storage dtype, frozen in their own (param_dtypes.py)
                g.persistent_alloc(f"{m.name} params", "sharded_params", sum(p.numel * stored_itemsize(p, s) for p in m.params))
            # torch.optim's states are zeros_like(param): the parameter's own dtype
            states = state_bytes(s.optimizer, s.momentum, [p.shape for p in m.params if p.trainable], s.storage_bytes)
            if states:
                g.persistent_alloc(f"{m.name} {s.optimizer} states", "optimizer_states", states)
        inputs = None
        for index in range(s.grad_accumulation):
            suffix = f" #{index + 1}" if s.grad_accumulation > 1 else ""
            g.phase, g.unit = "forward" + suffix, ""
            previous, inputs = inputs, g.alloc(COMPUTE, f"batch (input ids, labels){suffix}", "inputs", self.wl.input_bytes)
            if previous is not None:
                g.free(COMPUTE, previous)
            self._forward()
            g.phase = "backward" + suffix
            self._backward()
        self.sharded_grads = dict(self.grads)  # zero_grad(set_to_none=True) after the step frees them
        self.optimizer_step(None)
        g.free(COMPUTE, inputs)
        return g

    def _forward(self) -> None:
        """The forward and the loss inside one autocast region. A cast that autograd does not keep (a
        non-reentrant checkpoint saves nothing in forward) stays in autocast's cache until the region
        exits: `autocast.__exit__` clears it only once `autocast_decrement_nesting()` reaches 0
        (torch/amp/autocast_mode.py), and the checkpoint's forward neither enters autocast nor clears the
        cache (torch/utils/checkpoint.py). So every checkpointed module's casts live to the end of the
        forward, the loss included."""
        g = self.g
        prev = None
        for m in self.wl.modules:
            g.unit = m.name
            if self.autocast:
                self._cast(m)
            self.forward_compute(m, prev)
            prev = m
        g.unit = ""
        offloaded = self.techniques.activation_offload is not None  # save_on_cpu packed the rest (offload.py)
        for name in [name for name in self.casts if name in self.checkpoints or offloaded]:
            self._uncast_named(name)  # the region exits: clear_autocast_cache()

    def _backward(self) -> None:
        g = self.g
        modules = self.wl.modules
        for i in range(len(modules) - 1, -1, -1):
            m = modules[i]
            if not m.records_graph:  # the frozen prefix: autograd recorded nothing from here back
                break
            g.unit = m.name
            if self.autocast and m.name in self.checkpoints:
                self._cast(m)  # the recompute enters autocast again, casts, and saves what it casts
            self.backward_compute(m, modules[i - 1] if i else None, modules[i + 1] if i + 1 < len(modules) else None)
            if self.autocast:  # the GEMM's node releases the cast it saved once it has run, before ToCopyBackward
                self._uncast(m)
            self._accumulate_grads(m)

    def _cast(self, m: Module) -> None:
        params = autocast_params(m, self.params_by_name, self.s)
        if not params:
            return
        g = self.g
        self.casts[m.name] = tuple(g.alloc(COMPUTE, f"{p.name} autocast copy", "unsharded_params",
                                           p.numel * self.s.param_bytes) for p in params)
        numel = sum(p.numel for p in params)  # read fp32, write the compute dtype (one kernel per tensor)
        g.add("compute", COMPUTE, f"{m.name} autocast casts", hbm_bytes=numel * (self.s.storage_bytes + self.s.param_bytes),
              launches=len(params))

    def _uncast(self, m: Module) -> None:
        self._uncast_named(m.name)

    def _uncast_named(self, name: str) -> None:
        for buf in self.casts.pop(name, ()):
            self.g.free(COMPUTE, buf)

    def saved_weight_itemsize(self, p: Param) -> int:
        """What a GEMM saves is autocast's copy of its weight; a norm's weight is saved as stored."""
        return self.s.param_bytes if p.name in self.cast_names else stored_itemsize(p, self.s)

    def new_grad(self, p: Param) -> Buffer:
        """A weight autocast casts gets its gradient in the compute dtype (ToCopyBackward casts it back in
        `_accumulate_grads`); any other (an embedding's, a norm's: their ops run on the stored weight) in its
        own dtype, which AccumulateGrad steals as the `.grad` when there is none (Case 1.1, see below) and
        otherwise adds in place and drops."""
        if p.name in self.cast_names or not self.autocast:
            return super().new_grad(p)
        nbytes = p.numel * stored_itemsize(p, self.s)
        if p.name not in self.grads:
            self.grads[p.name] = self.g.alloc(COMPUTE, f"{p.name}.grad", "sharded_grads", nbytes)
            return self.grads[p.name]
        return self.g.alloc(COMPUTE, f"{p.name} unsharded grad", "unsharded_grads", nbytes)

    def _accumulate_grads(self, m: Module) -> None:
        """`ToCopyBackward` + `AccumulateGrad`: the gradient autograd produced in the compute dtype
        becomes `.grad` in the parameter's dtype (the first micro-batch), or is added into it.

        ToCopyBackward of an autocast cast returns a new tensor in the parameter's dtype. With no `.grad`
        yet AccumulateGrad steals it (`accumulateGrad` Case 1.1, torch/csrc/autograd/functions/
        accumulate_grad.h in the wheel's include/): it is the `.grad`. With one (a later micro-batch)
        it runs `variable_grad += new_grad` (Case 2.3), so that tensor is a temporary the size of the
        parameter in its own dtype, alive beside the compute-dtype gradient it was cast from."""
        g, s = self.g, self.s
        cast = self.cast_names
        for p in m.params + tuple(self.params_by_name[n] for n in m.tied_params):
            grad = self.unsharded_grads.pop(p.name, None)
            if grad is None:
                continue
            if grad is self.grads.get(p.name):  # stolen: it is the .grad
                continue
            temp = None
            if p.name not in self.grads:
                self.grads[p.name] = g.alloc(COMPUTE, f"{p.name}.grad", "sharded_grads", p.numel * s.storage_bytes)
            elif p.name in cast:
                temp = g.alloc(COMPUTE, f"{p.name} grad in {s.storage_dtype} (ToCopyBackward)", "temporaries",
                               p.numel * s.storage_bytes)
            if p.name in cast:  # ToCopyBackward reads the gradient and writes it in the parameter's dtype
                g.add("compute", COMPUTE, f"{p.name} grad cast", hbm_bytes=p.numel * (s.param_bytes + 2 * s.storage_bytes))
            g.free(COMPUTE, grad)
            if temp is not None:
                g.free(COMPUTE, temp)


def build_plain_step(workload: Workload, units: list[Unit], settings: FSDPSettings) -> OpGraph:
    return PlainRuntime(workload, units, settings).build()
