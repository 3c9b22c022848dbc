"""FSDP1's gradient reduction: the second half of `_post_backward_hook` (torch/distributed/fsdp/
_runtime_utils.py), `_reduce_grad` / `_reduce_grad_no_shard` and `_accumulate_sharded_grad`.

A mixin of `FSDP1Runtime`, split out to read beside those functions: it uses the runtime's op graph (`g`),
settings (`s`), the flat sizes (`flat_numel`, `local`), `flat_grads` (each unit's `.grad`) and
`sharded_grads` (`_saved_grad_shard`, by unit).

Everything runs on the post-backward stream after it waits the compute stream: the cast of the flat
gradient to `reduce_dtype` (a new tensor), the zero padding to S x W when the flat parameter does not
divide (`_get_reduce_scatter_tensors`), the pre-divide, a SUM reduce-scatter into a new shard and the
post-divide (FSDP1 divides whatever the dtype: `_init_utils` sets both factors), then the cast of the shard
to the parameter's dtype and its accumulation into `_saved_grad_shard`. HSDP moves the all-reduce over
the replicas, the post-divide and the accumulation to the all-reduce stream; NO_SHARD all-reduces the
whole flat gradient instead. The autograd gradient, produced on the compute stream, is freed at the end
of the hook after `record_stream(post_backward_stream)`.
"""

from __future__ import annotations

from fsdp_sim.hardware.host_link import D2H
from fsdp_sim.schedule.autograd import COMPUTE
from fsdp_sim.schedule.fsdp2_reduce import AR, REPLICATE_GROUP, SHARD_GROUP, sum_divide_factors
from fsdp_sim.schedule.ops import Buffer, Op
from fsdp_sim.wrap import Unit

POST_BACKWARD = "post_backward"
HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


