"""GPUs of one SKU are not alike, and a synchronous step runs at the pace of its slowest rank.

Per-GPU sustained kernel rates differ by binning and cooling: "5 % and higher" MAMF differences on one
8-GPU node [C1]; same-SKU GPUs over five clusters vary by 8 % on average, outliers 1.5x slower than the
median (Sinha et al., arXiv 2208.11035 [V]); six RTX 4090 hosts' short torch.mm rates have a standard
deviation of 2.6 % of their mean [I6] (in-situ.md 3). FSDP's all-gathers and reduce-scatters synchronise
every rank of the mesh at every unit, so a rank that is slower sets the step's pace: the others wait for it
at each collective. With N ranks whose compute-bound rates are independent draws of mean 1 and relative
spread sigma, the slowest is expected at 1 - k_N sigma, k_N = E[max of N standard normals] (1.42 at 8, 2.34
at 64, 3.04 at 512), so the representative rank's compute-bound kernels take 1 / (1 - k_N sigma) of their
time. The default mode carries this cost of scale; memory-bound kernels are not spread (HBM's clock does
not move with the SMs', in-situ.md 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from fsdp_sim.datafile import expect_mapping, get_key, reject_unknown_keys
from fsdp_sim.errors import ScenarioError

# The relative standard deviation of per-GPU sustained GEMM rate: six RTX 4090 hosts, short torch.mm
# 162.4-173.3 TFLOPS, sd 4.3 of mean 166.6 = 2.6 % [I6] (in-situ.md 3); the one measured standard deviation
# read, inside the 2-3 % the reference estimates for data-centre parts [est]
DEFAULT_SPREAD = 0.026
# A larger spread is refused: the slowest of the largest mesh a scenario admits (MAX_NODES x MAX_GPUS_PER_NODE,
# k = 5.64) must still run, 1 - 5.64 x 0.15 = 0.15 of the mean rate (at 0.2 it would be negative)
MAX_SPREAD = 0.15


@cache
def _normal_grid() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """x on a fine grid over [-10, 10], the standard normal's density and distribution function there, the
    grid's steps (the trapezoid rule's widths) and the first index from which the distribution function is
    1.0 to the last bit (x > 8.27: every power of it is 1 there); computed once, as every mesh size
    integrates over the same grid."""
    x = np.linspace(-10.0, 10.0, 40001)
    phi = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1.0 + np.array([math.erf(v) for v in x / math.sqrt(2.0)]))
    return x, phi, cdf, np.diff(x), int(np.argmax(cdf == 1.0))


@cache
def expected_max_of_normals(n: int) -> float:
    """E[max of n independent standard normals] = integral of x n phi(x) Phi(x)^(n-1) dx, numerically (n = 1
    gives 0, n = 2 gives 1/sqrt(pi)). Phi^(n-1) is 0 below some x (an underflow, from 64 ranks on a third of
    the grid), where `pow` takes its slow path, and 1 where Phi is: the power is worked out only between,
    and the integrand only from the first power that is not 0, in place (`pow` is half of this function's
    time, whole-grid temporaries most of the rest). The same numbers to the last bit: the integrand is
    the same products in the same order, its zeros sum to nothing, and the trapezoid sum runs over the
    whole grid, so numpy's pairwise summation adds in the same order (tests/test_variation.py compares with
    the power over the whole grid)."""
    if n <= 1:
        return 0.0
    x, phi, cdf, dx, ones = _normal_grid()
    start = _first_nonzero_power(cdf, n - 1)
    y = np.zeros_like(x)
    tail = y[start:]
    np.multiply(x[start:], n, out=tail)
    tail *= phi[start:]
    tail[:ones - start] *= cdf[start:ones] ** (n - 1)  # start <= ones: the power at `ones` is 1, not 0
    edges = y[1:] + y[:-1]
    edges *= dx
    return float(np.sum(edges) / 2)  # the trapezoid rule


_STRIDE = 64  # the coarse step of the search for where a power of the distribution function stops underflowing


def _first_nonzero_power(cdf: np.ndarray, k: int) -> int:
    """The first index at which cdf ** k is not 0: the powers of every 64th point, then of the points of
    the last stretch of zeros (cdf rises with x, so its powers are 0 on a prefix of the grid)."""
    coarse = cdf[::_STRIDE] ** k
    j = int(np.argmax(coarse != 0))  # cdf ends at 1: some power is not 0
    lo = max(0, (j - 1) * _STRIDE)
    return lo + int(np.argmax(cdf[lo:j * _STRIDE + 1] ** k != 0))


def slowest_rank_factor(ranks: int, spread: float) -> float:
    """How much longer the slowest of `ranks` GPUs takes over compute-bound work than the mean GPU."""
    return 1.0 / (1.0 - expected_max_of_normals(ranks) * spread) if ranks > 1 and spread > 0 else 1.0


_PACED: dict[tuple[int, float], tuple] = {}


def paced_profile(gpu, factor: float):
    """`gpu` as the step's slowest rank runs: compute-bound kernels `factor` times slower. One profile
    object per (profile, factor), so the kernel prices a sweep shares by profile stay shared."""
    if factor == 1.0:
        return gpu
    key = (id(gpu), factor)
    entry = _PACED.get(key)
    if entry is None or entry[0] is not gpu:
        sustained = replace(gpu.sustained, compute=gpu.sustained.compute / factor, pace=gpu.sustained.pace * factor)
        entry = _PACED[key] = (gpu, replace(gpu, sustained=sustained))
    return entry[1]


@dataclass(frozen=True, slots=True)
class LinkFault:
    """NIC `nic` of node `node` at `bandwidth` of its goodput: 0 down (NCCL routes over the node's other NICs,
    PXN relaying over NVLink), between 0 and 1 a NIC that trained at a lower speed or drops packets."""

    node: int
    nic: int
    bandwidth: float


@dataclass(frozen=True, slots=True)
class Variation:
    """The scenario's `variation:` section, all of it in one place: the spread of per-GPU compute-bound
    rate, the seed of per-rank draws (`--per-rank`), named slow ranks and nodes, as (index, speed) pairs
    (speed is the rank's compute-bound rate relative to the mean GPU's, before its own draw), and NICs slow
    or down (`links`, which the graph pricing reads: hardware/graph_pricing.py)."""

    spread: float = DEFAULT_SPREAD
    seed: int = 0
    stragglers: tuple[tuple[int, float], ...] = ()
    nodes: tuple[tuple[int, float], ...] = ()
    links: tuple[LinkFault, ...] = ()

    def named_speeds(self, gpus_per_node: int) -> list[tuple[float, int, str]]:
        """(speed, 0 a rank | 1 a node, "rank r" | "node n") of each rank and node the section names, before
        the draw, as `rank_speeds` gives it: a straggler's speed times its node's where that node is named too."""
        node_speed = dict(self.nodes)
        return [(s * node_speed.get(r // gpus_per_node, 1.0), 0, f"rank {r}") for r, s in self.stragglers] + \
            [(s, 1, f"node {n}") for n, s in self.nodes]

    def slowest_named(self, gpus_per_node: int) -> float | None:
        """The slowest speed of a rank or node the section names (`named_speeds`); None when none is named."""
        return min(self.named_speeds(gpus_per_node), default=(None,))[0]

    def named(self) -> dict:
        """What the scenario names, for the JSON (`hardware.variation`): each non-empty list of stragglers,
        slow nodes and NICs slow or down, in the keys of `variation:`."""
        out = {"stragglers": [{"rank": r, "speed": s} for r, s in self.stragglers],
               "nodes": [{"node": n, "speed": s} for n, s in self.nodes],
               "links": [{"node": f.node, "nic": f.nic, "bandwidth": f.bandwidth} for f in self.links]}
        return {key: items for key, items in out.items() if items}


def paced_by(variation: Variation, world_size: int, gpus_per_node: int) -> str:
    """What sets the default mode's compute pace (`pace_factor`): "rank r" or "node n", the slowest named,
    when it is slower than the spread's expected slowest rank; else "spread"."""
    named = variation.named_speeds(gpus_per_node)
    if not named or 1.0 / min(named)[0] <= slowest_rank_factor(world_size, variation.spread):
        return "spread"
    return min(named)[2]


