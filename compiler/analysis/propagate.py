"""Layout propagation helpers: the layouts a node needs and makes, and following a layout.

- `io_layouts(node, mesh)`: the input layouts a node needs and the output layouts it produces
  under its partition (the registry's rule, `registry.node_layouts`); a node without a
  partition is replicated; a collective keeps the layouts its values carry.
- `follow(...)`: the iteration dim (and stride) that makes a node take an input in the layout
  it already has on one mesh axis, so propagation moves no data.
- `requires_grad(graph)`: trainable parameters and every float value computed from one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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
