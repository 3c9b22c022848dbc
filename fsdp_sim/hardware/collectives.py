"""Time of one NCCL collective over the node's real fabric, from measured components.

Pure functions of (collective, bytes, process group, fabric), testable without SimPy.

Which algorithm. All-gather and reduce-scatter run Ring (NCCL's NVLS AG/RS needs SHARP across nodes, and
measured AG/RS on 8xH200 ran Ring [S8]). All-reduce runs NVLS where the node has NVLink SHARP and the group
is one node of more than 4 GPUs (engaged only above 4 [S8], hardware.md 3.5), Ring otherwise (across
nodes the NICs bound it either way).

Plateau bus bandwidth B (nccl-tests busbw [S1]). Inside one node: the profile's measured ring plateau for
that collective (or the NVLS all-reduce plateau), times the share of the node's links a ring of g GPUs uses
(1 on a switch, (g-1)/(G-1) on a full mesh). Across nodes, the NIC-sum rule (hardware.md 3.3,
component-timing 6.4): every ring channel enters and leaves each node once, and NCCL spreads its channels
over all the node's NICs, so B = min(intra-node ring plateau, node NIC goodput x g/G), where the node NIC
goodput is nics x line rate x efficiency (/ oversubscription off-rail) and g/G is the group's share of the
node's G GPUs (the other G/g groups run the same collective at the same time: SPMD).

Size dependence. B is reached only by large messages. A measured busbw(S) curve gives the shape: 8xA100
ring all-reduce for ring inside a node, 8xH200 NVLS all-reduce for NVLS, 4x8 B200 all-reduce for anything
across nodes [S8] (log-interpolated, normalised to its plateau, see `SizeCurve`). It is indexed by wire time
w = S f / B (f = (n-1)/n, 2(n-1)/n for all-reduce; S = the gathered output of an AG, the input of an RS,
the AR buffer, as nccl-tests counts it), not by S: under a fixed latency plus bytes over bandwidth the
fraction of the plateau reached depends on w alone, so a slower link (one NIC's share, PCIe) reaches its
plateau at smaller messages and a faster one at larger, instead of stretching the curve's latency by the
bandwidth ratio. The curve's time is then w / c(w).

Latency, without counting it twice. That time already contains the latency of the measured configuration
(the curve's all-reduce on n_ref GPUs over N_ref nodes). NCCL's tuner (the NCCL the run's torch ships,
software.py [C28]; constants [C27]) says how latency changes from there: ring AG/RS = base + (n-1-(N-1)) x
intraLat + (N-1) x interLat, all-reduce twice the steps (2N network steps before NCCL 2.26, 2(N-1) after), intraLat = max(intraLat, 3 x host net overhead) across nodes,
and the multi-node ring Simple all-reduce latency x1.4 once S/(channels x n) >= 64 B. So

    t = w / c(w) + L(kind, n, N) - L_ref

with L from the tuner on this fabric's hop latencies and L_ref the tuner latency of the measured
configuration, stored with the curve (`SizeCurve.latency_s`); at the measured configuration t is the
measurement. When the group's latency is below the reference's, the difference is negative, so t is
floored at w + (w / c(w) - w) x L / L_ref: the curve's overhead above pure wire time shrinks no faster than
the tuner latency does. Hence busbw never exceeds B and t grows with S.

Known limits: the latency is the Simple protocol's (FSDP messages are MiB-sized; below ~1 MiB NCCL picks
LL/LL128 [S8], so tiny messages at large scale are pessimistic); no Tree/NVLSTree/PAT/SHARP; the ring curve
shape of NVSwitch A100 is assumed for every scale-up fabric, the B200 EFA shape for every network; the
NIC-sum plateau holds at any node count, where measurements fall below it at scale (32 nodes of 8 H100:
all-gather of 2 GB ~200 GB/s against all-reduce ~340, hardware.md 3.3; "the tuner model is optimistic at
scale", component-timing 6.4), so all-gathers and reduce-scatters over tens of nodes are optimistic; NVLS
runs at its 8-GPU plateau from 5 GPUs (H200 gains 1.14x over Ring at 5 to 1.29x at 8, B200 engages at 6:
hardware.md 3.5; a TP group divides a node, so only 5- to 7-GPU nodes see it); NCCL's constants are
2.21.5's and 2.27.3's, the versions read: older and newer releases take the nearest.

Where these closed forms cannot answer (a blocking core: `oversubscription` above 1; a NIC slow or down:
`variation.links`), `graph_pricing.py` finds B on the cluster graph and `collective_time` takes it as
`plateau_Bps`, the size curve and latency as here; on a uniform non-blocking fabric the two agree.

Links shared by collectives in flight on different process groups: `links_crossed` names the per-rank
resources a group's collective uses ("nvlink" / "xgmi" / "pcie" for this GPU's scale-up ports, "nic" for
its share of the node's NICs), `link_loads` how much of each it uses running alone (1 on its bottleneck),
and `shared_slowdown` how much each of several collectives in flight is slowed when they share links.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from fsdp_sim.hardware.fabric import KINDS, Fabric, SizeCurve, bus_factor
from fsdp_sim.hardware.software import ring_all_reduce_inter_steps

DEFAULT_NCCL = (2, 27, 3)               # the version the measured curves' tuner latencies are computed with [C27]
RING_SIMPLE_BASE_LATENCY_S = 8.4e-6     # baseLat Ring Simple, NCCL 2.21.5-2.27.3 [C27] (hardware.md 3.2 [S3])
NVLS_BASE_LATENCY_S = 0.0               # baseLat NVLS = 0 [C27]
SIMPLE_NET_OVERHEAD_FACTOR = 3.0        # multi-node rings: intraLat = max(intraLat, netOverhead x 3) for Simple [C27]
RING_PLATEAU_FACTOR = 1.4               # multi-node ring Simple all-reduce latency x1.4 (sm80+; x1.9 before) [C27]
PLATEAU_MIN_BYTES_PER_RANK_CHANNEL = 64  # ... once nBytes / (nChannels x nRanks) >= 64 [C27] (tuning.cc)
NVLS_MIN_GPUS = 5                        # NVLS engaged only above 4 GPUs in the communicator [S8] (hardware.md 3.5)


@dataclass(frozen=True, slots=True)
class ProcessGroup:
    """A process group of `ranks` ranks spread evenly over `nodes` nodes."""

    ranks: int
    nodes: int

    def __post_init__(self) -> None:
        if self.ranks < 1 or not 1 <= self.nodes <= self.ranks:
            raise ValueError(f"ProcessGroup: {self.ranks} ranks on {self.nodes} nodes is not a layout")

    @property
    def ranks_per_node(self) -> float:
        return self.ranks / self.nodes


def algorithm(kind: str, group: ProcessGroup, fabric: Fabric) -> str:
    """"nvls" for an all-reduce on one NVLS node over more than 4 GPUs, else "ring"."""
    _check_kind(kind)
    nvls = kind == "all_reduce" and fabric.nvls is not None and group.nodes == 1 and group.ranks >= NVLS_MIN_GPUS
    return "nvls" if nvls else "ring"


def tuner_latency_s(kind: str, algo: str, ranks: int, nodes: int, fabric: Fabric, nbytes: float = 0.0,
                    nccl: tuple[int, ...] = DEFAULT_NCCL) -> float:
    """NCCL's tuner latency (Simple protocol) of one collective on `ranks` ranks over `nodes` nodes [C27]."""
    if ranks == 1:
        return 0.0
    if algo == "nvls":
        return NVLS_BASE_LATENCY_S + fabric.nvls.hop_latency_s  # single node: base + intraLat
    net = fabric.network
    if kind == "all_reduce":  # reduce-scatter then all-gather
        steps, inter = 2 * (ranks - 1), ring_all_reduce_inter_steps(nodes, nccl) if nodes > 1 else 0
    else:
        steps, inter = ranks - 1, nodes - 1
    intra = fabric.ring.hop_latency_s
    if nodes > 1:
        intra = max(intra, SIMPLE_NET_OVERHEAD_FACTOR * net.host_overhead_s)
    latency = RING_SIMPLE_BASE_LATENCY_S + (steps - inter) * intra + inter * net.hop_latency_s
    if kind == "all_reduce" and nodes > 1 and nbytes / (fabric.nccl_channels * ranks) >= PLATEAU_MIN_BYTES_PER_RANK_CHANNEL:
        latency *= RING_PLATEAU_FACTOR
    return latency


