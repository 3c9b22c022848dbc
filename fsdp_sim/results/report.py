"""The terminal summary of a simulated step. Every number carries its unit."""

from __future__ import annotations

GiB, MiB = 1 << 30, 1 << 20
# the figures of a sweep row (sweep.py's `_row`), in the CSV's column order; what a row holds beside them
# is the point's settings
COLUMNS = ("step_time_s", "tokens_per_s_per_gpu", "tokens_per_step", "peak_allocated_bytes", "peak_reserved_bytes",
           "required_bytes", "fits", "within_budget", "headroom_bytes", "allocator_retries_per_step",
           "communication_exposed_s", "overlap_fraction", "mfu", "cpu_bound_s", "peak_phase", "knife_edge", "error")


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s"


def fit_word(row: dict) -> str:
    """One verdict word per configuration, the same in every output: fits (within the budget), margin (runs,
    but inside the safety margin), no (does not fit); `(edge)` after it where the caching allocator's
    placement decided it (`memory.knife_edge`)."""
    word = verdict_word(row)
    return word + " (edge)" if row.get("knife_edge") else word


def verdict_word(row: dict) -> str:
    """fits, margin or no, without the knife-edge mark (what the tallies count)."""
    return "fits" if row["within_budget"] else "margin" if row["fits"] else "no"


def tally(rows: list[dict]) -> str:
    """How many configurations fit, run only inside the margin, do not fit and failed, in fit_word's words."""
    ok = [r for r in rows if not r.get("error")]
    words = [verdict_word(r) for r in ok]
    counts = [f"{words.count('fits')} fit", *([f"{words.count('margin')} only inside the safety margin"]
                                               if "margin" in words else []), f"{words.count('no')} do not"]
    edges = sum(bool(r.get("knife_edge")) for r in ok)
    failed = len(rows) - len(ok)
    return (f"{len(rows)} configurations: {', '.join(counts)}" + (f", {failed} failed" if failed else "")
            + (f" ({edges} on a knife edge: the allocator's placement decides)" if edges else ""))


def verdict(mem: dict) -> str:
    """FITS (within the budget), FITS INSIDE THE MARGIN (runs without an out-of-memory error, but eats into the
    safety margin the budget keeps), DOES NOT FIT (required is past the GPU's capacity)."""
    return "FITS" if mem["within_budget"] else "FITS INSIDE THE MARGIN" if mem["fits"] else "DOES NOT FIT"


def software_line(d: dict) -> str:
    """The stack the run assumes (hardware/software.py) and the rate its GPU sustains (profiles.Sustained)."""
    sw, hw = d["software"], d["hardware"]
    norm = f", norms {sw['norm']}" if sw["norm"] else ""
    spread, factor = f"spread {100 * hw['gpu_speed_spread']:.1f} %", f"compute x{hw['slowest_rank_factor']:.3f}"
    pacer = hw.get("paced_by", "spread")
    if pacer != "spread":  # a rank or node named in `variation:` is slower than the spread's expected slowest
        pace = (f"paced by {pacer} at speed {hw['slowest_named_speed']:.2f} (slower than the expected slowest of "
                f"{hw['world_size']} GPUs under {spread}: {factor})")
    else:
        pace = (f"the slowest of {hw['world_size']} GPUs' pace ({spread}"
                + (", slower than any rank or node named" if "paced_by" in hw else "") + f": {factor})")
    slowest = f", {pace}" if hw["slowest_rank_factor"] != 1 else ""
    compiled = f" (blocks: {sw['compiled_blocks']})" if sw.get("compiled_blocks") else ""
    return (f"  software           torch {sw['torch']} (NCCL {sw['nccl']}): SDPA {sw['sdpa_backend']}{norm}, "
            f"{'torch.compile' if sw['torch_compile'] else 'eager'}{compiled}; kernels at the GPU's sustained rate "
            f"(compute {hw['sustained_compute']:.3f}x, memory {hw['sustained_memory']:.2f}x its benchmarks){slowest}")


def fault_words(variation: dict) -> list[str]:
    """Each straggler, slow node and NIC named in `variation:`, in one wording for every kind: "rank 3 at
    speed 0.90", "node 1 at speed 0.80", "node 1 NIC 2 down", "node 2 NIC 0 at bandwidth 0.50"."""
    return ([f"rank {a['rank']} at speed {a['speed']:.2f}" for a in variation.get("stragglers", [])]
            + [f"node {a['node']} at speed {a['speed']:.2f}" for a in variation.get("nodes", [])]
            + [f"node {a['node']} NIC {a['nic']} "
               + ("down" if a["bandwidth"] == 0 else f"at bandwidth {a['bandwidth']:.2f}") for a in variation.get("links", [])])


