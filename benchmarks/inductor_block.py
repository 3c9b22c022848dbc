"""Print what Inductor (torch 2.13, CPU build) makes of one transformer block: the kernels of its
compiled forward and backward, each one's bytes read and written as counts of the block's sizes, and
the saved set AOTAutograd's min-cut partitioner keeps. `fsdp_sim/workload/compiled_block_data.py` is
this output for every block the simulator prices compiled (`--emit-all` writes it, a few minutes on
one core): `TABLES`, and `LORA_TABLES` for the Llama codes with peft's LoRA on q / k / v / o (rank 8,
dropout 0.05; `R` the rank, `C<n>` the RNG seeds' fixed n bytes).

    python benchmarks/inductor_block.py [--style torchtitan|hf_llama|gpt] [--kv-heads 1|4]
                                        [--checkpoint none|full|selective_op] [--lora-rank R]
    python benchmarks/inductor_block.py --emit-all > fsdp_sim/workload/compiled_block_data.py

T tokens, H hidden, Q heads x head_dim, KV the k / v projections' width, F the MLP's width, S the
sequence, D the head_dim; bf16 the activation dtype, f32 the upcasts (a complex64 buffer as float
pairs). Dims: fsdp_sim.torch_tools.llama_block.BlockConfig.
"""

from __future__ import annotations

import argparse
import math
import warnings

from fsdp_sim.torch_tools.inductor_block import extract
from fsdp_sim.torch_tools.llama_block import CHECKPOINTS, STYLES, BlockConfig, graphs_under_fully_shard, terms

# the tables the simulator holds: (style, attention, checkpoint); `gpt` blocks are multi-head (GPT-2, NeoX, ViT)
TABLES = [(style, attn, ck) for style in STYLES for attn in ("gqa", "mha") for ck in ("none", "selective_op")
          if not (style == "gpt" and attn == "gqa")]
# peft LoRA (rank R, dropout 0.05) on q / k / v / o around a frozen base: the Llama codes, no checkpoint
LORA_RANK = 8
LORA_TABLES = [(style, attn, "none") for style in ("torchtitan", "hf_llama") for attn in ("gqa", "mha")]


def _show(t: dict[str, int]) -> str:
    return " + ".join(f"{n} {k}" for k, n in sorted(t.items())) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--style", default="torchtitan", choices=STYLES)
    ap.add_argument("--kv-heads", type=int, default=1, help="1: grouped-query (k, v repeated); 4: multi-head")
    ap.add_argument("--checkpoint", default="none", choices=CHECKPOINTS)
    ap.add_argument("--lora-rank", type=int, default=0, help="peft LoRA on q / k / v / o, dropout 0.05, the rest frozen")
    ap.add_argument("--emit-all", action="store_true", help="print compiled_block_data.py, every table")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.emit_all:
        emit_all()
        return
    cfg = BlockConfig(style=args.style, batch=3, kv_heads=args.kv_heads, checkpoint=args.checkpoint,
                      lora_rank=args.lora_rank)
    e = extract(cfg)
    print(f"{args.style} block, T={cfg.tokens} H={cfg.hidden} heads={cfg.heads} head_dim={cfg.head_dim} "
          f"kv_heads={cfg.kv_heads} F={cfg.ffn}, {cfg.dtype}, checkpoint {cfg.checkpoint}; Dynamo graphs: {e.graphs}")
    for graph in ("forward", "backward"):
        ks = e.kernels(graph)
        print(f"\n{graph}: {len(ks)} kernels ({sum(k.kind == 'generated' for k in ks)} generated, "
              f"{sum(k.kind == 'library' for k in ks)} library calls)")
        for k in ks:
            name = k.name if k.kind == "library" else "generated " + "+".join(k.ops)
            print(f"  {name[:70]:70s} reads {_show(terms(k.reads, cfg, k.dtypes))}; "
                  f"writes {_show(terms(k.writes, cfg, k.dtypes))}")
        peak, end = e.transient(graph)
        if graph == "forward":
            print(f"  live buffers: peak {peak} B, {end} B at the end (output and saved set): transient {peak - end} B")
        else:
            print(f"  live buffers: peak {peak} B above the start (saved set and output gradient)")
    print("\nsaved for backward (the backward graph's inputs but the output's gradient):")
    for name, shape, dtype in e.saved:
        nbytes = math.prod(shape) * {"bfloat16": 2, "float32": 4, "complex64": 8, "bool": 1}.get(dtype, 0)
        print(f"  {name:12s} {str(shape):22s} {dtype:9s} {_show(terms({name: nbytes}, cfg, {name: dtype}))}")
    print(f"\nsaved activations (the block's input and parameters excluded): {e.saved_bytes()} B; "
          f"autograd's saved-tensor hooks see the compiled block keep {e.compiled_saved_bytes} B; "
          f"eager autograd on the CPU keeps {e.eager_saved_bytes} B")
    print(f"fully_shard on the compiled block (torchtitan's order), two steps: "
          f"{graphs_under_fully_shard(cfg)} Dynamo graph(s)")


