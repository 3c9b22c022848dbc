"""What each RMSNorm implementation keeps for backward, checked against autograd itself.

`norm_saves` is a closed form per kernel; here the real modules (written out as PyTorch and Hugging
Face write them) are traced on fake tensors and their saved bytes compared with it. Skipped without torch.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fsdp_sim.torch_tools.trace import trace_module  # noqa: E402
from fsdp_sim.workload.transformer import TransformerDims, norm_backward_moment, norm_saves, norm_transients  # noqa: E402

B, S, H = 2, 16, 64


class LlamaRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm (also Mistral's, Qwen2's, Phi-3's): cast back before the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(H))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + 1e-6)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(torch.nn.Module):
    """transformers' GemmaRMSNorm: the weight is applied in fp32, then the result is cast back."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(H))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, x):
        out = self._norm(x.float())
        return (out * (1.0 + self.weight.float())).type_as(x)


class Chain(torch.nn.Module):
    """proj -> norm -> head, so the norm's input comes from a module and its output feeds one."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.proj, self.norm, self.head = torch.nn.Linear(H, H), norm, torch.nn.Linear(H, H)

    def forward(self, x):
        return self.head(self.norm(self.proj(x)))


# (impl, module, emulate CUDA kernels, bytes the closed form leaves out): Gemma also keeps its fp32
# (1 + weight), one parameter-sized vector, which norm_saves (activations only) does not count.
CASES = [("hf_llama", LlamaRMSNorm, True, 0), ("composite", lambda: torch.nn.RMSNorm(H), False, 0),
         ("composite", GemmaRMSNorm, True, 4 * H), ("fused", lambda: torch.nn.RMSNorm(H), True, 0)]


@pytest.mark.parametrize("impl, norm, cuda, parameter_sized", CASES, ids=["llama", "torch-cpu", "gemma", "torch-cuda"])
@pytest.mark.parametrize("dtype, p", [("bf16", 2), ("fp32", 4)])
def test_norm_saves_match_autograd(impl, norm, cuda, parameter_sized, dtype, p):
    workload = trace_module(Chain(norm()), (torch.randn(B, S, H),), dtype=dtype, emulate_cuda=cuda)
    traced = next(m for m in workload.modules if m.name == "norm")
    expected = norm_saves(TransformerDims(hidden=H, layers=1, heads=4, vocab=8, norm_impl=impl), B * S, p)
    assert traced.saves_input == expected.keeps_input
    assert traced.saved_bytes == expected.extra + parameter_sized
    # what it allocates and drops: forward, the upcast; backward, its moment (transients, input and weight
    # gradients); Gemma's fp32 (1 + weight) moves its moment by parameter-sized vectors
    dims = TransformerDims(hidden=H, layers=1, heads=4, vocab=8, norm_impl=impl)
    assert traced.fwd_temp_bytes == norm_transients(dims, B * S, p).fwd
    assert abs(traced.bwd_temp_bytes - norm_backward_moment(dims, B * S, p)) <= 2 * parameter_sized


@pytest.mark.parametrize("mlp, norm, bias, dtype, kv_heads, tokens", [
    ("swiglu", "rmsnorm", False, "bf16", 8, 2048), ("swiglu", "rmsnorm", True, "fp32", 8, 2048),
    ("gelu", "layernorm", True, "bf16", 8, 2048), ("gelu", "rmsnorm", False, "fp32", 8, 2048),
    ("swiglu", "rmsnorm", False, "bf16", 2, 2048), ("swiglu", "rmsnorm", False, "bf16", 8, 256),
    ("gelu", "rmsnorm", True, "bf16", 2, 64)])
def test_block_and_final_norm_transients_match_the_traced_reference_model(mlp, norm, bias, dtype, kv_heads, tokens):
    """The analytic builder's forward and backward moments against the same model traced on the CPU (its
    composite RMSNorm upcasts): a block's (the norm's fp32 forward tensor can be its largest; ffn_norm's
    backward is a moment of its own; attention_norm's, with every weight gradient alive, the block's
    `bwd_tail_bytes` above its end state, is the peak with a few hundred tokens) and the final norm's.
    Not held: LayerNorm blocks with a few hundred tokens, whose peak is the accumulation of wq / wk / wv's
    input gradients, about two (tokens, hidden) tensors above the builder's; bias gradients (bytes)."""
    from fsdp_sim.scenario import parse_scenario
    from fsdp_sim.torch_tools.reference_model import ReferenceConfig
    from fsdp_sim.torch_tools.referee import reference_scenario, traced_reference_workload

    h = 1024
    cfg = ReferenceConfig(hidden=h, layers=2, heads=8, kv_heads=kv_heads, ffn_hidden=2816 if mlp == "swiglu" else 4096,
                          vocab=4096, mlp=mlp, norm=norm, bias=bias)
    batch, seq = (2, tokens // 2) if tokens > 1024 else (1, tokens)
    traced = {m.name: m for m in traced_reference_workload(cfg, batch=batch, seq=seq, param_dtype=dtype).modules}
    built = {m.name: m for m in parse_scenario(reference_scenario(cfg, world_size=8, batch=batch, seq=seq,
                                                                  param_dtype=dtype)).workload.modules}
    p = 2 if dtype == "bf16" else 4
    block = built["layers.1"]
    # the block's end state (over its start): its saved tensors released, its input's gradient and every
    # parameter's gradient made; attention_norm's moment is that plus the tail
    end = -block.saved_bytes + tokens * h * p + sum(q.numel for q in block.params) * p
    assert (block.fwd_temp_bytes, max(block.bwd_temp_bytes, end + block.bwd_tail_bytes)) == \
        (traced["layers.1"].fwd_temp_bytes, traced["layers.1"].bwd_temp_bytes)
    assert (built["norm"].fwd_temp_bytes, built["norm"].bwd_temp_bytes) == \
        (traced["norm"].fwd_temp_bytes, traced["norm"].bwd_temp_bytes)
