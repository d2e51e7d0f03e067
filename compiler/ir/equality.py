"""Structural equality of graphs, reporting the first difference.

Two graphs are equal when they print the same, up to the order of keys in attribute and
annotation dicts: names, value kinds, types, layouts, attributes (floats compared exactly,
`1` differs from `1.0` and from `true`), partitions, layers and their annotations, graph attributes, node
layers, annotations, locations, wiring, outputs and the mesh. Lists and tuples print alike
and so compare alike. The first mismatch is named by its path, e.g.
`node 12 (%x12 = linear @blocks.0.mlp.fc1): output 0 type f32[2,8,64] != f32[2,8,32]`.
"""

from __future__ import annotations

from typing import Any

from shardc.ir import Graph, Node, Value
from shardc.ir.printer import format_attr, format_layer, format_location


def _attr_text(value: Any) -> str:
    try:
        return format_attr(value)
    except TypeError:
        return repr(value)


def _dict_difference(what: str, a: dict[str, Any], b: dict[str, Any]) -> str | None:
    for key in a:
        if key not in b:
            return f"{what} {key} only in the first graph ({key}={_attr_text(a[key])})"
    for key in b:
        if key not in a:
            return f"{what} {key} only in the second graph ({key}={_attr_text(b[key])})"
    for key in a:
        ta, tb = _attr_text(a[key]), _attr_text(b[key])
        if ta != tb:
            return f"{what} {key}: {ta} != {tb}"
    return None


def _value_difference(where: str, a: Value, b: Value) -> str | None:
    checks: list[tuple[str, Any, Any]] = [
        ("name", f"%{a.name}", f"%{b.name}"),
        ("kind", a.kind, b.kind),
        ("type", a.type, b.type),
        ("layout", a.layout, b.layout),
    ]
    if a.kind == "parameter" or b.kind == "parameter":
        checks.append(("requires_grad", a.requires_grad, b.requires_grad))
    for what, x, y in checks:
        if x != y:
            return f"{where} {what} {x} != {y}"
    return None


def _describe(node: Node) -> str:
    outs = ", ".join(f"%{v.name}" for v in node.outputs)
    head = f"{outs} = {node.op}" if outs else node.op
    return f"{head} {format_location(node.location)}".rstrip()


def _node_difference(a: Node, b: Node) -> str | None:
    if a.op != b.op:
        return f"op {a.op} != {b.op}"
    if len(a.outputs) != len(b.outputs):
        return f"{len(a.outputs)} outputs != {len(b.outputs)}"
    for i, (x, y) in enumerate(zip(a.outputs, b.outputs)):
        found = _value_difference(f"output {i}", x, y)
        if found:
            return found
    diff = _dict_difference("attribute", a.attrs, b.attrs)
    if diff:
        return diff
    if len(a.inputs) != len(b.inputs):
        return f"{len(a.inputs)} operands != {len(b.inputs)}"
    for i, (x, y) in enumerate(zip(a.inputs, b.inputs)):
        if x.name != y.name:
            return f"operand {i} %{x.name} != %{y.name}"
    if a.partition != b.partition:
        return f"partition {a.partition} != {b.partition}"
    if a.layer != b.layer:
        return f"layer {a.layer} != {b.layer}"
    diff = _dict_difference("annotation", a.annotations, b.annotations)
    if diff:
        return diff
    if a.location != b.location:
        return f"location {format_location(a.location)} != {format_location(b.location)}"
    return None


def first_difference(a: Graph, b: Graph) -> str | None:
    """The path to the first mismatch between `a` and `b`, or None when they are equal."""
    if a.name != b.name:
        return f"graph name @{a.name} != @{b.name}"
    if a.mesh != b.mesh:
        return f"mesh {a.mesh} != {b.mesh}"
    diff = _dict_difference("graph attribute", a.attrs, b.attrs)
    if diff:
        return diff
    for what, xs, ys in (("input", a.inputs, b.inputs), ("param", a.params, b.params),
                         ("buffer", a.buffers, b.buffers)):
        for i, (x, y) in enumerate(zip(xs, ys)):
            found = _value_difference(f"{what} {i} (%{x.name}):", x, y)
            if found:
                return found
        if len(xs) != len(ys):
            extra = (xs if len(xs) > len(ys) else ys)[min(len(xs), len(ys))]
            return f"{len(xs)} {what}s != {len(ys)} (first unmatched: %{extra.name})"
    layers_a, layers_b = list(a.layers.values()), list(b.layers.values())
    for i, (layer_a, layer_b) in enumerate(zip(layers_a, layers_b)):
        if format_layer(layer_a) != format_layer(layer_b):
            return f"layer {i}: {format_layer(layer_a)} != {format_layer(layer_b)}"
    if len(layers_a) != len(layers_b):
        return f"{len(layers_a)} layers != {len(layers_b)}"
    for i, (node_a, node_b) in enumerate(zip(a.nodes, b.nodes)):
        found = _node_difference(node_a, node_b)
        if found:
            return f"node {i} ({_describe(node_a)}): {found}"
    if len(a.nodes) != len(b.nodes):
        n = min(len(a.nodes), len(b.nodes))
        extra_node = (a.nodes if len(a.nodes) > n else b.nodes)[n]
        return f"{len(a.nodes)} nodes != {len(b.nodes)} (first unmatched: node {n} ({_describe(extra_node)}))"
    names_a, names_b = [v.name for v in a.outputs], [v.name for v in b.outputs]
    if names_a != names_b:
        return "outputs " + ", ".join(f"%{n}" for n in names_a) + " != " + ", ".join(f"%{n}" for n in names_b)
    return None


def graphs_equal(a: Graph, b: Graph) -> bool:
    """True when `first_difference(a, b)` finds nothing."""
    return first_difference(a, b) is None


def assert_graphs_equal(a: Graph, b: Graph) -> None:
    """Raise AssertionError naming the first difference (for tests)."""
    found = first_difference(a, b)
    if found is not None:
        raise AssertionError(f"graphs differ: {found}")
