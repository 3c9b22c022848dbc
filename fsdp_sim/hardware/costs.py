"""Price each op of a step on a cluster: kernels at their measured speed, NCCL collectives, and what
running at once costs.

Overlap is not free. While an NCCL kernel runs it holds one SM per channel ("NCCL CTAs won't share an
SM with compute kernels", sjeaugey, nccl#689 [C26]) and moves about three times its link traffic through
HBM ("store to memory, then read back ... plus user data", nccl#1428 [C24]). So a concurrent op's
SM-bound part (matmuls, attention) slows by SMs / (SMs - NCCL channels), and its memory-bound part and the
collective share HBM: each slows by (HBM + the collective's HBM traffic) / HBM, weighted by the memory-bound
share of the compute op. These come from the components; the reference's measured averages (18.9 % for
overlapped compute, arXiv 2507.03114 [C25]) are what `benchmarks/bench_components.py` compares them with.
"""

from __future__ import annotations

from fsdp_sim.hardware.collectives import ProcessGroup, collective_time, link_loads, shared_slowdown
from fsdp_sim.hardware.compute import ComputeCosts
from fsdp_sim.hardware.graph_pricing import GraphPricing, graph_pricing, needs_graph
from fsdp_sim.hardware.host_link import HOST_GROUPS, HostCosts
from fsdp_sim.hardware.kernels import ComputeOptions, KernelTimes
from fsdp_sim.hardware.profiles import Cluster
from fsdp_sim.hardware.software import nccl_version
from fsdp_sim.hardware.variation import LinkFault
from fsdp_sim.schedule.ops import COLLECTIVES, Op

NCCL_HBM_TRAFFIC_PER_LINK_BYTE = 3.0  # HBM bytes per byte on the link: store, read back, user data [C24 nccl#1428]


