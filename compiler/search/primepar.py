"""PrimePar's 2-D primitive P(q x q) as candidate partitions of a contraction.

Rule: on a mesh with the two model axes tp and tq of equal power-of-two size q, a contraction
whose first operand I has a row dim M (not in the second operand W, a 2-d weight), whose W has a
column dim N (not in I) and which reduces k (the major factor of a tensor dim of both, divisible
by q) gets `partition<tp:M, tq:N; time k/q rotate (tp, tq)>` and the transposed orientation
`partition<tp:N, tq:M; time k/q rotate (tq, tp)>`, on top of every assignment of the other
axes (dp, cp). The grid axis splitting M comes first in `rotate (a, b)`; I is sharded (M, k) and
W (k, N) over the grid, I moves along b and W along a each step (`shardc.cost.grid2d`).
"""

from __future__ import annotations

import itertools

from shardc.ir import Axis, Mesh, TemporalSplit
from shardc.ops.registry import IterationSpace

GRID_AXES = (Axis.TP, Axis.TQ)
Spatial = tuple[tuple[str, str], ...]


def without_axes(mesh: Mesh, axes: tuple[str, ...]) -> Mesh:
    """`mesh` less the named axes."""
    return Mesh(tuple((a, s) for a, s in mesh.axes if a not in axes))


def _has(operand: tuple[tuple[str, ...], ...], dim: str) -> bool:
    return any(dim in f for f in operand)


def _major(operand: tuple[tuple[str, ...], ...], dim: str) -> bool:
    return any(f and f[0] == dim for f in operand)


def _divisible(spatial: Spatial, mesh: Mesh, sizes: dict[str, int]) -> bool:
    per_dim: dict[str, int] = {}
    for axis, dim in spatial:
        per_dim[dim] = per_dim.get(dim, 1) * mesh.axis_size(axis)
    return all(sizes[d] % k == 0 for d, k in per_dim.items())


def grid_partitions(space: IterationSpace, mesh: Mesh, spatials: list[Spatial], sizes: dict[str, int]
                    ) -> list[tuple[Spatial, TemporalSplit]]:
    """(spatial split, grid split) pairs of the module rule; `spatials` are the assignments of
    the other mesh axes, `sizes` the iteration dims' sizes as priced."""
    if not all(a in mesh.names for a in GRID_AXES) or len(space.inputs) < 2 or len(space.inputs[1]) != 2:
        return []  # the second operand is a 2-d weight (what the torch backend's grid runs)
    q = mesh.axis_size(Axis.TP)
    if q != mesh.axis_size(Axis.TQ) or q < 2 or q & (q - 1):
        return []
    i_op, w_op = space.inputs[0], space.inputs[1]
    free = [d for d in space.dims if d not in space.unsplittable and d not in dict(space.special)]
    reductions = [k for k in space.reductions if k in free and _major(i_op, k) and _major(w_op, k) and sizes[k] % q == 0]
    parallel = set(space.parallel)
    rows = [m for m in free if m in parallel and _has(i_op, m) and not _has(w_op, m)]
    cols = [n for n in free if n in parallel and _has(w_op, n) and not _has(i_op, n)]
    out = []
    for base in spatials:
        if any(a in GRID_AXES for a, _ in base):
            continue
        for (a, b), k, m, n in itertools.product((GRID_AXES, GRID_AXES[::-1]), reductions, rows, cols):
            spatial = tuple(sorted(base + ((a, m), (b, n)), key=lambda p: mesh.names.index(p[0])))
            if _divisible(spatial, mesh, sizes):
                out.append((spatial, TemporalSplit(k, q, a, b)))
    return out