def variation_lines(hw: dict) -> list[str]:
    """The summary's lines on what `variation:` names and how the collectives were priced (none for a plain
    scenario: the closed forms on a uniform fabric)."""
    lines = []
    var, priced = hw.get("variation"), hw.get("collective_pricing")
    if var:
        weakest = var.get("weakest_nic_node")
        lines.append("  variation          " + ", ".join(fault_words(var))
                     + (f" (the weakest node for rings across nodes: node {weakest['node']}, its NICs at "
                        f"{100 * weakest['nic_sum_fraction']:.1f} % of their sum)" if weakest else ""))
    if priced or (var and "links" in var):
        lines.append(f"  fabric             {pricing_words(hw)}")
    return lines


def pricing_words(hw: dict) -> str:
    """How the collectives were priced, in words (`hardware.collective_pricing`; absent: the closed forms)."""
    priced = hw.get("collective_pricing")
    if not priced:
        return ("collectives priced by the closed forms" + (": no collective crosses the NICs (one node), so the NIC "
                "faults cost nothing" if "links" in hw.get("variation", {}) else ""))
    why = {"oversubscription": f"oversubscription {priced['oversubscription']:g}:1 on {priced['topology']} with "
                               f"{priced['nodes_per_leaf']} nodes per leaf",
           "nic_faults": "NICs below their rate"}
    because = " and ".join(why[b] for b in priced["because"]) or "asked for"
    spines = f"{priced['spines']} spine{'s' if priced['spines'] != 1 else ''}"
    return (f"collectives priced on the topology graph ({because}; {spines}) for the "
            f"{', '.join(priced['groups']) or 'no'} group{'s' if len(priced['groups']) != 1 else ''}")


