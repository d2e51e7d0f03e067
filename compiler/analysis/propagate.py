"""Layout propagation helpers: the layouts a node needs and makes, and following a layout.

- `io_layouts(node, mesh)`: the input layouts a node needs and the output layouts it produces
  under its partition (the registry's rule, `registry.node_layouts`); a node without a
  partition is replicated; a collective keeps the layouts its values carry.
- `follow(...)`: the iteration dim (and stride) that makes a node take an input in the layout
  it already has on one mesh axis, so propagation moves no data.
- `requires_grad(graph)`: trainable parameters and every float value computed from one.
- `dims_by_position` / `carry_partition`: one node's partition carried to the same node
  traced at another batch, its dims matched by operand position, not by name, its strides
  counted on the new sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from shardc.ir import Graph, Layout, Mesh, Node, Partition, Placement, Shard, Value
from shardc.ops.registry import IterationSpace, get_op, node_layouts, operand_layout


def iteration_space(node: Node) -> IterationSpace:
    """The node's iteration space from the registry, bound to its operand types."""
    return get_op(node.op).iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs], node.attrs)


def io_layouts(node: Node, mesh: Mesh) -> tuple[list[Layout], list[Layout]]:
    """Input layouts `node` needs and output layouts it produces (see the module docstring)."""
    op = get_op(node.op)
    if op.kind == "collective":
        return [v.layout or Layout() for v in node.inputs], [v.layout or Layout() for v in node.outputs]
    if node.partition is None or not (node.partition.spatial or node.partition.temporal):
        return [Layout() for _ in node.inputs], [Layout() for _ in node.outputs]
    return node_layouts(iteration_space(node), node.partition, mesh)


def requires_grad(graph: Graph) -> dict[Value, bool]:
    """Value -> whether it carries a gradient (trainable parameters and float values read off one)."""
    out = {p: p.requires_grad for p in graph.params}
    for node in graph.nodes:
        flag = any(out.get(v, False) for v in node.inputs)
        for v in node.outputs:
            out[v] = flag and v.type.is_float
    return out


def follow(space: IterationSpace, operand: int, placement: Placement, axis: str, outer: Partition,
           mesh: Mesh, allowed: Callable[[str], bool] | None = None) -> tuple[str, int] | None:
    """(iteration dim, stride) such that a node split that way along `axis` (after the outer
    axes already in `outer`) needs input `operand` with exactly `placement` on `axis`; None if
    no split does. Only Shard placements can be followed; `allowed` filters the dims. Of several
    such splits (a shard of a flattened `(batch seq)` dim may read as either factor when the
    outer axes leave one batch row), the first whose dim the axes divide evenly wins."""
    if not isinstance(placement, Shard) or placement.dim >= len(space.inputs[operand]):
        return None
    factors = space.inputs[operand][placement.dim]
    strides = [k for k in range(1, placement.interleave + 1) if placement.interleave % k == 0]
    found: list[tuple[str, int]] = []
    for dim in factors:
        if allowed is not None and not allowed(dim):
            continue
        for stride in strides:
            trial = Partition(outer.spatial + ((axis, dim),), (),
                              outer.strides + (((axis, stride),) if stride > 1 else ()))
            try:
                got = operand_layout(space.inputs[operand], trial, space, mesh, False)
            except ValueError:
                continue
            if got.on(axis) == placement:
                found.append((dim, stride))
    even = [(d, k) for d, k in found if space.size(d) % (k * math.prod(
        mesh.axis_size(a) for a, e in outer.spatial + ((axis, d),) if e == d)) == 0]
    best = even or found
    return best[0] if best else None


def derives_from_input(graph: Graph, value: Value) -> bool:
    """Whether `value` is a graph input or computed from one only through views and casts."""
    inputs = set(graph.inputs)
    seen = value
    while seen not in inputs:
        node = seen.producer
        if node is None or get_op(node.op).kind not in ("view", "elementwise") or not node.inputs:
            return False
        seen = node.inputs[0]
    return True


def dims_by_position(src: IterationSpace, dst: IterationSpace) -> dict[str, str | None]:
    """Each iteration dim of `src` -> the dim of `dst` at the same operand positions, for one
    node traced at two batches: dim names are positional and a batch of one is bound as a
    broadcast dim (no name), so the names shift (`[1,16,128] -> [16,128]` names the sequence
    `r0` where `[4,16,128] -> [64,128]` names it `r1`; a mask broadcast over a batch of four is
    bound to the batch dim of one). Dims of `src` that `dst` folds into a broadcast map to None.
    Raises ValueError when the operands do not line up."""
    src_ops, dst_ops = src.inputs + src.outputs, dst.inputs + dst.outputs
    if len(src_ops) != len(dst_ops) or any(len(a) != len(b) for a, b in zip(src_ops, dst_ops)):
        raise ValueError("the operands have different ranks")
    folded = {f for a, b in zip(src_ops, dst_ops) for fa, fb in zip(a, b) if not fb for f in fa}
    out: dict[str, str | None] = dict.fromkeys(folded)
    for a, b in zip(src_ops, dst_ops):
        for fa, fb in zip(a, b):
            if not fa and all(dst.size(g) == 1 for g in fb):
                continue  # broadcast in `src`, bound to a dim of size 1 in `dst`
            kept = [f for f in fa if f not in folded]
            if len(kept) != len(fb):
                raise ValueError(f"dims {fa} and {fb} at the same position do not line up")
            for f, g in zip(kept, fb):
                if out.setdefault(f, g) != g:
                    raise ValueError(f"dim {f} lines up with both {out[f]} and {g}")
    return out


def carry_partition(partition: Partition, src: IterationSpace, dst: IterationSpace) -> Partition:
    """`partition` of a node with iteration space `src` carried to the same node traced at
    another batch (`dst`): its dims renamed by position (`dims_by_position`; a dim it splits
    that has no counterpart is a ValueError naming it), and each strided split's stride taken to
    `dst`'s sizes: a stride counts the blocks of its dim, and on a dim the batch folds into
    (`[b, s, v] -> [b*s, v]`, the batch outermost) the blocks are the sequences, so a micro-batch
    of 2 of a graph traced at 8 cuts `d0/8` as `d0/2` (one sequence: a plain split). A stride is
    kept where the dim's size did not change; one the new size does not divide is a ValueError."""
    dims = dims_by_position(src, dst)

    def rename(d: str) -> str:
        new = dims.get(d)
        if new is None:
            raise ValueError(f"dim {d!r} has no counterpart (a broadcast of size 1)")
        return new

    strides = []
    for axis, stride in partition.strides:
        dim = next(d for a, d in partition.spatial if a == axis)
        before, after = src.size(dim), dst.size(rename(dim))
        if before != after:
            if (stride * after) % before:
                raise ValueError(f"the split {axis}:{dim}/{stride} of {before} does not carry to {after}")
            stride = stride * after // before
        if stride > 1:
            strides.append((axis, stride))
    return Partition(tuple((a, rename(d)) for a, d in partition.spatial),
                     tuple(replace(t, dim=rename(t.dim)) for t in partition.temporal),
                     tuple(strides), partition.zigzag)
