"""The view and data-movement ops (reshape, permute, expand, slice, select, concat, split,
triu/tril): how each maps input dims to output dims, so a partition follows a tensor through
them. Registered beside `builtin`'s compute ops when `shardc.ops` is imported.
"""

from __future__ import annotations

from typing import Any

import torch

from shardc.ops.builtin import Types, aligned_space, dim_names, norm_dim
from shardc.ops.registry import IterationSpace, OpDef, register


def _reshape_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    """Group input and output dims into blocks of equal product; a block of one input dim and
    several output dims (or the reverse) becomes a composite `(a d)` whose major factor splits."""
    src, dst = list(i[0].shape), list(o[0].shape)
    in_dims: list[tuple[str, ...]] = []
    out_dims: list[tuple[str, ...]] = []
    sizes: list[tuple[str, int]] = []
    unsplittable: set[str] = set()
    si = di = 0
    counter = 0
    while si < len(src) or di < len(dst):
        if si < len(src) and src[si] == 1 and (di >= len(dst) or dst[di] != 1):
            in_dims.append(())
            si += 1
            continue
        if di < len(dst) and dst[di] == 1 and (si >= len(src) or src[si] != 1):
            out_dims.append(())
            di += 1
            continue
        s_block, d_block = [si], [di]
        ps, pd = src[si], dst[di]
        while ps != pd:
            if ps < pd:
                si += 1
                s_block.append(si)
                ps *= src[si]
            else:
                di += 1
                d_block.append(di)
                pd *= dst[di]
        si += 1
        di += 1
        if len(s_block) == 1:
            names = [f"r{counter + k}" for k in range(len(d_block))]
            sizes += [(n, dst[d]) for n, d in zip(names, d_block)]
            in_dims.append(tuple(names))
            out_dims += [(n,) for n in names]
        elif len(d_block) == 1:
            names = [f"r{counter + k}" for k in range(len(s_block))]
            sizes += [(n, src[s]) for n, s in zip(names, s_block)]
            in_dims += [(n,) for n in names]
            out_dims.append(tuple(names))
        else:  # a tangle of merges and splits: keep it whole
            names = [f"r{counter}"]
            sizes.append((names[0], ps))
            unsplittable.add(names[0])
            in_dims += [(names[0],) if k == 0 else () for k in range(len(s_block))]
            out_dims += [(names[0],) if k == 0 else () for k in range(len(d_block))]
        counter += len(names)
    return IterationSpace(tuple(sizes), (tuple(in_dims),), (tuple(out_dims),), frozenset(unsplittable))


register(OpDef("reshape", "view", _reshape_space, lambda x, shape: x.reshape(shape), flops=lambda i, o, a: 0))


def _permute_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    names = dim_names(i[0].rank)
    perm = [norm_dim(d, i[0].rank) for d in a["dims"]]
    return IterationSpace(tuple(zip(names, i[0].shape)), (tuple((n,) for n in names),),
                          (tuple((names[p],) for p in perm),))


register(OpDef("permute", "view", _permute_space, lambda x, dims: x.permute(dims), flops=lambda i, o, a: 0,
               doc="transpose(a, b) is a permute"))


def _expand_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    return aligned_space(i, o)


register(OpDef("expand", "view", _expand_space, lambda x, shape: x.expand(shape), flops=lambda i, o, a: 0))


def _slice_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    rank = i[0].rank
    d = norm_dim(a["dim"], rank)
    names = dim_names(rank)
    ins = tuple((n,) if k != d else (f"{n}in",) for k, n in enumerate(names))
    outs = tuple((n,) for n in names)
    sizes = tuple(zip(names, o[0].shape)) + ((f"{names[d]}in", i[0].shape[d]),)
    return IterationSpace(sizes, (ins,), (outs,), frozenset({names[d], f"{names[d]}in"}))


register(OpDef("slice", "view", _slice_space,
               lambda x, dim, start, end, step=1: x[(slice(None),) * norm_dim(dim, x.dim()) + (slice(start, end, step),)],
               flops=lambda i, o, a: 0, doc="x[start:end:step] along dim; that dim cannot be split"))


def _select_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    rank = i[0].rank
    d = norm_dim(a["dim"], rank)
    names = dim_names(rank)
    sizes = tuple(zip(names, i[0].shape))
    outs = tuple((n,) for k, n in enumerate(names) if k != d)
    return IterationSpace(sizes, (tuple((n,) for n in names),), (outs,), frozenset({names[d]}))


register(OpDef("select", "view", _select_space, lambda x, dim, index: x.select(dim, index), flops=lambda i, o, a: 0))


def _concat_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    space = aligned_space(i, o, fixed=(a["dim"],))
    return space


def _split_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    """Unequal pieces: the split dim cannot be split. Equal pieces: the input dim is `(piece d)`
    and `d` splits as a strided shard of the input (each device keeps its part of every piece:
    the q, k and v heads of a fused projection)."""
    d = norm_dim(a["dim"], i[0].rank)
    if len(o) > 1 and len({t.shape[d] for t in o}) == 1:
        space = aligned_space(o[:1], o[:1])
        ins = tuple((n,) if k != d else ("piece", n) for k, n in enumerate(space.dims))
        return IterationSpace(space.sizes + (("piece", len(o)),), (ins,), tuple(space.outputs[0] for _ in o),
                              frozenset({"piece"}))
    space = aligned_space(o[:1], o[:1], fixed=(a["dim"],))
    ins = tuple((n,) if k != d else ("whole",) for k, n in enumerate(space.dims))
    return IterationSpace(space.sizes + (("whole", i[0].shape[d]),), (ins,), tuple(space.outputs[0] for _ in o),
                          space.unsplittable | {"whole"})


register(OpDef("concat", "view", _concat_space, lambda *xs, dim: torch.cat(xs, dim), flops=lambda i, o, a: 0,
               doc="the concatenated dim cannot be split"))
register(OpDef("split", "view", _split_space, lambda x, sizes, dim: torch.split(x, list(sizes), dim),
               flops=lambda i, o, a: 0, num_outputs=lambda a: len(a["sizes"]),
               doc="pieces of `sizes` along dim; that dim splits only when the pieces are equal (strided)"))


def _position_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    return aligned_space(i, o, fixed=(-1, -2))


register(OpDef("triu", "elementwise", _position_space, lambda x, diagonal=0: torch.triu(x, diagonal),
               flops=lambda i, o, a: 0))
register(OpDef("tril", "elementwise", _position_space, lambda x, diagonal=0: torch.tril(x, diagonal),
               flops=lambda i, o, a: 0))
