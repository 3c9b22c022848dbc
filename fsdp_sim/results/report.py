"""The terminal summary of a simulated step. Every number carries its unit."""

from __future__ import annotations

GiB, MiB = 1 << 30, 1 << 20


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.2f} s"


def summary(d: dict) -> str:
    """Human-readable text from `StepResult.to_dict()` output."""
    peak, mem, comm, comp, f = d["peak"], d["memory"], d["communication"], d["compute"], d["fsdp"]
    tp, br = d["throughput"], comp["breakdown"]
    hw, over = d["hardware"], mem["overheads_bytes"]
    lines = [
        f"fsdp-sim: {d['scenario']} — {d['model']['name']} ({d['model']['params'] / 1e9:.2f} B params) on "
        f"{hw['nodes']}x{hw['gpus_per_node']} {hw['profile']} ({hw['world_size']} GPUs)",
        f"  FSDP2 {f['sharding_strategy']} (shard {f['shard_size']} x replicate {f['replicate_size']}), wrap {f['wrap']} "
        f"({len(d['units'])} units), reshard_after_forward={f['reshard_after_forward']}, "
        f"param {f['param_dtype']} / reduce {f['reduce_dtype']}, {f['optimizer']}, AC {f['activation_checkpointing']}",
        "",
        f"Step time            {fmt_time(d['step_time_s'])}   {tp['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, "
        f"{tp['tokens_per_step']} tokens per step",
        f"Compute busy         {fmt_time(comp['busy_s'])}   MFU {100 * comp['mfu']:.1f} %",
        f"  alone on the GPU   matmul {fmt_time(br['matmul_s'])}, attention {fmt_time(br['attention_s'])}, "
        f"memory-bound {fmt_time(br['memory_bound_s'])}",
        f"  slowed by NCCL     {fmt_time(br['interference_s'])}; waiting for the CPU (launch-bound) "
        f"{fmt_time(br['cpu_bound_s'])}",
        f"Communication        {fmt_time(comm['total_s'])} total, {fmt_time(comm['exposed_s'])} exposed, "
        f"overlap {100 * comm['overlap_fraction']:.1f} %",
        "  exposed            " + ", ".join(f"{k.replace('_', '-')} {fmt_time(v)}"
                                          for k, v in comm["exposed_by_collective_s"].items() if v or k != "all_reduce"),
        f"  per rank moved     all-gather {fmt_bytes(comm['all_gather_bytes'])}, "
        f"reduce-scatter {fmt_bytes(comm['reduce_scatter_bytes'])}"
        + (f", all-reduce {fmt_bytes(comm['all_reduce_bytes'])}" if comm["all_reduce_bytes"] else ""),
        "",
        f"Peak allocated       {fmt_bytes(peak['allocated_bytes'])} at {fmt_time(peak['time_s'])} "
        f"({peak['phase']}, {'unit ' + peak['unit'] if peak['unit'] else 'outside the FSDP units'}, op '{peak['op']}')",
        f"Peak reserved        {fmt_bytes(peak['reserved_bytes'])} (allocator pools per stream, no fragmentation model)",
        f"  reserved - allocated {fmt_bytes(over['reserved_minus_allocated'])}: freed blocks the stream pools keep "
        "cached, and size rounding",
        "  by category at the peak (they sum to peak allocated):",
    ]
    for cat, value in peak["by_category"].items():
        if value:
            lines.append(f"    {cat:<24}{fmt_bytes(value):>12}")
    lines.append("  largest live buffers at the peak:")
    for b in peak["live_buffers"]:
        lines.append(f"    {fmt_bytes(b['bytes']):>12}  {b['name']} [{b['category']}]")
    verdict = "FITS" if mem["fits"] else "DOES NOT FIT"
    lines += [
        "",
        f"GPU memory           {fmt_bytes(mem['capacity_bytes'])}; budget with {100 * mem['safety_margin']:.0f} % margin "
        f"{fmt_bytes(mem['budget_bytes'])}",
        f"Required             {fmt_bytes(mem['required_bytes'])} (reserved + CUDA context "
        f"{fmt_bytes(over['cuda_context'])} + NCCL {fmt_bytes(over['nccl'])})  -> {verdict}, "
        f"headroom {fmt_bytes(mem['headroom_bytes'])}",
    ]
    return "\n".join(lines)
