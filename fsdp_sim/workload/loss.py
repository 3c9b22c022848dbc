"""The cross-entropy kernels LM training uses, each as its source allocates, saves and runs it.

`training.loss` replaces a decoder's output head and loss (`build_transformer` builds `torch`). Per kernel,
over `tok` rows of a `v`-wide vocabulary, `p` the compute dtype's size:
- `torch`: `F.cross_entropy(logits.float())` (torchtitan's `cross_entropy_loss`): the fp32 copy,
  log_softmax's fp32 output saved, two fp32 logits-sized gradients in backward (see transformer.py).
- `bf16_logits`: `F.cross_entropy(logits)` without the upcast: the same ops in the compute dtype.
- `chunked`: torchtune's `CEWithChunkedOutputLoss` (`torchtune/modules/loss/ce_chunked_output_loss.py`,
  `num_output_chunks=8`) with the model's head applied per chunk (`TransformerDecoder.chunked_output`:
  `[self.output(c) for c in h.tensor_split(8, dim=1)]`): each chunk is upcast and cross-entropied on its own (`reduction="sum"`), so
  the fp32 copy and the backward's fp32 gradients are one chunk's, while every chunk's fp32 log-softmax
  output is still saved (the sum's graph keeps them all) and every chunk's bf16 logits exist at once.
- `flash_attn`: flash-attn's Triton `CrossEntropyLoss` (`flash_attn/ops/triton/cross_entropy.py`,
  llm-foundry's default): the kernel upcasts in registers and saves the logits themselves, the fp32 lse
  and the labels; its outputs are fp32 per-row losses and z-losses; backward writes `dlogits =
  torch.empty_like(logits)` (`inplace_backward=False`, the default) in one pass.
- `liger_fused_linear`: Liger's `LigerFusedLinearCrossEntropyLoss`
  (`liger_kernel/ops/fused_linear_cross_entropy.py`) takes the hidden states and the head's weight: the
  forward loops over token chunks of `next_power_of_2(ceil(BT / ceil(V / H)))` rows, computing each
  chunk's logits (one chunk buffer, `torch.mm(..., out=)`), its gradient in place, the input gradient
  into `grad_input = zeros_like(input)` and the weight gradient into `grad_weight = zeros_like(weight)`
  (the weight's dtype without `accum_dtype`); both are saved and handed out in backward as they are
  (the loss is the last op, grad_output is 1). The logits are never whole, the head has no backward.
"""

from __future__ import annotations

import math
from dataclasses import replace

from fsdp_sim.dtypes import itemsize
from fsdp_sim.errors import ScenarioError
from fsdp_sim.workload.kernels import elementwise, gemm, loss_kernels
from fsdp_sim.workload.model import Kernel, Module, Workload

LOSSES = ("torch", "bf16_logits", "chunked", "flash_attn", "liger_fused_linear")
TORCHTUNE_OUTPUT_CHUNKS = 8  # CEWithChunkedOutputLoss(num_output_chunks=8), torchtune's default


def seq_chunks(seq: int, n: int = TORCHTUNE_OUTPUT_CHUNKS) -> list[int]:
    """Lengths `tensor_split(n, dim=1)` cuts a sequence into: n pieces, the first seq % n one longer
    (empty ones when seq < n)."""
    q, r = divmod(seq, n)
    return [q + (i < r) for i in range(n)]


