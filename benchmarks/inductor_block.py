"""Print what Inductor (torch 2.13, CPU build) makes of one torchtitan Llama-3 block: the kernels of its
compiled forward and backward, each one's bytes read and written as counts of the block's sizes, and
the saved set AOTAutograd's min-cut partitioner keeps. `fsdp_sim/workload/compiled_block.py`'s table
is read off this output (`python benchmarks/inductor_block.py`, about a minute on one core).

    python benchmarks/inductor_block.py [--rope complex|rotate_half]

T tokens, H hidden (= heads x head_dim), KV the k / v projections' width, F the MLP's width; bf16 the
activation dtype, f32 / c64 the upcasts. Dims: fsdp_sim.torch_tools.inductor_block.BlockConfig.
"""

from __future__ import annotations

import argparse
import math
import warnings

from fsdp_sim.torch_tools.inductor_block import BlockConfig, extract, graphs_under_fully_shard, terms


def _show(t: dict[str, int]) -> str:
    return " + ".join(f"{n} {k}" for k, n in sorted(t.items())) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rope", default="complex", choices=("complex", "rotate_half"))
    ap.add_argument("--kv-heads", type=int, default=1, help="1: grouped-query (k, v repeated); 4: multi-head")
    ap.add_argument("--emit", action="store_true", help="print the table compiled_block.py holds, as Python")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    cfg = BlockConfig(rope=args.rope, batch=3, kv_heads=args.kv_heads)
    e = extract(cfg)
    if args.emit:
        emit(e)
        return
    print(f"torchtitan llama3 block, {args.rope} RoPE, T={cfg.tokens} H={cfg.hidden} heads={cfg.heads} "
          f"kv_heads={cfg.kv_heads} F={cfg.ffn}, {cfg.dtype}; Dynamo graphs: {e.graphs}")
    for graph in ("forward", "backward"):
        ks = e.kernels(graph)
        print(f"\n{graph}: {len(ks)} kernels ({sum(k.kind == 'generated' for k in ks)} generated, "
              f"{sum(k.kind == 'library' for k in ks)} library calls)")
        for k in ks:
            name = k.name if k.kind == "library" else "generated " + "+".join(k.ops)
            print(f"  {name[:70]:70s} reads {_show(terms(k.reads, cfg))}; writes {_show(terms(k.writes, cfg))}")
        peak, end = e.transient(graph)
        if graph == "forward":
            print(f"  live buffers: peak {peak} B, {end} B at the end (output and saved set): transient {peak - end} B")
        else:
            print(f"  live buffers: peak {peak} B above the start (saved set and output gradient)")
    print("\nsaved for backward (the backward graph's inputs but the output's gradient):")
    for name, shape, dtype in e.saved:
        nbytes = math.prod(shape) * {"bfloat16": 2, "float32": 4, "complex64": 8}[dtype]
        print(f"  {name:12s} {str(shape):22s} {dtype:9s} {_show(terms({name: nbytes}, cfg))}")
    print(f"\nsaved activations (the block's input and parameters excluded): {e.saved_bytes()} B; "
          f"autograd's saved-tensor hooks see the compiled block keep {e.compiled_saved_bytes} B; "
          f"eager autograd on the CPU (composite RMSNorm) keeps {e.eager_saved_bytes} B")
    print(f"fully_shard on the compiled block (torchtitan's order), two steps: "
          f"{graphs_under_fully_shard(cfg)} Dynamo graph(s)")


def _symbol(nbytes: int, cfg) -> str:
    (key,) = terms({"": nbytes}, cfg)
    size, dtype = key.split(" ")[:2]
    return size.replace("*", "").replace("/", "") + ("" if dtype == "bf16" else "_" + dtype)


def emit(e) -> None:
    """The graphs as `compiled_block.py` holds them: each kernel (graph, kind, ops, reads, writes) with
    its buffers named by size (`TH`: tokens x hidden in the activation dtype, `TKV_f32`, ...); the
    forward graph's inputs (`primals_*`: the block's input, its parameters, the rotary table) are read
    but owned outside the block (by the previous block and FSDP)."""
    rows = []
    for n in e.nodes:
        if n.kind == "view" and not n.writes:
            continue
        reads = tuple((b, _symbol(v, e.cfg)) for b, v in n.reads.items())
        writes = tuple((b, _symbol(v, e.cfg)) for b, v in n.writes.items())
        rows.append((n.graph, n.kind, n.name if n.kind != "generated" else "+".join(n.ops), reads, writes))
    print("KERNELS = (")
    for r in rows:
        print(f"    {r!r},")
    print(")")
    print("SAVED = " + repr(tuple(name for name, _, _ in e.saved if not name.startswith("primals"))))
    print("OUTPUTS = " + repr({g: tuple(o for o in outs if not o.startswith("primals")) for g, outs in e.outputs.items()}))


if __name__ == "__main__":
    main()
