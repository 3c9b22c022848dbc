"""Tracing a real nn.Module on fake tensors (needs torch; skipped without it)."""

from __future__ import annotations

import functools

import time
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from fsdp_sim.cli import main  # noqa: E402
from fsdp_sim.errors import ScenarioError  # noqa: E402
from fsdp_sim.scenario import parse_scenario  # noqa: E402
from fsdp_sim.simulate import simulate  # noqa: E402
from fsdp_sim.torch_tools.reference_model import ReferenceConfig, ReferenceTransformer, loss_fn  # noqa: E402
from fsdp_sim.torch_tools.trace import find_units, trace_module  # noqa: E402
from fsdp_sim.workload import TransformerDims, build_transformer  # noqa: E402
from fsdp_sim.workload.io import load_workload, save_workload  # noqa: E402
from fsdp_sim.workload.kernels import block_kernels  # noqa: E402
from fsdp_sim.workload.transformer import block_activations  # noqa: E402

TINY = dict(hidden=64, layers=2, heads=4, kv_heads=4, ffn_hidden=172, vocab=256)
B, S = 2, 32


def _model(**over):
    with torch.device("meta"):
        return ReferenceTransformer(ReferenceConfig(**{**TINY, **over}))


def _trace(dtype="bf16", **over):
    """The traced model and its workload, one trace per configuration for the whole session (workloads are
    frozen data; the tests read them, never change them)."""
    return _traced(dtype, tuple(sorted(over.items())))


@functools.cache
def _traced(dtype: str, over: tuple):
    model = _model(**dict(over))
    return model, trace_module(model, (torch.randint(0, TINY["vocab"], (B, S)),), loss_fn=loss_fn, dtype=dtype)


def _dims(**over) -> TransformerDims:
    c = {**TINY, **over}
    return TransformerDims(hidden=c["hidden"], layers=c["layers"], heads=c["heads"], kv_heads=c["kv_heads"],
                           ffn_hidden=c["ffn_hidden"], vocab=c["vocab"], mlp=c.get("mlp", "swiglu"),
                           norm=c.get("norm", "rmsnorm"), bias=c.get("bias", False),
                           tie_embeddings=c.get("tie_embeddings", False), learned_pos=c.get("learned_pos", False),
                           max_seq=c.get("max_seq", 0))


def test_tiny_model_traces_fast_in_forward_order():
    start = time.perf_counter()
    model, wl = _trace()
    assert time.perf_counter() - start < 10
    assert [m.name for m in wl.modules] == ["tok_embeddings", "layers.0", "layers.1", "norm", "output", "loss"]
    assert [m.kind for m in wl.modules] == ["embedding", "block", "block", "norm", "head", "loss"]
    assert [m.is_block for m in wl.modules] == [False, True, True, False, False, False]
    assert [m.in_model for m in wl.modules] == [True] * 5 + [False]
    assert wl.numel == sum(p.numel() for p in model.parameters())
    assert wl.activation_dtype == "bf16" and wl.tokens == B * S and wl.input_bytes == 2 * B * S * 8
    assert all(p.dtype == "fp32" and p.trainable for p in wl.params)  # storage dtype, not the compute dtype
    # the model is left as it was: meta fp32 parameters, no gradients, its training flag
    assert all(p.device.type == "meta" and p.dtype == torch.float32 and p.grad is None for p in model.parameters())


def test_order_is_execution_order_not_registration_order():
    class Backwards(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 2)
            self.body = nn.Linear(4, 8)

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))

    wl = trace_module(Backwards(), (torch.randn(3, 4),), dtype="fp32")
    assert [m.name for m in wl.modules] == ["body", "head"]
    assert wl.modules[0].fwd_flops == 2 * 3 * 4 * 8 and wl.modules[1].fwd_flops == 2 * 3 * 8 * 2
    # relu (glue after body, so body's) replaces body's linear output, a transient; relu's output is
    # passed on and saved twice (by relu and by head): counted once, as body's output kept by head
    body, head = wl.modules
    assert (body.output_bytes, body.fwd_temp_bytes, body.saved_bytes) == (3 * 8 * 4, 3 * 8 * 4, 0)
    assert head.saves_input and not body.saves_input
    assert any("saves its own output" in n for n in wl.meta["notes"])


