"""A BERT style encoder: token, position and token-type embeddings, post-LN blocks with GELU,
a padding attention mask as an input, and a masked-language-model head tied to the embeddings.

`forward(input_ids, token_type_ids, attention_mask, labels=None)` returns the MLM logits, or
the cross-entropy loss over positions whose label is not -100 when labels are given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    n_layer: int = 12
    n_head: int = 12
    hidden: int = 768
    intermediate: int = 3072
    max_positions: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.0
    eps: float = 1e-12


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: N(0, 0.02) for linear and embedding weights, zero biases."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.hidden // cfg.n_head
        self.query = nn.Linear(cfg.hidden, cfg.hidden)
        self.key = nn.Linear(cfg.hidden, cfg.hidden)
        self.value = nn.Linear(cfg.hidden, cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), x.size(1), self.n_head, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + mask_bias
        probs = self.drop(scores.softmax(dim=-1))
        y = torch.matmul(probs, v).permute(0, 2, 1, 3).flatten(2)
        return self.drop(self.out(y))


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.fc1 = nn.Linear(cfg.hidden, cfg.intermediate)
        self.fc2 = nn.Linear(cfg.intermediate, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.hidden, eps=cfg.eps)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x, mask_bias))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class Bert(nn.Module):
    position_ids: torch.Tensor

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.type_emb = nn.Embedding(cfg.type_vocab_size, cfg.hidden)
        self.emb_ln = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.emb_drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.n_layer)])
        self.head_fc = nn.Linear(cfg.hidden, cfg.hidden)
        self.head_ln = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab_size)
        self.decoder.weight = self.word_emb.weight
        self.apply(init_weights)
        self.register_buffer("position_ids", torch.arange(cfg.max_positions).unsqueeze(0), persistent=False)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        s = input_ids.size(1)
        x = self.word_emb(input_ids) + self.pos_emb(self.position_ids[:, :s]) + self.type_emb(token_type_ids)
        x = self.emb_drop(self.emb_ln(x))
        # 1 keeps a position, 0 pads it: padded keys get -10000 added to their scores (as BERT does).
        mask_bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, mask_bias)
        logits = self.decoder(self.head_ln(F.gelu(self.head_fc(x))))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, self.cfg.vocab_size), labels.view(-1), ignore_index=-100)


def bert(n_layer: int = 12, hidden: int = 768, n_head: int = 12, intermediate: int | None = None,
         vocab_size: int = 30522, seq: int = 512, batch: int = 8, dropout: float = 0.0,
         max_positions: int = 512, labels: bool = True) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A BERT of any size; inputs (input_ids, token_type_ids, attention_mask[, labels]) of shape [batch, seq].

    The example mask pads the last quarter of every other sequence; labels mark 15% of positions.
    """
    cfg = BertConfig(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, hidden=hidden,
                     intermediate=intermediate or 4 * hidden, max_positions=max(seq, max_positions),
                     dropout=dropout)
    model = Bert(cfg)
    ids = torch.randint(0, vocab_size, (batch, seq))
    types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous()
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1::2, seq - seq // 4:] = 0
    if not labels:
        return model, (ids, types, mask)
    chosen = torch.rand(batch, seq) < 0.15
    chosen[:, 0] = True  # at least one labelled position per sequence
    target = torch.where(chosen, torch.randint(0, vocab_size, (batch, seq)), torch.full((batch, seq), -100))
    return model, (ids, types, mask, target)


def tiny(batch: int = 2, seq: int = 16, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return bert(**{"n_layer": 2, "hidden": 64, "n_head": 4, "vocab_size": 128, "batch": batch, "seq": seq,
                   "max_positions": seq, **overrides})


def bert_base(batch: int = 8, seq: int = 512, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return bert(**{"n_layer": 12, "hidden": 768, "n_head": 12, "batch": batch, "seq": seq, **overrides})


def bert_large(batch: int = 8, seq: int = 512, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return bert(**{"n_layer": 24, "hidden": 1024, "n_head": 16, "batch": batch, "seq": seq, **overrides})


default = tiny