def summary(d: dict) -> str:
    """Human-readable text from `StepResult.to_dict()` output."""
    peak, mem, comm, comp, f = d["peak"], d["memory"], d["communication"], d["compute"], d["fsdp"]
    tp, br = d["throughput"], comp["breakdown"]
    hw, over, al = d["hardware"], mem["overheads_bytes"], d["allocator"]
    lines = [
        f"fsdp-sim: {d['scenario']} — {d['model']['name']} ({d['model']['params'] / 1e9:.2f} B params"
        f"{' on each tensor-parallel rank' if 'tp' in d['fsdp'] else ''}) on "
        f"{hw['nodes']}x{hw['gpus_per_node']} {hw['profile']} ({hw['world_size']} GPU{'s' if hw['world_size'] != 1 else ''})",
        (f"  no FSDP (plain training on one GPU, autocast to {f['param_dtype']}), {f['optimizer']}, "
         f"AC {f['activation_checkpointing']}" if f['runtime'] == "none" else
         f"  {f['runtime'].upper()} {f['sharding_strategy']} (shard {f['shard_size']} x replicate {f['replicate_size']}), "
         f"wrap {f['wrap']} ({len(d['units'])} units), "
         + (f"backward_prefetch={f['backward_prefetch']}, forward_prefetch={f['forward_prefetch']}, "
            f"limit_all_gathers={f['limit_all_gathers']}, use_orig_params={f['use_orig_params']}, "
            if f['runtime'] == "fsdp1" else f"reshard_after_forward={f['reshard_after_forward']}, ") +
         f"param {f['param_dtype']} / reduce {f['reduce_dtype']}, {f['optimizer']}, AC {f['activation_checkpointing']}"),
        f"  parameters         trainable {d['model']['trainable_params']} params, frozen {d['model']['frozen_params']} params; "
        f"trainable stored in {d['model']['param_storage_dtype']}",
        software_line(d),
        *variation_lines(d["hardware"]),
        *([f"  note               {f['zero_stage_note']}"] if f.get("zero_stage_note") else []),
        *([f"  tensor parallel    {f['tp']} ranks per TP group (sequence parallel {f['sequence_parallel']}); FSDP over "
           f"the {f['shard_size'] * f['replicate_size']} data-parallel ranks; parameters above are one rank's"]
          if "tp" in f else []),
        *([f"  float8             {f['float8_linears']} Float8Linear weights, float8 all-gather {f['float8_all_gather']}, "
           f"precomputed scales {f['float8_precompute_scale']}"] if "float8_linears" in f else []),
        "",
        f"Step time            {fmt_time(d['step_time_s'])}   {tp['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, "
        f"{tp['tokens_per_step']} tokens per step",
        *([f"  folded             {f['grad_accumulation']} micro-batches priced from "
           f"{comp['folded']['micro_batches_simulated']}: each middle one adds {fmt_time(comp['folded']['middle_micro_batch_s'])}"]
          if "folded" in comp else []),
        *per_rank_lines(d),
        f"Compute busy         {fmt_time(comp['busy_s'])}{ranks_of(d, 'compute_busy_s')}   MFU {100 * comp['mfu']:.1f} %",
        f"  alone on the GPU   matmul {fmt_time(br['matmul_s'])}, attention {fmt_time(br['attention_s'])}, "
        f"memory-bound {fmt_time(br['memory_bound_s'])}",
        f"  slowed by NCCL     {fmt_time(br['interference_s'])}; waiting for the CPU (launch-bound) "
        f"{fmt_time(br['cpu_bound_s'])}",
        f"Communication        {fmt_time(comm['total_s'])} total, {fmt_time(comm['exposed_s'])} exposed"
        f"{ranks_of(d, 'exposed_communication_s')}, overlap {100 * comm['overlap_fraction']:.1f} %",
        "  exposed            " + ", ".join(f"{k.replace('_', '-')} {fmt_time(v)}"
                                          for k, v in comm["exposed_by_collective_s"].items() if v or k != "all_reduce"),
        *waiting_lines(d),
        f"  per rank moved     all-gather {fmt_bytes(comm['all_gather_bytes'])}, "
        f"reduce-scatter {fmt_bytes(comm['reduce_scatter_bytes'])}"
        + (f", all-reduce {fmt_bytes(comm['all_reduce_bytes'])}" if comm["all_reduce_bytes"] else ""),
        "",
        f"Peak allocated       {fmt_bytes(peak['allocated_bytes'])} at {fmt_time(peak['time_s'])} "
        f"({peak['phase']}, {'unit ' + peak['unit'] if peak['unit'] else 'outside the FSDP units'}, op '{peak['op']}')",
        f"Peak reserved        {fmt_bytes(peak['reserved_bytes'])} (caching allocator model, steady state, "
        f"expandable_segments {'on' if al['expandable_segments'] else 'off'})",
        f"  cached, not allocated {fmt_bytes(al['cached_not_allocated_bytes'])}: free blocks the allocator keeps in "
        f"its per-stream pools and segments; empty_cache would return {fmt_bytes(al['empty_cache_releasable_bytes'])}",
        f"  first step         peak allocated {fmt_bytes(al['first_step']['allocated_bytes'])} "
        f"({al['first_step']['phase']}), reserved {fmt_bytes(al['first_step']['reserved_bytes'])} "
        "(optimizer states created in its optimizer step)",
        *([f"  on this GPU        {fmt_bytes(al['limit_bytes'])} left to the allocator: "
           + ("out of memory even after it frees its cached segments and retries" if al["out_of_memory"] else
              f"reserved {fmt_bytes(al['reserved_under_limit_bytes'])}, {al['retries_per_step']} allocator retries "
              f"per step ({al['retries']} in all; each a device synchronize and cudaFree of cached segments: a slower "
              "step, not priced)")]
          if peak["reserved_bytes"] > al["limit_bytes"] else []),
        "  by category at the peak (they sum to peak allocated):",
    ]
    for cat, value in peak["by_category"].items():
        if value:
            lines.append(f"    {cat:<24}{fmt_bytes(value):>12}")
    lines.append("  largest live buffers at the peak:")
    for b in peak["live_buffers"]:
        lines.append(f"    {fmt_bytes(b['bytes']):>12}  {b['name']} [{b['category']}]")
    lines += [
        "",
        f"GPU memory           {fmt_bytes(mem['capacity_bytes'])}; budget with {100 * mem['safety_margin']:.0f} % margin "
        f"{fmt_bytes(mem['budget_bytes'])}",
        f"Required             {fmt_bytes(mem['required_bytes'])} (reserved + CUDA context "
        f"{fmt_bytes(over['cuda_context'])} + NCCL {fmt_bytes(over['nccl'])} for the "
        f"process groups: {', '.join(mem['nccl_groups_bytes']) or 'none'})  -> {verdict(mem)}, "
        f"headroom {fmt_bytes(mem['headroom_bytes'])}",
    ]
    if mem.get("knife_edge"):  # the verdict rests on the caching allocator's placement (analysis.memory_summary)
        live, roomy = (fmt_bytes(d["peak"][k] + over["cuda_context"] + over["nccl"])
                       for k in ("allocated_bytes", "reserved_bytes"))
        lines.append(f"  knife edge         the live tensors need {live} with the overheads, and with room to spare the "
                     f"allocator would reserve {roomy}: on this GPU "
                     + (f"it fits only by releasing its cache and retrying, {d['allocator']['retries_per_step']} "
                        "times a step" if mem["fits"] else
                        "it runs out of memory, its cached free blocks too fragmented for a request"))
    parts = contributors(d)
    lines.append("  per GPU, by kind   " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items())
                 + " (they sum to required)")
    lines.append(f"  headroom advice    keep 10 % to 15 % of the GPU free for allocator growth and spikes the step does not "
                 f"show; this budget keeps {100 * mem['safety_margin']:.0f} % (report.safety_margin)")
    lines += host_lines(d)  # host memory per node, when the step offloads (host.py)
    return "\n".join(lines)


