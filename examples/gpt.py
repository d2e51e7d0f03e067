"""A GPT-2 style decoder (learned positions, pre-LN, GELU MLP of width 4h, tied or untied head).

Attention is written out Megatron-style (q k^T * scale, causal `masked_fill`, softmax, dropout,
@ v) so the traced graph holds every tensor Korthikanti et al. count in 34sbh + 5as^2b. The
factories never choose a device: `shardc.frontend.spec.load_model` builds them under
`with torch.device(dev)`, and on the meta device a 175B model costs no memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024  # longest sequence the position table and the mask allow
    dropout: float = 0.0
    tie: bool = True
    bias: bool = True
    # Attention through F.scaled_dot_product_attention (one fused flash kernel, as Megatron-Core
    # and NeMo run it with Transformer Engine) instead of the written-out ops; no attention dropout.
    flash: bool = False


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) for linear and embedding weights, zero biases."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class CausalSelfAttention(nn.Module):
    future: torch.Tensor

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not a multiple of n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.head_dim = cfg.n_embd // cfg.n_head
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.flash = cfg.flash
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        # True above the diagonal: the future positions a query must not see.
        future = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool).triu(1)
        self.register_buffer("future", future.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        q = q.view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, self.n_embd)
            return self.resid_drop(self.proj(y))
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.future[:, :, :s, :s], float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = (att @ v).transpose(1, 2).reshape(b, s, self.n_embd)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie:
            self.lm_head.weight = self.wte.weight
        self.apply(init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        s = idx.size(1)
        pos = torch.arange(s, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt(n_layer: int = 12, n_embd: int = 768, n_head: int = 12, vocab_size: int = 50257, seq: int = 1024,
        batch: int = 8, dropout: float = 0.0, tie: bool = True, bias: bool = True,
        block_size: int | None = None, targets: bool = True, flash: bool = False
        ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A GPT of any size and example inputs `(idx, targets)` of shape [batch, seq] on the default device
    (`flash`: attention as one fused `scaled_dot_product_attention`)."""
    cfg = GPTConfig(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    block_size=max(seq, block_size or seq), dropout=dropout, tie=tie, bias=bias, flash=flash)
    return build(cfg, batch=batch, seq=seq, targets=targets)


def build(cfg: GPTConfig, *, batch: int, seq: int, targets: bool = True) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    if seq > cfg.block_size:
        cfg = replace(cfg, block_size=seq)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))
    if not targets:
        return model, (idx,)
    return model, (idx, torch.randint(0, cfg.vocab_size, (batch, seq)))


def tiny(batch: int = 2, seq: int = 16, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return gpt(**{"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "batch": batch, "seq": seq,
                  **overrides})


def gpt2_small(batch: int = 8, seq: int = 1024, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return gpt(**{"n_layer": 12, "n_embd": 768, "n_head": 12, "batch": batch, "seq": seq, **overrides})


def gpt2_medium(batch: int = 8, seq: int = 1024, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return gpt(**{"n_layer": 24, "n_embd": 1024, "n_head": 16, "batch": batch, "seq": seq, **overrides})


def gpt2_large(batch: int = 8, seq: int = 1024, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return gpt(**{"n_layer": 36, "n_embd": 1280, "n_head": 20, "batch": batch, "seq": seq, **overrides})


def gpt2_xl(batch: int = 8, seq: int = 1024, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """GPT-2 XL, 1.5B parameters."""
    return gpt(**{"n_layer": 48, "n_embd": 1600, "n_head": 25, "batch": batch, "seq": seq, **overrides})


def gpt3_175b(batch: int = 1, seq: int = 2048, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """GPT-3 175B (h=12288, l=96, a=96, s=2048); build it on the meta device."""
    return gpt(**{"n_layer": 96, "n_embd": 12288, "n_head": 96, "batch": batch, "seq": seq, **overrides})


default = tiny
