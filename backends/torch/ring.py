"""Causal context parallelism: ring attention over blocks, and the zig-zag sequence layout.

- Ring attention (`ring_attention`): keys and values rotate around a mesh axis, one shard per
  step, and each rank folds every block into an online softmax (running max, sum and weighted
  values). A rank's queries and each key shard are *segments* of global positions: one per
  rank in the contiguous layout, two in the zig-zag one. Under a causal mask a (query segment,
  key segment) pair is skipped when every key lies after every query (no scores computed), is
  computed without a mask when every key lies at or before every query, and only the diagonal
  pairs build a mask from global positions.
- Zig-zag layout (`Shard(dim, zigzag=True)`): the dim (each interleaved block of it) is cut into
  2n chunks and rank c holds chunks c and 2n-1-c. With a contiguous split rank c of n does c+1
  blocks of causal work (the last rank sets the pace); zig-zag, every rank does the same.
  `zigzag_take` / `zigzag_assemble` split and join a full tensor, `zigzag_order` /
  `natural_order` permute a full tensor between the two orders, and the `zigzag_*` collectives
  are the contiguous collectives of `collectives.py` with those permutations around them
  (a zig-zag shard is a contiguous shard of the zig-zag-ordered tensor), so autograd and the
  conjugate backward come for free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardc.backends.torch import collectives as C
from shardc.backends.torch.collectives import MeshGroups, rotate_finish, rotate_start
from shardc.backends.torch.local_ops import causal_mask

Segment = tuple[int, int, int]  # (global position of the first element, local offset, length)


# ---- the zig-zag layout on full tensors ------------------------------------------------------

def zigzag_index(length: int, n: int, interleave: int = 1) -> list[int]:
    """Global positions in zig-zag order: within each of `interleave` blocks, rank 0's two chunks,
    then rank 1's, ...; a contiguous split of that order (`collectives._take`, piece c of every
    block) is the zig-zag split."""
    block = length // interleave
    chunk = block // (2 * n)
    if chunk * 2 * n * interleave != length:
        raise ValueError(f"a zig-zag split of {length} over {n} ranks ({interleave} blocks) needs "
                         f"{2 * n * interleave} equal chunks")
    out: list[int] = []
    for b in range(interleave):
        for r in range(n):
            for piece in (r, 2 * n - 1 - r):
                start = b * block + piece * chunk
                out.extend(range(start, start + chunk))
    return out


def zigzag_take(x: torch.Tensor, n: int, c: int, dim: int, interleave: int = 1) -> torch.Tensor:
    """Rank c's zig-zag piece of a full tensor along `dim` (chunks c and 2n-1-c of every block)."""
    pieces = []
    for block in x.chunk(interleave, dim):
        chunks = block.chunk(2 * n, dim)
        pieces += [chunks[c], chunks[2 * n - 1 - c]]
    return torch.cat(pieces, dim)


def zigzag_assemble(parts: list[torch.Tensor], dim: int, interleave: int = 1) -> torch.Tensor:
    """The inverse of `zigzag_take` over all ranks' pieces."""
    n = len(parts)
    halves = [p.chunk(2 * interleave, dim) for p in parts]
    out = []
    for b in range(interleave):
        out += [halves[r][2 * b] for r in range(n)] + [halves[r][2 * b + 1] for r in reversed(range(n))]
    return torch.cat(out, dim)


def zigzag_order(x: torch.Tensor, n: int, dim: int, interleave: int = 1) -> torch.Tensor:
    """A full tensor permuted along `dim` into zig-zag order (rank 0's piece first)."""
    index = torch.tensor(zigzag_index(x.shape[dim], n, interleave), device=x.device)
    return x.index_select(dim, index)


def natural_order(x: torch.Tensor, n: int, dim: int, interleave: int = 1) -> torch.Tensor:
    """The inverse of `zigzag_order`."""
    index = torch.tensor(zigzag_index(x.shape[dim], n, interleave), device=x.device)
    return x.index_select(dim, torch.argsort(index))