class OpCosts:
    """`duration(op)` alone, `host_s(op)` on the CPU and `slowdowns(running)` for a (replicate x shard)
    mesh laid out node-major on `cluster`.

    Shard groups are consecutive ranks (as `init_device_mesh` lays out the last mesh dim), so a shard
    group of `s` ranks spans ceil(s / gpus_per_node) nodes; a replicate group's members are `s` ranks
    apart, one per node once a shard group fills a node.
    """

    def __init__(self, cluster: Cluster, *, shard_size: int, replicate_size: int, compute_dtype: str,
                 options: ComputeOptions = ComputeOptions(), consecutive_groups: dict[str, int] | None = None,
                 groups: dict[str, ProcessGroup] | None = None, ring_factors: dict[str, float] | None = None,
                 link_faults: tuple[LinkFault, ...] = (), graph: bool | None = None) -> None:
        """`consecutive_groups`: more process groups of consecutive ranks, by name and size (hpZ's
        post-forward groups, which the backward all-gathers run in over their own links). `groups`: every process
        group laid out by the caller instead (a tensor-parallel mesh, `schedule/tp.py`), `ring_factors` the
        bytes a rank moves per byte of a collective in each group beyond these. `link_faults`: NICs slow or
        down (`variation.links`). `graph`: price the collectives on the cluster graph (True), by the closed
        forms (False), or on the graph only where the closed forms cannot (None: `needs_graph`)."""
        gpu, gpn = cluster.gpu, cluster.gpus_per_node
        self.gpu = gpu
        self.compute = ComputeCosts(gpu, compute_dtype, options)
        self.host = HostCosts(gpu.host, gpn)  # host-link copies and CPU work (offload), by op group
        self.host_s = self.compute.host_s  # the CPU issue thread's time for an op
        shard_nodes = -(-shard_size // gpn)
        replicate_nodes = replicate_size if shard_size >= gpn else cluster.nodes
        self.groups = groups if groups is not None else {
            "shard": ProcessGroup(shard_size, shard_nodes),
            "replicate": ProcessGroup(replicate_size, replicate_nodes),
        } | {name: ProcessGroup(k, -(-k // gpn)) for name, k in (consecutive_groups or {}).items()}
        self.fabric = cluster.fabric  # the profile's fabric with the scenario's hardware.network applied
        self.nccl = nccl_version(options.torch_version)  # whose tuner prices the collectives (software.py)
        self.ring = {"shard": (shard_size - 1) / shard_size, "replicate": 2 * (replicate_size - 1) / replicate_size}
        self.ring |= {name: (k - 1) / k for name, k in (consecutive_groups or {}).items()}  # all-gathers in them
        self.ring |= ring_factors or {}
        self.nccl_channels = self.fabric.nccl_channels  # SMs one collective holds (profile, [C26])
        self._loads = {name: {k: link_loads(k, g, self.fabric) for k in COLLECTIVES} for name, g in self.groups.items()}
        if graph is None:
            graph = needs_graph(cluster, link_faults)
        self.graph: GraphPricing | None = graph_pricing(cluster, link_faults, self.groups) if graph else None
        self._collective: dict[tuple, float] = {}  # by (kind, bytes, group): units of one size share a price
        self._demand: dict[int, float] = {}  # by op id: the engine asks at every change of the running set
        self._share: dict[int, float] = {}
        self._classes: dict[int, int] = {}  # by op id: the number of its `_rate_class`
        self._class_numbers: dict[tuple, int] = {}  # each `_rate_class` met, numbered from 1
        self._numbers_by_price: dict[tuple, int] = {}  # class numbers by what decides the class (`_rate_class`)
        self._mixes: dict[tuple, list[float]] = {}  # `slowdowns` by the running ops' class numbers, in order

    def pricing(self) -> dict | None:
        """How the collectives were priced, for the JSON (`GraphPricing.facts`); None: the closed forms."""
        return self.graph.facts() if self.graph is not None else None

    def times(self, op: Op) -> KernelTimes:
        """GPU time by class of a compute-stream op run alone; a host copy there (save_on_cpu) is memory-bound."""
        if op.group in HOST_GROUPS:
            return KernelTimes(memory=self.host.duration(op))
        return self.compute.times(op)

    def duration(self, op: Op) -> float:
        kind = op.kind
        if kind in COLLECTIVES:
            key = (kind, op.comm_bytes, op.group)
            t = self._collective.get(key)
            if t is None:
                graph, name = self.graph, op.group
                plateau = graph.busbw_Bps(name, kind) if graph is not None and graph.priced(name) else None
                t = self._collective[key] = collective_time(kind, op.comm_bytes, self.groups[name], self.fabric,
                                                            self.nccl, plateau)
            return t
        if op.group in HOST_GROUPS:
            return self.host.duration(op)
        if kind == "compute" or kind == "copy":
            return self.compute.duration(op)
        return 0.0

    def _hbm_demand(self, op: Op) -> float:
        """HBM bytes/s a running collective draws: its link traffic per second, three times over."""
        demand = self._demand.get(op.id)
        if demand is None:
            dur = self.duration(op)
            demand = NCCL_HBM_TRAFFIC_PER_LINK_BYTE * op.comm_bytes * self.ring[op.group] / dur if dur > 0 else 0.0
            self._demand[op.id] = demand
        return demand

    def slowdowns(self, running: list[Op]) -> list[float]:
        """How much slower each op of `running` runs beside the others than alone (>= 1 each), in its
        order. They depend on each op only through its `_rate_class`, and a step meets few mixes of classes
        (11 to 26 on the Llama 3 scenarios, where the engine asks 200 to 900 times), so each mix is worked out
        once per step (`_contention`) and looked up after, by the classes' numbers (a tuple of small ints
        hashes in a fraction of the time a tuple of the classes' own tuples takes, every time it is asked)."""
        classes = self._classes
        key = tuple([classes.get(o.id) or self._rate_class(o) for o in running])
        factors = self._mixes.get(key)
        if factors is None:
            factors = self._mixes[key] = self._contention(running)
        return factors

    def _rate_class(self, op: Op) -> int:
        """The number (from 1, so never falsy) of all that `_contention` reads of `op`: a collective's kind,
        group and HBM demand; a compute or copy op's memory-bound share and whether it runs on the host;
        nothing of any other op. Ops of one class share its number.

        A step's thousand timed ops fall in about ten classes, and what decides an op's class is already
        priced: a collective's demand is a function of its (kind, group, bytes), as its price is, and a
        compute or copy op's share of its `KernelTimes`, one object for every op of the same content
        (`ComputeCosts.times`). So the class is worked out once per such price and found after by it."""
        kind = op.kind
        if kind in COLLECTIVES:
            price = (kind, op.group, op.comm_bytes)
        elif kind == "compute" or kind == "copy":
            price = (op.group in HOST_GROUPS, id(self.compute.times(op)))  # the object outlives the step: held in `_by_op`
        else:
            price = ("other",)
        number = self._numbers_by_price.get(price)
        if number is None:
            if kind in COLLECTIVES:
                cls = (kind, op.group, self._hbm_demand(op))
            elif kind == "compute" or kind == "copy":
                cls = ("compute", op.group in HOST_GROUPS, self._memory_share(op))
            else:
                cls = ("other",)
            numbers = self._class_numbers
            number = self._numbers_by_price[price] = numbers.setdefault(cls, len(numbers) + 1)
        self._classes[op.id] = number
        return number

    def _contention(self, running: list[Op]) -> list[float]:
        """`slowdowns` worked out: what every op reads (the collectives in flight, their HBM traffic, the most
        memory-bound compute op) is found once."""
        comm = [o for o in running if o.kind in COLLECTIVES]
        if not comm:
            return [1.0] * len(running)
        hbm = self.gpu.memory_Bps
        demands = [self._hbm_demand(o) for o in comm]
        # collectives of different process groups in flight share the links both cross (HSDP's shard and
        # replicate groups meet on the NICs once a shard group spans nodes)
        if len(comm) == 1:
            links = (1.0,)
        elif self.graph is None:  # the closed forms' per-rank links
            links = shared_slowdown([self._loads[o.group][o.kind] for o in comm])
        else:
            links = self._graph_links(comm)
        memory_share = 0.0  # the most memory-bound compute op running, which the collectives share HBM with
        for o in running:
            if (o.kind == "compute" or o.kind == "copy") and (share := self._memory_share(o)) > memory_share:
                memory_share = share
        sms = self.gpu.sm_count
        held = min(self.nccl_channels * len(comm), sms - 1)
        demand = sum(demands)
        out, j = [], 0
        for o in running:
            kind = o.kind
            if kind in COLLECTIVES:
                out.append(links[j] * (1.0 + memory_share * demands[j] / hbm))
                j += 1
            elif (kind == "compute" or kind == "copy") and o.group not in HOST_GROUPS:
                memory = self._memory_share(o)
                out.append((1.0 - memory) * sms / (sms - held) + memory * (1.0 + demand / hbm))
            else:
                out.append(1.0)  # a host copy runs on a copy engine, CPU work on the host: no SM nor HBM shared
        return out

    def _graph_links(self, comm: list[Op]) -> tuple[float, ...]:
        """Each collective in flight slowed by the others on the graph's links they share (the closed
        forms' per-rank links for a group the graph does not lay out)."""
        slowed = self.graph.slowdowns(tuple((o.group, o.kind) for o in comm))
        return slowed if slowed is not None else shared_slowdown([self._loads[o.group][o.kind] for o in comm])

    def _memory_share(self, op: Op) -> float:
        share = self._share.get(op.id)
        if share is None:
            t = self.compute.times(op)
            share = self._share[op.id] = t.memory / t.total if t.total > 0 else 0.0
        return share
