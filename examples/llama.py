"""A Llama style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention.

Rotary tables (cos, sin) are precomputed buffers; attention is
`F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)`, so k and v keep their
`n_kv_head` heads. Factories never choose a device (see examples/gpt.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int = 32
    dim: int = 4096
    ffn_hidden: int = 11008
    max_seq: int = 2048
    rope_theta: float = 10000.0
    eps: float = 1e-5
    tie: bool = False


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) for linear and embedding weights, zero biases."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_head or cfg.n_head % cfg.n_kv_head:
            raise ValueError(f"dim={cfg.dim}, n_head={cfg.n_head}, n_kv_head={cfg.n_kv_head} do not divide")
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.dim // cfg.n_head
        self.wq = nn.Linear(cfg.dim, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        q = self.wq(x).view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.n_head * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(init_weights)
        head_dim = cfg.dim // cfg.n_head
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        s = idx.size(1)
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def llama(n_layer: int = 32, dim: int = 4096, n_head: int = 32, n_kv_head: int | None = None,
          ffn_hidden: int = 11008, vocab_size: int = 32000, seq: int = 2048, batch: int = 1,
          max_seq: int | None = None, rope_theta: float = 10000.0, eps: float = 1e-5, tie: bool = False,
          targets: bool = True) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A Llama of any size and example inputs `(idx, targets)` of shape [batch, seq]."""
    cfg = LlamaConfig(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head or n_head,
                      dim=dim, ffn_hidden=ffn_hidden, max_seq=max(seq, max_seq or seq), rope_theta=rope_theta,
                      eps=eps, tie=tie)
    model = Llama(cfg)
    idx = torch.randint(0, vocab_size, (batch, seq))
    if not targets:
        return model, (idx,)
    return model, (idx, torch.randint(0, vocab_size, (batch, seq)))


def tiny(batch: int = 2, seq: int = 16, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return llama(**{"n_layer": 2, "dim": 64, "n_head": 4, "n_kv_head": 2, "ffn_hidden": 160, "vocab_size": 128,
                    "batch": batch, "seq": seq, **overrides})


def llama_7b(batch: int = 1, seq: int = 2048, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return llama(**{"n_layer": 32, "dim": 4096, "n_head": 32, "ffn_hidden": 11008, "batch": batch, "seq": seq,
                    **overrides})


def llama_13b(batch: int = 1, seq: int = 2048, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return llama(**{"n_layer": 40, "dim": 5120, "n_head": 40, "ffn_hidden": 13824, "batch": batch, "seq": seq,
                    **overrides})


def llama_70b(batch: int = 1, seq: int = 4096, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Llama-2 70B: 8 key/value heads shared by 64 query heads."""
    return llama(**{"n_layer": 80, "dim": 8192, "n_head": 64, "n_kv_head": 8, "ffn_hidden": 28672,
                    "batch": batch, "seq": seq, **overrides})


default = tiny