def take(x: torch.Tensor, n: int, c: int, dim: int, interleave: int = 1, zigzag: bool = False) -> torch.Tensor:
    """Piece c of n of a full tensor along `dim`, contiguous (`collectives._take`) or zig-zag."""
    return zigzag_take(x, n, c, dim, interleave) if zigzag else C._take(x, n, c, dim, interleave)


def gather(x: torch.Tensor, mesh: MeshGroups, axis: str, dim: int, interleave: int = 1,
           zigzag: bool = False) -> torch.Tensor:
    """The full tensor from every rank's piece along `axis` (no autograd; for state dicts)."""
    full = C._all_gather(x, mesh, axis, dim, interleave)
    return natural_order(full, mesh.size(axis), dim, interleave) if zigzag and mesh.size(axis) > 1 else full


# ---- collectives on zig-zag shards (what generated code calls) -------------------------------

def zigzag_all_gather(x: torch.Tensor, mesh: MeshGroups, axis: str, dim: int, grad: str = "chunk",
                      interleave: int = 1) -> torch.Tensor:
    """S(dim, zigzag) -> R: gather the pieces, then put positions back in order."""
    full = C.all_gather(x, mesh, axis, dim, grad=grad, interleave=interleave)
    return natural_order(full, mesh.size(axis), dim, interleave) if mesh.size(axis) > 1 else full


def zigzag_chunk(x: torch.Tensor, mesh: MeshGroups, axis: str, dim: int, grad: str = "all_gather",
                 interleave: int = 1) -> torch.Tensor:
    """R -> S(dim, zigzag): this rank's two chunks of the replicated tensor."""
    return _into_zigzag(C.chunk, x, mesh, axis, dim, interleave, grad=grad)


def zigzag_reduce_scatter(x: torch.Tensor, mesh: MeshGroups, axis: str, dim: int, op: str = "sum",
                          interleave: int = 1) -> torch.Tensor:
    """P -> S(dim, zigzag)."""
    return _into_zigzag(C.reduce_scatter, x, mesh, axis, dim, interleave, op=op)


def _into_zigzag(collective: Callable[..., torch.Tensor], x: torch.Tensor, mesh: MeshGroups, axis: str, dim: int,
                 interleave: int, **kwargs: Any) -> torch.Tensor:
    """The contiguous `collective` onto a shard, with positions put in zig-zag order first (so
    that each rank's contiguous piece is its two zig-zag chunks); nothing on one rank."""
    if mesh.size(axis) == 1:
        return x
    return collective(zigzag_order(x, mesh.size(axis), dim, interleave), mesh, axis, dim, interleave=interleave,
                      **kwargs)


def zigzag_pad(x: torch.Tensor, mesh: MeshGroups, axis: str, dim: int, interleave: int = 1) -> torch.Tensor:
    """S(dim, zigzag) -> P(sum): the piece in zeros of the full size, at its positions."""
    full = C.pad(x, mesh, axis, dim, interleave=interleave)
    return natural_order(full, mesh.size(axis), dim, interleave) if mesh.size(axis) > 1 else full


def zigzag_all_to_all(x: torch.Tensor, mesh: MeshGroups, axis: str, src: int, dst: int, src_interleave: int = 1,
                      dst_interleave: int = 1, src_zigzag: bool = False, dst_zigzag: bool = False) -> torch.Tensor:
    """S(src) -> S(dst) where either side is zig-zag: permute the full dim before or after."""
    n = mesh.size(axis)
    if n == 1:
        return x
    if src == dst:  # only the order changes: gather in one order, keep this rank's piece of the other
        gather_fn = zigzag_all_gather if src_zigzag else C.all_gather
        chunk_fn = zigzag_chunk if dst_zigzag else C.chunk
        return chunk_fn(gather_fn(x, mesh, axis, src, grad="chunk", interleave=src_interleave), mesh, axis, dst,
                        interleave=dst_interleave)
    if dst_zigzag:
        x = zigzag_order(x, n, dst, dst_interleave)
    out = C.all_to_all(x, mesh, axis, src, dst, src_interleave=src_interleave, dst_interleave=dst_interleave)
    return natural_order(out, n, src, src_interleave) if src_zigzag else out


