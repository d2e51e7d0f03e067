"""What one rank runs for an IR node: the registry's torch impl on local shards, plus the few ops
whose sharded form is not the op on local pieces (vocab-parallel embedding and cross entropy, a
linear whose bias must be added once per partial sum, attention on a chunk of the queries).

Generated code calls `op(...)` wrappers named after the registry entry, so the `.code` of a
generated module reads `shardc_ops_linear(x, w)`; rank-dependent numbers (vocab offsets, query
offsets, whether this rank adds the bias) are literals in each rank's code.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from shardc.backends.torch.collectives import MeshGroups, all_reduce
from shardc.ops.registry import get_op


@cache
def compute_op(name: str) -> Callable[..., Any]:
    """A named function running the registry impl of `name` (what fx prints in generated code)."""
    impl = get_op(name).impl

    def run(*args: Any, **attrs: Any) -> Any:
        return impl(*args, **attrs)

    run.__name__ = run.__qualname__ = name
    run.__module__ = "shardc.ops.builtin"
    return run


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Rows of this rank's vocabulary slice; ids outside it give zeros (the output is Partial(sum))."""
    local = ids - vocab_start
    inside = (local >= 0) & (local < weight.shape[0])
    out = F.embedding(torch.where(inside, local, torch.zeros_like(local)), weight)
    return out * inside.unsqueeze(-1).to(out.dtype)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mesh: MeshGroups, axis: str,
                                 vocab_start: int, ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy over classes split along `axis`: all-reduce the row max (no gradient), the sum
    of exponentials and the target logit (identity backward: the loss is replicated on `axis`)."""
    row_max = all_reduce(logits.detach().amax(-1), mesh, axis, op="max")
    shifted = logits - row_max.unsqueeze(-1)
    sum_exp = all_reduce(shifted.exp().sum(-1), mesh, axis, op="sum")
    local = targets - vocab_start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, torch.where(inside, local, torch.zeros_like(local)).unsqueeze(-1)).squeeze(-1)
    picked = all_reduce(picked * inside.to(picked.dtype), mesh, axis, op="sum")
    losses = sum_exp.log() - picked
    valid = targets != ignore_index
    losses = losses * valid.to(losses.dtype)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum().clamp_min(1).to(losses.dtype)


def causal_mask(q_len: int, k_len: int, q_offset: int, k_offset: int, device: torch.device) -> torch.Tensor:
    """True where query position q_offset+i may attend key position k_offset+j (j <= i globally)."""
    qpos = torch.arange(q_len, device=device).unsqueeze(-1) + q_offset
    kpos = torch.arange(k_len, device=device) + k_offset
    return kpos <= qpos


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              q_offset: int = 0, k_offset: int = 0) -> torch.Tensor:
    """Scaled dot-product attention on local heads; when this rank holds a chunk of the queries
    (sequence split) the causal mask is built from global positions."""
    if is_causal and (q_offset or k_offset or q.shape[-2] != k.shape[-2]):
        keep = causal_mask(q.shape[-2], k.shape[-2], q_offset, k_offset, q.device)
        if mask is not None:
            keep = keep & mask if mask.dtype == torch.bool else torch.where(keep, mask, float("-inf"))
        mask, is_causal = keep, False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=enable_gqa)