def liger_chunk_rows(tok: int, hidden: int, vocab: int) -> int:
    """Rows of one Liger chunk: the transient logits bounded to about tok x hidden elements."""
    inc_factor = -(-vocab // hidden)
    return min(1 << max(0, math.ceil(math.log2(-(-tok // inc_factor)))), tok)


def _torch_loss_module(rows: int, v: int, p: int, *, upcast: bool, chunk_rows: int, chunks: int) -> Module:
    """`cross_entropy` over `chunks` pieces of at most `chunk_rows` rows: each piece's copy (when upcast)
    and backward gradients are transient, every piece's log-softmax output is saved (with nll_loss's
    4-byte total weight)."""
    q = 4 if upcast else p
    logits = rows * v * q
    chunk = chunk_rows * v * q
    return Module("loss", "loss", fwd_hbm_bytes=3 * logits, saved_bytes=logits + 4 * chunks,
                  fwd_temp_bytes=chunk if upcast and p != 4 else 0, bwd_temp_bytes=2 * chunk, bwd_temp_parts=2, output_bytes=4,
                  saves_input=False, in_model=False, kernels=loss_kernels(rows, v, p, upcast=upcast))


def apply_loss(workload: Workload, loss: str, *, batch: int, seq: int) -> Workload:
    """`workload` with its output head and loss as `loss` runs them (`torch`: unchanged)."""
    if loss == "torch":
        return workload
    names = [m.name for m in workload.modules]
    if names[-2:] != ["output", "loss"] or workload.modules[-2].kind != "head":
        raise ScenarioError(f"training.loss: {loss} replaces a decoder's output head and cross-entropy; "
                            f"{workload.name} does not end in a decoder's output head and loss")
    head = workload.modules[-2]
    tok, v, h = head.kernels[0].shape
    p = itemsize(workload.activation_dtype)
    logits = tok * v * p
    if loss == "bf16_logits":
        new = (head, _torch_loss_module(tok, v, p, upcast=False, chunk_rows=tok, chunks=1))
    elif loss == "chunked":
        lengths = seq_chunks(seq)
        kernels = tuple(gemm(f"output chunk {i}", batch * n, v, h) for i, n in enumerate(lengths) if n)
        # the weight is used once per chunk: autograd sums the weight-gradient contributions out of place
        # (each is a transposed view, so `InputBuffer::accumulate` cannot add in place): the running sum,
        # the next contribution and their sum exist at once
        new = (replace(head, kernels=kernels, bwd_temp_bytes=3 * v * h * p if len(kernels) > 1 else 0),
               _torch_loss_module(tok, v, p, upcast=True, chunk_rows=batch * lengths[0], chunks=len(lengths)))
    elif loss == "flash_attn":
        ce = Kernel("flash_attn cross_entropy", "cross_entropy", (tok, v), bytes=logits + 3 * tok * 4,
                    bwd_bytes=2 * logits + tok * 8, launches=3, bwd_launches=1)
        new = (head, Module("loss", "loss", fwd_hbm_bytes=logits, saved_bytes=tok * 4, fwd_temp_bytes=2 * tok * 4,
                            output_bytes=4, saves_input=True, in_model=False, kernels=(ce,)))
    else:
        new = _liger(head, tok, v, h, p)
    return replace(workload, modules=workload.modules[:-2] + new)


def _liger(head: Module, tok: int, v: int, h: int, p: int) -> tuple[Module, Module]:
    """The head and loss fused: all three GEMMs in the forward (logits, input and weight gradients), the
    in-place cross-entropy kernel over each chunk's logits, nothing in backward."""
    rows = liger_chunk_rows(tok, h, v)
    kernels = (_forward_gemm("output logits (chunked)", tok, v, h),
               Kernel("liger cross_entropy (in place)", "cross_entropy", (rows, v), bytes=2 * tok * v * p,
                      launches=-(-tok // rows), bwd_launches=0),
               _forward_gemm("grad input", tok, h, v), _forward_gemm("grad weight", v, h, tok),
               elementwise("zero grad_input, grad_weight", (tok + v) * h * p, 0, launches=2, bwd_launches=0))
    fused = replace(head, fwd_flops=3 * head.fwd_flops, bwd_flops=0.0, fwd_hbm_bytes=(tok + 2 * v) * h * p,
                    saved_bytes=(tok + v) * h * p, fwd_temp_bytes=rows * v * p + tok * 4 + tok, output_bytes=4,
                    saves_input=False, kernels=kernels)
    return fused, Module("loss", "loss", output_bytes=4, saves_input=False, in_model=False)


def _forward_gemm(name: str, m: int, n: int, k: int) -> Kernel:
    """A GEMM the forward runs and the backward does not differentiate (Liger computes its gradients itself)."""
    return replace(gemm(name, m, n, k, input_grad=False), weight_grad=False, bwd_launches=0)
