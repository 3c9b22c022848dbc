"""GPU profiles loaded from `hardware_profiles/*.yaml` into frozen dataclasses.

The loader checks the keys exactly (an unknown or missing key is an error naming it) and that every
figure is a positive number. Units live in the key names: bytes, bytes/s, FLOP/s, seconds. The node's
links are a `fabric:` mapping (`fsdp_sim.hardware.fabric`); a scenario may override its NICs. An optional
`host:` mapping is the GPU's link to host memory and the node's host memory (`fsdp_sim.hardware.host_link`). A `sustained:` mapping says how a long training step's kernels run
beside the short benchmarks the profile's rates come from (`Sustained`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from fsdp_sim.datafile import check_mapping, read_data
from fsdp_sim.dtypes import DTYPE_BYTES
from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.hardware.fabric import Fabric, Network, parse_fabric
from fsdp_sim.hardware.host_link import HostLink, parse_host

REPO_PROFILES = Path(__file__).resolve().parents[2] / "hardware_profiles"
_TOP_KEYS = {"name", "description", "arch", "sm_count", "memory_bytes", "hbm_bandwidth_Bps", "peak_flops",
             "matmul_efficiency", "gpus_per_node", "fabric", "cuda_context_bytes", "nccl_bytes", "sustained"}
# the host link and memory (hardware/host_link.py): only offload needs them; the large-GEMM fraction of the
# fp8 peak where a measurement of this part exists (else kernel_data.FP8_EFFICIENCY by architecture)
_OPTIONAL_KEYS = {"host", "fp8_matmul_efficiency"}
_PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a file stem in a profile folder
_ARCH = re.compile(r"sm\d{2,3}|gfx\d{3,4}[a-z]?")  # CUDA compute capability (sm80, sm90, sm100) or AMD target (gfx942)


@dataclass(frozen=True, slots=True)
class Sustained:
    """A GPU through a training step of seconds, repeated for hours, against the benchmarks of a few hundred
    milliseconds on a cool GPU that its rates come from (MAMF, FlashAttention's figures, memory-bound
    kernel benchmarks): it settles at the clock its power limit allows under dense tensor-core load
    (`../shared/reference/in-situ.md` 1-2). Compute-bound kernels (GEMM, attention) run at `compute` times
    their benchmark rate, memory-bound ones at `memory` times theirs (HBM's clock does not move at these
    limits: in-situ.md 4). The clocks are stated where a source gives them (None where none does)."""

    power_limit_w: float
    benchmark_clock_mhz: float | None  # the SM clock the profile's benchmark figures ran at
    sm_clock_mhz: float | None  # the SM clock settled under dense tensor-core load at the power limit
    compute: float  # compute-bound kernels' rate, as a fraction of their benchmark rate
    memory: float  # memory-bound kernels' bandwidth, as a fraction of their benchmark bandwidth
    source: str  # where the derating comes from (printed by benchmarks/bench_components.py)
    # the step's pace (hardware/variation.py `paced_profile`): compute-bound time x this, a measured module
    # time too (a profiler trace's, billed as compute-bound: hardware/compute.py); 1 unpaced
    pace: float = 1.0


BENCHMARK_RATES = Sustained(0.0, None, None, 1.0, 1.0, "benchmark rates, no derating")


@dataclass(frozen=True, slots=True)
class GpuProfile:
    name: str
    description: str
    arch: str
    sm_count: int
    memory_bytes: int
    hbm_bandwidth_Bps: float
    peak_flops: dict[str, float]
    matmul_efficiency: float
    gpus_per_node: int
    fabric: Fabric
    cuda_context_bytes: int
    nccl_bytes: int
    host: HostLink | None = None
    fp8_matmul_efficiency: float | None = None
    sustained: Sustained = BENCHMARK_RATES

    @property
    def memory_Bps(self) -> float:
        """Device-memory bandwidth through a long step: the vendor peak, derated as `sustained` says."""
        return self.hbm_bandwidth_Bps * self.sustained.memory

    def at_benchmark_rates(self) -> GpuProfile:
        """This GPU as its short benchmarks see it (no sustained derating): benchmarks/bench_components.py
        prints both."""
        return replace(self, sustained=BENCHMARK_RATES)

    def matmul_peak(self, dtype: str, allow_tf32: bool = False) -> float:
        """Dense peak FLOP/s of matmuls in `dtype`: fp32 ones run on TF32 tensor cores only when allowed
        (`torch.backends.cuda.matmul.allow_tf32`, off by default)."""
        return self.flops("tf32" if dtype == "fp32" and allow_tf32 and "tf32" in self.peak_flops else dtype)

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` (fp32: the non-tensor-core rate)."""
        if dtype not in self.peak_flops:
            raise ScenarioError(f"fsdp.mixed_precision.param_dtype: {dtype} is not supported by {self.name} "
                                f"(it lists {sorted(self.peak_flops)})")
        return self.peak_flops[dtype]


