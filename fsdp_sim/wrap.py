"""Wrap policies: which modules become FSDP units (one `fully_shard` call each).

As with `fully_shard`, units are made bottom-up and the root (`fully_shard(model)`) takes every
parameter no inner unit claimed, e.g. the embedding, final norm and output head under `per_block`.
The workload's granularity is a block: parts of a block are never wrapped on their own.

`torchtitan` is the wrapping of torchtitan's `apply_fsdp_to_decoder` (torchtitan/distributed/fsdp.py at
b5bcd76c6): the embedding its own unit, every block, the final norm and output head grouped
(`fully_shard([model.norm, model.lm_head], reshard_after_forward=...policy == "always")`, i.e. not
resharded after forward: backward needs them first), then the root (`fully_shard(model)`), which is left
with no parameters. With tied weights the embedding joins the norm and head in that group.

`peft` is peft's `fsdp_auto_wrap_policy` (`peft/utils/other.py`), which Answer.AI's fsdp_qlora
(`train.py`, `get_wrapping_policy`) and accelerate with peft pass to FullyShardedDataParallel:
`_or_policy([lambda_policy, transformer_policy])`, the lambda wrapping every module with no children whose
`weight` requires grad (`len(list(module.named_children())) == 0 and getattr(module, "weight", None) is not
None and module.weight.requires_grad`), the other every decoder layer. So each LoRA adapter (`lora_A`,
`lora_B`, leaf Linears) is a FullyShardedDataParallel instance of its own inside its block's, and a
trainable embedding, norm or head outside the blocks too: every FlatParameter is either trained or
frozen. The adapters are the block unit's `nested` units (the workload's granularity is a block: their
hooks run inside the block's, `schedule/fsdp1.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_sim.errors import ScenarioError
from fsdp_sim.workload.model import Module, Param, Workload

POLICIES = ("per_block", "every_k_blocks", "size_based", "whole_model", "torchtitan", "peft")


@dataclass(frozen=True, slots=True)
class Unit:
    """One FSDP unit: its name, the modules it owns (forward order) and their parameters.

    `reshard_after_forward` is set when the policy fixes the unit's `fully_shard` argument (torchtitan's
    norm + head group: False); None takes the scenario's. `nested`: the units the policy made of leaf
    modules inside this unit's modules (peft's adapters inside a block), in forward order; they own the
    parameters named in their `params`, which this unit's do not repeat, and `modules` names the module
    they run in.
    """

    name: str
    modules: tuple[str, ...]
    params: tuple[Param, ...]
    is_root: bool = False
    reshard_after_forward: bool | None = None
    nested: tuple[Unit, ...] = ()

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
    if policy in ("torchtitan", "peft"):
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
    if policy == "peft":
        inner = _peft_units(model_modules, inner)
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


def _leaves(params: tuple[Param, ...]) -> dict[str, list[Param]]:
    """The parameters by the module that owns them (the name less its last part), in order."""
    leaves: dict[str, list[Param]] = {}
    for p in params:
        leaves.setdefault(p.name.rsplit(".", 1)[0], []).append(p)
    return leaves


def _trained_leaves(params: tuple[Param, ...]) -> list[str]:
    """The modules peft's lambda policy wraps: those whose `weight` requires grad. The workload names only
    parameters, so a module is the parameters' common prefix; one with a `.weight` is taken as a leaf
    (a block's Linears and norms, an adapter's lora_A / lora_B)."""
    return [leaf for leaf, ps in _leaves(params).items() if any(p.name == leaf + ".weight" and p.trainable for p in ps)]


def _peft_units(model_modules: list[Module], blocks: list[Unit]) -> list[Unit]:
    """peft's `fsdp_auto_wrap_policy`: every block a unit, the leaf modules with a trainable weight units of
    their own, nested in their block's; a module outside the blocks whose weight is trained (an embedding,
    the final norm, the head: each a leaf) a unit beside them. Units in pre-forward order."""
    units = []
    for b in blocks:
        leaves = _leaves(b.params)
        wrapped = _trained_leaves(b.params)
        nested = tuple(Unit(leaf, b.modules, tuple(leaves[leaf])) for leaf in wrapped)
        claimed = {p.name for u in nested for p in u.params}
        units.append(Unit(b.name, b.modules, tuple(p for p in b.params if p.name not in claimed), nested=nested))
    block_names = {u.name for u in units}
    for m in model_modules:
        if m.name not in block_names and not m.is_block and _trained_leaves(m.params):
            units.append(Unit(m.name, (m.name,), m.params))
    order = {m.name: i for i, m in enumerate(model_modules)}
    return sorted(units, key=lambda u: order[u.modules[0]])


def _unit_name(group: list[Module]) -> str:
    return group[0].name if len(group) == 1 else f"{group[0].name}..{group[-1].name}"
