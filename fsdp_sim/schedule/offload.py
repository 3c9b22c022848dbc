"""CPU offload and activation offload: what crosses the host link, on which stream, and what lives in
pinned host memory instead of on the GPU. Read beside torch 2.13's `_fully_shard/_fsdp_param.py`,
`_fsdp_collectives.py`, `_fsdp_param_group.py` and `torch/autograd/graph.py`.

`CPUOffloadPolicy(pin_memory=True)` (FSDP2):
- the padded sharded parameters are `.cpu().pin_memory()` (FSDPParam._init_sharded_param); torch.optim's
  states are `zeros_like` of them, so they live on the host too;
- each all-gather's inputs are made on the copy-in stream per parameter: `_get_param_all_gather_inputs`
  skips the flat foreach copy for offloaded parameters, and `FSDPParam.all_gather_inputs` copies the shard
  `.to(device, non_blocking=True)`, then `_to_dtype_if_needed` casts it (a new tensor; the fp32 copy drops);
  `all_gather_copy_in` copies the inputs into the all-gather buffer, and `del param_all_gather_inputs`;
- `foreach_reduce` copies each new sharded gradient `.to("cpu", non_blocking=True)` on the post-reduce
  stream and keeps no GPU reference ("future RS-stream ops run after the copy"); with a gradient already
  there (accumulation) the copy is blocking and the add runs on the CPU;
- `finalize_backward` synchronizes on every `grad_offload_event`, and the optimizer then steps the host
  shards on the CPU (torch.optim on CPU tensors: `_default_to_fused_or_foreach` picks foreach only for
  CUDA tensors, so the single-tensor loop runs; hardware/host_link.py prices it).

`save_on_cpu(pin_memory=True)` around the model's forward: every tensor autograd saves is copied into a new
pinned host tensor (`packed.copy_(tensor, non_blocking=True)`, on the current stream: no overlap with
compute) and the GPU tensor drops once nothing else holds it; backward's unpack copies it back `.to(device,
non_blocking=True)` on the current stream when its node runs. Per module here: a module's saved tensors and
the input it saved go to the host after its forward and return before its backward (or its recompute).
torch's default is `pin_memory=False` (`save_on_cpu.__init__`, torch/autograd/graph.py): `tensor.cpu()`
into pageable memory, blocking both ways; `training.activation_offload: true` is the pinned form.

The pack hook sees every tensor a node saves, parameters included (`saved_tensors_hooks` wrap each
`SavedVariable`): each GEMM's weight (the unsharded parameter under FSDP, autocast's copy in plain training)
and a norm's weight are copied to the host as well, although the GPU keeps them (FSDP frees its copy at
reshard, autocast's cache at the region's exit); in backward the unpack makes a new GPU copy of each, beside
the one FSDP re-gathers, alive until its node has run. Not packed: an embedding's weight (its backward
saves the indices), a bias beside a GEMM (addmm's backward does not read it), a bitsandbytes 4-bit base
(`MatMul4Bit` keeps it on `ctx.tensors`, not `save_for_backward`), and anything inside a non-reentrant
checkpoint, whose own saved-tensor hooks are the innermost and win (torch/utils/checkpoint.py): its
forward packs nothing, and its input is held by the recompute closure, not saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_sim.datafile import get_key
from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.host_link import CPU, D2H, H2D
from fsdp_sim.schedule.optimizers import step_cost
from fsdp_sim.schedule.ops import Buffer, Op
from fsdp_sim.schedule.param_dtypes import NON_FLOATING, casts, stored_itemsize
from fsdp_sim.workload.frozen import QUANT_STATE_SUFFIX
from fsdp_sim.workload.model import Module, Param
from fsdp_sim.wrap import Unit

COMPUTE, COPY_IN = "compute", "all_gather_copy_in"
CPU_STREAM = "host"  # the training loop's thread once it works on host tensors (the CPU optimizer step)
OFFLOAD_POLICIES = ("OffloadPolicy", "CPUOffloadPolicy")  # fully_shard(offload_policy=...): none, or to the CPU
MAX_HOST_MEMORY_GB = 1 << 20


def offload_keys(fsdp: dict, training: dict, gpu, shard_size: int, version: int = 2) -> dict:
    """`fsdp.offload_policy` (+ `fsdp.offload_pin_memory`) and `training.activation_offload` as FSDPSettings
    fields, checked against the profile (offload needs its `host:` link). The first two are fully_shard's
    words: FSDP1 (`version: 1`) spells CPU offload its own way."""
    if version != 2:
        for key in ("offload_policy", "offload_pin_memory"):
            if key in fsdp:
                raise ScenarioError(f"fsdp.{key}: fully_shard's argument (fsdp.version: 2); FullyShardedDataParallel "
                                    "takes cpu_offload=CPUOffload(offload_params=True) instead")

    policy = get_key("fsdp", fsdp, "offload_policy", str, "OffloadPolicy", choices=OFFLOAD_POLICIES)
    pin_memory = get_key("fsdp", fsdp, "offload_pin_memory", bool, True)
    offload_params = policy == "CPUOffloadPolicy"
    if "offload_pin_memory" in fsdp and not offload_params:
        raise ScenarioError("fsdp.offload_pin_memory: only CPUOffloadPolicy takes it; set fsdp.offload_policy: CPUOffloadPolicy")
    if offload_params and not pin_memory:
        raise ScenarioError("fsdp.offload_pin_memory: false (pageable memory, blocking gradient copies) is not "
                            "modelled yet; CPUOffloadPolicy's default true is")
    if offload_params and shard_size == 1:
        raise ScenarioError("fsdp.offload_policy: CPUOffloadPolicy with a shard group of one (no all-gather) is not "
                            "modelled yet")
    activation_offload = get_key("training", training, "activation_offload", bool, False)
    if (offload_params or activation_offload) and gpu.host is None:
        raise ScenarioError(f"hardware.profile: {gpu.name} has no host: section (host link and memory), which "
                            "fsdp.offload_policy and training.activation_offload need")
    return {"offload_params": offload_params, "activation_offload": activation_offload}


def host_memory_key(hardware: dict) -> int | None:
    """`hardware.host_memory_gb`: the host memory of one node in GiB (2**30 bytes, as DIMMs are sized), or
    None for the profile's."""
    gb = get_key("hardware", hardware, "host_memory_gb", float, None, positive=True, maximum=MAX_HOST_MEMORY_GB)
    return None if gb is None else int(gb * (1 << 30))


