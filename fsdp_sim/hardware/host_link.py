"""The host side of a node: the link between each GPU and pinned host memory, the host's memory, and the
speed of torch.optim on the CPU. Pure functions of data, whatever runtime offloads (FSDP2's
`CPUOffloadPolicy`, FSDP1's `CPUOffload`, `torch.autograd.graph.save_on_cpu`).

A profile's `host:` mapping gives the link as measured from one GPU (copy-engine bandwidth with pinned
memory, each direction) and how many GPUs of the node sit behind one such link to the CPU socket (a PCIe
switch's uplink). FSDP is SPMD: every rank of the node copies the same bytes at the same moment, so the
GPUs behind one link split it evenly; each sees `h2d_Bps / gpus_per_link`.

The optimizer step of offloaded parameters runs on the CPU: torch.optim on CPU tensors (foreach and fused
default to off there). The one published figure for torch's CPU Adam is ZeRO-Offload's Table 4 (a DGX-2
host); its rate is host-memory-bandwidth bound (component-timing.md 7), so it is kept as host bytes per
second and shared by every rank of the node, which step at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_sim.errors import ScenarioError, show
from fsdp_sim.datafile import check_mapping

H2D, D2H, CPU = "h2d", "d2h", "cpu"  # the `group` of a host-link copy or of work on the CPU (schedule/offload.py)
HOST_GROUPS = (H2D, D2H, CPU)
LINKS = ("pcie_gen4_x16", "pcie_gen5_x16", "nvlink_c2c")
# torch.optim.Adam on the CPU: 10 B parameters in 14.76 s, the largest size of ZeRO-Offload (USENIX ATC'21)
# Table 4, "PyTorch CPU Adam" column, DGX-2 host = 2x Xeon Platinum 8168 [C35] (component-timing.md 7)
TORCH_CPU_ADAM_ELEMENTS_PER_S = 10e9 / 14.76
# ... as host-memory bytes: _single_tensor_adam's passes without weight decay, 72 B per element
# (schedule/optimizers.py _PASSES["adam"], the same ops on CPU tensors)
TORCH_CPU_ADAM_BYTES_PER_ELEMENT = 72
TORCH_CPU_OPTIMIZER_BYTES_PER_S = TORCH_CPU_ADAM_ELEMENTS_PER_S * TORCH_CPU_ADAM_BYTES_PER_ELEMENT
_KEYS = {"link", "h2d_Bps", "d2h_Bps", "gpus_per_link", "memory_bytes"}


@dataclass(frozen=True, slots=True)
class HostLink:
    """One GPU's link to pinned host memory and the node's host memory (bytes)."""

    link: str
    h2d_Bps: float
    d2h_Bps: float
    gpus_per_link: int
    memory_bytes: int


def parse_host(data, where: str, gpus_per_node: int) -> HostLink:
    """A profile's `host:` mapping, keys checked exactly, figures positive, `gpus_per_link` a divisor of the node."""
    data = check_mapping(where, data, _KEYS)
    if data["link"] not in LINKS:
        raise ScenarioError(f"{where}.link: {show(data['link'])} is not one of {list(LINKS)}")
    for key, low, high in (("h2d_Bps", 1e8, 1e13), ("d2h_Bps", 1e8, 1e13), ("memory_bytes", 1 << 30, 1 << 50)):
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ScenarioError(f"{where}.{key}: must be a number in [{low:g}, {high:g}], got {show(value)}")
    share = data["gpus_per_link"]
    if isinstance(share, bool) or not isinstance(share, int) or share < 1 or gpus_per_node % share:
        raise ScenarioError(f"{where}.gpus_per_link: must be a divisor of gpus_per_node {gpus_per_node}, got {show(share)}")
    if data["memory_bytes"] != int(data["memory_bytes"]):
        raise ScenarioError(f"{where}.memory_bytes: must be an integer, got {show(data['memory_bytes'])}")
    return HostLink(data["link"], float(data["h2d_Bps"]), float(data["d2h_Bps"]), share, int(data["memory_bytes"]))


def link_share(host: HostLink, gpus_per_node: int) -> int:
    """GPUs that copy over one host link at once: those behind it, at most the GPUs the node has."""
    return min(host.gpus_per_link, gpus_per_node)


def copy_time(nbytes: float, direction: str, host: HostLink, gpus_per_node: int) -> float:
    """Seconds to move `nbytes` between one GPU and pinned host memory while every GPU behind the same
    link moves as much (SPMD)."""
    rate = host.h2d_Bps if direction == H2D else host.d2h_Bps
    return nbytes * link_share(host, gpus_per_node) / rate


def cpu_optimizer_time(traffic_bytes: float, ranks_on_host: int) -> float:
    """Seconds of a torch.optim step on the CPU that reads and writes `traffic_bytes` of host memory,
    while the other ranks of the node step their own shards on the same host."""
    return traffic_bytes * ranks_on_host / TORCH_CPU_OPTIMIZER_BYTES_PER_S


class HostCosts:
    """`duration(op)` of the ops whose group is in HOST_GROUPS, on one node of `gpus_per_node` GPUs.
    A copy's `comm_bytes` cross the link; the CPU's `comm_bytes` are host-memory traffic."""

    def __init__(self, host: HostLink | None, gpus_per_node: int) -> None:
        """`host` None: the profile has no `host:` section, and the scenario refuses offload on it."""
        self.host, self.gpus_per_node = host, gpus_per_node

    def duration(self, op) -> float:
        if op.group == CPU:
            return cpu_optimizer_time(op.comm_bytes, self.gpus_per_node)
        return copy_time(op.comm_bytes, op.group, self.host, self.gpus_per_node)
