"""CUDA kernels for the fake CPU trace: what a GPU's kernels save for backward, where the CPU's differ.

`trace_module` runs on the CPU (fake tensors), where a few ops dispatch to other kernels than on CUDA
and so save other tensors for backward. `cuda_stand_ins(torch)` maps those torch functions to
stand-ins that allocate the CUDA kernel's outputs and save what it saves (fake tensors carry no
values, so nothing needs computing):

- `F.rms_norm`: CUDA runs one fused kernel (`_fused_rms_norm`) that keeps the input, the fp32 rstd and
  the weight; the CPU decomposes it into fp32 ops that keep two fp32 copies of the input instead.
- `F.layer_norm`: `native_layer_norm` keeps the input, mean, rstd, weight and bias on both, but the
  statistics are fp32 on CUDA and in the input dtype on the CPU.
- `F.dropout` in training (not in place): `native_dropout` on CUDA keeps a bool mask; the CPU multiplies
  by a mask in the input's dtype.
- `F.scaled_dot_product_attention` with dropout: CUDA's flash / memory-efficient kernels apply it inside
  (saving an RNG seed, no mask); the CPU falls back to the math path and materializes the scores.
"""

from __future__ import annotations

__all__ = ["cuda_stand_ins"]


def cuda_stand_ins(torch) -> dict:
    """Torch function -> its CUDA stand-in (see the module docstring)."""

    def stats(x, k: int):
        return x.new_empty(tuple(x.shape[:x.dim() - k]) + (1,) * k, dtype=torch.float32)

    class FusedNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, normalized_shape, weight, bias, eps, layer_norm):
            k = len(normalized_shape)
            saved = (stats(x, k), stats(x, k)) if layer_norm else (stats(x, k),)
            ctx.save_for_backward(x, weight, bias, *saved)
            return x.clone()  # a new output like the kernel's, reading x and writing it once (its traffic)

        @staticmethod
        def backward(ctx, grad):
            x, weight, bias, *_ = ctx.saved_tensors
            need = ctx.needs_input_grad
            return (torch.empty_like(x) if need[0] else None, None,
                    torch.empty_like(weight) if weight is not None and need[2] else None,
                    torch.empty_like(bias) if bias is not None and need[3] else None, None, None)

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        return FusedNorm.apply(x, tuple(normalized_shape), weight, None, eps, False)

    def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *_cudnn_enable):
        return FusedNorm.apply(x, tuple(normalized_shape), weight, bias, eps, True)

    class FusedDropout(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(torch.empty(x.shape, dtype=torch.bool, device=x.device))  # the mask
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return torch.empty_like(grad)

    F = torch.nn.functional
    plain_dropout = F.dropout

    def dropout(x, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and x.numel() and not inplace:
            return FusedDropout.apply(x)
        return plain_dropout(x, p, training, inplace)

    plain_sdpa = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
        return plain_sdpa(query, key, value, attn_mask, 0.0, is_causal, *args, **kwargs)

    return {F.rms_norm: rms_norm, torch.rms_norm: rms_norm, F.layer_norm: layer_norm, torch.layer_norm: layer_norm,
            F.dropout: dropout, F.scaled_dot_product_attention: sdpa}