@dataclass(slots=True)
class HostMemory:
    """Pinned host memory of one rank: the state kept there by category, the offloaded activations (level
    now and peak) and the CPU optimizer step's temporaries. Exact byte counts."""
    persistent: dict[str, int] = field(default_factory=dict)
    activations: int = 0
    activations_peak: int = 0
    optimizer_temp: int = 0

    def hold(self, category: str, nbytes: int) -> None:
        self.persistent[category] = self.persistent.get(category, 0) + int(nbytes)

    def offload(self, nbytes: int) -> None:
        self.activations += nbytes
        self.activations_peak = max(self.activations_peak, self.activations)

    def reload(self, nbytes: int) -> None:
        self.activations -= nbytes

    @property
    def peak_bytes(self) -> int:
        """The most the rank holds at once: its state plus the larger of the offloaded activations (all
        returned by the end of backward) and the optimizer step's temporaries (after it)."""
        return sum(self.persistent.values()) + max(self.activations_peak, self.optimizer_temp)


class CPUOffload:
    """FSDP2's `CPUOffloadPolicy` as a part of the step (techniques.py): the all-gather inputs copied from the
    host, the sharded gradients copied to it, the optimizer step on the CPU. Reads the step's graph,
    settings, host memory and sharded gradients; keeps which units' gradients are on the host."""

    def __init__(self, step) -> None:
        self.step = step
        self.host_grads: set[str] = set()  # units whose sharded gradient is on the host

    def all_gather_inputs_from_host(self, u: Unit, waits: tuple) -> list[Buffer]:
        """FSDPParam.all_gather_inputs for offloaded shards, on the copy-in stream: per parameter an H2D copy
        of its padded shard, then the cast to param_dtype (which drops the copy). Returns the inputs, which
        the caller frees after the copy-in (`del param_all_gather_inputs`)."""
        g, s = self.step.g, self.step.s
        inputs = []
        for p in u.params:
            n = p.padded_shard_numel(s.shard_size)
            shard = g.alloc(COPY_IN, f"{p.name} shard on the GPU", "temporaries", n * stored_itemsize(p, s))
            g.add("copy", COPY_IN, f"{p.name} shard H2D", deps=waits, comm_bytes=shard.nbytes, group=H2D)
            waits = ()
            if casts(p, s):
                cast = g.alloc(COPY_IN, f"{p.name} all-gather input in {s.param_dtype}", "temporaries", n * s.param_bytes)
                g.add("copy", COPY_IN, f"{p.name} shard cast to {s.param_dtype}", hbm_bytes=shard.nbytes + cast.nbytes)
                g.free(COPY_IN, shard)
                shard = cast
            inputs.append(shard)
        return inputs

    def offload_sharded_grads(self, u: Unit, stream: str, event: Op) -> Op:
        """The new sharded gradient `.to("cpu")` on the post-reduce stream after `event`; the GPU copy is
        dropped at once. The first gradient of a step becomes the host's `.grad` (a non-blocking copy into
        pinned memory); a later one (gradient accumulation with sync) is copied with `non_blocking=False`
        and added into it on the CPU, both on the autograd thread inside foreach_reduce (torch 2.13
        `_fsdp_collectives.py`: "the CPU add kernel depends on the copy result and we cannot run the add
        as a callback"), so nothing more is issued until the add is done. Returns the copy, the stream's
        last op."""
        step = self.step
        g = step.g
        grad = step.sharded_grads.pop(u.name)
        d2h = g.add("copy", stream, f"{u.name} sharded grads D2H", deps=(event,), comm_bytes=grad.nbytes, group=D2H)
        g.free(stream, grad)
        if u.name in self.host_grads:  # grad += new_grad on CPU tensors: read both, write one
            add = g.add("compute", CPU_STREAM, f"{u.name} accumulate sharded grads on the CPU", deps=(d2h,),
                        comm_bytes=3 * grad.nbytes, group=CPU, launches=0)
            g.synchronize(add)  # the blocking copy, then the add, on the thread that issues the kernels
        else:
            self.host_grads.add(u.name)
            step.host.hold("sharded_grads", grad.nbytes)
        return d2h

    def cpu_optimizer_step(self, last_reduce: Op | None, shards: list[int]) -> None:
        """After the grad_offload_event synchronizes (the CPU waits the last D2H copy, which the compute
        stream's last wait covers), torch.optim steps the host shards on the CPU: the single-tensor loop
        unless fused was asked for (CPU fused Adam(W) exists)."""
        step = self.step
        s = step.s
        impl = "fused" if s.optimizer_impl == "fused" else "for_loop"
        cost = step_cost(s.optimizer, impl, s.momentum, shards, s.storage_bytes)
        step.host.optimizer_temp = cost.temp_bytes
        step.g.add("compute", CPU_STREAM, f"{s.optimizer}.step on the CPU ({impl})", deps=(last_reduce,),
                   comm_bytes=cost.traffic_bytes, group=CPU, launches=0)
        self.host_grads.clear()  # zero_grad(set_to_none=True)


