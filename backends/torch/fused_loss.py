"""The LM head and its cross entropy over token chunks, as one autograd node (chunked linear
cross entropy, as Liger and torchtune run it).

Rule. `chunked_linear_cross_entropy(x, weight, bias, targets, steps)` is
`cross_entropy(linear(x, weight, bias).reshape(-1, V), targets.reshape(-1))` computed over
`steps` equal chunks of the token rows, one after another, never materialising the whole
`[tokens, V]` logits nor their gradient:
- forward: per chunk, the chunk's logits (fp32, as a loss reads them), their log-sum-exp and the
  target logit; only x, the weight, the targets and one fp32 log-sum-exp per row are saved;
- backward: per chunk, the logits again (one more head matmul), turned in place into their
  gradient (softmax minus the target's one-hot, times the output gradient over the count of
  counted rows), then `grad_x[chunk] = g @ W` written into one full-size input gradient and
  `grad_W += g^T x_chunk` accumulated into one weight gradient.
So one chunk's logits (and, under mixed precision, their compute-dtype copy) are live at a time
in either pass. With the classes split over a mesh axis (`mesh`, `axis`, `vocab_start`: this
rank's first class; Megatron's vocab-parallel cross entropy), each chunk all-reduces its rows'
maximum, then their sum of exponentials with the target logit (one fp32 pair per row); backward
needs no collective (the log-sum-exp is saved global; the input gradient leaves Partial(sum),
reduced where the replicated input entered the split head). `reduction` mean divides by the rows whose target is not `ignore_index` over
all chunks (the unchunked loss exactly), sum does not divide. Which graph pattern runs through
this, and how it is priced, is `shardc.analysis.head_loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shardc.backends.torch.collectives import MeshGroups

Reduce = Callable[[torch.Tensor, str], torch.Tensor]  # (tensor, "max" | "sum") -> reduced over the classes' axis


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                steps: int, ignore_index: int, reduction: str, reduce: Reduce | None, vocab_start: int) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        flat = targets.reshape(-1)
        wide = _loss_dtype(x.dtype)
        lse = torch.empty(rows.shape[0], dtype=wide, device=x.device)
        total = torch.zeros((), dtype=wide, device=x.device)
        for xc, tc, lc in zip(rows.chunk(steps), flat.chunk(steps), lse.chunk(steps)):
            logits = F.linear(xc, weight, bias).to(wide)
            valid = tc != ignore_index
            local = tc - vocab_start
            inside = valid & (local >= 0) & (local < logits.shape[-1])
            picked = logits.gather(-1, torch.where(inside, local, 0).unsqueeze(-1)).squeeze(-1) * inside
            if reduce is None:
                torch.logsumexp(logits, -1, out=lc)
            else:  # classes split: the rows' maximum, then (sum of exponentials, target logit) over the axis
                top = reduce(logits.amax(-1), "max")
                pair = reduce(torch.stack([(logits - top.unsqueeze(-1)).exp().sum(-1), picked]), "sum")
                lc.copy_(pair[0].log() + top)
                picked = pair[1]
            total += ((lc - picked) * valid).sum()
            del logits
        count = (flat != ignore_index).sum().clamp_min(1).to(wide)
        ctx.save_for_backward(x, weight, bias, targets, lse, count)
        ctx.steps, ctx.ignore_index, ctx.reduction, ctx.vocab_start = steps, ignore_index, reduction, vocab_start
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias, targets, lse, count = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        flat = targets.reshape(-1)
        scale = grad / count if ctx.reduction == "mean" else grad
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(rows) if need_x else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        chunks = zip(rows.chunk(ctx.steps), flat.chunk(ctx.steps), lse.chunk(ctx.steps),
                     grad_x.chunk(ctx.steps) if grad_x is not None else [None] * ctx.steps)
        for xc, tc, lc, gxc in chunks:
            g = F.linear(xc, weight, bias).to(lse.dtype)
            g.sub_(lc.unsqueeze(-1)).exp_()  # softmax, in place
            valid = tc != ctx.ignore_index
            local = tc - ctx.vocab_start
            inside = valid & (local >= 0) & (local < g.shape[-1])
            g.scatter_add_(-1, torch.where(inside, local, 0).unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
            g.mul_((scale * valid).unsqueeze(-1))
            g = g.to(x.dtype)  # the compute dtype's gradient of the head's output (no copy in fp32)
            if gxc is not None:
                torch.mm(g, weight, out=gxc)
            if grad_w is not None:
                grad_w.addmm_(g.t(), xc)
            if grad_b is not None:
                grad_b.add_(g.sum(0))
            del g
        return (grad_x.view_as(x) if grad_x is not None else None, grad_w, grad_b, None, None, None, None, None, None)


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for a low-precision head (the loss reads fp32), the head's own dtype otherwise."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def chunked_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 targets: torch.Tensor, steps: int, ignore_index: int = -100,
                                 reduction: str = "mean", mesh: MeshGroups | None = None, axis: str | None = None,
                                 vocab_start: int = 0) -> torch.Tensor:
    """`cross_entropy(linear(x, weight, bias).reshape(-1, V), targets.reshape(-1))` over `steps`
    token chunks (module rule): one chunk's logits live at a time, recomputed in backward. With
    `mesh` and `axis`, `weight` holds the classes from `vocab_start` on of a split vocabulary."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked linear cross entropy reduces by mean or sum, not {reduction!r}")
    if x.shape[:-1].numel() != targets.numel():
        raise ValueError(f"chunked linear cross entropy: {x.shape[:-1].numel()} token rows of x {tuple(x.shape)} "
                         f"but {targets.numel()} targets {tuple(targets.shape)}")
    reduce: Reduce | None = None
    if mesh is not None and axis is not None:
        from shardc.backends.torch.collectives import all_reduce

        def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
            return all_reduce(t, mesh, axis, op=op)

    return _ChunkedLinearCrossEntropy.apply(x, weight, bias, targets, steps, ignore_index, reduction, reduce,
                                            vocab_start)
