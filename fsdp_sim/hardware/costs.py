"""Price each op of a step on a cluster: roofline compute, HBM-bound copies, ring collectives."""

from __future__ import annotations

from fsdp_sim.hardware.collectives import CollectiveCost, all_gather_time, all_reduce_time, reduce_scatter_time
from fsdp_sim.hardware.profiles import Cluster
from fsdp_sim.schedule.ops import Op

_COLLECTIVE_TIME = {"all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time, "all_reduce": all_reduce_time}


class OpCosts:
    """`duration(op)` for a (replicate x shard) mesh laid out node-major on `cluster`.

    Shard groups are consecutive ranks (as `init_device_mesh` lays out the last mesh dim), so a shard
    group of `s` ranks spans ceil(s / gpus_per_node) nodes; a replicate group's members are `s` ranks
    apart, one per node once a shard group fills a node.
    """

    def __init__(self, cluster: Cluster, *, shard_size: int, replicate_size: int, compute_dtype: str) -> None:
        gpu, gpn = cluster.gpu, cluster.gpus_per_node
        self.gpu = gpu
        self.matmul_flops = gpu.flops(compute_dtype) * gpu.matmul_efficiency
        shard_nodes = -(-shard_size // gpn)
        replicate_nodes = replicate_size if shard_size >= gpn else cluster.nodes
        self.groups = {
            "shard": CollectiveCost(shard_size, shard_nodes, gpu.intra_node, gpu.inter_node),
            "replicate": CollectiveCost(replicate_size, replicate_nodes, gpu.intra_node, gpu.inter_node),
        }

    def compute_time(self, flops: float, hbm_bytes: float) -> float:
        """Matmul FLOPs at the achievable rate plus elementwise traffic at HBM bandwidth.

        A module is a sequence of kernels on one stream: its matmuls are compute-bound and its norms,
        activations and residual adds are memory-bound, and they do not overlap each other, so the
        two times add (a roofline `max` would hide the elementwise kernels behind the matmuls).
        """
        return flops / self.matmul_flops + hbm_bytes / self.gpu.hbm_bandwidth_Bps

    def duration(self, op: Op) -> float:
        kind = op.kind
        if op.measured_s is not None:
            return op.measured_s
        if kind == "compute" or kind == "copy":
            return self.compute_time(op.flops, op.hbm_bytes)
        if kind in _COLLECTIVE_TIME:
            return _COLLECTIVE_TIME[kind](op.comm_bytes, self.groups[op.group])
        return 0.0
