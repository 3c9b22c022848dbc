"""The transformer block torch.compile is asked about: its code in three styles, its configurations, and
how its buffers' sizes are named.

`LlamaBlock(cfg)` is one pre-norm block written as torchtitan's Llama-3, transformers' Llama or GPT-2
write it (`BlockConfig.style`), with torchtitan's activation checkpointing inside it and peft's LoRA on
its attention projections as options: the module `inductor_block.extract` compiles and reads.
`size_names` / `terms` name a buffer by the product of the block's sizes its element count is, so
that what Inductor reads at toy sizes becomes a table the simulator scales to any model
(`benchmarks/inductor_block.py --emit-all`). `graphs_under_fully_shard` / `graphs_under_tensor_parallel`
count the Dynamo graphs the block makes when composed with FSDP2 or tensor parallelism as torchtitan
orders them, on a fake two-rank process group: whether one compiled block is one graph there too.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("fsdp_sim.torch_tools needs PyTorch; pip install torch==2.13.0") from exc

__all__ = ["STYLES", "CHECKPOINTS", "BlockConfig", "LlamaBlock", "rope_table", "size_names", "terms", "torch_dtype",
           "graphs_under_fully_shard", "graphs_under_tensor_parallel"]

STYLES = ("torchtitan", "hf_llama", "gpt")
CHECKPOINTS = ("none", "full", "selective_op")


@dataclass(frozen=True)
class BlockConfig:
    """A block's dimensions and code path. The defaults keep every size distinct from the others
    (head_dim 48: heads x head_dim = 192 is not hidden), so that each buffer's element count names the
    product it is (tokens x hidden, tokens x heads x head_dim, tokens x ffn, ...); `terms` refuses a
    configuration where two products meet.

    `style`: `torchtitan` (Llama-3: `nn.RMSNorm`, complex RoPE, repeat_kv on (b, s, kv, d), SwiGLU),
    `hf_llama` (transformers' Llama / Mistral / Qwen2 / Qwen3 decoder layer: `LlamaRMSNorm`'s eager
    upcast, rotate_half RoPE on (b, heads, s, d) with cos / sin in the activation dtype, `repeat_kv` on
    (b, kv, s, d), `down(act(gate) * up)`), `gpt` (GPT-2 / GPT-NeoX / ViT: `nn.LayerNorm` with a bias,
    biased Linears, GELU MLP, no rotary embedding: positions are added in the embedding).
    `checkpoint`: torchtitan's `apply_ac` inside the compiled region: `full` (non-reentrant, no RNG
    state kept) or `selective_op` (its op-level policy, technique_referee.py `_op_sac_context`)."""

    hidden: int = 256
    heads: int = 4
    kv_heads: int = 1
    ffn: int = 704
    batch: int = 2
    seq: int = 40
    dtype: str = "bf16"
    style: str = "torchtitan"
    head_dim: int = 48
    checkpoint: str = "none"
    norm_eps: float = 1e-5
    lora_rank: int = 0  # > 0: peft LoRA on q / k / v / o (alpha 2 x rank, dropout `lora_dropout`), the rest frozen
    lora_dropout: float = 0.05

    def __post_init__(self) -> None:
        if self.style not in STYLES or self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"style {self.style!r} / checkpoint {self.checkpoint!r}: expected one of {STYLES} / {CHECKPOINTS}")

    @property
    def rope(self) -> str:
        return {"torchtitan": "complex", "hf_llama": "rotate_half", "gpt": "none"}[self.style]

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def _rope_complex(xq, xk, freqs_cis):
    """torchtitan's `apply_rotary_emb` (models/llama3/model/model.py), on (b, s, heads, d)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    return torch.view_as_real(xq_ * f).flatten(3).type_as(xq), torch.view_as_real(xk_ * f).flatten(3).type_as(xk)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rope_rotate_half(xq, xk, cos, sin):
    """transformers' `apply_rotary_pos_emb` (models/llama/modeling_llama.py), on (b, heads, s, d); cos
    and sin as `LlamaRotaryEmbedding` returns them for position ids of batch 1, unsqueezed at dim 1."""
    cos, sin = cos[: xq.shape[2]][None, None], sin[: xq.shape[2]][None, None]
    return xq * cos + _rotate_half(xq) * sin, xk * cos + _rotate_half(xk) * sin