def weakest_nic_node(links: tuple[LinkFault, ...], nics_per_node: int) -> dict | None:
    """The node whose NICs keep the least of their summed rate: a ring across nodes runs through every node,
    so the node left with the least sets the pace of its inter-node hops (the graph prices it exactly:
    hardware/graph_pricing.py). None when no NIC is below its rate."""
    lost: dict[int, float] = {}
    for f in links:
        lost[f.node] = lost.get(f.node, 0.0) + (1.0 - f.bandwidth)
    if not any(lost.values()):
        return None
    node = min(lost, key=lambda k: (-lost[k], k))
    return {"node": node, "nic_sum_fraction": 1.0 - lost[node] / nics_per_node}


def pace_factor(variation: Variation, world_size: int, gpus_per_node: int) -> float:
    """How much longer the default mode's representative rank takes over compute-bound work: the slowest
    rank's pace, the expected slowest of the spread or a named straggler or node if that is slower (a
    named rank also draws from the spread, which this leaves out: it is at most k_N sigma of its speed)."""
    if world_size <= 1:
        return 1.0
    named = variation.slowest_named(gpus_per_node)
    return max(slowest_rank_factor(world_size, variation.spread), 1.0 / named if named is not None else 1.0)


def rank_speeds(variation: Variation, world_size: int, gpus_per_node: int) -> np.ndarray:
    """Each rank's compute-bound rate relative to the mean GPU's: a normal draw of mean 1 and relative
    spread sigma from `seed` (numpy's PCG64, so a seed gives the same draws on every platform), times its
    straggler's and its node's speed. A draw at or below zero is refused: past MAX_SPREAD's reasoning,
    some rank of this seed would not run at all."""
    speeds = 1.0 + variation.spread * np.random.default_rng(variation.seed).standard_normal(world_size)
    if variation.spread > 0 and speeds.min() <= 0:
        raise ScenarioError(f"variation.seed: {variation.seed} draws rank {int(speeds.argmin())} at speed "
                            f"{speeds.min():.3f}; a GPU must run: try another seed or a smaller gpu_speed_spread")
    for node, speed in variation.nodes:
        speeds[node * gpus_per_node:(node + 1) * gpus_per_node] *= speed
    for rank, speed in variation.stragglers:
        speeds[rank] *= speed
    return speeds


