"""Hardware as data: GPU and link profiles, the cluster shape, and the collective cost model."""

from fsdp_sim.hardware.collectives import CollectiveCost, all_gather_time, all_reduce_time, reduce_scatter_time
from fsdp_sim.hardware.profiles import Cluster, GpuProfile, Link, load_profile, profile_names

__all__ = ["Cluster", "CollectiveCost", "GpuProfile", "Link", "all_gather_time", "all_reduce_time",
           "load_profile", "profile_names", "reduce_scatter_time"]
