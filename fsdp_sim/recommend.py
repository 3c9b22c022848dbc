"""`fsdp-sim recommend`: the fastest configuration that fits, why not a faster one, and the runners-up.

Configurations are compared by tokens/s per GPU (a larger micro-batch does more work per step, so step
time alone would favour the smallest batch), ties going to the one that needs less memory. The search
space is a grid file, or `default_axes`: the FSDP knobs the scenario format has, applied to the base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdp_sim.grid import Axis
from fsdp_sim.results.report import fit_word, fmt_bytes, fmt_time, tally, verdict_word
from fsdp_sim.errors import ScenarioError
from fsdp_sim.scenario import MAX_GRAD_ACCUMULATION, MAX_NODES, STRATEGIES, parse_scenario

SIGNIFICANT = 0.05  # a share of the step below which exposed communication or CPU-bound time limits nothing
MICRO_BATCHES = (1, 2, 4, 8)


def parse_base(base: dict, folder: Path):
    """The base scenario, parsed once for `default_axes` and `written_values` (a bad base fails here, as
    one line)."""
    return parse_scenario(base, name="recommend", base=folder)


def default_axes(base: dict, scenario, *, micro_batch: bool = True, global_batch: int | None = None) -> list[Axis]:
    """The default search space for `base`: wrap granularity (per block, every 2 or 4 blocks, whole model),
    backward prefetch, sharding strategy (with reshard_after_forward as it implies, and HSDP with one
    node's GPUs per shard group when there is more than one node), activation checkpointing, the
    allocator's expandable segments (torchtitan's launcher turns them on: they change what is reserved,
    not the step's time, so they decide only where memory does) and the micro-batch (not for a traced
    workload, whose trace fixed it). With `global_batch` (sequences per optimizer step, which a team keeps
    fixed: the hyperparameters stay) the micro-batch axis becomes `batch_axis`'s: micro-batch x gradient
    accumulation x node count giving exactly that many sequences. `scenario` is `base` parsed (`parse_base`)."""
    cluster = scenario.cluster
    blocks = sum(m.is_block for m in scenario.workload.modules)
    wrap = [{"fsdp.wrap": "per_block"}]
    wrap += [{"fsdp.wrap": "every_k_blocks", "fsdp.blocks_per_unit": k} for k in (2, 4) if k < blocks]
    wrap += [{"fsdp.wrap": "whole_model"}]
    gpn = cluster.gpus_per_node
    # the 1-D strategies shard over every rank (their default shard size), whatever the node count
    sharding = [{"fsdp.sharding_strategy": "FULL_SHARD", "fsdp.reshard_after_forward": True},
                {"fsdp.sharding_strategy": "SHARD_GRAD_OP", "fsdp.reshard_after_forward": False}]
    if cluster.nodes > 1:
        sharding += [{"fsdp.sharding_strategy": "HYBRID_SHARD", "fsdp.reshard_after_forward": True, "fsdp.shard_size": gpn},
                     {"fsdp.sharding_strategy": "_HYBRID_SHARD_ZERO2", "fsdp.reshard_after_forward": False,
                      "fsdp.shard_size": gpn}]
    own = written(base, scenario)
    axes = [Axis("wrap", _with(own["wrap"], wrap)),
            Axis.of("fsdp.backward_prefetch", list(_with(own["fsdp.backward_prefetch"], [True, False]))),
            Axis("sharding", _with(own["sharding"], sharding)),
            Axis.of("training.activation_checkpointing",
                    list(_with(own["training.activation_checkpointing"], ["none", "full"]))),
            Axis.of("allocator.expandable_segments", list(_with(own["allocator.expandable_segments"], [False, True])))]
    traced = isinstance(base.get("model"), dict) and "workload" in base["model"]
    if global_batch is not None:
        axes.append(batch_axis(base, scenario, global_batch))
    elif micro_batch and not traced:
        axes.append(Axis.of("training.micro_batch", list(_with(own["training.micro_batch"], MICRO_BATCHES))))
    return axes


NODE_FACTORS = (8, 4, 2, 1, 0.5, 0.25, 0.125)  # the node counts a fixed global batch is tried on: x8 to /8


def batch_axis(base: dict, scenario, global_batch: int) -> Axis:
    """Micro-batch x gradient accumulation x node count with exactly `global_batch` sequences per step:
    micro_batch x grad_accumulation x data-parallel ranks (the world over the TP degree) = global_batch,
    at 1/8 to 8 times the scenario's nodes. The scenario's own combination first when it gives that batch."""
    cluster, s = scenario.cluster, scenario.settings
    if isinstance(base.get("model"), dict) and "workload" in base["model"]:
        raise ScenarioError("--global-batch: a traced workload fixed its micro-batch (model.workload); trace it "
                            "again at another batch to change it")
    options = []
    for factor in NODE_FACTORS:
        nodes = cluster.nodes * factor
        if nodes != int(nodes) or not 1 <= nodes <= MAX_NODES:
            continue
        ranks = int(nodes) * cluster.gpus_per_node // s.tp
        for mb in sorted({*MICRO_BATCHES, (base.get("training") or {}).get("micro_batch", 1), 16, 32}):
            if isinstance(mb, int) and global_batch % (mb * ranks) == 0 and \
                    1 <= global_batch // (mb * ranks) <= MAX_GRAD_ACCUMULATION:
                options.append({"hardware.nodes": int(nodes), "training.micro_batch": mb,
                                "training.grad_accumulation": global_batch // (mb * ranks)})
    if not options:
        raise ScenarioError(f"--global-batch {global_batch}: no micro-batch x accumulation x node count gives "
                            f"{global_batch} sequences per step (data-parallel ranks a multiple of "
                            f"{cluster.gpus_per_node // s.tp} per node)")
    own = written(base, scenario)["batch"]
    return Axis("batch", _with(own, options) if own in options else tuple(options))





def written_values(base: dict, scenario, axes: list[Axis]) -> dict[str, Any]:
    """The columns of the row that is the scenario as written, among `default_axes`' points (`scenario`:
    `base` parsed, as `default_axes` was given it)."""
    own = written(base, scenario)
    values = {k: None for axis in axes for k in axis.keys}
    for axis in axes:
        option = own[axis.name]
        values |= option if isinstance(option, dict) else {axis.name: option}
    return values


def written(base: dict, scenario) -> dict[str, Any]:
    """The scenario's own value of each default axis, as the axis sets it: every axis offers it, so the
    scenario as written is always a candidate (`recommend` then says what the winner changes from it)."""
    fsdp, training = base.get("fsdp") or {}, base.get("training") or {}
    s = scenario.settings
    wrap = {"fsdp.wrap": scenario.wrap} | {f"fsdp.{k}": fsdp[k] for k in ("blocks_per_unit", "min_params") if k in fsdp}
    sharding = {"fsdp.sharding_strategy": scenario.sharding_strategy, "fsdp.reshard_after_forward": s.reshard_after_forward}
    if STRATEGIES[scenario.sharding_strategy][0] != "1d" or s.shard_size != s.shard_size * s.replicate_size:
        sharding["fsdp.shard_size"] = s.shard_size  # not the default of a 1-D strategy (every rank)
    return {"wrap": wrap, "fsdp.backward_prefetch": fsdp.get("backward_prefetch", True), "sharding": sharding,
            "training.activation_checkpointing": training.get("activation_checkpointing", "none"),
            "allocator.expandable_segments": scenario.allocator.expandable_segments,
            "training.micro_batch": training.get("micro_batch", 1),
            "batch": {"hardware.nodes": scenario.cluster.nodes, "training.micro_batch": training.get("micro_batch", 1),
                      "training.grad_accumulation": s.grad_accumulation}}


def _with(own, choices) -> tuple:
    """`choices` with `own` first when it is not among them."""
    return tuple(choices) if own in choices else (own, *choices)


def _rank(row: dict) -> tuple:
    return (-row["tokens_per_s_per_gpu"], row["required_bytes"])


def _differs(row: dict, best: dict, keys: list[str]) -> dict[str, Any]:
    return {k: row.get(k) for k in keys if row.get(k) != best.get(k)}


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)  # as --set takes it back


def _setting(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_value(v)}" for k, v in values.items() if v is not None) or "the same settings"


def _budget(row: dict) -> int:
    return row["required_bytes"] + row["headroom_bytes"]


def _limit_of_fastest(best: dict, total: int) -> tuple[str, str]:
    """What holds back the fastest configuration of all: exposed communication, the CPU, or compute."""
    step, exposed, cpu = best["step_time_s"], best["communication_exposed_s"], best["cpu_bound_s"]
    shares = f"MFU {100 * best['mfu']:.1f} %, exposed communication {fmt_time(exposed)}, CPU-bound {fmt_time(cpu)}"
    head = f"the fastest of all {total} configurations"
    if max(exposed, cpu) < SIGNIFICANT * step:
        return "compute", f"compute: {head}, its step is kernels ({shares})"
    if exposed >= cpu:
        return ("exposed_communication", f"exposed communication: {head}; {fmt_time(exposed)} of its "
                f"{fmt_time(step)} step is communication compute does not hide ({shares})")
    return ("cpu_bound", f"CPU-bound: {head}; the compute stream waits {fmt_time(cpu)} of its {fmt_time(step)} "
            f"step for the CPU to launch kernels ({shares})")


def _retries(row: dict) -> int:
    """`num_alloc_retries` a step: the allocator released its cached segments and asked the driver again."""
    return row.get("allocator_retries_per_step", 0)


def _trade(row: dict, best: dict, keys: list[str]) -> dict:
    """`row` against the best: the settings that differ and what they change."""
    return {"row": row, "differs": _differs(row, best, keys),
            "tokens_per_s_change": row["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"] - 1,
            "required_change_bytes": row["required_bytes"] - best["required_bytes"]}


def _trade_line(trade: dict) -> str:
    change = trade["required_change_bytes"]
    return (f"{100 * trade['tokens_per_s_change']:+6.1f} % tokens/s, {('+' if change >= 0 else '') + fmt_bytes(change):>11} "
            f"required, headroom {fmt_bytes(trade['row']['headroom_bytes'])}: {_setting(trade['differs'])}")


def _as_written(rows: list[dict], keys: list[str], written: dict | None) -> dict | None:
    if written is None:
        return None
    return next((r for r in rows if all(r.get(k) == written.get(k) for k in keys)), None)


def recommend(rows: list[dict], keys: list[str], *, top: int = 3, written: dict | None = None) -> dict:
    """The recommendation from sweep rows: `best` (fastest that fits), `limit` and `reason` (what stops
    the next faster configuration, or the fastest one), `next_faster` (of the faster configurations, the
    one fewest settings away from the best, then the least faster), `runners_up` (the next fitting
    configurations with figures unlike the best's, each with its trade-off), `without_retries` (when the
    best fits only by the allocator freeing its cache and retrying every step, a slowdown the step time
    does not price: the fastest that fits without), `counts`, and `as_written`: the row of the scenario as
    written (`written`: its columns) and what the best changes from it (`change`)."""
    ok = [r for r in rows if not r.get("error")]
    fitting = sorted((r for r in ok if r["within_budget"]), key=_rank)  # fits and keeps the safety margin
    words = [verdict_word(r) for r in ok]
    counts = {"configurations": len(rows), "fits": words.count("fits"), "margin": words.count("margin"),
              "no": words.count("no"), "errors": len(rows) - len(ok)}  # the verdict words every output uses
    out = {"keys": keys, "counts": counts, "tally": tally(rows), "best": None, "limit": None, "reason": "",
           "next_faster": None, "runners_up": [], "without_retries": None,
           "as_written": _as_written(rows, keys, written), "change": None}
    if not fitting:
        if ok:
            least = min(ok, key=lambda r: r["required_bytes"])
            out["limit"], out["reason"] = "memory", (
                f"memory: nothing fits; the smallest ({_setting({k: least.get(k) for k in keys})}) needs "
                f"{fmt_bytes(least['required_bytes'])} of a {fmt_bytes(_budget(least))} budget")
        else:
            out["limit"], out["reason"] = "errors", f"every configuration failed: {rows[0]['error'] if rows else 'none'}"
        return out
    best = fitting[0]
    out["best"] = best
    mine = out["as_written"]
    if mine is not None and mine is not best and not mine.get("error"):
        out["change"] = _trade(best, mine, keys)  # the best against the scenario as written
    faster = [r for r in ok if r["tokens_per_s_per_gpu"] > best["tokens_per_s_per_gpu"]]  # none of them fits
    if faster:  # the nearest: fewest settings changed from the best, then the smallest gain
        nxt = min(faster, key=lambda r: (len(_differs(r, best, keys)), r["tokens_per_s_per_gpu"], r["required_bytes"]))
        gain = nxt["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"] - 1
        out["next_faster"], out["limit"] = nxt, "memory"
        out["reason"] = (f"memory: the next faster ({_setting(_differs(nxt, best, keys))}) gives {100 * gain:+.1f} % "
                         f"tokens/s per GPU but needs {fmt_bytes(nxt['required_bytes'])}, "
                         f"{fmt_bytes(-nxt['headroom_bytes'])} over the {fmt_bytes(_budget(nxt))} budget")
    else:
        out["limit"], out["reason"] = _limit_of_fastest(best, len(ok))
    if _retries(best):
        out["without_retries"] = next((_trade(r, best, keys) for r in fitting if not _retries(r)), None)
    seen = {(best["tokens_per_s_per_gpu"], best["required_bytes"])}
    for row in fitting[1:]:
        figures = (row["tokens_per_s_per_gpu"], row["required_bytes"])
        if figures in seen:
            continue  # the same trade-off under another name (a knob that changes nothing here)
        seen.add(figures)
        out["runners_up"].append(_trade(row, best, keys))
        if len(out["runners_up"]) == top:
            break
    return out


def explain(rec: dict) -> str:
    """The recommendation as text; every number with its unit."""
    counted = rec["tally"]
    best = rec["best"]
    if best is None:
        return f"No configuration fits.\nWhy          {rec['reason']}\n{counted}"
    mine, change = rec.get("as_written"), rec.get("change")
    lines = [
        "Recommended  " + ("the scenario as written: " if best is mine else "")
        + _setting({k: best.get(k) for k in rec["keys"]}),
        f"  {best['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, step {fmt_time(best['step_time_s'])}, "
        f"MFU {100 * best['mfu']:.1f} %, required {fmt_bytes(best['required_bytes'])} of "
        f"{fmt_bytes(_budget(best))} (headroom {fmt_bytes(best['headroom_bytes'])})",
        *([f"Changed      from the scenario as written ({fit_word(mine)}: {mine['tokens_per_s_per_gpu']:.0f} tokens/s "
           f"per GPU, required {fmt_bytes(mine['required_bytes'])}), it buys {_trade_line(change)}"] if change else []),
        f"Why          {rec['reason']}",
    ]
    if _retries(best):
        lines.append(f"  it fits only as the allocator frees its cached segments and retries, {_retries(best)} times a "
                     "step (num_alloc_retries; each a device synchronize and cudaFree: slower than this step time)")
        other = rec.get("without_retries")
        lines.append(f"Without retries  {_trade_line(other)}" if other else "Without retries  no configuration fits")
    if rec["runners_up"]:
        lines.append("Runners-up")
    for r in rec["runners_up"]:
        lines.append(f"  {_trade_line(r)}")
    lines.append(counted)
    return "\n".join(lines)