def _symbol(name: str, nbytes: int, dtype: str, cfg) -> str:
    if dtype == "int64":  # Inductor's RNG seeds (`inductor_seeds`: one int64 per random op), a fixed size
        return f"C{nbytes}"
    (key,) = terms({name: nbytes}, cfg, {name: dtype})
    if key.startswith("?"):
        raise ValueError(f"buffer {name}: {nbytes} B ({dtype}) is no product of the block's sizes")
    size, label = key.split(" ")[:2]
    return size.replace("*", "").replace("/", "") + ("" if label == "bf16" else "_" + label)


def table(e) -> tuple:
    """(kernels, saved, outputs) as `compiled_block.py` holds them: each kernel (graph, kind, ops, reads,
    writes) with its buffers named by size (`TH`: tokens x hidden in the activation dtype, `TKV_f32`, ...);
    the forward graph's inputs (`primals_*`: the block's input, its parameters, the rotary table) are read
    but owned outside the block (by the previous block and FSDP)."""
    rows = []
    for n in e.nodes:
        if n.kind == "view" and not n.writes:
            continue
        reads = tuple((b, _symbol(b, v, n.dtypes.get(b, "?"), e.cfg)) for b, v in n.reads.items())
        writes = tuple((b, _symbol(b, v, n.dtypes.get(b, "?"), e.cfg)) for b, v in n.writes.items())
        rows.append((n.graph, n.kind, n.name if n.kind != "generated" else "+".join(n.ops), reads, writes))
    saved = tuple(name for name, _, _ in e.saved if not name.startswith("primals"))
    outputs = {g: tuple(o for o in outs if not o.startswith("primals")) for g, outs in e.outputs.items()}
    return tuple(rows), saved, outputs


def emit_all() -> None:
    import torch
    print(HEADER.format(version=torch.__version__, cfg=BlockConfig(batch=3)))
    for name, keys, rank in (("TABLES", TABLES, 0), ("LORA_TABLES", LORA_TABLES, LORA_RANK)):
        if rank:
            print(f"\n# the same blocks with peft's LoRA (rank {rank}, alpha {2 * rank}, dropout 0.05) on q / k / v / o, "
                  "every other parameter frozen\n# (`LlamaBlock` with `lora_rank`); `R` the rank, `C<n>` a "
                  "fixed n bytes (the RNG seeds, one int64 per dropout)")
        print(f"{name} = {{")
        for style, attn, ck in keys:
            cfg = BlockConfig(style=style, batch=3, kv_heads=1 if attn == "gqa" else 4, checkpoint=ck, lora_rank=rank)
            rows, saved, outputs = table(extract(cfg))
            print(f"    {(style, attn, ck)!r}: (")
            print("        (")
            for r in rows:
                print(f"            {r!r},")
            print("        ),")
            print(f"        {saved!r},")
            print(f"        {outputs!r},")
            print("    ),")
        print("}")


HEADER = '''"""What Inductor (torch {version}) compiles one transformer block into, as data: every kernel of the
compiled forward and backward graphs, in Inductor's order, with the buffers it reads and writes, and
the tensors AOTAutograd's min-cut partitioner saves for backward.

Generated by `python benchmarks/inductor_block.py --emit-all > fsdp_sim/workload/compiled_block_data.py`
on the CPU build of torch {version}, from the scheduler nodes after Inductor's fusion pass
(`fsdp_sim/torch_tools/inductor_block.py` says how, and where CUDA's Triton backend may differ).
`TABLES[(style, attention, checkpoint)]` = (kernels, saved, outputs): `style` the block's code
(`BlockConfig.style`: torchtitan's Llama-3, transformers' Llama, GPT-2 / ViT style), `attention` gqa
({cfg.kv_heads} kv head of {cfg.heads}) or mha, `checkpoint` none or torchtitan's op-level selective policy.
Each kernel: (graph, kind, ops or library call, reads, writes), a buffer as (Inductor's name, size):
a product of T tokens, H hidden, Q heads x head_dim, KV the k / v width, F ffn, S the sequence, D the
head_dim, `heads`, in the activation dtype or `_f32` (a complex64 buffer as float pairs); `QH`, `KVH`,
`FH`, `H`, `Q`, `KV`, `F` parameters and biases. `primals_*` are the forward graph's inputs (the
block's input, parameters, the rotary table): owned outside the block. In MHA KV = Q: `TKV` stands for both.
"""
'''


if __name__ == "__main__":
    main()
