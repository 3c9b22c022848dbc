"""When a step does not fit, the usual ways out on the same model, each simulated: so DOES NOT FIT leads
somewhere. `run` prints them under the summary; `recommend` names the first that fits when its own space
had nothing.

The ways are the ones people reach for: activation checkpointing (selective, then full), FSDP's CPU
offload, LoRA on the attention projections, QLoRA on every linear layer (peft's and bitsandbytes' usual
settings), full checkpointing with offload or with QLoRA (the recipes people combine), and more GPUs: the
fewest nodes (doubling) on which the step fits as written. Each is the scenario with that change, run as a
sweep point.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from fsdp_sim.sweep import assign, run_point

MAX_NODE_DOUBLINGS = 10  # up to 1,024 times the scenario's nodes
# peft LoraConfig as the techniques grid writes them (scenarios/llama2-70b-8xa100-80gb-techniques.grid.yaml)
LORA = {"rank": 16, "alpha": 32, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "dropout": 0.05}
QLORA = {"rank": 64, "alpha": 16, "targets": "all-linear", "dropout": 0.05, "quantize": "nf4"}


def _tries(data: dict) -> list[tuple[str, dict[str, Any]]]:
    training, fsdp = data.get("training") or {}, data.get("fsdp") or {}
    model = data.get("model")
    adapted = isinstance(model, dict) and "lora" in model  # LoRA / QLoRA already: not a way out
    ac = training.get("activation_checkpointing", "none")
    tries = [(f"activation_checkpointing: {mode}", {"training.activation_checkpointing": mode})
             for mode in ("selective_op", "full") if ac != mode and not (ac == "full" and mode == "selective_op")]
    if fsdp.get("version") == 1:
        offload = ("CPU offload (cpu_offload=CPUOffload(offload_params=True))", {"fsdp.cpu_offload": True})
    else:
        offload = ("CPU offload (CPUOffloadPolicy)", {"fsdp.offload_policy": "CPUOffloadPolicy"})
    offloaded = all(fsdp.get(k.split(".", 1)[1]) == v for k, v in offload[1].items())
    if not offloaded:  # a way out is a change: not what the scenario already does
        tries.append(offload)
    if not adapted:
        tries += [("LoRA r16 on q, k, v, o", {"model.lora": LORA}), ("QLoRA r64 nf4 on every linear", {"model.lora": QLORA})]
    if ac != "full":  # the recipes people combine (Answer.AI's 70B QLoRA: QLoRA, checkpointing and offload)
        full = {"training.activation_checkpointing": "full"}
        if not offloaded:
            tries.append((f"full checkpointing + {offload[0]}", full | offload[1]))
        if not adapted:
            tries.append(("full checkpointing + QLoRA r64 nf4", full | {"model.lora": QLORA}))
    return tries


def ways_out(data: dict, base: Path) -> list[dict]:
    """Rows (`sweep._row`'s figures, with `way`) of each way out of `data` that simulates; last the fewest
    nodes that fit, or (`none`) that no node count up to MAX_NODE_DOUBLINGS doublings does."""
    rows = []
    for way, changes in _tries(data):
        trial = copy.deepcopy(data)
        for key, value in changes.items():
            assign(trial, key, copy.deepcopy(value))
        row = run_point(trial, base)
        if not row.get("error"):
            rows.append({"way": way} | row)
    hardware = data.get("hardware") or {}
    nodes = hardware.get("nodes", 1)
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        rows += _more_nodes(data, base, nodes)
    return rows


def _more_nodes(data: dict, base: Path, nodes: int) -> list[dict]:
    """The fewest nodes (doubling) on which the step fits, or a `none` row.

    The search stops as soon as a doubling leaves the rank's required memory where it was or raises it.
    More nodes shrink a rank only through what is sharded over them: parameters, gradients and optimizer
    state over the shard group, 1 / its size, a saving that halves with each doubling. What grows is the
    padding: FSDP2 splits dim 0 into W chunks of ceil(dim0 / W) rows and pads every rank's to the first
    one's (torch 2.13 `_fsdp_param.py`, `padded_sharded_size = chunks[0].size()  # 0th always padded`), so
    an all-gather's output, W x that, passes dim 0 once W does and then doubles with W (405B FULL_SHARD
    without checkpointing: 384.5 GiB required on 256 nodes, 384.6 on 512, 386.6 on 1,024, 448.2 on 8,192).
    A doubling that saves nothing has a shard group that did not grow (HYBRID_SHARD's fixed `shard_size`,
    NO_SHARD: every later doubling is alike) or a padding that grows as fast as the saving shrinks (every
    later doubling saves less and pads more): either way no larger count fits, and the rest of the search
    would only simulate ever larger clusters, up to 1,024x the nodes, each on the cluster graph where that
    prices the collectives. The first doubling is compared with the second, not with the scenario: it may
    add a process group's NCCL buffers (HSDP's replicate group runs no collective while it has one rank)."""
    required = None
    for k in range(1, MAX_NODE_DOUBLINGS + 1):
        trial = copy.deepcopy(data)
        assign(trial, "hardware.nodes", nodes << k)
        row = run_point(trial, base)
        if row.get("error"):
            return []  # a shard size or mesh the larger world does not allow: stop there
        if row["within_budget"]:
            return [{"way": f"{nodes << k} nodes instead of {nodes}"} | row]
        if required is not None and row["required_bytes"] >= required:
            return [{"way": f"more nodes: none fits as written ({nodes << k:,} nodes need no less a GPU than "
                            f"{nodes << (k - 1):,}: memory stops shrinking)", "none": True}]
        required = row["required_bytes"]
    return [{"way": f"more nodes: none up to {nodes << MAX_NODE_DOUBLINGS:,} fits as written", "none": True}]


def first_fitting(rows: list[dict]) -> dict | None:
    return next((r for r in rows if not r.get("none") and r["within_budget"]), None)


def ways_out_lines(rows: list[dict]) -> list[str]:
    """The ways out under a summary: each with its required memory, verdict and tokens/s per GPU."""
    from fsdp_sim.results.report import fit_word, fmt_bytes

    if not rows:
        return ["", "Ways out           none of checkpointing, CPU offload, LoRA, QLoRA or more nodes simulates here"]
    width = max((len(r["way"]) for r in rows if not r.get("none")), default=0)  # a `none` row has no columns
    return ["", "Ways out           the scenario with each change:"] + [
        f"  {r['way']}" if r.get("none") else
        f"  {r['way']:<{width}}  required {fmt_bytes(r['required_bytes']):>10}  {fit_word(r):<6}  "
        f"{r['tokens_per_s_per_gpu']:.0f} tokens/s per GPU" for r in rows]
