"""DeepSpeed's ZeRO stages (`fsdp.zero_stage`) as the FSDP strategies closest to them.

ZeRO (Rajbhandari et al., SC20) stage 3 shards parameters, gradients and optimizer states: FULL_SHARD.
Stage 2 shards gradients and optimizer states and keeps the 16-bit parameters whole through forward and
backward: SHARD_GRAD_OP (FSDP2's `reshard_after_forward=False`), which differs in that FSDP still keeps the
parameters sharded between steps and all-gathers them once per step. Stage 1 shards only the optimizer
states; FSDP has no strategy that keeps whole gradients beside sharded states, so it is modelled as
SHARD_GRAD_OP too, which shards the gradients ZeRO-1 keeps whole (a ZeRO-1 step needs up to one more
gradient copy than shown, (W-1)/W of the 16-bit gradients) and reduce-scatters where ZeRO-1 all-reduces.
"""

ZERO_STAGES = {1: "SHARD_GRAD_OP", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
ZERO_NOTES = {
    1: "ZeRO-1 modelled as SHARD_GRAD_OP: FSDP also shards the gradients ZeRO-1 keeps whole (up to (W-1)/W of "
       "the 16-bit gradients more in DeepSpeed) and keeps parameters sharded between steps",
    2: "ZeRO-2 modelled as SHARD_GRAD_OP: FSDP keeps the parameters sharded between steps and all-gathers them "
       "once per step, where DeepSpeed keeps them whole",
}
