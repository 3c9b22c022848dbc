"""Wrap policies: which modules become FSDP units (one `fully_shard` call each).

As with `fully_shard`, units are made bottom-up and the root (`fully_shard(model)`) takes every
parameter no inner unit claimed, e.g. the embedding, final norm and output head under `per_block`.
The workload's granularity is a block: parts of a block are never wrapped on their own.

`torchtitan` is the wrapping of torchtitan's `apply_fsdp_to_decoder` (torchtitan/distributed/fsdp.py at
b5bcd76c6): the embedding its own unit, every block, the final norm and output head grouped
(`fully_shard([model.norm, model.lm_head], reshard_after_forward=...policy == "always")`, i.e. not
resharded after forward: backward needs them first), then the root (`fully_shard(model)`), which is left
with no parameters. With tied weights the embedding joins the norm and head in that group.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_sim.errors import ScenarioError
from fsdp_sim.workload.model import Module, Param, Workload

POLICIES = ("per_block", "every_k_blocks", "size_based", "whole_model", "torchtitan")


@dataclass(frozen=True, slots=True)
class Unit:
    """One FSDP unit: its name, the modules it owns (forward order) and their parameters.

    `reshard_after_forward` is set when the policy fixes the unit's `fully_shard` argument (torchtitan's
    norm + head group: False); None takes the scenario's.
    """

    name: str
    modules: tuple[str, ...]
    params: tuple[Param, ...]
    is_root: bool = False
    reshard_after_forward: bool | None = None

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
    if policy == "torchtitan":
        return [[b] for b in blocks]
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
    inner = [Unit(_unit_name(g), tuple(m.name for m in g), tuple(p for m in g for p in m.params)) for g in groups]
    if policy == "torchtitan":
        inner = _torchtitan_units(model_modules, inner)
    claimed = {name for u in inner for name in u.modules}
    rest = [m for m in model_modules if m.name not in claimed]
    root = Unit("root", tuple(m.name for m in rest), tuple(p for m in rest for p in m.params), is_root=True)
    return [root, *inner]


def _torchtitan_units(model_modules: list[Module], blocks: list[Unit]) -> list[Unit]:
    """apply_fsdp_to_decoder: fully_shard(tok_embeddings), each block, fully_shard([norm, lm_head],
    reshard_after_forward=False); with tied weights fully_shard([tok_embeddings, norm, lm_head], False).

    The embedding is every embedding module before the first block, the head group every module after
    the last block (a decoder: the final norm and the output projection). Units stay in pre-forward order.
    """
    block_index = [i for i, m in enumerate(model_modules) if m.is_block]
    first, last = (block_index[0], block_index[-1]) if block_index else (len(model_modules), len(model_modules) - 1)
    embeddings = [m for m in model_modules[:first] if m.kind == "embedding" and m.params]
    head = [m for m in model_modules[last + 1:] if m.params or m.tied_params]
    embedding_names = {p.name for m in embeddings for p in m.params}
    tied = any(t in embedding_names for m in head for t in m.tied_params)
    units = []
    if embeddings and not tied:
        units.append(Unit(_unit_name(embeddings), tuple(m.name for m in embeddings),
                          tuple(p for m in embeddings for p in m.params)))
    units += blocks
    group = (embeddings if tied else []) + head
    if group:
        units.append(Unit(_unit_name(group), tuple(m.name for m in group), tuple(p for m in group for p in m.params),
                          reshard_after_forward=False))
    order = {m.name: i for i, m in enumerate(model_modules)}
    return sorted(units, key=lambda u: order[u.modules[0]])


def _unit_name(group: list[Module]) -> str:
    return group[0].name if len(group) == 1 else f"{group[0].name}..{group[-1].name}"
