"""A small, readable torchtitan-style decoder-only transformer used as the referee's model.

``ReferenceTransformer(cfg)`` has the module structure the simulator reasons about::

    tok_embeddings        nn.Embedding(vocab, hidden)
    pos_embeddings        nn.Embedding(max_seq, hidden)   (only with cfg.learned_pos; GPT-2 style)
    layers                nn.ModuleList of TransformerBlock
        attention_norm    nn.RMSNorm / nn.LayerNorm
        attention         wq, wk, wv, wo  (GQA: k/v repeat_interleave'd up to `heads`)
        ffn_norm          nn.RMSNorm / nn.LayerNorm
        feed_forward      swiglu: w1, w3, w2  (w2(silu(w1 x) * w3 x)); gelu: w1, w2 (w2(gelu(w1 x)))
    norm                  nn.RMSNorm / nn.LayerNorm
    output                nn.Linear(hidden, vocab, bias=False); weight tied to tok_embeddings when
                          cfg.tie_embeddings

Deliberately no RoPE (and no dropout): positions come only from the optional learned position
embedding, so the activation inventory stays easy to enumerate.  Attention is
``F.scaled_dot_product_attention(is_causal=True)``.  ``cfg.bias`` adds biases to every linear layer
of the blocks (the output head never has one).

``loss_fn(logits, labels)`` upcasts the logits to fp32 before cross-entropy, as torchtitan does;
the fp32 logits and the log-softmax output are real memory in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "fsdp_sim.torch_tools needs PyTorch; install it with `pip install -e '.[torch]' from a clone, or pip install torch==2.13.0`"
    ) from exc

__all__ = ["ReferenceConfig", "ReferenceTransformer", "TransformerBlock", "example_1b", "loss_fn"]


@dataclass
class ReferenceConfig:
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 8
    ffn_hidden: int = 688
    vocab: int = 4096
    mlp: str = "swiglu"  # 'swiglu' | 'gelu'
    norm: str = "rmsnorm"  # 'rmsnorm' | 'layernorm'
    bias: bool = False  # bias on the block's linear layers
    tie_embeddings: bool = False
    learned_pos: bool = False
    max_seq: int = 2048
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError("hidden must be divisible by heads")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be divisible by kv_heads")
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"mlp must be 'swiglu' or 'gelu', got {self.mlp!r}")
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {self.norm!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _make_norm(cfg: ReferenceConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ReferenceConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.kv_heads < self.heads:
            rep = self.heads // self.kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, cfg: ReferenceConfig) -> None:
        super().__init__()
        self.mlp = cfg.mlp
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        if cfg.mlp == "swiglu":
            self.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ReferenceConfig) -> None:
        super().__init__()
        # torchtitan's registration order (the FSDP unit's parameter order: the builder's block_params)
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = _make_norm(cfg)
        self.ffn_norm = _make_norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class ReferenceTransformer(nn.Module):
    def __init__(self, cfg: ReferenceConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_embeddings = nn.Embedding(cfg.max_seq, cfg.hidden) if cfg.learned_pos else None
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.layers))
        self.norm = _make_norm(cfg)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            h = h + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on fp32-upcast logits (torchtitan's ``cross_entropy_loss``)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1))


def example_1b() -> tuple[ReferenceTransformer, object]:
    """A 1.1 B-parameter Llama-style model (TinyLlama's shape) and its loss, for `fsdp-sim trace`."""
    cfg = ReferenceConfig(hidden=2048, layers=22, heads=32, kv_heads=4, ffn_hidden=5632, vocab=32000)
    return ReferenceTransformer(cfg), loss_fn