ZIGZAG_COLLECTIVES = {"all_gather": zigzag_all_gather, "chunk": zigzag_chunk, "reduce_scatter": zigzag_reduce_scatter,
                      "pad": zigzag_pad, "all_to_all": zigzag_all_to_all}


# ---- ring attention ---------------------------------------------------------------------------

def segments(length: int, n: int, c: int, zigzag: bool, offset: int | None = None) -> list[Segment]:
    """The global positions rank c of n holds of a sequence split along one axis, as segments;
    `length` is the local length. Contiguous: one segment starting at `offset` (c*length by
    default); zig-zag: chunks c and 2n-1-c of half the local length each."""
    if not zigzag:
        return [(c * length if offset is None else offset, 0, length)]
    half = length // 2
    return [(c * half, 0, half), ((2 * n - 1 - c) * half, half, half)]


def visibility(q: Segment, k: Segment) -> str:
    """Under a causal mask: "none" (every key after every query), "full" (every key at or before
    every query) or "diagonal" (a mask is needed)."""
    qg, _, ql = q
    kg, _, kl = k
    if kg > qg + ql - 1:
        return "none"
    return "full" if kg + kl - 1 <= qg else "diagonal"


class _Softmax:
    """The online softmax state of one query segment."""

    def __init__(self) -> None:
        self.max: torch.Tensor | None = None
        self.sum: torch.Tensor | None = None
        self.acc: torch.Tensor | None = None

    def add(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        # The max is a constant shift (it cancels in the ratio), so no gradient flows through it.
        block_max = scores.detach().amax(-1)
        new_max = block_max if self.max is None else torch.maximum(self.max, block_max)
        p = torch.exp(scores - new_max.unsqueeze(-1))
        block = torch.matmul(p, values)
        if self.max is None or self.sum is None or self.acc is None:
            self.sum, self.acc = p.sum(-1), block
        else:
            alpha = torch.exp(self.max - new_max)
            self.sum = self.sum * alpha + p.sum(-1)
            self.acc = self.acc * alpha.unsqueeze(-1) + block
        self.max = new_max

    def result(self) -> torch.Tensor:
        if self.acc is None or self.sum is None:
            raise RuntimeError("ring attention: a query segment saw no key (a fully masked row)")
        return self.acc / self.sum.unsqueeze(-1)


def _rows(x: torch.Tensor | None, seg: Segment, q_len: int) -> torch.Tensor | None:
    """The rows of a user mask for one query segment (a mask broadcast over rows stays whole)."""
    if x is None or x.dim() < 2 or x.shape[-2] != q_len:
        return x
    return x[..., seg[1]:seg[1] + seg[2], :]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
                   mesh: MeshGroups, axis: str, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False, q_offset: int | None = None, rotate_mask: bool = False,
                   zigzag: bool = False) -> torch.Tensor:
    """Attention with keys and values rotating around `axis` (module docstring). `q_offset` is the
    global position of this rank's first query (contiguous layout); with `zigzag` the queries,
    keys and values are zig-zag shards. `mask`, if any, covers all keys (full t, natural order)
    or, with `rotate_mask`, this rank's key shard and travels with the keys."""
    n, c = mesh.size(axis), mesh.coord(axis)
    rep = q.shape[-3] // k.shape[-3] if k.dim() >= 3 and k.shape[-3] != q.shape[-3] else 1
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_len, k_len = q.shape[-2], k.shape[-2]
    q_segments = segments(q_len, n, c, zigzag, q_offset)
    states = [_Softmax() for _ in q_segments]
    ties: list[torch.Tensor] = []
    cur_k, cur_v, cur_mask = k, v, mask
    for t in range(n):
        src = (c + t) % n
        handles = {}
        if t + 1 < n:  # post the next shard's transfer before computing on this one
            handles = {"k": rotate_start(cur_k, mesh, axis, -1, tag=0), "v": rotate_start(cur_v, mesh, axis, -1, tag=1)}
            if rotate_mask and cur_mask is not None:
                handles["mask"] = rotate_start(cur_mask, mesh, axis, -1, tag=2)
        k_segments = segments(k_len, n, src, zigzag)
        used = False
        for qs, state in zip(q_segments, states):
            seen = [(ks, visibility(qs, ks) if is_causal else "full") for ks in k_segments]
            seen = [(ks, how) for ks, how in seen if how != "none"]
            if not seen:
                continue
            used = True
            kk, vv = _keys(cur_k, seen), _keys(cur_v, seen)
            if rep > 1:
                kk, vv = kk.repeat_interleave(rep, dim=-3), vv.repeat_interleave(rep, dim=-3)
            qq = q[..., qs[1]:qs[1] + qs[2], :] if len(q_segments) > 1 else q
            scores = torch.matmul(qq, kk.transpose(-1, -2)) * scale
            if mask is not None:
                source = cur_mask if rotate_mask else mask
                piece = _rows(source, qs, q_len)
                assert piece is not None
                cols = [piece[..., (ks[1] if rotate_mask else ks[0]):(ks[1] if rotate_mask else ks[0]) + ks[2]]
                        for ks, _ in seen]
                piece = torch.cat(cols, -1)
                scores = scores.masked_fill(~piece, float("-inf")) if piece.dtype == torch.bool else scores + piece
            if any(how == "diagonal" for _, how in seen):
                keep = torch.cat([causal_mask(qs[2], ks[2], qs[0], ks[0], q.device) for ks, _ in seen], -1)
                scores = scores.masked_fill(~keep, float("-inf"))
            state.add(scores, vv)
        if not used and (cur_k.requires_grad or cur_v.requires_grad):
            # Nothing to add, but the shards must stay in the autograd graph: every rank's backward
            # has to run the same reverse rotations, or the ring deadlocks.
            ties.append(cur_k.sum() + cur_v.sum())
        if handles:
            cur_k = rotate_finish(cur_k, handles["k"], mesh, axis, -1)
            cur_v = rotate_finish(cur_v, handles["v"], mesh, axis, -1)
            if "mask" in handles:
                cur_mask = handles["mask"].wait()
    out = torch.cat([s.result() for s in states], -2) if len(states) > 1 else states[0].result()
    for tie in ties:
        out = out + 0.0 * tie
    return out


def _keys(x: torch.Tensor, seen: list[tuple[Segment, str]]) -> torch.Tensor:
    """The rows of a key (or value) shard that the visible segments cover, in segment order."""
    if len(seen) == 1 and seen[0][0][1] == 0 and seen[0][0][2] == x.shape[-2]:
        return x
    return torch.cat([x[..., s[1]:s[1] + s[2], :] for s, _ in seen], -2)


def causal_work(n: int, zigzag: bool) -> list[int]:
    """Per rank of a ring of n, the (query chunk x key chunk) blocks its causal ring attention
    computes, in units of one chunk of 1/(2n) of the sequence against another (a diagonal
    block counts whole: it is computed, then masked). Contiguous: rank c computes c full
    shards and its diagonal shard, 4c + 4 units; zig-zag: 3 units for its own shard and 2 for
    every other, 2n + 1 on every rank."""
    out = []
    for c in range(n):
        total = 0
        q_segs = segments(2, n, c, zigzag, None if zigzag else 2 * c)
        for src in range(n):
            for qs in q_segs:
                k_segs = segments(2, n, src, zigzag, None if zigzag else 2 * src)
                total += sum(qs[2] * ks[2] for ks in k_segs if visibility(qs, ks) != "none")
        out.append(total)
    return out