# A named rank or node runs at most this much faster than the mean GPU: same-SKU GPUs over five clusters
# range to 1.5x apart (Sinha et al., arXiv 2208.11035 [V]); a faster part is another SKU, another profile
MAX_SPEED = 1.5


def parse_variation(raw, world_size: int = 1, nodes: int = 1, nics_per_node: int = 1) -> Variation:
    """`variation: {gpu_speed_spread: sigma, seed: n, stragglers: [{rank, speed}], nodes: [{node, speed}],
    links: [{node, nic, bandwidth}]}`: the relative standard deviation of per-GPU sustained compute rate
    (default DEFAULT_SPREAD; 0: every GPU alike, no cost of scale), the seed of `--per-rank`'s draws, ranks
    or nodes named slow (or fast), and NICs slow or down (`parse_links`)."""
    raw = expect_mapping("variation", raw)
    reject_unknown_keys("variation", raw, {"gpu_speed_spread", "seed", "stragglers", "nodes", "links"})
    spread = get_key("variation", raw, "gpu_speed_spread", float, DEFAULT_SPREAD, maximum=MAX_SPREAD)
    if spread < 0:
        raise ScenarioError(f"variation.gpu_speed_spread: {spread} must be zero or more")
    seed = get_key("variation", raw, "seed", int, 0, maximum=2**63 - 1)
    if seed < 0:
        raise ScenarioError(f"variation.seed: {seed} must be zero or more")
    return Variation(spread, seed, _named(raw, "stragglers", "rank", world_size), _named(raw, "nodes", "node", nodes),
                     parse_links(raw, nodes, nics_per_node))


