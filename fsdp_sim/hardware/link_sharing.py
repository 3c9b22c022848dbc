"""Collectives in flight on the cluster graph: each link's load and each collective's bus bandwidth.

Two rules divide a link among the collectives crossing it:

- `max_min` (the default): max-min fair, by progressive filling. Every collective's bus bandwidth rises
  at the same pace; when a link fills, the collectives crossing it stop there and the others go on. Two
  rings of one shape on one link get half each, as a switch port serving its flows in turn gives them;
  and what a collective held back elsewhere cannot use goes to the others (work-conserving), which is
  what the links do: a flow that sends less leaves the port to the rest.
- `proportional`: the rule `collectives.shared_slowdown` applies to its per-rank links: a link asked for
  L times its capacity by the collectives' bandwidths alone slows every one crossing it L times, and a
  collective is slowed by its most loaded link. Kept so the graph can be set beside today's pricing: on
  the same loads it gives the same numbers. It can leave capacity idle (a collective slowed by one link
  still counts its full demand on the others), which is why it is not the default.

Pricing (`graph_pricing.py`) uses max-min among the groups of one shape, alike rings on alike links, and the
proportional rule between collectives of different shapes, whose loads on a shared link differ.

Both agree where one link is shared by collectives that all want it whole: two alike on one link run
at half their rate each (`shared_slowdown([{"nic"}, {"nic"}]) == (2.0, 2.0)`).

`spmd_busbw_Bps` is the graph's counterpart of `collectives.plateau_busbw_Bps`: every process group of
one shape runs the collective at once (SPMD), and the answer is the slowest group's bus bandwidth.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: networkx takes ~0.2 s to import, and most steps never build a graph
    import networkx as nx

from fsdp_sim.hardware.collectives import ProcessGroup
from fsdp_sim.hardware.fabric import bus_factor
from fsdp_sim.hardware.rings import Edge, alone_busbw_Bps, group_layouts, ring_loads, ring_paths

RULES = ("max_min", "proportional")
_TIGHT = 1e-9  # relative slack under which a link counts as full (float rounding of the filling steps)


@dataclass(frozen=True, slots=True)
class InFlight:
    """One collective in flight: its kind, bytes (nccl-tests' S), ranks and its ring's link loads."""

    kind: str
    nbytes: float
    ranks: int
    loads: Mapping[Edge, float] = field(repr=False)


def in_flight(graph: nx.DiGraph, kind: str, nbytes: float, gpus: Sequence[str]) -> InFlight:
    """A `kind` collective of `nbytes` on a ring over `gpus` (rank order)."""
    return InFlight(kind, nbytes, len(gpus), ring_loads(graph, ring_paths(graph, gpus), kind))


@dataclass(frozen=True, slots=True)
class Sharing:
    """What each collective gets (`busbw_Bps`, against `alone_Bps` with the links to itself; its tightest
    link `bottleneck`) and what each loaded link carries (`link_Bps`, bytes/s; `utilisation`, of capacity)."""

    busbw_Bps: tuple[float, ...]
    alone_Bps: tuple[float, ...]
    bottleneck: tuple[Edge | None, ...]
    link_Bps: dict[Edge, float]
    utilisation: dict[Edge, float]

    @property
    def slowdown(self) -> tuple[float, ...]:
        """alone / shared, >= 1 (1 for a collective that crosses no link)."""
        return tuple(1.0 if math.isinf(a) else a / b if b > 0 else math.inf
                     for a, b in zip(self.alone_Bps, self.busbw_Bps))

    def wire_s(self, flights: Sequence[InFlight]) -> tuple[float, ...]:
        """Seconds each collective's bytes take on the wire at its share: S x bus factor / busbw."""
        return tuple(0.0 if f.ranks < 2 or f.nbytes <= 0 else f.nbytes * bus_factor(f.kind, f.ranks) / bw
                     if bw > 0 else math.inf for f, bw in zip(flights, self.busbw_Bps))


def share_links(graph: nx.DiGraph, flights: Sequence[InFlight], *, rule: str = "max_min",
                capacity: Mapping[Edge, float] | None = None, alone_Bps: Sequence[float] | None = None) -> Sharing:
    """Divide the graph's links among `flights` by `rule` (see the module docstring). `capacity`: each link's
    bandwidth_Bps read from the graph once by a caller that shares many times (`graph_pricing.py`).
    `alone_Bps`: what each flight runs at without the others, where that is not its links to itself (the
    proportional rule asks the links for it; `graph_pricing` gives each the rate of its SPMD shape)."""
    if rule not in RULES:
        raise ValueError(f"rule {rule!r} is not one of {RULES}")
    if capacity is None:
        edges = graph.edges
        caps = {e: edges[e]["bandwidth_Bps"] for f in flights for e in f.loads}
    else:
        caps = {e: capacity[e] for f in flights for e in f.loads}
    alone = tuple(alone_Bps) if alone_Bps is not None else tuple(alone_busbw_Bps(caps, f.loads) for f in flights)
    if rule == "max_min":
        busbw, bottleneck = _max_min(caps, flights)
    else:
        busbw, bottleneck = _proportional(caps, flights, alone)
    link_Bps = _link_Bps(flights, busbw)
    utilisation = {e: (bps / caps[e] if caps[e] > 0 else math.inf) for e, bps in link_Bps.items()}
    return Sharing(tuple(busbw), alone, tuple(bottleneck), dict(link_Bps), utilisation)


def _link_Bps(flights: Sequence[InFlight], busbw: Sequence[float]) -> dict[Edge, float]:
    """Bytes/s each link carries when every flight runs at its busbw (one that crosses no link, inf, adds none)."""
    link_Bps: dict[Edge, float] = defaultdict(float)
    for f, bw in zip(flights, busbw):
        if math.isfinite(bw):
            for e, load in f.loads.items():
                link_Bps[e] += load * bw
    return link_Bps


def spmd_busbw_Bps(graph: nx.DiGraph, kind: str, group: ProcessGroup, *, node_stride: int = 1,
                   rule: str = "max_min") -> float:
    """Bus bandwidth of `kind` on `group` while every group of its shape runs it too (the slowest's)."""
    flights = [in_flight(graph, kind, 1.0, gpus) for gpus in group_layouts(graph, group, node_stride=node_stride)]
    return min(share_links(graph, flights, rule=rule).busbw_Bps)


def _max_min(caps: dict[Edge, float], flights: Sequence[InFlight]) -> tuple[list[float], list[Edge | None]]:
    """Progressive filling: raise every unfrozen collective's busbw together until a link fills."""
    rate = [0.0 if f.loads else math.inf for f in flights]
    bottleneck: list[Edge | None] = [None] * len(flights)
    residual = dict(caps)
    active = {i for i, f in enumerate(flights) if f.loads}
    while active:
        demand: dict[Edge, float] = defaultdict(float)
        for i in active:
            for e, load in flights[i].loads.items():
                demand[e] += load
        times = {e: residual[e] / d for e, d in demand.items() if d > 0}
        step = max(0.0, min(times.values()))
        full = {e for e, t in times.items() if t <= step * (1 + _TIGHT)}
        for i in active:
            rate[i] += step
        for e, d in demand.items():
            residual[e] = 0.0 if e in full else residual[e] - step * d
        for i in sorted(active):
            crossed = sorted(e for e in flights[i].loads if e in full)
            if crossed:
                bottleneck[i] = crossed[0]
                active.discard(i)
    return rate, bottleneck


def _proportional(caps: dict[Edge, float], flights: Sequence[InFlight],
                  alone: tuple[float, ...]) -> tuple[list[float], list[Edge | None]]:
    """`shared_slowdown`'s rule on the graph's links: each slowed by its most over-asked link."""
    asked = _link_Bps(flights, alone)
    busbw, bottleneck = [], []
    for f, bw in zip(flights, alone):
        over = max(((asked[e] / caps[e], e) for e in f.loads if caps[e] > 0), default=(1.0, None))
        busbw.append(bw / max(1.0, over[0]))
        tightest = min(f.loads, key=lambda e: (caps[e] / f.loads[e], e), default=None)  # its own limit alone
        bottleneck.append(over[1] if over[0] > 1.0 else tightest)
    return busbw, bottleneck
