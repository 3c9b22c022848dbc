"""Scenario files: load, check every key and value, resolve into what the simulator needs.

A scenario is YAML with the sections `model`, `training`, `hardware`, `fsdp`, `compute` and `report` (README
documents every key). Checking happens here, at the edge: an unknown key, a wrong type or an
impossible combination raises `ScenarioError` naming the key and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any


from fsdp_sim.datafile import expect_mapping, get_key, read_data, reject_unknown_keys
from fsdp_sim.deepspeed_words import ZERO_STAGES
from fsdp_sim.engine.allocator import AllocatorConfig, allocator_config
from fsdp_sim.dtypes import DTYPE_BYTES
from fsdp_sim.errors import ScenarioError, one_line, show, warn
from fsdp_sim.hardware.fabric import LAYOUTS, NETWORK_SCALARS, Network, check_network_value
from fsdp_sim.hardware.kernels import SDPA_BACKENDS, ComputeOptions
from fsdp_sim.hardware.profiles import Cluster, load_profile
from fsdp_sim.hardware.software import rms_norm_kernel
from fsdp_sim.hardware.variation import LinkFault, Variation, parse_variation
from fsdp_sim.schedule.clipping import DEFAULT_MAX_NORM
from fsdp_sim.schedule.optimizers import IMPLEMENTATIONS, OPTIMIZERS, check_optimizer
from fsdp_sim.schedule.offload import host_memory_key, offload_keys
from fsdp_sim.schedule.fsdp1_scenario import FSDP1_ONLY, fsdp1_options, fsdp1_settings
from fsdp_sim.schedule.plain import plain_version
from fsdp_sim.schedule.settings import FSDPSettings, post_forward_size
from fsdp_sim.workload import PRESETS, TransformerDims, Workload, build_transformer
from fsdp_sim.workload.model import derived
from fsdp_sim.workload.transformer import DIM_LIMITS, MAX_LAYERS, MAX_SEQ
from fsdp_sim.workload.checkpointing import MODES as AC_MODES, ac_frequency
from fsdp_sim.workload.loss import LOSSES, apply_loss
from fsdp_sim.workload.lora import ADAPTATION_KEYS, adapt_workload
from fsdp_sim.workload.profile_trace import apply_profile_trace
from fsdp_sim.workload.compiled_block import compiled_workload
from fsdp_sim.workload.float8 import float8_workload, parse_float8
from fsdp_sim.workload.tensor_parallel import TensorParallel, build_tp_transformer, parse_parallelism
from fsdp_sim.wrap import POLICIES, Unit, make_units

STRATEGIES = {  # FSDP1 name -> (mesh, default reshard_after_forward) as FSDP2 expresses it (torchtitan docs/fsdp.md)
    "FULL_SHARD": ("1d", True), "SHARD_GRAD_OP": ("1d", False), "HYBRID_SHARD": ("2d", True),
    "_HYBRID_SHARD_ZERO2": ("2d", False), "NO_SHARD": ("replicate", False),
}
@dataclass(frozen=True, slots=True)
class Scenario:
    """A validated scenario: the workload, its FSDP units, the cluster and the FSDP settings."""

    name: str
    workload: Workload
    units: list[Unit]
    cluster: Cluster
    settings: FSDPSettings
    wrap: str
    sharding_strategy: str
    safety_margin: float
    compute: ComputeOptions = ComputeOptions()
    allocator: AllocatorConfig = AllocatorConfig()  # PYTORCH_CUDA_ALLOC_CONF (engine/allocator.py)
    zero_stage: int | None = None  # fsdp.zero_stage, when the strategy was given in DeepSpeed's words
    variation: Variation = Variation()  # the `variation:` section, NIC faults too (hardware/variation.py)

    @property
    def gpu_speed_spread(self) -> float:
        return self.variation.spread

    @property
    def link_faults(self) -> tuple[LinkFault, ...]:
        """variation.links: NICs slow or down (hardware/variation.py)."""
        return self.variation.links


_DIM_KEYS = {f.name for f in fields(TransformerDims)}


def _model_dims(raw: dict) -> tuple[str, TransformerDims]:
    reject_unknown_keys("model", raw, _DIM_KEYS | {"preset"})
    preset = get_key("model", raw, "preset", str, None)
    overrides = {k: v for k, v in raw.items() if k != "preset"}
    for key in overrides:  # the checked values (2.0 as 2): a float must not reach the byte counts
        kind = bool if key in ("bias", "tie_embeddings", "learned_pos", "dropout") else str if key in ("mlp", "norm", "attention", "norm_impl") else int
        overrides[key] = get_key("model", overrides, key, kind, maximum=DIM_LIMITS.get(key))
    if preset is not None:
        if preset not in PRESETS:
            raise ScenarioError(f"model.preset: unknown preset {show(preset)}, expected one of {sorted(PRESETS)}")
        base = PRESETS[preset]
        if {"hidden", "heads"} & overrides.keys() and base.head_dim == base.hidden // base.heads:
            overrides.setdefault("head_dim", None)  # a derived head_dim follows the overridden hidden / heads
        return preset, replace(base, **overrides)
    for key in ("hidden", "layers", "heads", "vocab"):
        if key not in overrides:
            raise ScenarioError(f"model.{key}: missing (required without a preset)")
    return "custom", TransformerDims(**overrides)


MAX_BYTES = 1 << 50  # 1 PiB: far beyond any GPU, and within the ledger's exact integer range
MAX_TOTAL_BYTES = 1 << 56  # all modules' parameters, grads, optimizer states and activations: int64 keeps headroom
MAX_MODULE_PASSES = 5000  # modules x micro-batches: about 60 ops each, a few seconds of simulation in all
# a step of more micro-batches is priced from this many (results/folded.py)
FOLDED_MICRO_BATCHES = 3
MAX_MICRO_BATCH, MAX_GRAD_ACCUMULATION = 1 << 20, 4096
MAX_NODES, MAX_GPUS_PER_NODE = 1 << 16, 1024


def _module_bytes(workload: Workload) -> tuple[int, int]:
    """(the largest module's bytes, all modules' bytes) as `_check_scale` bounds them."""
    largest = total = 0
    for m in workload.modules:
        numel = m.numel
        largest = max(largest, numel * 4, m.saved_bytes, m.fwd_temp_bytes, m.bwd_temp_bytes, m.output_bytes)
        total += numel * 16 + m.saved_bytes + m.fwd_temp_bytes + m.bwd_temp_bytes + m.output_bytes
    return largest, total


def _check_scale(workload: Workload, grad_accumulation: int = 1) -> None:
    """Refuse sizes no GPU step has (a typo such as hidden: 1e9), before they overflow the arithmetic, and
    a step whose simulation would run past MAX_MODULE_PASSES modules x micro-batches even folded (a step of
    many micro-batches is simulated with FOLDED_MICRO_BATCHES: `folds`)."""
    largest, total = derived(workload, "module bytes", lambda: _module_bytes(workload))
    if largest > MAX_BYTES or total > MAX_TOTAL_BYTES:
        what = (f"a module of {show(workload.name)} would need {largest / (1 << 50):.3g} PiB" if largest > MAX_BYTES
                else f"{show(workload.name)} would need {total / (1 << 50):.3g} PiB in all")
        raise ScenarioError(f"model: {what}; check the model dimensions and training.micro_batch / seq_len")
    passes = len(workload.modules) * min(grad_accumulation, FOLDED_MICRO_BATCHES)
    if passes > MAX_MODULE_PASSES:
        raise ScenarioError(f"model: {len(workload.modules):,} modules x {min(grad_accumulation, FOLDED_MICRO_BATCHES)} "
                            f"micro-batches simulated is past the limit of {MAX_MODULE_PASSES:,} module passes per step")


def folds(grad_accumulation: int) -> bool:
    """Whether the step is priced from FOLDED_MICRO_BATCHES micro-batches (results/folded.py): it has more,
    and the middle ones are alike, so any count costs about two simulations."""
    return grad_accumulation > FOLDED_MICRO_BATCHES


def _workload(model: dict, *, micro_batch: int, seq_len: int, act_dtype: str, base: Path,
              tp: TensorParallel = TensorParallel(), norm_impl: str = "fused") -> Workload:
    """The model section as a workload: a Hugging Face config.json, a workload file, or dimensions, whose
    RMSNorm runs `norm_impl` (the torch release's `nn.RMSNorm`) unless `model.norm_impl` says otherwise."""
    sources = [k for k in ("hf_config", "workload") if k in model]
    if sources:
        if tp.size > 1 and sources[0] != "hf_config":
            raise ScenarioError(f"parallelism.tp: needs a model given by dimensions, a preset or hf_config, not "
                                f"model.{sources[0]}")
        if len(model) > 1:
            other = sorted(map(str, set(model) - {sources[0]}))[0]
            raise ScenarioError(f"model.{other}: not allowed beside model.{sources[0]}")
        path = get_key("model", model, sources[0], str)
        path = Path(path) if Path(path).is_absolute() else base / path
        if sources[0] == "hf_config":
            from fsdp_sim.workload.hf_config import build_from_hf_config
            return build_from_hf_config(path, micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype, tp=tp)
        from fsdp_sim.workload.io import load_workload
        return load_workload(path)
    name, dims = _model_dims(model)
    if "norm_impl" not in model:
        dims = replace(dims, norm_impl=norm_impl)
    if tp.size > 1:  # one rank's share of torchtitan's TP plan (workload/tensor_parallel.py)
        return build_tp_transformer(dims, tp, micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype, name=name)
    return build_transformer(dims, micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype, name=name)


def _compute_options(compute: dict) -> ComputeOptions:
    """`compute.*`: TF32 for fp32 matmuls (PyTorch's default is off), torch.compile, the SDPA backend and the
    torch version whose default backend order picks it."""
    version = get_key("compute", compute, "torch_version", str, "2.13")
    parts = version.split(".")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() and len(p) <= 4 for p in parts):
        raise ScenarioError(f"compute.torch_version: expected a version such as '2.13' or '2.5.1', got {version[:40]!r}")
    return ComputeOptions(allow_tf32=get_key("compute", compute, "allow_tf32", bool, False),
                          torch_compile=get_key("compute", compute, "torch_compile", bool, False),
                          sdpa_backend=get_key("compute", compute, "sdpa_backend", str, "auto", choices=SDPA_BACKENDS),
                          torch_version=tuple(int(p) for p in parts))


