"""torch.compile's block (workload/compiled_block.py): Inductor's kernels and the partitioner's saved set.

The referee cases compile a torchtitan Llama-3 block with the installed torch (CPU build) and hold the
table to Inductor's own output (the saved set, the transients, each kernel's bytes) and to autograd's
saved-tensor hooks around the compiled block (what AOTAutograd's Function saves). PyTorch's MemTracker
cannot run one: under its dispatch mode Dynamo skips the frame, and `fullgraph=True` then fails
("torch.compile with fullgraph=True found no compiled frames", torch 2.13); FSDPMemTracker on a
compiled, fully_shard'ed block stops on an AssertionError; Inductor's own buffers are allocated outside
the dispatcher anyway.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from fsdp_sim.hardware.kernels import ComputeOptions, kernels_time
from fsdp_sim.hardware.profiles import load_profile
from fsdp_sim.scenario import parse_scenario
from fsdp_sim.simulate import simulate
from fsdp_sim.workload.compiled_block import compiled_activations, compiled_kernels
from fsdp_sim.workload.kernels import block_kernels
from fsdp_sim.workload.presets import PRESETS
from fsdp_sim.workload.transformer import TransformerDims, block_activations

MEMORY_KINDS = ("inductor_reduction", "inductor_pointwise", "elementwise")


@pytest.mark.slow  # Inductor compiles a block (C++ on the CPU): about 20 s
@pytest.mark.parametrize("kv_heads", [1, 4])
def test_the_table_is_what_inductor_compiles(kv_heads):
    """Saved set, forward transient and backward peak, and every memory-bound kernel's bytes, against a
    block compiled now with the installed torch."""
    pytest.importorskip("torch")
    from fsdp_sim.torch_tools.inductor_block import BlockConfig, extract
    cfg = BlockConfig(batch=3, kv_heads=kv_heads)
    e = extract(cfg)
    assert e.graphs == 1  # one Dynamo graph: no break inside the block
    assert e.compiled_saved_bytes == e.saved_bytes()  # what autograd's hooks see the compiled Function save
    d = TransformerDims(hidden=cfg.hidden, layers=1, heads=cfg.heads, kv_heads=kv_heads, ffn_hidden=cfg.ffn, vocab=8)
    saved, fwd_temp, bwd_peak, _ = compiled_activations(d, cfg.batch, cfg.seq, 2)
    rope_table = cfg.seq * cfg.head_dim // 2 * 8  # `_conj`: a view of the model's rotary table, not the block's
    assert saved == e.saved_bytes() - rope_table
    peak, end = e.transient("forward")
    assert fwd_temp == peak - end
    assert bwd_peak == e.transient("backward")[0]
    memory = [n for n in e.nodes if n.kind == "generated" or (n.kind == "library" and "mm" not in n.name
                                                                  and "scaled_dot_product" not in n.name)]
    # the CPU backend's kernels: no mix-order reduction (a GPU Triton fusion), as before torch 2.10
    ours = [k for k in compiled_kernels(d, cfg.batch, cfg.seq, 2, causal=True, torch_version=(2, 9))
            if k.kind in MEMORY_KINDS]
    assert len(ours) == len(memory)
    for k, n in zip(ours, memory):
        assert k.bytes + k.bwd_bytes == n.read_bytes + n.write_bytes  # the norms' weights are read too
        assert (k.bytes > 0) == (n.graph == "forward")


@pytest.mark.slow
def test_under_full_checkpointing_the_compiled_backward_recomputes_what_eager_bytes_say():
    """torchtitan's full checkpoint inside the compiled block: the partitioner saves nothing but the
    block's input (and the RNG state), and the compiled backward's peak (its recompute and the gradients, fused) is what
    the eager block's saved bytes and backward transient add up to, within 2 %, where the no-checkpoint
    table's would be 10 % short: why `compiled_workload(checkpointed=True)` keeps the eager bytes."""
    pytest.importorskip("torch")
    from fsdp_sim.torch_tools.inductor_block import BlockConfig, extract
    cfg = BlockConfig(batch=3, checkpoint=True)
    e = extract(cfg)
    # nothing but the input (a `primals`) and the generator's state (5,056 B of the CPU's Mersenne
    # twister; the CUDA generator's seed and offset are 16 B)
    assert [name for name, _, _ in e.saved if not name.startswith(("primals", "rng_state"))] == []
    d = TransformerDims(hidden=cfg.hidden, layers=1, heads=cfg.heads, kv_heads=cfg.kv_heads, ffn_hidden=cfg.ffn, vocab=8)
    eager = block_activations(d, cfg.batch, cfg.seq, 2)
    peak = e.transient("backward")[0]
    assert eager.saved + eager.bwd_temp == pytest.approx(peak, rel=0.02)
    saved, _, bwd, _ = compiled_activations(d, cfg.batch, cfg.seq, 2)
    assert saved + bwd < 0.92 * peak


