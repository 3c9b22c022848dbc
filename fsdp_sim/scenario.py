"""Scenario files: load, check every key and value, resolve into what the simulator needs.

A scenario is YAML with the sections `model`, `training`, `hardware`, `fsdp`, `compute` and `report` (README
documents every key). Checking happens here, at the edge: an unknown key, a wrong type or an
impossible combination raises `ScenarioError` naming the key and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any


from fsdp_sim.datafile import read_data, reject_unknown_keys
from fsdp_sim.dtypes import DTYPE_BYTES
from fsdp_sim.errors import ScenarioError
from fsdp_sim.hardware.fabric import NETWORK_SCALARS, Network, check_network_value
from fsdp_sim.hardware.kernels import SDPA_BACKENDS, ComputeOptions
from fsdp_sim.hardware.profiles import Cluster, load_profile
from fsdp_sim.schedule.optimizers import IMPLEMENTATIONS, OPTIMIZERS
from fsdp_sim.schedule.settings import FSDPSettings
from fsdp_sim.workload import PRESETS, TransformerDims, Workload, build_transformer
from fsdp_sim.workload.profile_trace import apply_profile_trace
from fsdp_sim.wrap import POLICIES, Unit, make_units

STRATEGIES = {  # FSDP1 name -> (mesh, reshard_after_forward) as FSDP2 expresses it (torchtitan docs/fsdp.md)
    "FULL_SHARD": ("1d", True), "SHARD_GRAD_OP": ("1d", False), "HYBRID_SHARD": ("2d", True),
    "_HYBRID_SHARD_ZERO2": ("2d", False), "NO_SHARD": ("replicate", False),
}
_MISSING = object()


def _expect(section: str, data: Any) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ScenarioError(f"{section}: expected a mapping, got {type(data).__name__}")
    return data


def _get(section: str, data: dict, key: str, kind: type, default=_MISSING, *, choices=None, positive=False):
    value = data.get(key, default)
    where = f"{section}.{key}"
    if value is _MISSING:
        raise ScenarioError(f"{where}: missing (required)")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if value is None:
        if default is None:  # the key is optional and null means "not set"
            return None
        raise ScenarioError(f"{where}: expected {kind.__name__}, got nothing (null)")
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ScenarioError(f"{where}: expected {kind.__name__}, got {value!r}")
    if choices is not None and value not in choices:
        raise ScenarioError(f"{where}: {value!r} is not one of {list(choices)}")
    if positive and value <= 0:
        raise ScenarioError(f"{where}: must be positive, got {value!r}")
    return value


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


_DIM_KEYS = {f.name for f in fields(TransformerDims)}


def _model_dims(raw: dict) -> tuple[str, TransformerDims]:
    reject_unknown_keys("model", raw, _DIM_KEYS | {"preset"})
    preset = _get("model", raw, "preset", str, None)
    overrides = {k: v for k, v in raw.items() if k != "preset"}
    for key, value in overrides.items():
        kind = bool if key in ("bias", "tie_embeddings", "learned_pos", "dropout") else str if key in ("mlp", "norm", "attention", "norm_impl") else int
        _get("model", overrides, key, kind)
    if preset is not None:
        if preset not in PRESETS:
            raise ScenarioError(f"model.preset: unknown preset {preset!r}, expected one of {sorted(PRESETS)}")
        base = PRESETS[preset]
        if {"hidden", "heads"} & overrides.keys() and base.head_dim == base.hidden // base.heads:
            overrides.setdefault("head_dim", None)  # a derived head_dim follows the overridden hidden / heads
        return preset, replace(base, **overrides)
    for key in ("hidden", "layers", "heads", "vocab"):
        if key not in overrides:
            raise ScenarioError(f"model.{key}: missing (required without a preset)")
    return "custom", TransformerDims(**overrides)


MAX_BYTES = 1 << 50  # 1 PiB: far beyond any GPU, and within the ledger's exact integer range


def _check_scale(workload: Workload) -> None:
    """Refuse sizes no GPU step has (a typo such as hidden: 1e9), before they overflow the arithmetic."""
    largest = max(max(m.numel * 4, m.saved_bytes, m.fwd_temp_bytes, m.bwd_temp_bytes, m.output_bytes)
                  for m in workload.modules)
    if largest > MAX_BYTES:
        raise ScenarioError(f"model: a module of {workload.name!r} would need {largest / (1 << 50):.3g} PiB; "
                            f"check the model dimensions and training.micro_batch / seq_len")


def _workload(model: dict, *, micro_batch: int, seq_len: int, act_dtype: str, base: Path) -> Workload:
    """The model section as a workload: a Hugging Face config.json, a workload file, or dimensions."""
    sources = [k for k in ("hf_config", "workload") if k in model]
    if sources:
        if len(model) > 1:
            other = sorted(set(model) - {sources[0]})[0]
            raise ScenarioError(f"model.{other}: not allowed beside model.{sources[0]}")
        path = _get("model", model, sources[0], str)
        path = Path(path) if Path(path).is_absolute() else base / path
        if sources[0] == "hf_config":
            from fsdp_sim.workload.hf_config import build_from_hf_config
            return build_from_hf_config(path, micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype)
        from fsdp_sim.workload.io import load_workload
        return load_workload(path)
    name, dims = _model_dims(model)
    return build_transformer(dims, micro_batch=micro_batch, seq_len=seq_len, act_dtype=act_dtype, name=name)


def _compute_options(compute: dict) -> ComputeOptions:
    """`compute.*`: TF32 for fp32 matmuls (PyTorch's default is off), torch.compile, the SDPA backend and the
    torch version whose default backend order picks it."""
    version = _get("compute", compute, "torch_version", str, "2.13")
    parts = version.split(".")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() and len(p) <= 4 for p in parts):
        raise ScenarioError(f"compute.torch_version: expected a version such as '2.13' or '2.5.1', got {version[:40]!r}")
    return ComputeOptions(allow_tf32=_get("compute", compute, "allow_tf32", bool, False),
                          torch_compile=_get("compute", compute, "torch_compile", bool, False),
                          sdpa_backend=_get("compute", compute, "sdpa_backend", str, "auto", choices=SDPA_BACKENDS),
                          torch_version=tuple(int(p) for p in parts))


_NETWORK_KINDS = {"nics_per_node": int, "nic_gbps": float, "nic_efficiency": float, "rail_optimized": bool,
                  "oversubscription": float, "hop_latency_s": float, "host_overhead_s": float}


def _network(hardware: dict, profile: Network) -> Network | None:
    """`hardware.network`: the profile's NICs with the keys given replaced (None when the key is absent)."""
    if "network" not in hardware:
        return None
    network = _expect("hardware.network", hardware["network"])
    reject_unknown_keys("hardware.network", network, set(NETWORK_SCALARS))
    given = {}
    for key in network:
        value = _get("hardware.network", network, key, _NETWORK_KINDS[key])
        given[key] = check_network_value(f"hardware.network.{key}", key, value)
    return replace(profile, **given)


def parse_scenario(data: Any, name: str = "scenario", base: Path | None = None) -> Scenario:
    """Check and resolve scenario data; relative file paths inside it are taken from `base`."""
    base = base or Path.cwd()
    data = _expect("scenario", data)
    reject_unknown_keys("scenario", data, {"name", "model", "training", "hardware", "fsdp", "compute", "report"})
    if "model" not in data:
        raise ScenarioError("model: missing (a preset name, transformer dimensions, hf_config or workload)")
    model = data["model"]
    model = _expect("model", {"preset": model} if isinstance(model, str) else model)

    training = _expect("training", data.get("training"))
    reject_unknown_keys("training", training, {"micro_batch", "seq_len", "grad_accumulation", "optimizer",
                                       "activation_checkpointing", "optimizer_impl", "momentum"})
    if isinstance(data["model"], dict) and "workload" in data["model"]:
        for key in ("micro_batch", "seq_len"):
            if key in training:
                raise ScenarioError(f"training.{key}: not allowed with model.workload (the trace fixed the batch shape)")
    micro_batch = _get("training", training, "micro_batch", int, 1, positive=True)
    seq_len = _get("training", training, "seq_len", int, 2048, positive=True)
    grad_accumulation = _get("training", training, "grad_accumulation", int, 1, positive=True)
    optimizer = _get("training", training, "optimizer", str, "adamw", choices=OPTIMIZERS)
    optimizer_impl = _get("training", training, "optimizer_impl", str, "foreach", choices=IMPLEMENTATIONS)
    momentum = _get("training", training, "momentum", bool, True)
    if "momentum" in training and optimizer != "sgd":
        raise ScenarioError(f"training.momentum: only SGD takes it (Adam's moments are always kept), got optimizer {optimizer}")
    if optimizer_impl == "fused" and optimizer == "sgd":
        raise ScenarioError("training.optimizer_impl: fused SGD does not run on FSDP2's sharded DTensor parameters; "
                            "use foreach or for_loop")
    ac = _get("training", training, "activation_checkpointing", str, "none", choices=("none", "full"))

    hardware = _expect("hardware", data.get("hardware"))
    reject_unknown_keys("hardware", hardware, {"profile", "nodes", "gpus_per_node", "network"})
    gpu = load_profile(_get("hardware", hardware, "profile", str))
    nodes = _get("hardware", hardware, "nodes", int, 1, positive=True)
    gpn = _get("hardware", hardware, "gpus_per_node", int, gpu.gpus_per_node, positive=True)
    cluster = Cluster(gpu, nodes, gpn, _network(hardware, gpu.fabric.network))
    world = cluster.world_size

    fsdp = _expect("fsdp", data.get("fsdp"))
    reject_unknown_keys("fsdp", fsdp, {"version", "wrap", "blocks_per_unit", "min_params", "sharding_strategy",
                               "shard_size", "reshard_after_forward", "reshard_last_block", "backward_prefetch",
                               "requires_gradient_sync",
                               "mixed_precision"})
    version = _get("fsdp", fsdp, "version", int, 2, choices=(2,))
    del version  # FSDP1 mode is not modelled yet; only 2 is accepted
    wrap = _get("fsdp", fsdp, "wrap", str, "per_block", choices=POLICIES)
    k = _get("fsdp", fsdp, "blocks_per_unit", int, 1, positive=True)
    min_params = _get("fsdp", fsdp, "min_params", int, 100_000_000, positive=True)
    strategy = _get("fsdp", fsdp, "sharding_strategy", str, "FULL_SHARD", choices=tuple(STRATEGIES))
    mesh, reshard = STRATEGIES[strategy]
    raf = _get("fsdp", fsdp, "reshard_after_forward", bool, None)
    if raf is not None and "sharding_strategy" in fsdp and raf != reshard:
        raise ScenarioError(f"fsdp.reshard_after_forward: {raf} contradicts sharding_strategy {strategy} (which implies {reshard})")
    reshard = reshard if raf is None else raf
    # false: m.set_modules_to_backward_prefetch([m]) on every FSDP module m (not [], which keeps the default)
    backward_prefetch = _get("fsdp", fsdp, "backward_prefetch", bool, True)
    reshard_last_block = _get("fsdp", fsdp, "reshard_last_block", bool, True)
    requires_gradient_sync = _get("fsdp", fsdp, "requires_gradient_sync", bool, True)
    shard_size = {"1d": world, "2d": gpn, "replicate": 1}[mesh]
    shard_size = _get("fsdp", fsdp, "shard_size", int, shard_size, positive=True)
    if world % shard_size:
        raise ScenarioError(f"fsdp.shard_size: {shard_size} does not divide the world size {world} "
                            f"({nodes} nodes x {gpn} GPUs)")
    mp = _expect("fsdp.mixed_precision", fsdp.get("mixed_precision"))
    reject_unknown_keys("fsdp.mixed_precision", mp, {"param_dtype", "reduce_dtype"})
    dtypes = tuple(d for d in DTYPE_BYTES if d in ("fp32", "bf16", "fp16"))
    param_dtype = _get("fsdp.mixed_precision", mp, "param_dtype", str, "bf16", choices=dtypes)
    reduce_dtype = _get("fsdp.mixed_precision", mp, "reduce_dtype", str, "fp32", choices=dtypes)
    gpu.flops(param_dtype)  # the GPU must support the compute dtype

    report = _expect("report", data.get("report"))
    reject_unknown_keys("report", report, {"safety_margin"})
    margin = _get("report", report, "safety_margin", float, 0.10)
    if not 0 <= margin < 1:
        raise ScenarioError(f"report.safety_margin: {margin} must be in [0, 1)")

    workload = _workload(model, micro_batch=micro_batch, seq_len=seq_len, act_dtype=param_dtype, base=base)
    _check_scale(workload)
    compute = _expect("compute", data.get("compute"))
    reject_unknown_keys("compute", compute, {"trace", "allow_tf32", "torch_compile", "sdpa_backend", "torch_version"})
    options = _compute_options(compute)
    if "trace" in compute:
        trace = Path(_get("compute", compute, "trace", str))
        workload = apply_profile_trace(workload, trace if trace.is_absolute() else base / trace)
    units = make_units(workload, wrap, k=k, min_params=min_params)
    settings = FSDPSettings(shard_size=shard_size, replicate_size=world // shard_size, reshard_after_forward=reshard,
                            param_dtype=param_dtype, reduce_dtype=reduce_dtype, optimizer=optimizer,
                            optimizer_impl=optimizer_impl, momentum=momentum,
                            activation_checkpointing=ac == "full", backward_prefetch=backward_prefetch,
                            reshard_last_unit=reshard_last_block,
                            grad_accumulation=grad_accumulation, requires_gradient_sync=requires_gradient_sync)
    return Scenario(name=_get("scenario", data, "name", str, name), workload=workload, units=units, cluster=cluster,
                    settings=settings, wrap=wrap, sharding_strategy=strategy, safety_margin=margin, compute=options)


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    return parse_scenario(read_data(path, "scenario"), name=path.stem, base=path.parent)