def _intra_busbw(kind: str, group: ProcessGroup, fabric: Fabric) -> float:
    """The ring plateau through this group's GPUs of one node; no scale-up hop with one GPU per node."""
    g = group.ranks_per_node
    return fabric.ring.busbw_Bps(kind) * fabric.scale_up_share(g) if g > 1 else math.inf


def _nic_busbw(group: ProcessGroup, fabric: Fabric) -> float:
    """This group's share of the node's NIC goodput: g of the node's G GPUs use g/G of its NICs."""
    return fabric.network.node_goodput_Bps * min(1.0, group.ranks_per_node / fabric.gpus_per_node)


def plateau_busbw_Bps(kind: str, group: ProcessGroup, fabric: Fabric) -> float:
    """Large-message bus bandwidth B of `kind` on `group` (the NIC-sum rule across nodes)."""
    if algorithm(kind, group, fabric) == "nvls":
        return fabric.nvls.all_reduce_busbw_Bps
    intra = _intra_busbw(kind, group, fabric)
    return intra if group.nodes == 1 else min(intra, _nic_busbw(group, fabric))


def _size_curve(algo: str, group: ProcessGroup, fabric: Fabric) -> SizeCurve:
    if algo == "nvls":
        return fabric.nvls.size_curve
    return fabric.network.size_curve if group.nodes > 1 else fabric.ring.size_curve