def _named(raw: dict, key: str, index: str, count: int) -> tuple[tuple[int, float], ...]:
    """`variation.<key>: [{<index>: i, speed: s}]`, each i in [0, count) named once, s in (0, MAX_SPEED]."""
    items = raw.get(key) or []
    if not isinstance(items, list):
        raise ScenarioError(f"variation.{key}: expected a list of {{{index}, speed}}, got {type(items).__name__}")
    out: dict[int, float] = {}
    for n, item in enumerate(items):
        where = f"variation.{key}[{n}]"
        item = expect_mapping(where, item)
        reject_unknown_keys(where, item, {index, "speed"})
        i = get_key(where, item, index, int)
        if not 0 <= i < count:
            raise ScenarioError(f"{where}.{index}: {i} is out of range: the mesh has {count} {index}s (0 to {count - 1})")
        if i in out:
            raise ScenarioError(f"{where}.{index}: {index} {i} is named twice")
        speed = get_key(where, item, "speed", float)
        if not 0 < speed <= MAX_SPEED:
            raise ScenarioError(f"{where}.speed: {speed} must be in (0, {MAX_SPEED}]: the {index}'s compute-bound "
                                "rate relative to the mean GPU's")
        out[i] = speed
    return tuple(sorted(out.items()))


def parse_links(raw, nodes: int, nics_per_node: int) -> tuple[LinkFault, ...]:
    """`variation.links: [{node, nic, bandwidth}]`, checked against the cluster (node and NIC indices from 0;
    one entry a NIC; a node of a multi-node job keeps at least one NIC up, or its ring could not leave it)."""
    entries = expect_mapping("variation", raw).get("links")
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise ScenarioError(f"variation.links: expected a list of {{node, nic, bandwidth}}, got {type(entries).__name__}")
    faults: dict[tuple[int, int], LinkFault] = {}
    for i, entry in enumerate(entries):
        where = f"variation.links[{i}]"
        entry = expect_mapping(where, entry)
        reject_unknown_keys(where, entry, {"node", "nic", "bandwidth"})
        node, nic = get_key(where, entry, "node", int), get_key(where, entry, "nic", int)
        for key, value, count, what in (("node", node, nodes, "nodes"), ("nic", nic, nics_per_node, "NICs a node")):
            if not 0 <= value < count:
                raise ScenarioError(f"{where}.{key}: {value} is not in [0, {count - 1}] (the cluster has {count} {what})")
        bandwidth = get_key(where, entry, "bandwidth", float, maximum=1.0)
        if bandwidth < 0:
            raise ScenarioError(f"{where}.bandwidth: {bandwidth} must be in [0, 1] (a fraction of the NIC's rate)")
        if (node, nic) in faults:
            raise ScenarioError(f"{where}: node {node} NIC {nic} is listed twice")
        faults[node, nic] = LinkFault(node, nic, bandwidth)
    for node in {k for k, _ in faults}:
        down = sum(1 for (k, _), f in faults.items() if k == node and f.bandwidth == 0)
        if nodes > 1 and down == nics_per_node:
            raise ScenarioError(f"variation.links: every NIC of node {node} is down, so its ranks cannot reach the others")
    return tuple(sorted(faults.values(), key=lambda f: (f.node, f.nic)))