_NETWORK_KINDS = {"nics_per_node": int, "nic_gbps": float, "nic_efficiency": float, "rail_optimized": bool,
                  "oversubscription": float, "hop_latency_s": float, "host_overhead_s": float}


def _network(hardware: dict, profile: Network) -> Network | None:
    """`hardware.network`: the profile's NICs with the keys given replaced (None when the key is absent)."""
    if "network" not in hardware:
        return None
    network = expect_mapping("hardware.network", hardware["network"])
    reject_unknown_keys("hardware.network", network, set(NETWORK_SCALARS) | _SWITCH_KEYS)
    given = {}
    for key in network.keys() - _SWITCH_KEYS:
        value = get_key("hardware.network", network, key, _NETWORK_KINDS[key])
        given[key] = check_network_value(f"hardware.network.{key}", key, value)
    return replace(profile, **given, **_switches(network, given.get("rail_optimized")))


_SWITCH_KEYS = {"topology", "spines", "nodes_per_leaf"}
_MAX_SWITCHES = 1 << 16  # spines or nodes a leaf: far past any fabric, so the graph stays buildable


def _switches(network: dict, rail_optimized: bool | None) -> dict:
    """`hardware.network.topology` (the switches' layout, which sets `rail_optimized` to match), `spines` and
    `nodes_per_leaf` (hardware/topology.py: a leaf's nodes decide which ring hops cross the spines)."""
    out = {key: get_key("hardware.network", network, key, int, None, positive=True,
                          maximum=_MAX_SWITCHES) for key in ("spines", "nodes_per_leaf")}
    layout = get_key("hardware.network", network, "topology", str, None, choices=LAYOUTS)
    if layout is not None:
        if rail_optimized is not None and rail_optimized != (layout == "rail_optimized"):
            raise ScenarioError(f"hardware.network.topology: {layout} contradicts rail_optimized: "
                                f"{str(rail_optimized).lower()} (give one of them)")
        out |= {"topology": layout, "rail_optimized": layout == "rail_optimized"}
    return {key: value for key, value in out.items() if value is not None}