@pytest.mark.parametrize("over", [{}, {"kv_heads": 2}, {"mlp": "gelu", "norm": "layernorm", "bias": True,
                                                          "tie_embeddings": True, "learned_pos": True, "max_seq": 64}])
def test_param_count_matches_the_analytic_builder(over):
    _, wl = _trace(**over)
    analytic = build_transformer(_dims(**over), micro_batch=B, seq_len=S, act_dtype="bf16", name="a")
    assert wl.numel == analytic.numel
    assert {p.name for p in wl.params} == {p.name for p in analytic.params}


def test_tied_head_names_the_embedding_weight():
    _, wl = _trace(tie_embeddings=True)
    head = next(m for m in wl.modules if m.name == "output")
    assert head.params == () and head.tied_params == ("tok_embeddings.weight",)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_block_saved_bytes_op_by_op(kv_heads):
    """The inventory of a pre-norm SDPA block (CUDA kernels: fused RMSNorm, flash attention)."""
    _, wl = _trace(kv_heads=kv_heads)
    tok, h, f, p = B * S, TINY["hidden"], TINY["ffn_hidden"], 2
    bsh, bsf, stats, lse = tok * h * p, tok * f * p, tok * 4, B * TINY["heads"] * S * 4
    expected = (stats + bsh  # attention_norm rstd, its output (saved by wq, wk, wv)
                + 3 * bsh + bsh + lse  # q, k, v (expanded) saved by SDPA, its BSHD output (saved by wo too), lse
                + bsh + stats + bsh  # residual h (saved by ffn_norm), its rstd, its output (w1, w3)
                + 4 * bsf)  # w1 out (silu), silu out, w3 out (mul), product (w2)
    for block in (m for m in wl.modules if m.is_block):
        assert block.saved_bytes == expected
        assert block.saves_input and block.output_bytes == bsh
        assert block.fwd_temp_bytes == bsh  # wo's (and w2's) output, freed by the residual add
    assert block_activations(_dims(kv_heads=kv_heads), B, S, p).saved == expected  # the analytic builder agrees


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("over", [{"kv_heads": 2}, {"mlp": "gelu", "norm": "layernorm", "bias": True}])
def test_block_saved_bytes_match_the_analytic_builder(dtype, over):
    _, wl = _trace(dtype, **over)
    analytic = block_activations(_dims(**over), B, S, 2 if dtype == "bf16" else 4)
    for block in (m for m in wl.modules if m.is_block):
        assert (block.saved_bytes, block.fwd_temp_bytes, block.saves_input) == \
            (analytic.saved, analytic.fwd_temp, analytic.saves_input)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cpu_rms_norm_is_the_composite_kernel(dtype):
    """Without the CUDA stand-ins the CPU's decomposed RMSNorm is traced: fp32 copies of the input."""
    model = _model()
    wl = trace_module(model, (torch.randint(0, 256, (B, S)),), loss_fn=loss_fn, dtype=dtype, emulate_cuda=False)
    analytic = block_activations(replace(_dims(), norm_impl="composite"), B, S, 2 if dtype == "bf16" else 4)
    assert wl.modules[1].saved_bytes == analytic.saved
    assert wl.modules[1].saves_input == analytic.saves_input == (dtype == "fp32")


def test_flops_match_the_analytic_forward():
    _, wl = _trace()
    analytic = build_transformer(_dims(), micro_batch=B, seq_len=S, act_dtype="bf16", name="a")
    for traced, modelled in zip(wl.modules, analytic.modules):
        assert traced.fwd_flops == pytest.approx(modelled.fwd_flops)
    block = wl.modules[1]
    assert block.bwd_flops >= 2 * block.fwd_flops  # attention's backward is 2.5x its forward


