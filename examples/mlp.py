"""A deep MLP with a classification (cross-entropy) or regression (mean squared error) loss.

`forward(x, targets=None)` returns the outputs, or the loss when targets are given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class MLPConfig:
    in_features: int = 1024
    hidden: int = 4096
    out_features: int = 1000
    n_layer: int = 8
    loss: str = "ce"  # "ce" (classes) or "mse" (regression)
    dropout: float = 0.0


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        if cfg.loss not in ("ce", "mse"):
            raise ValueError(f"loss must be 'ce' or 'mse', got {cfg.loss!r}")
        self.cfg = cfg
        widths = [cfg.in_features] + [cfg.hidden] * (cfg.n_layer - 1)
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])])
        self.drop = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(widths[-1], cfg.out_features)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = self.drop(F.relu(layer(x)))
        y = self.head(x)
        if targets is None:
            return y
        if self.cfg.loss == "ce":
            return F.cross_entropy(y, targets)
        return ((y - targets) ** 2).mean()


def mlp(in_features: int = 1024, hidden: int = 4096, out_features: int = 1000, n_layer: int = 8,
        batch: int = 64, loss: str = "ce", dropout: float = 0.0,
        targets: bool = True) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """An MLP of `n_layer` linear layers and example inputs `(x, targets)` with `batch` rows."""
    model = MLP(MLPConfig(in_features, hidden, out_features, n_layer, loss, dropout))
    x = torch.randn(batch, in_features)
    if not targets:
        return model, (x,)
    if loss == "ce":
        return model, (x, torch.randint(0, out_features, (batch,)))
    return model, (x, torch.randn(batch, out_features))


def tiny(batch: int = 8, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return mlp(**{"in_features": 32, "hidden": 64, "out_features": 10, "n_layer": 3, "batch": batch, **overrides})


default = tiny