@pytest.mark.slow
def test_fully_shard_on_the_compiled_block_adds_no_graph():
    """torchtitan's order, compile then `fully_shard`: FSDP2's hooks run outside the compiled block, so
    two steps make one Dynamo graph (no break at the hooks, no recompile once parameters are unsharded)."""
    pytest.importorskip("torch")
    from fsdp_sim.torch_tools.inductor_block import BlockConfig, graphs_under_fully_shard
    assert graphs_under_fully_shard(BlockConfig(batch=3)) == 1


dims = st.builds(lambda h, heads, rep, f: TransformerDims(hidden=64 * heads * h, layers=1, heads=heads,
                                                           kv_heads=heads // rep, ffn_hidden=f * 64, vocab=8),
                 st.integers(1, 4), st.sampled_from([4, 8, 16, 32]), st.sampled_from([1, 2, 4]), st.integers(4, 300))


@settings(max_examples=40, deadline=None)
@given(d=dims, tokens=st.sampled_from([512, 2048, 8192]))
def test_compile_saves_the_repeat_and_the_silu_output_no_more(d, tokens):
    """The partitioner keeps k and v before the GQA repeat and recomputes SiLU from w1's output (wo's
    output in place of the residual sum is the same size): eager's saved bytes less exactly
    2 (q - kv) + ffn per token, in the activation dtype."""
    p = 2
    eager = block_activations(d, 1, tokens, p).saved
    compiled, _, _, _ = compiled_activations(d, 1, tokens, p)
    assert eager - compiled == tokens * p * (2 * (d.q_dim - d.kv * d.head_dim) + d.ffn)


@pytest.mark.parametrize("profile", ["h100-sxm", "a100-80gb"])
def test_compiled_memory_bound_time_is_inductors_kernels_no_faster(profile):
    """A compiled block's memory-bound time sits between eager's and what one hand-written fused kernel
    per chain would take (the model before the table): Inductor fuses less and runs slower than Liger."""
    gpu = load_profile(profile)
    d = PRESETS["llama3-8b"]
    on = ComputeOptions(torch_compile=True)
    eager = block_kernels(d, 1, 8192, 2, causal=True)
    for pass_ in ("forward", "backward"):
        compiled = kernels_time(gpu, compiled_kernels(d, 1, 8192, 2, causal=True), pass_, "bf16", on)
        ideal = kernels_time(gpu, eager, pass_, "bf16", on)
        slow = kernels_time(gpu, eager, pass_, "bf16", ComputeOptions())
        assert ideal.memory < compiled.memory < slow.memory
        assert compiled.matmul == ideal.matmul and compiled.attention == ideal.attention


def test_compile_on_llama3_8b_shortens_the_step_and_lowers_the_peak_by_the_saved_bytes():
    """llama3-8b-8xh100 peaks in the loss's backward with every block's activations alive: compile
    lowers the activations there by 32 blocks' saving, and the step is faster than eager."""
    from pathlib import Path
    import yaml
    base = yaml.safe_load(Path("scenarios/llama3-8b-8xh100.yaml").read_text())
    runs = {c: simulate(parse_scenario(base | {"compute": {"torch_compile": c}})) for c in (False, True)}
    acts = {c: r.peak()["by_category"]["activations"] for c, r in runs.items()}
    d = PRESETS["llama3-8b"]
    saving = block_activations(d, 1, 8192, 2).saved - compiled_activations(d, 1, 8192, 2)[0]
    assert acts[False] - acts[True] == d.layers * saving
    assert runs[True].step_time_s < runs[False].step_time_s


def test_mix_order_reduction_drops_the_weight_gradient_kernel_where_inductor_takes_it():
    """From torch 2.10, with tokens x hidden >= 5 Mi elements and tokens >= 2 x hidden (llama3-8b at 8192
    tokens), the norms' weight-gradient reduction joins their input gradients' kernels: one kernel and
    its bytes less; at 4096 tokens (tokens < 2 x hidden) or on 2.9 it stays."""
    d = PRESETS["llama3-8b"]

    def backward(tokens, version):
        ks = [k for k in compiled_kernels(d, 1, tokens, 2, causal=True, torch_version=version) if k.kind in MEMORY_KINDS]
        return sum(k.bwd_launches for k in ks), sum(k.bwd_bytes for k in ks)

    (fused_n, fused_b), (plain_n, plain_b) = backward(8192, (2, 13)), backward(8192, (2, 9))
    assert fused_n == plain_n - 1
    assert plain_b - fused_b == 8192 * (7 * d.hidden * 2 + 2 * 4) + 2 * d.hidden * 2  # 7 (tokens, hidden) reads, two rstd, two rows
    assert backward(4096, (2, 13)) == backward(4096, (2, 9))