def test_other_modules_and_loss():
    _, wl = _trace()
    tok, h, v = B * S, TINY["hidden"], TINY["vocab"]
    emb, norm, head, loss = wl.modules[0], wl.modules[3], wl.modules[4], wl.modules[5]
    assert (emb.saved_bytes, emb.output_bytes, emb.saves_input) == (0, tok * h * 2, False)
    assert (norm.saved_bytes, norm.saves_input) == (tok * 4, True)
    assert (head.saved_bytes, head.output_bytes, head.saves_input) == (0, tok * v * 2, True)
    # HBM traffic is the elementwise ops' (matmuls are timed by FLOPs): none in a bare linear head
    assert head.fwd_hbm_bytes == 0 and norm.fwd_hbm_bytes > 0 and wl.modules[1].fwd_hbm_bytes > 0
    assert loss.saved_bytes >= tok * v * 4  # the fp32 log-softmax output
    assert not loss.saves_input and loss.fwd_temp_bytes == tok * v * 4  # the fp32 cast of the logits


@pytest.mark.parametrize("over", [{"kv_heads": 2}, {"mlp": "gelu", "norm": "layernorm", "bias": True}])
def test_traced_block_kernels_match_block_kernels(over):
    """The kernels a traced block dispatches: block_kernels' GEMMs and attention, fused norms, one kernel per op."""
    _, wl = _trace(**over)
    analytic = block_kernels(_dims(**over), B, S, 2, causal=True)
    for block in (m for m in wl.modules if m.is_block):
        ks = block.kernels
        assert [k.shape for k in ks if k.kind == "gemm"] == [k.shape for k in analytic if k.kind == "gemm"]
        assert [k.name for k in ks if k.kind == "gemm"][:2] == ["attention.wq: " + ("addmm" if over.get("bias") else "mm"),
                                                              "attention.wk: " + ("addmm" if over.get("bias") else "mm")]
        assert [(k.shape, k.causal) for k in ks if k.kind == "attention"] == [((B, TINY["heads"], S, 16), True)]
        assert [k.shape for k in ks if k.kind == "norm"] == [(B * S, TINY["hidden"])] * 2  # the CUDA stand-ins
        assert sum(k.fwd_flops for k in ks) == block.fwd_flops
        assert sum(k.bytes for k in ks) == block.fwd_hbm_bytes  # every memory-bound op is one kernel
        assert all(k.launches == 1 for k in ks if k.bytes or k.kind in ("gemm", "attention"))
        # the backward's memory-bound work is on the kernels too (and the priced attention / GEMMs are not)
        assert sum(k.bwd_bytes for k in ks) > block.fwd_hbm_bytes
        # w2 keeps the block's last saved tensor (its input): a non-reentrant recompute stops before it
        assert [k.name for k in ks if not k.recompute and k.launches] == [
            "feed_forward.w2: " + ("addmm" if over.get("bias") else "mm"), "add"]


def test_bmm_folds_its_batch_and_a_convolution_is_a_gemm():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, kernel_size=4, stride=4)
            self.w = nn.Parameter(torch.empty(5, 16, 6))

        def forward(self, x):
            y = self.conv(x).flatten(2)  # (2, 8, 16)
            return torch.bmm(y.transpose(0, 1)[:5], self.w)  # (5, 2, 16) @ (5, 16, 6)

    wl = trace_module(Mixed(), (torch.randn(2, 3, 16, 16),), dtype="fp32")
    ks = wl.modules[0].kernels
    assert [k.shape for k in ks if k.kind == "gemm"] == [(2 * 16, 8, 3 * 4 * 4), (5 * 2, 6, 16)]
    assert sum(k.fwd_flops for k in ks) == wl.modules[0].fwd_flops


def test_fp32_doubles_the_activations():
    _, bf16 = _trace("bf16")
    _, fp32 = _trace("fp32")
    assert fp32.modules[1].output_bytes == 2 * bf16.modules[1].output_bytes
    assert fp32.activation_dtype == "fp32"