def _reshard_after_forward(fsdp: dict, key: str, shard_size: int, default: bool | None) -> bool | int | None:
    """`fsdp.reshard_after_forward` / `root_reshard_after_forward`: true, false or an hpZ group size.

    An int is checked as `_get_post_forward_mesh_info` checks it (a factor of the shard group size;
    1 means false, the shard group size true)."""
    value = fsdp.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ScenarioError(f"fsdp.{key}: expected true, false or a group size (int), got {value!r}")
    return post_forward_size(value, shard_size, f"fsdp.{key}")


def _prefetch_depth(fsdp: dict, key: str, default: bool) -> int:
    """A prefetch setting as a depth: false = 0, true = 1, or k units (0 = false)."""
    value = fsdp.get(key, default)
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, int) or value < 0:
        raise ScenarioError(f"fsdp.{key}: expected true, false or a number of units (int >= 0), got {value!r}")
    return value


def _output_dtype(value: Any, units: list[Unit], dtypes: tuple[str, ...]) -> tuple[str | None, tuple]:
    """`fsdp.mixed_precision.output_dtype`: a dtype for every unit's policy, or {module: dtype} for the
    policy of the unit that owns each module named (e.g. {output: fp32}: fp32 logits)."""
    where = "fsdp.mixed_precision.output_dtype"
    if value is None:
        return None, ()
    if isinstance(value, str):
        if value not in dtypes:
            raise ScenarioError(f"{where}: {value!r} is not one of {list(dtypes)}")
        return value, ()
    if not isinstance(value, dict):
        raise ScenarioError(f"{where}: expected a dtype or a mapping of module name to dtype, got {value!r}")
    owner = {name: u.name for u in units for name in u.modules}
    per_unit: dict[str, str] = {}
    for module, dtype in value.items():
        if module not in owner:
            raise ScenarioError(f"{where}.{module}: no such module in the model (e.g. {', '.join(list(owner)[-3:])})")
        if dtype not in dtypes:
            raise ScenarioError(f"{where}.{module}: {dtype!r} is not one of {list(dtypes)}")
        if per_unit.get(owner[module], dtype) != dtype:
            raise ScenarioError(f"{where}.{module}: unit {owner[module]} already has output_dtype {per_unit[owner[module]]}")
        per_unit[owner[module]] = dtype
    return None, tuple(sorted(per_unit.items()))