# the memory categories at the peak as the five contributors ZeRO's accounting names (parameters,
# gradients, optimizer states, activations; the rest is overhead, with the cache, CUDA context and NCCL)
KINDS = {"parameters": ("sharded_params", "unsharded_params"), "gradients": ("sharded_grads", "unsharded_grads"),
         "optimizer states": ("optimizer_states",), "activations": ("activations", "inputs")}


def per_rank_lines(d: dict) -> list[str]:
    """The summary's per-rank lines (`run --per-rank`, results/ranks.py; none without a `per_rank` section)."""
    p = d.get("per_rank")
    if p is None:
        return []
    named = [f"rank {a['rank']}" + f" x{a['speed']:.2f}" for a in p["stragglers"]] + \
            [f"node {a['node']} x{a['speed']:.2f}" for a in p["nodes"]]
    speed = {r["rank"]: r["speed"] for r in (d["ranks"][p["slowest_rank"]], d["ranks"][p["fastest_rank"]])}
    lines = [
        f"  per rank           {p['ranks']} ranks played (spread {100 * p['gpu_speed_spread']:.1f} %, seed {p['seed']}"
        + (f"; {', '.join(named)}" if named else "") + f"): slowest rank {p['slowest_rank']} "
        f"(speed {speed[p['slowest_rank']]:.3f}) ends at {fmt_time(p['step_time_s']['slowest'])}, fastest rank "
        f"{p['fastest_rank']} (speed {speed[p['fastest_rank']]:.3f}) at {fmt_time(p['step_time_s']['fastest'])}; "
        f"every rank at the mean speed {fmt_time(p['representative_step_time_s'])}",
    ]
    for a in p["attribution"]:
        lines.append(f"  held back by       rank {a['rank']} (speed {a['speed']:.3f}) cost the step {fmt_time(a['cost_s'])}: "
                     f"last to arrive at {a['collectives']} collectives")
    return lines


def ranks_of(d: dict, key: str) -> str:
    """With `--per-rank`, whose figure the compute or communication line gives: a rank's, the mean over the
    ranks, and the most any rank had (`per_rank[key]`); nothing without."""
    p = d.get("per_rank")
    return f" a rank (mean of {p['ranks']} ranks; most {fmt_time(p[key]['max'])})" if p else ""


def waiting_lines(d: dict) -> list[str]:
    """With `--per-rank`, how long a rank's collectives wait for their group's last rank, split into what
    stalls its compute stream and what runs beside its kernels or transfers (results/ranks.RankActivity)."""
    p = d.get("per_rank")
    if p is None:
        return []
    wait, stall = p["collective_wait_s"]["mean"], p["stalled_s"]["mean"]
    return [f"  waiting            for the group's last rank {fmt_time(wait)} a rank: {fmt_time(stall)} of it stalls the "
            f"compute stream (most {fmt_time(p['stalled_s']['max'])}), {fmt_time(max(0.0, wait - stall))} beside its "
            "kernels or transfers"]


def host_lines(d: dict) -> list[str]:
    """The summary's host lines (none without a `host` section)."""
    h = d.get("host")
    if h is None:
        return []
    verdict = "FITS" if h["fits"] else "DOES NOT FIT"
    parts = ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in h["by_category_per_rank"].items())
    return [
        "",
        f"Host memory          {fmt_bytes(h['per_node_bytes'])} per node = {h['ranks_per_node']} GPUs x "
        f"{fmt_bytes(h['per_rank_bytes'])} per rank ({parts}); pinned {fmt_bytes(h['pinned_per_rank_bytes'])} per rank, "
        "the optimizer's states pageable",
        f"  node has           {fmt_bytes(h['capacity_bytes'])}  -> {verdict}; over {h['link']} per rank: "
        f"H2D {fmt_bytes(h['h2d_bytes_per_rank'])}, D2H {fmt_bytes(h['d2h_bytes_per_rank'])}",
        f"  on the CPU         {fmt_time(h['cpu_s'])} (optimizer step, gradient adds); save_on_cpu copies on the "
        f"compute stream {fmt_time(h['compute_stream_copies_s'])} (in memory-bound above)",
    ]


def contributors(d: dict) -> dict[str, int]:
    """Required memory split five ways: parameters, gradients, optimizer states, activations (at the peak)
    and overhead (temporaries, communication buffers, what the allocator caches, CUDA context, NCCL)."""
    by = d["peak"]["by_category"]
    parts = {kind: sum(by.get(c, 0) for c in cats) for kind, cats in KINDS.items()}
    parts["overhead"] = d["memory"]["required_bytes"] - sum(parts.values())
    return parts