@dataclass(frozen=True, slots=True)
class Cluster:
    """`nodes` x `gpus_per_node` identical GPUs: one NVLink-class domain per node, NICs between nodes.

    `network`, when set, replaces the profile's NICs (a scenario's `hardware.network`: the same GPU node
    behind another cloud's network, e.g. AWS p4d's 4x 100G EFA instead of DGX A100's 8x HDR).
    """

    gpu: GpuProfile
    nodes: int
    gpus_per_node: int
    network: Network | None = None
    host_memory_bytes: int | None = None  # per node: the scenario's hardware.host_memory_gb, else the profile's

    @property
    def host_capacity_bytes(self) -> int | None:
        """Host memory of one node: the scenario's figure, else the profile's (None if it has none)."""
        if self.host_memory_bytes is not None:
            return self.host_memory_bytes
        return self.gpu.host.memory_bytes if self.gpu.host is not None else None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def fabric(self) -> Fabric:
        """The effective fabric: the profile's, with the scenario's network in place of its own."""
        fabric = self.gpu.fabric
        return fabric if self.network is None else replace(fabric, network=self.network)


# (smallest, largest) of each figure: far outside any GPU, so every time and byte count stays finite and exact
_RANGES = {"sm_count": (1, 1 << 16), "memory_bytes": (1 << 20, 1 << 50), "hbm_bandwidth_Bps": (1e9, 1e15),
           "peak_flops": (1e9, 1e18), "gpus_per_node": (1, 1024), "cuda_context_bytes": (1, 1 << 40),
           "nccl_bytes": (1, 1 << 40),
           # a GEMM at under 0.1 % of peak is no GPU's: far below it, times stop being finite
           "matmul_efficiency": (1e-3, 1.0), "fp8_matmul_efficiency": (1e-3, 1.0),
           # a training step's rate against a short benchmark's: a power cap can halve it, nothing doubles it
           "power_limit_w": (1.0, 1e5), "clock_mhz": (1.0, 1e5), "derate": (0.05, 1.0)}


def _number(path: str, key: str, value, *, integer: bool = False, limits: str | None = None) -> float:
    low, high = _RANGES[limits or key.split(".")[0]]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ScenarioError(f"{path}: {key} must be a number in [{low:g}, {high:g}], got {show(value)}")
    if integer and value != int(value):
        raise ScenarioError(f"{path}: {key} must be an integer, got {show(value)}")
    return int(value) if integer else float(value)