def _check_trace_times(workload: Workload, peak: float, gpu: str) -> None:
    """A measured time shorter than its module's FLOPs need at the GPU's peak cannot be true of this model on
    this GPU (and would give an MFU above 100 %): refuse it, naming the module."""
    for m in workload.modules:
        for phase, t, flops in (("forward", m.fwd_time_s, m.fwd_flops), ("backward", m.bwd_time_s, m.bwd_flops)):
            if t is not None and flops > 0 and t * peak < flops * (1 - 1e-9):
                raise ScenarioError(f"compute.trace: {show(m.name)} {phase} takes {t * 1e3:.3g} ms in the trace, less "
                                    f"than its {flops:.3g} FLOPs need at the {gpu} peak ({flops / peak * 1e3:.3g} ms): "
                                    "a trace of another model, batch or GPU?")


def _name(data: dict, default: str) -> str:
    """`name`: one printable line (it heads the summary); a file name that is not is shown escaped."""
    name = get_key("scenario", data, "name", str, default)
    if not name.isprintable() or len(name) > 200:
        if "name" in data:
            raise ScenarioError(f"name: expected one printable line of at most 200 characters, got {show(name)}")
        name = one_line(name, 200)
    return name


def _profile_ref(value: str, base: Path) -> str:
    """`hardware.profile`: a profile name as it is, a relative path to a YAML file from the scenario's folder."""
    path = Path(value)
    if path.suffix in (".yaml", ".yml") and not path.is_absolute():
        return str(base / path)
    return value


