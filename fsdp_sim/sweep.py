"""Sweeps: one scenario, the cartesian product of a few of its keys, simulated in parallel processes.

`--set fsdp.wrap=per_block,whole_model --set training.micro_batch=1,2,4` gives six points. A point whose
combination is impossible (a shard size that does not divide the world, say) becomes a row with its
error; a key that exists in no scenario is a bad input for the whole sweep.
"""

from __future__ import annotations

import copy
import itertools
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from fsdp_sim.datafile import read_data
from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate

COLUMNS = ("step_time_s", "tokens_per_s_per_gpu", "tokens_per_step", "peak_allocated_bytes", "peak_reserved_bytes",
           "required_bytes", "fits", "headroom_bytes", "communication_exposed_s", "overlap_fraction", "mfu",
           "cpu_bound_s", "peak_phase", "error")


def parse_assignment(text: str) -> tuple[str, list[Any]]:
    """`key.path=v1,v2` -> ("key.path", [v1, v2]); values are YAML scalars (1 -> int, true -> bool)."""
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise ScenarioError(f"--set {text!r}: expected KEY=VALUE[,VALUE...], e.g. fsdp.wrap=per_block,whole_model")
    return key, [yaml.safe_load(v) for v in values.split(",")]


def _assign(data: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif isinstance(child, str) and part == "model":  # a preset name becomes a mapping with overrides
            child = node[part] = {"preset": child}
        elif not isinstance(child, dict):
            raise ScenarioError(f"--set {key}: {part!r} is not a section of the scenario")
        node = child
    node[leaf] = value


def points(base: dict, axes: list[tuple[str, list[Any]]]) -> list[tuple[dict, dict]]:
    """(the swept values, the scenario data) for every combination, in the order the axes were given."""
    out = []
    for combo in itertools.product(*(values for _, values in axes)):
        data = copy.deepcopy(base)
        chosen = {}
        for (key, _), value in zip(axes, combo):
            _assign(data, key, value)
            chosen[key] = value
        out.append((chosen, data))
    return out


def run_point(data: dict, base: Path) -> dict:
    """The figures of one point, or its error (one line) when the combination is not valid."""
    try:
        d = simulate(parse_scenario(data, name="sweep", base=base)).to_dict()
    except ScenarioError as exc:
        return {"error": str(exc)}
    return {"step_time_s": d["step_time_s"], "tokens_per_s_per_gpu": d["throughput"]["tokens_per_s_per_gpu"],
            "tokens_per_step": d["throughput"]["tokens_per_step"], "peak_allocated_bytes": d["peak"]["allocated_bytes"],
            "peak_reserved_bytes": d["peak"]["reserved_bytes"], "required_bytes": d["memory"]["required_bytes"],
            "fits": d["memory"]["fits"], "headroom_bytes": d["memory"]["headroom_bytes"],
            "communication_exposed_s": d["communication"]["exposed_s"],
            "overlap_fraction": d["communication"]["overlap_fraction"], "mfu": d["compute"]["mfu"],
            "cpu_bound_s": d["compute"]["breakdown"]["cpu_bound_s"], "peak_phase": d["peak"]["phase"], "error": ""}


def sweep(path: str, assignments: list[str], *, jobs: int | None = None) -> tuple[list[str], list[dict]]:
    """Run every point of the sweep; returns the swept keys and one row per point."""
    base = read_data(path, "scenario")
    if not assignments:
        raise ScenarioError("--set: give at least one KEY=VALUE[,VALUE...] to sweep")
    if not isinstance(base, dict):
        raise ScenarioError(f"scenario: {path} must hold a mapping")
    axes = [parse_assignment(a) for a in assignments]
    todo = points(base, axes)
    folder = Path(path).parent
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(run_point, [data for _, data in todo], itertools.repeat(folder),
                                chunksize=max(1, len(todo) // 64)))
    for result in results:
        if "unknown key" in result["error"]:  # a misspelt --set key: the sweep itself is wrong
            raise ScenarioError(result["error"])
    return [k for k, _ in axes], [chosen | result for (chosen, _), result in zip(todo, results)]
