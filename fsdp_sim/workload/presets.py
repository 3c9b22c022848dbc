"""Published dimensions of well-known models (from their papers / released config.json files)."""

from fsdp_sim.workload.transformer import TransformerDims

_GPT2 = dict(mlp="gelu", norm="layernorm", bias=True, tie_embeddings=True, learned_pos=True, max_seq=1024, vocab=50257)
_LLAMA2 = dict(mlp="swiglu", norm="rmsnorm", vocab=32000)
_LLAMA3 = dict(mlp="swiglu", norm="rmsnorm", vocab=128256)

PRESETS: dict[str, TransformerDims] = {
    # GPT-2 (Radford et al. 2019; HF openai-community/gpt2*): n_embd, n_layer, n_head, 4x MLP
    "gpt2": TransformerDims(hidden=768, layers=12, heads=12, ffn_hidden=3072, **_GPT2),
    "gpt2-xl": TransformerDims(hidden=1600, layers=48, heads=25, ffn_hidden=6400, **_GPT2),
    # Llama 2 (Touvron et al. 2023; meta-llama/Llama-2-*-hf config.json)
    "llama2-7b": TransformerDims(hidden=4096, layers=32, heads=32, ffn_hidden=11008, **_LLAMA2),
    "llama2-13b": TransformerDims(hidden=5120, layers=40, heads=40, ffn_hidden=13824, **_LLAMA2),
    "llama2-70b": TransformerDims(hidden=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672, **_LLAMA2),
    # Llama 3 / 3.1 (Dubey et al. 2024, Table 3; meta-llama/Meta-Llama-3*-* config.json)
    "llama3-8b": TransformerDims(hidden=4096, layers=32, heads=32, kv_heads=8, ffn_hidden=14336, **_LLAMA3),
    "llama3-70b": TransformerDims(hidden=8192, layers=80, heads=64, kv_heads=8, ffn_hidden=28672, **_LLAMA3),
    "llama3-405b": TransformerDims(hidden=16384, layers=126, heads=128, kv_heads=8, ffn_hidden=53248, **_LLAMA3),
}
