"""Temporal partitions as loops: a dim cut into steps computed one after another on one rank.

- `temporal_loop`: no rotation (sequence chunking, micro-steps): each step runs the op on one
  chunk of every operand holding the dim; outputs are concatenated (the dim is parallel) or
  accumulated (the dim is a reduction).
- `rotating_loop`: PrimePar's primitive on one mesh axis. The operands that hold the rotated
  reduction dim as a shard pass it to the previous rank every step, so at step t rank c holds
  chunk (c + t) mod n; operands that hold that dim whole are indexed at that chunk. Partial
  products accumulate locally; no collective, nothing replicated. The next shard's transfer is
  posted (async isend/irecv into a second buffer) before the current step computes.
- `ring_attention`: the same rotation for keys and values with an online softmax (running max,
  sum and weighted values), causal masking by global positions (context parallelism).
"""

from __future__ import annotations

from typing import Any

import torch

from shardc.backends.torch.collectives import MeshGroups, rotate_finish, rotate_start
from shardc.backends.torch.local_ops import causal_mask, compute_op


def temporal_loop(op: str, *inputs: Any, dims: tuple[int | None, ...], out_dim: int | None, steps: int,
                  reduce: str = "sum", offsets: tuple[tuple[str, int, int], ...] = (), **attrs: Any) -> torch.Tensor:
    """Run registry op `op` over `steps` chunks. `dims[i]` is the tensor dim of input i cut into
    chunks (None: passed whole); the output is concatenated along `out_dim`, or summed (`reduce`
    "sum") or averaged ("mean") when None. `offsets` holds (keyword, base, per-step increment) for arguments that
    move with the chunk (a query chunk's global position)."""
    fn = compute_op(op) if op != "attention" else _attention_fn()
    outs = []
    for t in range(steps):
        args = [x if d is None or x is None else x.chunk(steps, d)[t] for x, d in zip(inputs, dims)]
        extra = {name: base + t * step for name, base, step in offsets}
        outs.append(fn(*args, **attrs, **extra))
    if out_dim is not None:
        return torch.cat(outs, out_dim)
    total = outs[0]
    for o in outs[1:]:
        total = total + o
    return total / steps if reduce == "mean" else total


def _attention_fn() -> Any:
    from shardc.backends.torch.local_ops import attention

    return attention


def rotating_loop(op: str, *inputs: Any, mesh: MeshGroups, axis: str, rotating: tuple[int, ...],
                  indexed: tuple[tuple[int, int], ...], once: tuple[int, ...] = (), **attrs: Any) -> torch.Tensor:
    """Accumulate `op` over the n shards of a reduction dim rotating along `axis` (see module doc).
    `rotating`: inputs holding their shard of the dim (they move); `indexed`: (input, tensor dim)
    pairs holding the whole dim (sliced at the current chunk); `once`: inputs used at step 0 only
    (a bias)."""
    n, c = mesh.size(axis), mesh.coord(axis)
    current = list(inputs)
    total = None
    for t in range(n):
        src = (c + t) % n
        handles = {}
        if t + 1 < n:  # post the next shard's transfer before computing on this one
            handles = {i: rotate_start(current[i], mesh, axis, -1, tag=i) for i in rotating}
        args = [x.chunk(n, dict(indexed)[i])[src] if i in dict(indexed) else x for i, x in enumerate(current)]
        args = [None if (i in once and t > 0) else x for i, x in enumerate(args)]
        while args and args[-1] is None:
            args.pop()
        out = compute_op(op)(*args, **attrs)
        total = out if total is None else total + out
        for i, h in handles.items():
            current[i] = rotate_finish(current[i], h, mesh, axis, -1)
    assert total is not None
    return total


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                   mesh: MeshGroups, axis: str, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, q_offset: int = 0, rotate_mask: bool = False) -> torch.Tensor:
    """Attention with keys and values rotating around `axis` (ring attention). `q_offset` is the
    global position of this rank's first query; `mask`, if any, covers all keys (full t) or,
    with `rotate_mask`, this rank's key chunk and travels with the keys."""
    n, c = mesh.size(axis), mesh.coord(axis)
    if k.shape[-3] != q.shape[-3] and k.dim() >= 3:
        rep = q.shape[-3] // k.shape[-3]
    else:
        rep = 1
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    chunk = k.shape[-2]
    running_max = running_sum = acc = None
    cur_k, cur_v, cur_mask = k, v, mask
    for t in range(n):
        src = (c + t) % n
        handles = {}
        if t + 1 < n:
            handles = {"k": rotate_start(cur_k, mesh, axis, -1, tag=0), "v": rotate_start(cur_v, mesh, axis, -1, tag=1)}
            if rotate_mask and cur_mask is not None:
                handles["mask"] = rotate_start(cur_mask, mesh, axis, -1, tag=2)
        kk = cur_k.repeat_interleave(rep, dim=-3) if rep > 1 else cur_k
        vv = cur_v.repeat_interleave(rep, dim=-3) if rep > 1 else cur_v
        scores = torch.matmul(q, kk.transpose(-1, -2)) * scale
        if mask is not None:
            piece = cur_mask if rotate_mask and cur_mask is not None else mask[..., src * chunk:(src + 1) * chunk]
            scores = scores.masked_fill(~piece, float("-inf")) if piece.dtype == torch.bool else scores + piece
        skip = False
        if is_causal:
            if src * chunk > q_offset + q.shape[-2] - 1:
                skip = True  # every key of this chunk lies in every query's future
            else:
                keep = causal_mask(q.shape[-2], chunk, q_offset, src * chunk, q.device)
                scores = scores.masked_fill(~keep, float("-inf"))
        if skip:
            # Nothing to add, but the shards must stay in the autograd graph: every rank's backward
            # has to run the same reverse rotations, or the ring deadlocks.
            if acc is not None and (cur_k.requires_grad or cur_v.requires_grad):
                acc = acc + 0.0 * (cur_k.sum() + cur_v.sum())
        else:
            # The max is a constant shift (it cancels in the ratio), so no gradient flows through it.
            block_max = scores.detach().amax(-1)
            new_max = block_max if running_max is None else torch.maximum(running_max, block_max)
            p = torch.exp(scores - new_max.unsqueeze(-1))
            block = torch.matmul(p, vv)
            if running_max is None or running_sum is None or acc is None:
                running_sum, acc = p.sum(-1), block
            else:
                alpha = torch.exp(running_max - new_max)
                running_sum = running_sum * alpha + p.sum(-1)
                acc = acc * alpha.unsqueeze(-1) + block
            running_max = new_max
        if handles:
            cur_k = rotate_finish(cur_k, handles["k"], mesh, axis, -1)
            cur_v = rotate_finish(cur_v, handles["v"], mesh, axis, -1)
            if "mask" in handles:
                cur_mask = handles["mask"].wait()
    assert acc is not None and running_sum is not None
    return acc / running_sum.unsqueeze(-1)
