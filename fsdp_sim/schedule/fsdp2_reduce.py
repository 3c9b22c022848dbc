"""FSDP2's gradient reduction, `foreach_reduce` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):
the reduce-scatter copy-in, the collective on its stream, under HSDP the all-reduce with the post-divide and
cast on the all-reduce stream, and the events and buffers the hooks keep for later waits.

A mixin of `FSDP2Runtime`, split out to read beside that one torch function: it uses the runtime's op
graph (`g`), settings (`s`), per-unit shard sizes and the gradient and reduce state the runtime keeps
(`unsharded_grads`, `accumulated_grads`, `sharded_grads`, `reduce_scatter_state`, `all_reduce_states`,
`partial_reduce_outputs`, `last_post_reduce_events`).
"""

from __future__ import annotations

from fsdp_sim.schedule.autograd import COMPUTE
from fsdp_sim.schedule.settings import REPLICATE_GROUP, SHARD_GROUP
from fsdp_sim.wrap import Unit

RS, AR = "reduce_scatter", "all_reduce"


class GradientReduction:
    # ---- gradient reduction (foreach_reduce) -------------------------------------------------
    def foreach_reduce(self, u: Unit) -> None:
        """COL:foreach_reduce: copy-in on the compute stream, then reduce-scatter, all-reduce, post-reduce.

        On the reduce-scatter stream: the output, the pre-divide (fp16 only), the reduce-scatter (a
        copy for a shard group of one), whose event the next post_backward waits. HSDP moves the
        post-reduce stream to the all-reduce stream: the in-place all-reduce, then the post-divide
        (fp16 only) and the cast to the sharded parameter's dtype run there. The reduce-dtype output
        is dropped when foreach_reduce returns, unless HSDP's `_all_reduce_state` keeps it (it
        stops the next reduce-scatter from reusing its block while the all-reduce runs) until
        `finalize_backward`. The last op on the post-reduce stream is the group's post-reduce event.
        HSDP with `set_requires_all_reduce(False)` returns after the reduce-scatter: its output becomes
        (or is added, on the reduce-scatter stream, into) `_partial_reduce_output`, which the next
        all-reducing backward adds into its output before the all-reduce, then drops.
        """
        s, g = self.s, self.g
        shard = self.trainable_shard[u.name]
        rs_in = g.alloc(COMPUTE, f"{u.name} reduce-scatter input", "reduce_scatter_buffers", shard * s.shard_size * s.reduce_bytes)
        # a gradient accumulated over earlier micro-batches (in reduce_dtype) replaces this backward's
        accumulated, unsharded = self.accumulated_grads, self.unsharded_grads
        grads = [accumulated.pop(p.name, None) or unsharded.pop(p.name)
                 for p in u.params if p.name in accumulated or p.name in unsharded]
        copy_in = g.add("copy", COMPUTE, f"{u.name} reduce-scatter copy-in",
                        hbm_bytes=sum([b.nbytes for b in grads]) + rs_in.nbytes)
        # `unsharded_grads.clear()` frees them after the copy-in, all but one with a shard group of more than
        # one: the loop that re-chunks Shard(dim != 0) gradients (`for i, (fsdp_param, unsharded_grad) in
        # enumerate(...)`, run whenever world_size > 1) leaves its variable on the last gradient, which lives
        # until foreach_reduce returns (the root's: the output head's, vocab x hidden)
        held = grads.pop() if grads and s.shard_size > 1 else None
        for buf in grads:
            g.free(COMPUTE, buf)
        existing = self.sharded_grads.get(u.name)  # from an earlier micro-batch
        cast = s.reduce_dtype != s.storage_dtype  # _to_dtype_if_needed: a new tensor
        partial_only = s.replicate_size > 1 and not self.all_reduce_grads
        partial = self.partial_reduce_outputs.pop(u.name, None)
        rs_out_is_grad = not cast and existing is None and not partial_only
        # the reduce-scatter stream waits the compute stream (the copy-in)
        rs_out = g.alloc(RS, f"{u.name} sharded grads" if rs_out_is_grad else
                         f"{u.name} partial reduce output" if partial_only and partial is None else
                         f"{u.name} reduce-scatter output",
                         "sharded_grads" if rs_out_is_grad else "reduce_scatter_buffers", shard * s.reduce_bytes, deps=(copy_in,))
        pre_divide, post_divide = gradient_divide_factors(s.reduce_dtype, s.shard_size * s.replicate_size)
        if pre_divide:
            g.add("copy", RS, f"{u.name} pre-divide grads by {pre_divide:g}", deps=(copy_in,), hbm_bytes=2 * rs_in.nbytes)
        if s.shard_size > 1:
            reduce_scatter = g.add("reduce_scatter", RS, f"{u.name} reduce-scatter", deps=(copy_in,), group=SHARD_GROUP,
                                   comm_bytes=rs_in.nbytes)
        else:  # reduce_output.copy_(reduce_scatter_input)
            reduce_scatter = g.add("copy", RS, f"{u.name} copy grads to reduce output (shard group of one)",
                                   deps=(copy_in,), hbm_bytes=rs_in.nbytes + rs_out.nbytes)
        self.reduce_scatter_state = (rs_in, reduce_scatter)
        post_reduce_stream, event = RS, reduce_scatter
        if partial_only:  # accumulations run on the reduce-scatter stream
            if partial is None:
                self.partial_reduce_outputs[u.name] = rs_out
            else:
                event = g.add("copy", RS, f"{u.name} accumulate partial reduce output", deps=(event,),
                              hbm_bytes=2 * partial.nbytes + rs_out.nbytes)
                g.free(RS, rs_out)
                self.partial_reduce_outputs[u.name] = partial
            self.last_post_reduce_events[RS] = event
            if held is not None:
                g.free(COMPUTE, held)
            return
        if partial is not None:  # reduce_output += partial_reduce_output
            event = g.add("copy", RS, f"{u.name} add partial reduce output", deps=(event,),
                          hbm_bytes=2 * rs_out.nbytes + partial.nbytes)
        if s.replicate_size > 1:
            post_reduce_stream = AR
            event = g.add("all_reduce", AR, f"{u.name} all-reduce (replicas)", deps=(event,),
                          group=REPLICATE_GROUP, comm_bytes=rs_out.nbytes)
        if post_divide:
            event = g.add("copy", post_reduce_stream, f"{u.name} post-divide grads by {post_divide:g}", deps=(event,),
                          hbm_bytes=2 * rs_out.nbytes)
        new_grad = rs_out
        if cast:
            new_grad = g.alloc(post_reduce_stream,
                               f"{u.name} sharded grads" if existing is None else f"{u.name} new sharded grads",
                               "sharded_grads" if existing is None else "reduce_scatter_buffers",
                               shard * s.storage_bytes, deps=(event,))
            event = g.add("copy", post_reduce_stream, f"{u.name} cast sharded grads to {s.storage_dtype}", deps=(event,),
                          hbm_bytes=rs_out.nbytes + new_grad.nbytes)
        if existing is not None:  # sharded_param.grad += new sharded grad
            event = g.add("copy", post_reduce_stream, f"{u.name} accumulate sharded grads", deps=(event,),
                          hbm_bytes=2 * existing.nbytes + new_grad.nbytes)
        else:
            self.sharded_grads[u.name] = new_grad
        # returned: what no sharded gradient references is dropped
        if new_grad is not rs_out and existing is not None:
            g.free(post_reduce_stream, new_grad)
        if not rs_out_is_grad:
            if s.replicate_size > 1:
                self.all_reduce_states[u.name] = rs_out
            else:
                g.free(RS, rs_out)
        if partial is not None:  # PG:post_backward: self._partial_reduce_output = None
            g.free(RS, partial)
        if self.techniques.cpu_offload:  # CPUOffloadPolicy: the sharded gradient goes to the host (offload.py)
            event = self.techniques.cpu_offload.offload_sharded_grads(u, post_reduce_stream, event)
        self.last_post_reduce_events[post_reduce_stream] = event
        if held is not None:
            g.free(COMPUTE, held)


def gradient_divide_factors(reduce_dtype: str, data_parallel_size: int) -> tuple[float | None, float | None]:
    """COL:_get_gradient_divide_factors without a user factor: the (pre, post) divide kernels, None if none.

    fp32 and bf16 reduce with NCCL's ReduceOp.AVG, no divide kernel; fp16 sums, dividing by about
    sqrt(N) before and the rest after to stay in range. A factor of 1 runs no kernel (_div_if_needed).
    """
    if reduce_dtype in ("fp32", "bf16"):
        return None, None
    return sum_divide_factors(data_parallel_size)


def sum_divide_factors(data_parallel_size: int) -> tuple[float | None, float | None]:
    """The (pre, post) divide kernels around a SUM reduction over `data_parallel_size` ranks, None if none:
    a power of two about sqrt(N) before, the rest after (`DefaultState._get_gradient_predivide_factor`,
    which FSDP1 applies whatever the dtype and FSDP2 for fp16)."""
    factor = float(data_parallel_size)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    post = factor / pre
    return (pre if pre != 1 else None), (post if post != 1 else None)
