"""A node's fabric as NCCL sees it, loaded from a profile's `fabric:` mapping into frozen dataclasses.

Three parts, one per way a collective can travel:
- `ring`: the scale-up links inside a node (NVLink/NVSwitch, xGMI, PCIe) — the nccl-tests busbw plateau of
  a ring over the node's GPUs for each collective, NCCL's per-hop latency there, and the measured size curve;
- `nvls`: NVLink SHARP all-reduce inside an NVSwitch node (Hopper, Blackwell), or `None`;
- `network`: the node's NICs (count, line rate, goodput efficiency, rails, oversubscription), the per-hop
  network latency, the host's network overhead, and the measured multi-node size curve.

The loader checks the keys exactly and every figure's range, naming `<path>: fabric.<key>` on failure.
Units are in the key names: bytes, B/s, GB/s (1e9 B/s), Gb/s, seconds.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field

from fsdp_sim.datafile import check_mapping
from fsdp_sim.errors import ScenarioError, show

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
SCALE_UP_LINKS = {"nvswitch": "nvlink", "xgmi_mesh": "xgmi", "pcie": "pcie"}  # fabric.scale_up -> link name
LAYOUTS = ("rail_optimized", "fat_tree")  # hardware.network.topology (topology.py lays them out)
NETWORK_SCALARS = ("nics_per_node", "nic_gbps", "nic_efficiency", "rail_optimized", "oversubscription",
                   "hop_latency_s", "host_overhead_s")


def bus_factor(kind: str, ranks: int) -> float:
    """nccl-tests busbw / algbw [S1, S2]: (n-1)/n for all-gather and reduce-scatter, 2(n-1)/n for all-reduce."""
    return (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks


@dataclass(frozen=True, slots=True)
class SizeCurve:
    """Measured nccl-tests busbw of `collective` against message size, on `ranks` GPUs over `nodes` nodes,
    where NCCL's tuner latency is `latency_s` (the latency the measured times already contain).

    The curve is kept as a function of wire time w = S x bus_factor / plateau (the time the bytes alone
    would take at the plateau, the largest size's busbw): `fraction(w)` is the busbw reached, as a fraction
    of the plateau, interpolated linearly in log(w)-log(busbw). Indexed so, a faster or slower link of the
    same shape reaches its plateau at proportionally larger or smaller messages, which is exact for a fixed
    latency plus bytes over bandwidth. Two rules make it a time model: a longer wire time never finishes
    sooner (where the measurement says otherwise, the larger size's busbw is capped to keep its time), and
    below the smallest measured size the time stays that size's time (latency-bound).
    """

    collective: str
    ranks: int
    nodes: int
    latency_s: float
    size_bytes: tuple[float, ...]
    busbw_GBps: tuple[float, ...]
    _log_wire: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _log_fractions: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        plateau = self.busbw_GBps[-1]
        fractions = [self.busbw_GBps[0] / plateau]
        for i in range(1, len(self.size_bytes)):  # time_i = w_i / c_i must not drop below time_{i-1}
            cap = fractions[-1] * self.size_bytes[i] / self.size_bytes[i - 1]
            fractions.append(min(self.busbw_GBps[i] / plateau, cap))
        factor = bus_factor(self.collective, self.ranks) / (plateau * 1e9)
        object.__setattr__(self, "_log_wire", tuple(math.log(s * factor) for s in self.size_bytes))
        object.__setattr__(self, "_log_fractions", tuple(math.log(c) for c in fractions))

    def fraction(self, wire_s: float) -> float:
        xs, ys = self._log_wire, self._log_fractions
        x = math.log(wire_s)
        if x >= xs[-1]:
            return 1.0
        if x <= xs[0]:
            return math.exp(ys[0] + x - xs[0])
        i = bisect_right(xs, x) - 1
        return math.exp(ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i]))


@dataclass(frozen=True, slots=True)
class Ring:
    """Ring collectives over one node's scale-up links: busbw plateaus (B/s), per-hop latency (s)."""

    all_gather_busbw_Bps: float
    reduce_scatter_busbw_Bps: float
    all_reduce_busbw_Bps: float
    hop_latency_s: float
    size_curve: SizeCurve

    def busbw_Bps(self, kind: str) -> float:
        return getattr(self, f"{kind}_busbw_Bps")


@dataclass(frozen=True, slots=True)
class Nvls:
    """NVLink SHARP all-reduce inside one NVSwitch node: busbw plateau (B/s), NCCL's NVLS latency (s)."""

    all_reduce_busbw_Bps: float
    hop_latency_s: float
    size_curve: SizeCurve


@dataclass(frozen=True, slots=True)
class Network:
    """The node's NICs and the fabric between nodes (a scenario's `hardware.network` may override the scalars).

    `topology`, `spines` and `nodes_per_leaf` lay out the switches above the NICs (`topology.py`); only a
    scenario sets them (None: the layout `rail_optimized` names, the layout's default switch counts)."""

    nics_per_node: int
    nic_gbps: float
    nic_efficiency: float
    rail_optimized: bool
    oversubscription: float
    hop_latency_s: float
    host_overhead_s: float
    size_curve: SizeCurve
    topology: str | None = None
    spines: int | None = None
    nodes_per_leaf: int | None = None

    @property
    def node_goodput_Bps(self) -> float:
        """Sum of the node's NIC goodput, B/s. A rail-optimized fabric keeps a ring's NIC-to-NIC hops on one
        rail [C30 via component-timing 6.4], so the core's oversubscription applies only without rails. With
        oversubscription above 1, `graph_pricing.py` prices the rings on the cluster graph instead (only the hops
        that cross a leaf's uplinks share them); this uniform charge stays for a group the graph cannot lay."""
        core = 1.0 if self.rail_optimized else self.oversubscription
        return self.nics_per_node * self.nic_gbps * 1e9 / 8 * self.nic_efficiency / core


@dataclass(frozen=True, slots=True)
class Fabric:
    """A node of `gpus_per_node` GPUs on `scale_up` links, its NICs, and NCCL's channels per collective."""

    scale_up: str
    gpus_per_node: int
    nccl_channels: int
    ring: Ring
    nvls: Nvls | None
    network: Network

    @property
    def scale_up_link(self) -> str:
        return SCALE_UP_LINKS[self.scale_up]

    def scale_up_share(self, gpus: float) -> float:
        """Fraction of the ring plateau a ring through `gpus` GPUs of one node reaches. A switch (or the PCIe
        host) gives every GPU its full bandwidth whatever the ring's size; on a full mesh a ring of g GPUs
        uses only the g-1 links among them (MI300X: 312.9 GB/s with 8 GPUs, 47.7 with 2 [S8])."""
        if self.scale_up != "xgmi_mesh" or self.gpus_per_node <= 1:
            return 1.0
        return min(1.0, max(gpus - 1, 0.0) / (self.gpus_per_node - 1))


# ---- loading --------------------------------------------------------------------------------------
# the largest value of each kind of figure, and the smallest of a rate: far outside any real fabric, so
# that every collective's time stays finite
_LIMITS = {"latency": (0.0, 1.0), "rate": (1e-3, 1e16), "count": (1, 1 << 20), "size": (1.0, 2.0 ** 60),
           "fraction": (1e-3, 1.0), "factor": (1.0, 1000.0)}


def _kind(where: str) -> str:
    leaf = where.rsplit(".", 1)[-1]
    if leaf.endswith("latency_s") or leaf.endswith("overhead_s"):
        return "latency"
    if leaf in ("ranks", "nodes", "nccl_channels", "nics_per_node"):
        return "count"
    if leaf in ("nic_efficiency", "oversubscription"):
        return "fraction" if leaf == "nic_efficiency" else "factor"
    return "size" if leaf == "size_bytes" else "rate"


def _positive(where: str, value, *, integer: bool = False) -> float:
    low, high = _LIMITS[_kind(where)]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and low <= value <= high):
        raise ScenarioError(f"{where}: must be a positive number in [{low:g}, {high:g}], got {show(value)}")
    if integer:
        if value != int(value):
            raise ScenarioError(f"{where}: must be an integer, got {show(value)}")
        return int(value)
    return float(value)


def check_network_value(where: str, key: str, value):
    """One network scalar, checked: counts and rates positive, efficiency in (0, 1], oversubscription >= 1."""
    if key == "rail_optimized":
        if not isinstance(value, bool):
            raise ScenarioError(f"{where}: must be true or false, got {value!r}")
        return value
    number = _positive(where, value, integer=key == "nics_per_node")
    if key == "nic_efficiency" and number > 1:
        raise ScenarioError(f"{where}: must be in (0, 1], got {value!r}")
    if key == "oversubscription" and not 1 <= number <= 1000:
        raise ScenarioError(f"{where}: must be in [1, 1000] (1 = non-blocking), got {value!r}")
    return number


def _curve(where: str, data) -> SizeCurve:
    data = check_mapping(where, data, {"collective", "ranks", "nodes", "latency_s", "size_bytes", "busbw_GBps"})
    if not isinstance(data["collective"], str) or data["collective"] not in KINDS:
        raise ScenarioError(f"{where}.collective: {show(data['collective'])} is not one of {list(KINDS)}")
    ranks, nodes = _positive(f"{where}.ranks", data["ranks"], integer=True), _positive(f"{where}.nodes", data["nodes"], integer=True)
    if ranks < 2 or nodes > ranks:
        raise ScenarioError(f"{where}: needs 2 or more ranks and at most one node per rank, got {ranks} ranks on {nodes} nodes")
    sizes, busbw = data["size_bytes"], data["busbw_GBps"]
    for key, values in (("size_bytes", sizes), ("busbw_GBps", busbw)):
        if not isinstance(values, list) or len(values) < 2:
            raise ScenarioError(f"{where}.{key}: must be a list of two or more numbers")
    if len(sizes) != len(busbw):
        raise ScenarioError(f"{where}: size_bytes has {len(sizes)} entries, busbw_GBps {len(busbw)}")
    sizes = tuple(_positive(f"{where}.size_bytes", s) for s in sizes)
    busbw = tuple(_positive(f"{where}.busbw_GBps", b) for b in busbw)
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ScenarioError(f"{where}.size_bytes: sizes must increase")
    if max(busbw) > busbw[-1]:
        raise ScenarioError(f"{where}.busbw_GBps: the largest size's busbw must be the plateau (the largest value)")
    return SizeCurve(data["collective"], ranks, nodes, _positive(f"{where}.latency_s", data["latency_s"]), sizes, busbw)


def parse_fabric(data, where: str, gpus_per_node: int) -> Fabric:
    """`data` is a profile's `fabric:` mapping; `where` prefixes error messages (`<path>: fabric`)."""
    data = check_mapping(where, data, {"scale_up", "nccl_channels", "ring", "nvls", "network"})
    if not isinstance(data["scale_up"], str) or data["scale_up"] not in SCALE_UP_LINKS:
        raise ScenarioError(f"{where}.scale_up: {show(data['scale_up'])} is not one of {sorted(SCALE_UP_LINKS)}")
    ring = check_mapping(f"{where}.ring", data["ring"], {f"{k}_busbw_Bps" for k in KINDS} | {"hop_latency_s", "size_curve"})
    ring = Ring(*(_positive(f"{where}.ring.{k}_busbw_Bps", ring[f"{k}_busbw_Bps"]) for k in KINDS),
                _positive(f"{where}.ring.hop_latency_s", ring["hop_latency_s"]), _curve(f"{where}.ring.size_curve", ring["size_curve"]))
    nvls = None
    if data["nvls"] is not None:
        raw = check_mapping(f"{where}.nvls", data["nvls"], {"all_reduce_busbw_Bps", "hop_latency_s", "size_curve"})
        nvls = Nvls(_positive(f"{where}.nvls.all_reduce_busbw_Bps", raw["all_reduce_busbw_Bps"]),
                    _positive(f"{where}.nvls.hop_latency_s", raw["hop_latency_s"]), _curve(f"{where}.nvls.size_curve", raw["size_curve"]))
    raw = check_mapping(f"{where}.network", data["network"], set(NETWORK_SCALARS) | {"size_curve"})
    network = Network(*(check_network_value(f"{where}.network.{k}", k, raw[k]) for k in NETWORK_SCALARS),
                      _curve(f"{where}.network.size_curve", raw["size_curve"]))
    return Fabric(data["scale_up"], gpus_per_node, _positive(f"{where}.nccl_channels", data["nccl_channels"], integer=True),
                  ring, nvls, network)