def parse_scenario(data: Any, name: str = "scenario", base: Path | None = None) -> Scenario:
    """Check and resolve scenario data; relative file paths inside it are taken from `base`."""
    base = base or Path.cwd()
    data = expect_mapping("scenario", data)
    reject_unknown_keys("scenario", data, {"name", "model", "training", "hardware", "fsdp", "compute", "report",
                                           "allocator", "parallelism", "variation"})
    if "model" not in data:
        raise ScenarioError("model: missing (a preset name, transformer dimensions, hf_config or workload)")
    model = data["model"]
    model = expect_mapping("model", {"preset": model} if isinstance(model, str) else model)
    adaptation = {k: model[k] for k in ADAPTATION_KEYS if k in model}  # workload/lora.py: frozen, LoRA, QLoRA
    model = {k: v for k, v in model.items() if k not in ADAPTATION_KEYS}

    training = expect_mapping("training", data.get("training"))
    reject_unknown_keys("training", training, {"micro_batch", "seq_len", "grad_accumulation", "optimizer",
                                       "activation_checkpointing", "optimizer_impl", "momentum", "activation_offload", "ac_every", "loss",
                                       "param_storage_dtype", "max_norm"})
    if isinstance(data["model"], dict) and "workload" in data["model"]:
        for key in ("micro_batch", "seq_len"):
            if key in training:
                raise ScenarioError(f"training.{key}: not allowed with model.workload (the trace fixed the batch shape)")
    micro_batch = get_key("training", training, "micro_batch", int, 1, positive=True, maximum=MAX_MICRO_BATCH)
    seq_len = get_key("training", training, "seq_len", int, 2048, positive=True, maximum=MAX_SEQ)
    grad_accumulation = get_key("training", training, "grad_accumulation", int, 1, positive=True,
                             maximum=MAX_GRAD_ACCUMULATION)
    optimizer = get_key("training", training, "optimizer", str, "adamw", choices=OPTIMIZERS)
    optimizer_impl = get_key("training", training, "optimizer_impl", str, "foreach", choices=IMPLEMENTATIONS)
    momentum = get_key("training", training, "momentum", bool, True)
    if "momentum" in training and optimizer != "sgd":
        raise ScenarioError(f"training.momentum: only SGD takes it (Adam's moments are always kept), got optimizer {optimizer}")
    if optimizer_impl == "fused" and optimizer == "sgd":
        raise ScenarioError("training.optimizer_impl: fused SGD does not run on FSDP2's sharded DTensor parameters; "
                            "use foreach or for_loop")
    # clip_grad_norm_'s max_norm (schedule/clipping.py): torchtitan's and HF Trainer's 1.0; null: no clipping
    max_norm = None if "max_norm" in training and training["max_norm"] is None else \
        get_key("training", training, "max_norm", float, DEFAULT_MAX_NORM, positive=True)
    ac = get_key("training", training, "activation_checkpointing", str, "none", choices=AC_MODES)
    ac_every = ac_frequency(ac, get_key("training", training, "ac_every", int, None, positive=True, maximum=MAX_LAYERS))

    hardware = expect_mapping("hardware", data.get("hardware"))
    reject_unknown_keys("hardware", hardware, {"profile", "nodes", "gpus_per_node", "network", "host_memory_gb"})
    gpu = load_profile(_profile_ref(get_key("hardware", hardware, "profile", str), base))
    nodes = get_key("hardware", hardware, "nodes", int, 1, positive=True, maximum=MAX_NODES)
    gpn = get_key("hardware", hardware, "gpus_per_node", int, gpu.gpus_per_node, positive=True, maximum=MAX_GPUS_PER_NODE)
    if gpn > gpu.gpus_per_node and gpu.fabric.scale_up != "pcie":
        warn(f"hardware.gpus_per_node: {gpn} is more than the {gpu.name} node's {gpu.gpus_per_node} GPUs (its NVLink "
             "domain); the fabric is priced as if they all shared it")
    cluster = Cluster(gpu, nodes, gpn, _network(hardware, gpu.fabric.network), host_memory_key(hardware))
    tp = parse_parallelism(data.get("parallelism"), gpn)
    world = cluster.world_size // tp.size  # the data-parallel mesh's ranks (FSDP runs over world / tp)

    fsdp = expect_mapping("fsdp", data.get("fsdp"))
    reject_unknown_keys("fsdp", fsdp, {"version", "wrap", "blocks_per_unit", "min_params", "sharding_strategy",
                               "shard_size", "reshard_after_forward", "root_reshard_after_forward",
                               "reshard_last_block", "forward_prefetch", "backward_prefetch",
                               "requires_gradient_sync", "requires_all_reduce", "reshard_after_backward",
                               "mixed_precision", "offload_policy", "offload_pin_memory", "zero_stage", *FSDP1_ONLY})
    version = plain_version(fsdp, cluster.world_size)
    if version is None:
        version = get_key("fsdp", fsdp, "version", int, 2, choices=(1, 2))
    # FSDP1's own words; each version refuses the other's keys (none: no FSDP, schedule/plain.py)
    fsdp, fsdp1 = fsdp1_options(fsdp, version, gpu) if version else (fsdp, {})
    check_optimizer(optimizer, version)  # Adafactor cannot step FSDP2's DTensors (schedule/optimizers.py)
    wrap = get_key("fsdp", fsdp, "wrap", str, "per_block", choices=POLICIES)
    k = get_key("fsdp", fsdp, "blocks_per_unit", int, 1, positive=True)
    min_params = get_key("fsdp", fsdp, "min_params", int, 100_000_000, positive=True)
    # an FSDP1 strategy name is a mesh and a default reshard_after_forward; an explicit
    # reshard_after_forward replaces the default, as fully_shard takes any value on any mesh
    strategy = get_key("fsdp", fsdp, "sharding_strategy", str, "FULL_SHARD", choices=tuple(STRATEGIES))
    zero_stage = get_key("fsdp", fsdp, "zero_stage", int, None, choices=tuple(ZERO_STAGES))
    if zero_stage is not None:  # DeepSpeed's words for the same choice
        if "sharding_strategy" in fsdp:
            raise ScenarioError("fsdp.zero_stage: not allowed beside fsdp.sharding_strategy (say one of them)")
        strategy = ZERO_STAGES[zero_stage]
    mesh, strategy_reshard = STRATEGIES[strategy]
    shard_size = {"1d": world, "2d": gpn // tp.size, "replicate": 1}[mesh]
    shard_size = get_key("fsdp", fsdp, "shard_size", int, shard_size, positive=True)
    if world % shard_size:
        gpus = f"{nodes} nodes x {gpn} GPUs"  # under TP, FSDP's mesh is the GPUs / tp (parallelism.tp)
        size = (f"the data-parallel size {world} ({gpus} / tp {tp.size})" if tp.size > 1
                else f"the world size {world} ({gpus})")
        raise ScenarioError(f"fsdp.shard_size: {shard_size} does not divide {size}")
    reshard = _reshard_after_forward(fsdp, "reshard_after_forward", shard_size, strategy_reshard)
    root_reshard = _reshard_after_forward(fsdp, "root_reshard_after_forward", shard_size, None)
    # backward: true = FSDP2's default (one ahead), false = m.set_modules_to_backward_prefetch([m]) on every
    # FSDP module m (not [], which keeps the default), k = lists of the k units before; forward: none by default
    backward_prefetch = _prefetch_depth(fsdp, "backward_prefetch", True)
    forward_prefetch = _prefetch_depth(fsdp, "forward_prefetch", False)
    reshard_last_block = get_key("fsdp", fsdp, "reshard_last_block", bool, True)
    requires_gradient_sync = get_key("fsdp", fsdp, "requires_gradient_sync", bool, True)
    requires_all_reduce = get_key("fsdp", fsdp, "requires_all_reduce", bool, True)
    reshard_after_backward = get_key("fsdp", fsdp, "reshard_after_backward", bool, True)
    mp = expect_mapping("fsdp.mixed_precision", fsdp.get("mixed_precision"))
    reject_unknown_keys("fsdp.mixed_precision", mp, {"param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"})
    dtypes = tuple(d for d in DTYPE_BYTES if d in ("fp32", "bf16", "fp16"))
    storage_dtype = get_key("training", training, "param_storage_dtype", str, "fp32", choices=("fp32", "bf16", "fp16"))
    # null: MixedPrecisionPolicy(param_dtype=None), nothing cast, compute in the storage dtype; a dtype is the
    # policy's, to which FSDPParam casts every floating parameter stored in another (a frozen base too)
    cast_params = not ("param_dtype" in mp and mp["param_dtype"] is None)
    param_dtype = get_key("fsdp.mixed_precision", mp, "param_dtype", str, "bf16", choices=dtypes) if cast_params else storage_dtype
    # MixedPrecisionPolicy's default: no reduce_dtype, the gradients are reduced in their own dtype
    reduce_dtype = get_key("fsdp.mixed_precision", mp, "reduce_dtype", str, None, choices=dtypes)
    cast_forward_inputs = get_key("fsdp.mixed_precision", mp, "cast_forward_inputs", bool, True)
    gpu.flops(param_dtype)  # the GPU must support the compute dtype

    report = expect_mapping("report", data.get("report"))
    reject_unknown_keys("report", report, {"safety_margin"})
    margin = get_key("report", report, "safety_margin", float, 0.10)
    if not 0 <= margin < 1:
        raise ScenarioError(f"report.safety_margin: {margin} must be in [0, 1)")

    compute = expect_mapping("compute", data.get("compute"))
    reject_unknown_keys("compute", compute, {"trace", "allow_tf32", "torch_compile", "sdpa_backend", "torch_version",
                                             "float8"})
    options = _compute_options(compute)  # the torch release decides the software stack (hardware/software.py)
    workload = _workload(model, micro_batch=micro_batch, seq_len=seq_len, act_dtype=param_dtype, base=base, tp=tp,
                         norm_impl=rms_norm_kernel(options.torch_version))
    loss = get_key("training", training, "loss", str, "torch", choices=LOSSES)
    # workload/loss.py: the head and loss as `loss` runs them, once per workload
    workload = derived(workload, ("loss", loss, micro_batch, seq_len),
                       lambda: apply_loss(workload, loss, batch=micro_batch, seq=seq_len))
    if adaptation:  # a sweep's points of one model, batch and sequence share the workload: adapt it once (read-only)
        workload = derived(workload, ("adapted", repr(adaptation)), lambda: adapt_workload(workload, adaptation))
    if options.torch_compile:  # Inductor's kernels and saved set, or why not (workload/compiled_block.py), once per workload
        workload = derived(workload, ("compiled", tp.size, ac, bool(adaptation), options.torch_version, version == 2),
                           lambda: compiled_workload(workload, tp.size, checkpoint=ac, adapted=bool(adaptation),
                                                     torch_version=options.torch_version, fsdp2=version == 2))
    _check_scale(workload, grad_accumulation)
    if "trace" in compute:
        trace = Path(get_key("compute", compute, "trace", str))
        workload = apply_profile_trace(workload, trace if trace.is_absolute() else base / trace)
        _check_trace_times(workload, gpu.matmul_peak(param_dtype, options.allow_tf32), gpu.name)
    float8 = parse_float8(compute.get("float8"), gpu, reshard)  # torchao float8 Linears (workload/float8.py)
    workload, float8_weights = derived(workload, ("float8", float8), lambda: float8_workload(workload, float8))
    units = list(derived(workload, ("units", wrap, k, min_params),  # a list of its own: Scenario.units
                          lambda: tuple(make_units(workload, wrap, k=k, min_params=min_params))))
    output_dtype, unit_output_dtype = _output_dtype(mp.get("output_dtype"), units, dtypes)
    settings = FSDPSettings(shard_size=shard_size, replicate_size=world // shard_size, reshard_after_forward=reshard,
                            root_reshard_after_forward=root_reshard, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                            output_dtype=output_dtype, unit_output_dtype=unit_output_dtype,
                            cast_forward_inputs=cast_forward_inputs, optimizer=optimizer,
                            optimizer_impl=optimizer_impl, momentum=momentum, max_norm=max_norm,
                            activation_checkpointing=ac == "full", forward_prefetch=forward_prefetch,
                            backward_prefetch=backward_prefetch, reshard_last_unit=reshard_last_block,
                            grad_accumulation=grad_accumulation, requires_gradient_sync=requires_gradient_sync,
                            requires_all_reduce=requires_all_reduce, reshard_after_backward=reshard_after_backward,
                            ac_mode=ac, ac_every=ac_every, tp=tp.size, sequence_parallel=tp.sequence_parallel,
                            float8_weights=float8_weights, float8_all_gather=float8.fsdp_float8_all_gather,
                            float8_precompute_scale=float8.precompute_scale,
                            storage_dtype=storage_dtype, cast_params=cast_params,
                            **offload_keys(fsdp, training, gpu, shard_size, version))
    if fsdp1:
        settings = fsdp1_settings(settings, fsdp1)
    if not version:
        settings = replace(settings, version=0)
    return Scenario(name=_name(data, name), workload=workload, units=units, cluster=cluster,
                    settings=settings, wrap=wrap, sharding_strategy=strategy, safety_margin=margin, compute=options,
                    allocator=allocator_config(expect_mapping("allocator", data.get("allocator"))), zero_stage=zero_stage,
                    variation=parse_variation(data.get("variation"), cluster.world_size, cluster.nodes,
                                              cluster.fabric.network.nics_per_node))


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    return parse_scenario(read_data(path, "scenario"), name=path.stem, base=path.parent)
