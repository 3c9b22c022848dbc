"""Wrap policies: which modules become FSDP units (one `fully_shard` call each).

As with `fully_shard`, units are made bottom-up and the root (`fully_shard(model)`) takes every
parameter no inner unit claimed, e.g. the embedding, final norm and output head under `per_block`.
The workload's granularity is a block: parts of a block are never wrapped on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_sim.errors import ScenarioError
from fsdp_sim.workload.model import Module, Param, Workload

POLICIES = ("per_block", "every_k_blocks", "size_based", "whole_model")


@dataclass(frozen=True, slots=True)
class Unit:
    """One FSDP unit: its name, the modules it owns (forward order) and their parameters."""

    name: str
    modules: tuple[str, ...]
    params: tuple[Param, ...]
    is_root: bool = False

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def shard_numel(self, world: int, *, trainable_only: bool = False) -> int:
        """Elements one rank stores: each parameter's dim-0 chunk, padded to the largest chunk."""
        return sum(p.padded_shard_numel(world) for p in self.params if p.trainable or not trainable_only)


def _groups(blocks: list[Module], policy: str, k: int, min_params: int) -> list[list[Module]]:
    if policy == "per_block":
        return [[b] for b in blocks]
    if policy == "every_k_blocks":
        return [blocks[i:i + k] for i in range(0, len(blocks), k)]
    if policy == "whole_model":
        return []
    # size_based: as torch's size_based_auto_wrap_policy, a module is wrapped when the parameters no
    # child claimed reach min_params; blocks too small on their own fall to their container
    # (`layers`), which is wrapped if all of them together reach it.
    if blocks and blocks[0].numel >= min_params:
        return [[b] for b in blocks]
    if sum(b.numel for b in blocks) >= min_params:
        return [blocks]
    return []


def make_units(workload: Workload, policy: str = "per_block", *, k: int = 1, min_params: int = 100_000_000) -> list[Unit]:
    """Units in pre-forward order: the root first, then inner units in the order their modules run."""
    if policy not in POLICIES:
        raise ScenarioError(f"fsdp.wrap: unknown policy {policy!r}, expected one of {list(POLICIES)}")
    if k <= 0:
        raise ScenarioError(f"fsdp.blocks_per_unit: must be a positive integer, got {k}")
    model_modules = [m for m in workload.modules if m.in_model]
    blocks = [m for m in model_modules if m.is_block]
    groups = _groups(blocks, policy, k, min_params)
    if policy == "size_based":
        groups += [[m] for m in model_modules if not m.is_block and m.numel >= min_params]
        order = {m.name: i for i, m in enumerate(model_modules)}
        groups.sort(key=lambda g: order[g[0].name])
    claimed = {m.name for g in groups for m in g}
    inner = [Unit(_unit_name(g), tuple(m.name for m in g), tuple(p for m in g for p in m.params)) for g in groups]
    rest = [m for m in model_modules if m.name not in claimed]
    root = Unit("root", tuple(m.name for m in rest), tuple(p for m in rest for p in m.params), is_root=True)
    return [root, *inner]


def _unit_name(group: list[Module]) -> str:
    return group[0].name if len(group) == 1 else f"{group[0].name}..{group[-1].name}"