def test_traced_workload_simulates_from_a_scenario(tmp_path):
    _, wl = _trace()
    save_workload(wl, tmp_path / "traced.yaml")
    assert load_workload(tmp_path / "traced.yaml") == wl
    scenario = parse_scenario({"model": {"workload": "traced.yaml"}, "hardware": {"profile": "h100-sxm"}},
                              base=tmp_path)
    result = simulate(scenario).to_dict()
    assert result["peak"] and result["step_time_s"] > 0


def test_model_without_loss_or_blocks():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    wl = trace_module(model, (torch.randn(8, 16),), dtype="fp32")
    assert [m.name for m in wl.modules] == ["0", "1", "2"]
    assert not any(m.is_block for m in wl.modules) and all(m.in_model for m in wl.modules)
    assert wl.numel == sum(p.numel() for p in model.parameters())
    assert wl.modules[1].saves_input  # GELU keeps its input


def test_frozen_parameters_and_explicit_blocks():
    model = _model()
    model.tok_embeddings.weight.requires_grad_(False)
    units = find_units(model, (nn.RMSNorm,))
    assert ("norm", model.norm, True) in units
    assert ("layers.0.attention_norm", model.layers[0].attention_norm, True) in units
    wl = trace_module(model, (torch.randint(0, 256, (B, S)),), loss_fn=loss_fn)
    assert not wl.modules[0].params[0].trainable


def test_failures_are_scenario_errors():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x[x.nonzero()[:, 0]])

    with pytest.raises(ScenarioError, match="failed under FakeTensorMode"):
        trace_module(DataDependent(), (torch.randn(3, 4),))
    with pytest.raises(ScenarioError, match="dtype"):
        trace_module(_model(), (torch.randint(0, 256, (B, S)),), dtype="int8")


FACTORY = """
from fsdp_sim.torch_tools.reference_model import ReferenceConfig, ReferenceTransformer, loss_fn
import torch

def tiny():
    cfg = ReferenceConfig(hidden=64, layers=2, heads=4, kv_heads=4, ffn_hidden=172, vocab=256)
    return ReferenceTransformer(cfg), loss_fn

def mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

def broken():
    raise RuntimeError("boom")
"""


def test_cli_trace(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_factories.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    assert main(["trace", "my_factories:tiny", "--batch", "2", "--seq", "32", "-o", "w.yaml"]) == 0
    wl = load_workload(tmp_path / "w.yaml")
    assert [m.name for m in wl.modules][-1] == "loss" and wl.tokens == 64
    assert "ReferenceTransformer: 6 modules (2 blocks)" in capsys.readouterr().out
    assert main(["trace", "my_factories:mlp", "--input-shape", "8,16", "--dtype", "fp32", "-q", "-o", "m.json"]) == 0
    assert load_workload(tmp_path / "m.json").numel == 16 * 32 + 32 + 32 * 4 + 4


@pytest.mark.parametrize("args, message", [
    (["no_colon"], "is not package.module:factory"),
    (["no_such_module:f"], "cannot import no_such_module"),
    (["my_factories:nothing"], "has no attribute 'nothing'"),
    (["my_factories:broken"], "broken() failed: RuntimeError: boom"),
    (["my_factories:mlp", "--batch", "2", "--seq", "4"], "--input-shape: required"),
    (["my_factories:tiny"], "--batch and --seq"),
    (["my_factories:tiny", "--batch", "2", "--seq", "4", "--block-type", "Nope"], "no module of class 'Nope'"),
])
def test_cli_trace_errors_exit_2_with_one_line(tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / "my_factories.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    assert main(["trace", *args, "-o", "w.yaml"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("fsdp-sim: error:")


def test_cli_trace_without_torch(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # as if torch were not installed
    assert main(["trace", "my_factories:tiny", "--batch", "2", "--seq", "4", "-o", "w.yaml"]) == 2
    assert "pip install -e '.[torch]'" in capsys.readouterr().err