def collective_time(kind: str, nbytes: float, group: ProcessGroup, fabric: Fabric,
                    nccl: tuple[int, ...] = DEFAULT_NCCL, plateau_Bps: float | None = None) -> float:
    """Seconds for one `kind` collective of `nbytes` (AG: gathered output; RS: full input; AR: the buffer)
    under the tuner of NCCL `nccl`; `plateau_Bps`: the plateau B found on the cluster graph instead of
    the closed form's (`graph_pricing.py`), the size curve and latencies as ever."""
    _check_kind(kind)
    if group.ranks == 1 or nbytes <= 0:
        return 0.0
    algo = algorithm(kind, group, fabric)
    curve = _size_curve(algo, group, fabric)
    plateau = plateau_Bps if plateau_Bps is not None else plateau_busbw_Bps(kind, group, fabric)
    wire = nbytes * bus_factor(kind, group.ranks) / plateau
    shaped = wire / curve.fraction(wire)  # the measured curve's time, its own configuration's latency included
    latency = tuner_latency_s(kind, algo, group.ranks, group.nodes, fabric, nbytes, nccl)
    latency_ref = curve.latency_s
    floor = wire + (shaped - wire) * min(1.0, latency / latency_ref)
    return max(shaped + latency - latency_ref, floor)


def busbw_Bps(kind: str, nbytes: float, group: ProcessGroup, fabric: Fabric) -> float:
    """The nccl-tests busbw the model predicts for one collective of `nbytes`."""
    return nbytes * bus_factor(kind, group.ranks) / collective_time(kind, nbytes, group, fabric)


# ---- links shared by collectives in flight ----------------------------------------------------------
def links_crossed(group: ProcessGroup, fabric: Fabric) -> frozenset[str]:
    """Per-rank links a collective on `group` uses: the scale-up ports when the group has 2+ GPUs in a node,
    "nic" when it spans nodes; a group of one crosses nothing."""
    links = set()
    if group.ranks_per_node > 1:
        links.add(fabric.scale_up_link)
    if group.nodes > 1:
        links.add("nic")
    return frozenset(links)


def link_loads(kind: str, group: ProcessGroup, fabric: Fabric) -> dict[str, float]:
    """Fraction of each crossed link's capacity the collective uses running alone: 1.0 on its bottleneck."""
    if group.ranks == 1:
        return {}
    busbw = plateau_busbw_Bps(kind, group, fabric)
    capacity = {fabric.scale_up_link: (fabric.nvls.all_reduce_busbw_Bps if algorithm(kind, group, fabric) == "nvls"
                                       else _intra_busbw(kind, group, fabric)),
                "nic": _nic_busbw(group, fabric)}
    return {link: busbw / capacity[link] for link in links_crossed(group, fabric)}


def shared_slowdown(in_flight: Sequence[Set[str] | Mapping[str, float]]) -> tuple[float, ...]:
    """How much each collective in flight is slowed (>= 1) by the others on the links it crosses.

    Each entry is a collective's links: a set (it saturates each, load 1) or `link_loads`' mapping. A link
    whose loads sum to L > 1 is shared in proportion, so everything crossing it runs L times slower; a
    collective is slowed by its most loaded link. Two collectives alone on one link: (2.0, 2.0).
    """
    loads = [dict(x) if isinstance(x, Mapping) else dict.fromkeys(x, 1.0) for x in in_flight]
    total: dict[str, float] = defaultdict(float)
    for entry in loads:
        for link, load in entry.items():
            total[link] += load
    return tuple(max([1.0, *(total[link] for link in entry)]) for entry in loads)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"collective kind {kind!r} is not one of {KINDS}")
