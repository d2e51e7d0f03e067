"""Temporal partitions as loops: a dim cut into steps computed one after another on one rank.

Which temporal splits reach these loops is the capability table's (`shardc.ops.lowering`: one
split per node; chunks not of reshape/expand/full/arange nor of a special or unsplittable dim;
rotations of a contraction's reduction dim or attention's key dim, one step per device), which
the solver's candidates obey and codegen (`emit.py`) checks with the same messages.

- `temporal_loop`: no rotation (sequence chunking, micro-steps): each step runs the op on one
  chunk of every operand holding the dim; outputs are concatenated (the dim is parallel) or
  accumulated (the dim is a reduction).
- `rotating_loop`: PrimePar's primitive on one mesh axis. The operands that hold the rotated
  reduction dim as a shard pass it to the previous rank every step, so at step t rank c holds
  chunk (c + t) mod n; operands that hold that dim whole are indexed at that chunk. Partial
  products accumulate locally; no collective, nothing replicated. The next shard's transfer is
  posted (async isend/irecv into a second buffer) before the current step computes.
- `ring_attention` (in `ring.py`, re-exported here): the same rotation for keys and values with
  an online softmax, causal blocks skipped or masked by global positions (context parallelism).
"""

from __future__ import annotations

from typing import Any

import torch

from shardc.backends.torch.collectives import MeshGroups, rotate_finish, rotate_start
from shardc.backends.torch.local_ops import compute_op
from shardc.backends.torch.ring import ring_attention

__all__ = ["ring_attention", "rotating_loop", "temporal_loop"]


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