class FlatGradientReduction:
    def reduce_grad(self, u: Unit) -> None:
        """`_post_backward_hook` from `post_backward_stream.wait_stream(current_stream)` on."""
        s, g = self.s, self.g
        grad = self.flat_grads.pop(u.name)  # autograd_computed_grad
        g.wait_event(POST_BACKWARD, self._last_compute_op())
        flat = grad
        if s.reduce_dtype != s.param_dtype:  # flat_param.grad.data = flat_param.grad.to(reduce_dtype)
            kept = not self.sharded and s.reduce_dtype == s.storage_dtype and u.name not in self.sharded_grads
            flat = g.alloc(POST_BACKWARD, f"{u.name} flat grad in {s.reduce_dtype}",
                           "sharded_grads" if kept else "reduce_scatter_buffers", self.flat_numel[u.name] * s.reduce_bytes)
            g.add("copy", POST_BACKWARD, f"{u.name} cast flat grad to {s.reduce_dtype}",
                  hbm_bytes=grad.nbytes + flat.nbytes)
        pre_divide, post_divide = sum_divide_factors(s.shard_size * s.replicate_size)
        if self.sharded:
            kept, stream, event = self._reduce_scatter(u, flat, pre_divide, post_divide)
        else:
            kept, stream, event = self._all_reduce_no_shard(u, flat, pre_divide, post_divide)
        if s.offload_params and self.sharded:  # _offload_grad: _cpu_grad.copy_(_saved_grad_shard, non_blocking=True)
            event = g.add("copy", stream, f"{u.name} sharded grad D2H (_cpu_grad)",
                          comm_bytes=self.sharded_grads[u.name].nbytes, group=D2H)
        if flat is not grad and flat is not kept:
            g.free(POST_BACKWARD, flat)
        if grad is not kept:  # record_stream(autograd_computed_grad, post_backward_stream), then out of scope
            g.free(COMPUTE, grad, record_stream=POST_BACKWARD)
        self.last_post_reduce_events[stream] = event

    def _reduce_scatter(self, u: Unit, flat: Buffer, pre_divide, post_divide) -> tuple[Buffer | None, str, Op]:
        """`_reduce_grad`: pad, pre-divide, reduce-scatter into `new_sharded_grad`; HSDP all-reduces it on
        the all-reduce stream (`record_stream` there); post-divide; accumulate."""
        s, g = self.s, self.g
        local = self.local[u.name]
        padded = flat
        if local * s.shard_size != self.flat_numel[u.name]:  # F.pad(unsharded_grad, [0, numel_to_pad])
            padded = g.alloc(POST_BACKWARD, f"{u.name} padded flat grad", "reduce_scatter_buffers",
                             local * s.shard_size * s.reduce_bytes)
            g.add("copy", POST_BACKWARD, f"{u.name} pad flat grad", hbm_bytes=flat.nbytes + padded.nbytes)
        final = s.reduce_dtype == s.storage_dtype and u.name not in self.sharded_grads
        new = g.alloc(POST_BACKWARD, f"{u.name} sharded grad" if final else f"{u.name} new sharded grad",
                      "sharded_grads" if final else "reduce_scatter_buffers", local * s.reduce_bytes)
        if pre_divide:
            g.add("copy", POST_BACKWARD, f"{u.name} pre-divide grads by {pre_divide:g}", hbm_bytes=2 * padded.nbytes)
        event = g.add("reduce_scatter", POST_BACKWARD, f"{u.name} reduce-scatter", group=SHARD_GROUP,
                      comm_bytes=padded.nbytes)
        stream = POST_BACKWARD
        if s.replicate_size > 1 and s.sharding_strategy in HYBRID_STRATEGIES:
            g.wait_event(AR, event)
            stream = AR
            event = g.add("all_reduce", AR, f"{u.name} all-reduce (replicas)", group=REPLICATE_GROUP,
                          comm_bytes=new.nbytes)
        if post_divide:
            event = g.add("copy", stream, f"{u.name} post-divide grads by {post_divide:g}", hbm_bytes=2 * new.nbytes)
        if padded is not flat:
            g.free(POST_BACKWARD, padded)
        return self._accumulate_sharded_grad(u, new, stream, event)

    def _all_reduce_no_shard(self, u: Unit, flat: Buffer, pre_divide, post_divide) -> tuple[Buffer | None, str, Op]:
        """`_reduce_grad_no_shard`: divide, all-reduce the whole flat gradient over every rank, divide,
        cast to the parameter's dtype (`_cast_grad_to_param_dtype`): that is `.grad` for the optimizer."""
        g = self.g
        if pre_divide:
            g.add("copy", POST_BACKWARD, f"{u.name} pre-divide grads by {pre_divide:g}", hbm_bytes=2 * flat.nbytes)
        event = g.add("all_reduce", POST_BACKWARD, f"{u.name} all-reduce", group=REPLICATE_GROUP, comm_bytes=flat.nbytes)
        if post_divide:
            event = g.add("copy", POST_BACKWARD, f"{u.name} post-divide grads by {post_divide:g}", hbm_bytes=2 * flat.nbytes)
        return self._accumulate_sharded_grad(u, flat, POST_BACKWARD, event)

    def _accumulate_sharded_grad(self, u: Unit, new: Buffer, stream: str, event: Op) -> tuple[Buffer | None, str, Op]:
        """`_accumulate_sharded_grad`: cast to the parameter's dtype if the reduction ran in another (the
        low-precision tensor is dropped, recorded on the current stream), then `_saved_grad_shard += ` the
        shard when an earlier micro-batch left one, else it becomes `_saved_grad_shard`. Returns the buffer
        kept as the gradient (None if it was added into an existing one), the stream and its last op."""
        s, g = self.s, self.g
        existing = self.sharded_grads.get(u.name)
        grad = new
        if new.nbytes and s.reduce_dtype != s.storage_dtype:
            grad = g.alloc(stream, f"{u.name} sharded grad" if existing is None else f"{u.name} new sharded grad",
                           "sharded_grads" if existing is None else "reduce_scatter_buffers",
                           new.nbytes // s.reduce_bytes * s.storage_bytes)
            event = g.add("copy", stream, f"{u.name} cast sharded grad to {s.storage_dtype}",
                          hbm_bytes=new.nbytes + grad.nbytes)
            if self.sharded:  # NO_SHARD's low-precision gradient is the autograd one, freed by the caller
                g.free(POST_BACKWARD, new, record_stream=stream)
        if existing is None:
            self.sharded_grads[u.name] = grad
            return grad, stream, event
        event = g.add("copy", stream, f"{u.name} accumulate into _saved_grad_shard",
                      hbm_bytes=2 * existing.nbytes + grad.nbytes)
        if self.sharded or grad is not new:  # NO_SHARD's uncast gradient is the caller's to free
            g.free(POST_BACKWARD if grad is new else stream, grad, record_stream=stream)
        return None, stream, event

    def final_reduction_wait(self) -> Op | None:
        """`_post_backward_final_callback`: the compute stream waits the post-backward stream and, under
        HSDP, the all-reduce stream (whose work follows the last reduce-scatter): the later event. Under
        CPUOffload the CPU then synchronizes (the D2H gradient copies) and `_finalize_params` makes
        `_cpu_grad` the `.grad`, dropping `_saved_grad_shard` on the GPU."""
        events = self.last_post_reduce_events
        event = events.get(AR) or events.get(POST_BACKWARD)
        events.clear()
        if self.s.offload_params and self.sharded and event is not None:
            self.g.synchronize(event)
            for buf in self.sharded_grads.values():
                self.g.free(COMPUTE, buf)
            self.sharded_grads.clear()
        return event