class HFRMSNorm(nn.Module):
    """transformers' `LlamaRMSNorm`: upcast, mean of squares, rsqrt, cast back, times the weight."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LoraLinear(nn.Module):
    """peft's `lora.Linear.forward` around a frozen base: `base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`."""

    def __init__(self, base: nn.Linear, rank: int, dropout: float) -> None:
        super().__init__()
        self.base_layer, self.scaling = base.requires_grad_(False), 2.0  # lora_alpha = 2 x rank
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class LlamaBlock(nn.Module):
    """One pre-norm block in `cfg.style`'s code: h = x + wo(sdpa(rope(wq n1), rope(wk n1), wv n1)),
    out = h + w2(mlp(n2)), k and v repeated to every head where kv_heads < heads (module names are
    torchtitan's whatever the style)."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        h, q, kv, f = cfg.hidden, cfg.q_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn
        self.cfg = cfg
        bias = cfg.style == "gpt"
        norm = {"torchtitan": lambda: nn.RMSNorm(h, eps=cfg.norm_eps), "hf_llama": lambda: HFRMSNorm(h, cfg.norm_eps),
                "gpt": lambda: nn.LayerNorm(h, eps=cfg.norm_eps)}[cfg.style]
        self.attention_norm, self.ffn_norm = norm(), norm()
        self.wq, self.wk = nn.Linear(h, q, bias=bias), nn.Linear(h, kv, bias=bias)
        self.wv, self.wo = nn.Linear(h, kv, bias=bias), nn.Linear(q, h, bias=bias)
        self.w1, self.w2 = nn.Linear(h, f, bias=bias), nn.Linear(f, h, bias=bias)
        self.w3 = None if cfg.style == "gpt" else nn.Linear(h, f, bias=False)
        if cfg.lora_rank:  # peft's get_peft_model: every parameter frozen, adapters on the attention projections
            self.requires_grad_(False)
            for name in ("wq", "wk", "wv", "wo"):
                setattr(self, name, LoraLinear(getattr(self, name), cfg.lora_rank, cfg.lora_dropout))

    def attention(self, x, rope):
        cfg = self.cfg
        bs, s, _ = x.shape
        xq = self.wq(x).view(bs, s, -1, cfg.head_dim)
        xk = self.wk(x).view(bs, s, -1, cfg.head_dim)
        xv = self.wv(x).view(bs, s, -1, cfg.head_dim)
        rep = cfg.heads // cfg.kv_heads
        if cfg.style == "hf_llama":  # transpose first, rotate, then `repeat_kv` on (b, kv, s, d)
            xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
            xq, xk = _rope_rotate_half(xq, xk, *rope)
            if rep > 1:
                xk = xk[:, :, None].expand(bs, cfg.kv_heads, rep, s, cfg.head_dim).reshape(bs, cfg.heads, s, cfg.head_dim)
                xv = xv[:, :, None].expand(bs, cfg.kv_heads, rep, s, cfg.head_dim).reshape(bs, cfg.heads, s, cfg.head_dim)
            out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
            return self.wo(out.transpose(1, 2).contiguous().reshape(bs, s, -1))
        if cfg.rope == "complex":
            xq, xk = _rope_complex(xq, xk, rope)
        if rep > 1:  # torchtitan's repeat_kv
            xk = xk.unsqueeze(3).expand(bs, s, cfg.kv_heads, rep, cfg.head_dim).reshape(bs, s, cfg.heads, cfg.head_dim)
            xv = xv.unsqueeze(3).expand(bs, s, cfg.kv_heads, rep, cfg.head_dim).reshape(bs, s, cfg.heads, cfg.head_dim)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, s, -1))

    def forward(self, x, rope):
        """`rope`: the model's precomputed rotary table, an input of each block as in torchtitan
        (`freqs_cis`, complex64) and transformers (cos, sin in the activation dtype); None for `gpt`."""
        if self.cfg.checkpoint != "none":  # torchtitan's apply_ac: checkpoint_wrapper(preserve_rng_state=False)
            from torch.utils.checkpoint import checkpoint
            from fsdp_sim.torch_tools.technique_referee import _op_sac_context
            extra = {"context_fn": _op_sac_context} if self.cfg.checkpoint == "selective_op" else {}
            return checkpoint(self._block, x, rope, use_reentrant=False, preserve_rng_state=False, **extra)
        return self._block(x, rope)

    def mlp(self, n):
        if self.w3 is None:  # GPT-2's gelu_new (tanh); ViT's exact GELU is the same one pointwise kernel
            return self.w2(F.gelu(self.w1(n), approximate="tanh"))
        return self.w2(F.silu(self.w1(n)) * self.w3(n))

    def _block(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.mlp(self.ffn_norm(h))


def rope_table(cfg: BlockConfig):
    """The rotary table torchtitan's `precompute_freqs_cis` makes (complex64), transformers' cos / sin
    (`LlamaRotaryEmbedding`: computed in fp32, cast to the activation dtype), or None (`gpt`)."""
    hd = cfg.head_dim
    if cfg.rope == "none":
        return None
    freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.outer(torch.arange(cfg.seq).float(), freqs)
    if cfg.rope == "complex":
        return torch.polar(torch.ones_like(angles), angles)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(torch_dtype(cfg.dtype)), emb.sin().to(torch_dtype(cfg.dtype))


def torch_dtype(name: str):
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def size_names(cfg: BlockConfig) -> dict[int, str]:
    """Element count -> the product of the block's sizes it is (T tokens, H hidden, Q heads x head_dim,
    KV the k / v width, F the MLP's width, S the sequence, D the head_dim, R a LoRA rank; weights as Q*H, KV*H, F*H;
    biases and norm weights as H, Q, KV, F). In MHA KV = Q: the KV name stands for both."""
    t, h, q, kv, f = cfg.tokens, cfg.hidden, cfg.q_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn
    return {t * h: "T*H", t * q: "T*Q", t * kv: "T*KV", t * f: "T*F", t: "T", t * cfg.heads: "T*heads",
            q * h: "Q*H", kv * h: "KV*H", f * h: "F*H", h: "H", q: "Q", kv: "KV", f: "F",
            cfg.seq * cfg.head_dim: "S*D",  # the rotary table: cos or sin, or the complex one as float pairs
            **({t * r: "T*R", r * h: "R*H", r * q: "R*Q", r * kv: "R*KV"} if (r := cfg.lora_rank) else {})}


def terms(nbytes_by_buffer: dict[str, int], cfg: BlockConfig, dtypes: dict[str, str] | None = None) -> dict[str, int]:
    """Buffers' bytes as counts of the block's sizes: {"T*H bf16": 2, "T f32": 1, ...} ("?" where a
    size is none of them), each buffer's element count read in its dtype (`dtypes`, Inductor's; a
    complex64 buffer as float32 pairs, as `view_as_real` has it). Without `dtypes`, the first of bf16,
    f32 that names a product."""
    names = size_names(cfg)
    out: dict[str, int] = {}
    for buf, nbytes in nbytes_by_buffer.items():
        dtype = (dtypes or {}).get(buf)
        size, label = {"bfloat16": (2, "bf16"), "float32": (4, "f32"), "complex64": (4, "f32"),
                       "bool": (1, "bool")}.get(dtype, (0, ""))
        if not size:
            size, label = next(((n, t) for n, t in ((2, "bf16"), (4, "f32")) if nbytes % n == 0 and nbytes // n in names),
                               (0, ""))
        key = f"{names[nbytes // size]} {label}" if size and nbytes % size == 0 and nbytes // size in names \
            else f"? {nbytes} B"
        out[key] = out.get(key, 0) + 1
    return out


def _graphs_on_fake_ranks(cfg: BlockConfig, prepare, steps: int = 2) -> int:
    """Dynamo graphs made over `steps` forward and backward passes of `LlamaBlock(cfg)` after
    `prepare(block, mesh)` (which compiles it as torchtitan does), on a two-rank fake process group."""
    import torch._dynamo
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_backend() != "fake":
            raise RuntimeError("a non-fake default process group is initialised; run this in its own process")
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    graphs = []

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    try:
        torch._dynamo.reset()
        block = prepare(LlamaBlock(cfg), init_device_mesh("cpu", (2,)), backend)
        x = torch.randn(cfg.batch, cfg.seq, cfg.hidden, dtype=torch_dtype(cfg.dtype), requires_grad=True)
        rope = rope_table(cfg)
        for _ in range(steps):
            block(x, rope).sum().backward()
    finally:
        dist.destroy_process_group()
    return len(graphs)


def graphs_under_fully_shard(cfg: BlockConfig = BlockConfig(), steps: int = 2) -> int:
    """Dynamo graphs made over `steps` forward and backward passes of a block compiled as torchtitan
    does it (`torch.compile(block, fullgraph=True)`, then `fully_shard` on the compiled module, bf16
    parameters), on a two-rank fake process group: 1 when FSDP2's hooks stay outside the compiled
    region (no graph break) and unsharding does not recompile it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def prepare(block, mesh, backend):
        block = torch.compile(block, backend=backend, fullgraph=True)
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch_dtype(cfg.dtype)))
        return block
    return _graphs_on_fake_ranks(cfg, prepare, steps)


def graphs_under_tensor_parallel(cfg: BlockConfig = BlockConfig(kv_heads=2), steps: int = 2) -> int:
    """Dynamo graphs of a block tensor-parallel over two ranks as torchtitan orders it (`parallelize_module`
    first -- q / k / v / w1 / w3 colwise, wo / w2 rowwise, no sequence parallel -- then
    `torch.compile(block, fullgraph=True)`): 1 when Dynamo traces the DTensor hooks (`from_local`,
    the redistributions, which lower to functional collectives) into the graph instead of breaking at
    them. Each rank's block then views its own heads (heads / 2, kv_heads / 2)."""
    from dataclasses import replace as replace_
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def prepare(block, mesh, backend):
        block, col, row = block.to(torch_dtype(cfg.dtype)), ColwiseParallel(), RowwiseParallel()
        parallelize_module(block, mesh, {"wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w2": row,
                                         **({"w3": col} if block.w3 is not None else {})})
        block.cfg = replace_(cfg, heads=cfg.heads // 2, kv_heads=cfg.kv_heads // 2)
        return torch.compile(block, backend=backend, fullgraph=True)
    return _graphs_on_fake_ranks(cfg, prepare, steps)