def weights_autograd_saves(m: Module, tied: tuple[Param, ...] = ()) -> tuple[Param, ...]:
    """The parameters of `m` (and the tied ones it uses) that its nodes save for backward (module
    docstring): GEMM weights and norm weights in a floating dtype, not an embedding's, a GEMM's bias or a
    4-bit base and its block scales."""
    if m.kind == "embedding" or not m.records_graph:
        return ()
    names = {p.name for p in m.params}
    packed = {n[:-len(QUANT_STATE_SUFFIX)] + ".weight" for n in names if n.endswith(QUANT_STATE_SUFFIX)}
    gemms = {p.name.rsplit(".", 1)[0] for p in m.params if len(p.shape) >= 2}
    return tuple(p for p in m.params + tied
                 if p.dtype not in NON_FLOATING and p.name not in packed
                 and not (len(p.shape) < 2 and p.name.endswith(".bias") and p.name.rsplit(".", 1)[0] in gemms))


class ActivationOffload:
    """`save_on_cpu(pin_memory=True)` around the model's forward as a part of the step (techniques.py): moves
    the step's saved tensors and saved inputs to its host memory and back; keeps what it moved, by module."""

    def __init__(self, step) -> None:
        self.step = step
        self.offloaded: dict[str, list] = {}  # by module: what went to the host
        self.weights: dict[str, int] = {}  # by module: bytes of the weights packed
        self.weight_copies: dict[str, Buffer] = {}  # by module: the weights' GPU copies its backward unpacked

    def offload_saved(self, m: Module, prev: Module | None) -> None:
        """After m's forward: its saved tensors, and the input it saved (an earlier module's output that only
        autograd still holds once m's forward is done), are copied to pinned host memory on the compute
        stream and dropped; the weights it saved are copied too, and stay on the GPU where their owner
        keeps them. A checkpointed module packs nothing (module docstring)."""
        step = self.step
        if not m.in_model or m.name in step.checkpoints:
            return
        g = step.g
        tied = tuple(step.params_by_name[n] for n in m.tied_params)
        weights = sum(p.numel * step.saved_weight_itemsize(p) for p in weights_autograd_saves(m, tied))
        if weights:
            g.add("copy", COMPUTE, f"{m.name} weights D2H (save_on_cpu)", comm_bytes=weights, group=D2H)
            step.host.offload(weights)
            self.weights[m.name] = weights
        moved = []
        if m.name in step.saved:
            moved.append(("saved", step.saved.pop(m.name)))
        if prev is not None and prev.in_model and prev.name in step.outputs:
            moved.append(("input", step.outputs.pop(prev.name)))
        for _, buf in moved:
            g.add("copy", COMPUTE, f"{buf.name} D2H (save_on_cpu)", comm_bytes=buf.nbytes, group=D2H)
            g.free(COMPUTE, buf)
            step.host.offload(buf.nbytes)
        if moved:
            self.offloaded[m.name] = moved

    def reload_saved(self, m: Module, prev: Module | None) -> None:
        """Before m's backward (and its recompute): what `offload_saved` moved comes back, H2D on the compute
        stream, where autograd reads it from."""
        step = self.step
        g = step.g
        weights = self.weights.pop(m.name, 0)
        if weights:
            self.weight_copies[m.name] = g.alloc(COMPUTE, f"{m.name} weights unpacked (save_on_cpu)",
                                                 "unsharded_params", weights)
            g.add("copy", COMPUTE, f"{m.name} weights H2D (save_on_cpu unpack)", comm_bytes=weights, group=H2D)
            step.host.reload(weights)
        for what, old in self.offloaded.pop(m.name, ()):
            buf = g.alloc(COMPUTE, old.name, old.category, old.nbytes)
            g.add("copy", COMPUTE, f"{old.name} H2D (save_on_cpu unpack)", comm_bytes=old.nbytes, group=H2D)
            step.host.reload(old.nbytes)
            if what == "input":
                step.outputs[prev.name] = buf
            else:
                step.saved[m.name] = buf

    def release_weights(self, m: Module) -> None:
        """After m's backward: its nodes have run and dropped the weights they unpacked."""
        buf = self.weight_copies.pop(m.name, None)
        if buf is not None:
            self.step.g.free(COMPUTE, buf)