def parse_profile(data, path: str) -> GpuProfile:
    check_mapping(path, data, _TOP_KEYS, _OPTIONAL_KEYS)
    peaks = data["peak_flops"]
    if not isinstance(peaks, dict) or not peaks or not all(k in DTYPE_BYTES for k in peaks):
        raise ScenarioError(f"{path}: peak_flops must map dtypes ({', '.join(DTYPE_BYTES)}) to FLOP/s")
    eff = _number(path, "matmul_efficiency", data["matmul_efficiency"])
    if not isinstance(data["arch"], str) or not _ARCH.fullmatch(data["arch"]):
        raise ScenarioError(f"{path}: arch must be like sm80, sm90, sm100 or gfx942, got {show(data['arch'])}")
    for key in ("name", "description"):
        if not isinstance(data[key], str) or not data[key].isprintable() or len(data[key]) > 200:
            raise ScenarioError(f"{path}: {key} must be one printable line of at most 200 characters, "
                                f"got {show(data[key])}")
    gpus_per_node = _number(path, "gpus_per_node", data["gpus_per_node"], integer=True)
    return GpuProfile(
        name=data["name"], description=data["description"], arch=data["arch"],
        sm_count=_number(path, "sm_count", data["sm_count"], integer=True),
        memory_bytes=_number(path, "memory_bytes", data["memory_bytes"], integer=True),
        hbm_bandwidth_Bps=_number(path, "hbm_bandwidth_Bps", data["hbm_bandwidth_Bps"]),
        peak_flops={k: _number(path, f"peak_flops.{k}", v) for k, v in peaks.items()},
        matmul_efficiency=eff,
        gpus_per_node=gpus_per_node, fabric=parse_fabric(data["fabric"], f"{path}: fabric", gpus_per_node),
        cuda_context_bytes=_number(path, "cuda_context_bytes", data["cuda_context_bytes"], integer=True),
        nccl_bytes=_number(path, "nccl_bytes", data["nccl_bytes"], integer=True),
        host=parse_host(data["host"], f"{path}: host", gpus_per_node) if "host" in data else None,
        fp8_matmul_efficiency=_fp8_efficiency(path, data),
        sustained=_sustained(path, data["sustained"]))


def _sustained(path: str, data) -> Sustained:
    where = f"{path}: sustained"
    check_mapping(where, data, {"power_limit_w", "benchmark_clock_mhz", "sm_clock_mhz", "compute_derate",
                                "memory_derate", "source"})
    clocks = {k: None if data[k] is None else _number(where, k, data[k], limits="clock_mhz")
              for k in ("benchmark_clock_mhz", "sm_clock_mhz")}
    if not isinstance(data["source"], str) or not data["source"].isprintable() or not data["source"].strip():
        raise ScenarioError(f"{where}.source: expected one printable line naming the derating's source")
    return Sustained(power_limit_w=_number(where, "power_limit_w", data["power_limit_w"]), **clocks,
                     compute=_number(where, "compute_derate", data["compute_derate"], limits="derate"),
                     memory=_number(where, "memory_derate", data["memory_derate"], limits="derate"),
                     source=data["source"])


def _fp8_efficiency(path: str, data: dict) -> float | None:
    if "fp8_matmul_efficiency" not in data:
        return None
    if "fp8" not in data["peak_flops"]:
        raise ScenarioError(f"{path}: fp8_matmul_efficiency needs an fp8 entry in peak_flops")
    return _number(path, "fp8_matmul_efficiency", data["fp8_matmul_efficiency"])


def _profile_dirs() -> list[Path]:
    """`$FSDP_SIM_PROFILES`, then `./hardware_profiles`, then the checkout's own folder."""
    extra = os.environ.get("FSDP_SIM_PROFILES")
    dirs = ([Path(extra)] if extra else []) + [Path.cwd() / "hardware_profiles", REPO_PROFILES]
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def profile_names() -> list[str]:
    return sorted({p.stem for d in _profile_dirs() for p in d.glob("*.yaml")})


@cache
def load_profile(name_or_path: str) -> GpuProfile:
    """A profile by name (a file stem in `hardware_profiles/`) or by path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        found = [d / f"{name_or_path}.yaml" for d in _profile_dirs()
                 if _PROFILE_NAME.fullmatch(name_or_path) and (d / f"{name_or_path}.yaml").is_file()]
        if not found:
            raise ScenarioError(f"hardware.profile: unknown profile {show(name_or_path)}, expected one of "
                                f"{profile_names()} or a path to a .yaml file")
        path = found[0]
    return parse_profile(read_data(path, "hardware.profile"), str(path))
