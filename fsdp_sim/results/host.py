"""Host memory of a node beside GPU memory, for a step that offloads (CPU offload, save_on_cpu).

Every rank of a node keeps its own shards on the node's one host memory, so the node needs the
rank's peak (`schedule/offload.py` HostMemory: state + the larger of the offloaded activations and the
CPU optimizer's temporaries) times the ranks it runs. Exact integers. Nothing here for a step that
offloads nothing: its result has no `host` section.
"""

from __future__ import annotations

from fsdp_sim.hardware.host_link import CPU, D2H, H2D


def host_memory(result) -> dict:
    """`{"host": {...}}` for `StepResult.to_dict()`, or {} when nothing was offloaded."""
    host = result.graph.host
    if host is None:
        return {}
    cluster = result.scenario.cluster
    ranks = cluster.gpus_per_node
    per_rank = host.peak_bytes
    capacity = cluster.host_capacity_bytes
    moved = {H2D: 0, D2H: 0}
    cpu_s = compute_copies_s = 0.0
    start, end = result.timing.start, result.timing.end
    for op in result.graph.ops:
        if op.group in moved:
            moved[op.group] += int(op.comm_bytes)
            if op.stream == "compute":  # save_on_cpu's copies hold the compute stream
                compute_copies_s += float(end[op.id] - start[op.id])
        elif op.group == CPU:
            cpu_s += float(end[op.id] - start[op.id])
    by_category = dict(sorted(host.persistent.items())) | {"activations": host.activations_peak,
                                                           "optimizer_temporaries": host.optimizer_temp}
    # pinned: the shards FSDP pins, the gradients a non-blocking D2H copy lands in (`_to_copy` pins a CUDA ->
    # CPU non_blocking destination), save_on_cpu's copies; pageable: torch.optim's states (`zeros_like` of a
    # pinned parameter does not pin) and the CPU step's temporaries
    pinned = per_rank - host.persistent.get("optimizer_states", 0) - (host.optimizer_temp if host.optimizer_temp
                                                                        > host.activations_peak else 0)
    return {"host": {"link": cluster.gpu.host.link, "ranks_per_node": ranks,
                     "per_rank_bytes": per_rank, "per_node_bytes": per_rank * ranks,
                     "pinned_per_rank_bytes": pinned,
                     "by_category_per_rank": {k: v for k, v in by_category.items() if v},
                     "capacity_bytes": capacity, "fits": per_rank * ranks <= capacity,
                     "h2d_bytes_per_rank": moved[H2D], "d2h_bytes_per_rank": moved[D2H],
                     "cpu_s": cpu_s, "compute_stream_copies_s": compute_copies_s}}
