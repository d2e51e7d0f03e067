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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocabulary-parallel cross entropy as one autograd node (module doc of
    `vocab_parallel_cross_entropy`): per row the loss, keeping only this rank's softmax."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, mesh: MeshGroups, axis: str,  # type: ignore[override]
                vocab_start: int, ignore_index: int) -> torch.Tensor:
        rows = logits.reshape(-1, logits.shape[-1])
        top = all_reduce(rows.amax(-1), mesh, axis, op="max")
        probs = rows - top.unsqueeze(-1)  # the one [rows, classes] tensor made here: exp, then softmax, in place
        index, inside, valid = _targets(targets, vocab_start, ignore_index, rows.shape[-1])
        picked = probs.gather(-1, index).squeeze(-1) * inside.to(probs.dtype)
        probs.exp_()
        pair = all_reduce(torch.stack([probs.sum(-1), picked]), mesh, axis, op="sum")  # (sum of exp, target logit)
        probs.div_(pair[0].unsqueeze(-1))
        ctx.save_for_backward(probs, targets)
        ctx.shape, ctx.vocab_start, ctx.ignore_index = logits.shape, vocab_start, ignore_index
        return ((pair[0].log() - pair[1]) * valid.to(probs.dtype)).view(targets.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        probs, targets = ctx.saved_tensors
        index, inside, valid = _targets(targets, ctx.vocab_start, ctx.ignore_index, probs.shape[-1])
        # softmax - one_hot(target), times the row's gradient, written over the saved softmax
        probs.scatter_add_(-1, index, -inside.to(probs.dtype).unsqueeze(-1))
        probs.mul_((grad.reshape(-1) * valid.to(grad.dtype)).unsqueeze(-1))
        return probs.view(ctx.shape), None, None, None, None, None


def _targets(targets: torch.Tensor, vocab_start: int, ignore_index: int,
             classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's target as a column index into this rank's classes, 0 where outside them; whether
    it is inside them; whether the row counts) for `classes` classes from `vocab_start` on."""
    flat = targets.reshape(-1)
    valid = flat != ignore_index
    local = flat - vocab_start
    inside = valid & (local >= 0) & (local < classes)
    return torch.where(inside, local, torch.zeros_like(local)).unsqueeze(-1), inside, valid


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mesh: MeshGroups, axis: str,
                                 vocab_start: int, ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy over classes split along `axis` (this rank's from `vocab_start` on), as
    Megatron's vocab-parallel cross entropy runs it: one autograd node that all-reduces the rows'
    maximum, then (sum of exponentials, target logit) in one call, and keeps a single
    `[rows, classes]` tensor, the softmax, made beside the logits (which it lets go) and turned
    in place into their gradient in backward; no collective backward (the loss is replicated on
    `axis`). The cost model prices exactly this (`shardc.cost.head.vocab_parallel_loss`)."""
    losses = _VocabParallelCrossEntropy.apply(logits, targets, mesh, axis, vocab_start, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum().clamp_min(1).to(losses.dtype)


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
