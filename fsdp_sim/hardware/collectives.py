"""Time of one NCCL collective: ring latency plus bytes over bus bandwidth.

Pure functions of (collective, bytes, group shape, links), testable without SimPy. The model is NCCL's
own tuner shape [hardware.md §3.2]: a fixed base latency, one per-hop latency per ring step (the steps
that cross nodes pay the network hop), and the ring's data volume (W-1)/W of the full buffer per rank
over the bus bandwidth of the bottleneck link (NVLink inside a node, the per-GPU NIC across nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_sim.hardware.profiles import Link

NCCL_BASE_LATENCY_S = 8.4e-6  # Ring/Tree Simple base latency in NCCL's tuner (src/graph/tuning.cc) [S3]


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """A process group's shape: `ranks` in all, spread over `nodes` nodes."""

    ranks: int
    nodes: int
    intra: Link
    inter: Link

    @property
    def bandwidth_Bps(self) -> float:
        return self.intra.bandwidth_Bps if self.nodes == 1 else min(self.intra.bandwidth_Bps, self.inter.bandwidth_Bps)

    def latency_s(self, steps_per_rank_hop: int = 1) -> float:
        """Ring latency: base + one hop per step; `steps_per_rank_hop` is 2 for all-reduce (RS then AG)."""
        inter_steps = (self.nodes - 1) * steps_per_rank_hop
        intra_steps = (self.ranks - 1) * steps_per_rank_hop - inter_steps
        return NCCL_BASE_LATENCY_S + intra_steps * self.intra.hop_latency_s + inter_steps * self.inter.hop_latency_s


def all_gather_time(full_bytes: float, group: CollectiveCost) -> float:
    """All-gather whose output is `full_bytes`: each rank receives (W-1)/W of it."""
    if group.ranks == 1:
        return 0.0
    return group.latency_s() + full_bytes * (group.ranks - 1) / group.ranks / group.bandwidth_Bps


def reduce_scatter_time(full_bytes: float, group: CollectiveCost) -> float:
    """Reduce-scatter whose input is `full_bytes`: the same ring volume as the all-gather."""
    return all_gather_time(full_bytes, group)


def all_reduce_time(nbytes: float, group: CollectiveCost) -> float:
    """Ring all-reduce of `nbytes`: a reduce-scatter then an all-gather, 2(W-1)/W of the buffer."""
    if group.ranks == 1:
        return 0.0
    return group.latency_s(2) + 2 * nbytes * (group.ranks - 1) / group.ranks / group.bandwidth_Bps
