"""Hardware as data: GPU and fabric profiles, the cluster shape, and the collective cost model."""

from fsdp_sim.hardware.collectives import (ProcessGroup, collective_time, link_loads, links_crossed,
                                           shared_slowdown)
from fsdp_sim.hardware.fabric import Fabric, Network
from fsdp_sim.hardware.profiles import Cluster, GpuProfile, load_profile, profile_names

__all__ = ["Cluster", "Fabric", "GpuProfile", "Network", "ProcessGroup", "collective_time", "link_loads",
           "links_crossed", "load_profile", "profile_names", "shared_slowdown"]
