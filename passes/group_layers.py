"""group-layers: find the repeated blocks of a model and file every node under a layer.

Rules:
- A layer is the set of nodes whose module path starts `P.i`, where `i` is the first integer
  component of the path and `P` the components before it (`blocks.3`, `transformer.h.3`,
  `model.layers.3`, `bert.encoder.layer.3`). The outermost index wins, so experts inside a
  block stay in the block. A model with no indexed path at all is one layer, `model`.
- A node with no such path goes to `embed` before the first layer and to `head` after the
  last. Between layers it joins the layer before it when it has no module path at all (the
  parent's loop body, `x = x + block(x)`) or when the layers on both sides are the same;
  otherwise its run of nodes becomes a layer named after the top module (or `between<k>`).
- Each layer gets a structural hash: its ops, attributes, output types, layouts and
  partitions, module paths relative to the layer, parameter shapes and names relative to the
  layer, and its wiring (operands as positions inside the layer, or as the k-th value from
  outside). Layers with equal hashes share a block class, `block0`, `block1`, ... in order of
  first appearance; `embed`, `head` and in-between layers are their own class.
- `graph.layers` is rebuilt in node order; annotations of layers that already existed are kept.
The graph is changed in place and returned.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from shardc.ir import Graph, Layer, Node, Value
from shardc.passmanager import Pass, PassContext, register_pass
from shardc.printer import format_attrs

_INDEX = re.compile(r"\d+")


def layer_of_path(module_path: str) -> str | None:
    """`transformer.h.3.attn.c_attn` -> `transformer.h.3`; None when no component is an index."""
    parts = module_path.split(".") if module_path else []
    for i, part in enumerate(parts):
        if _INDEX.fullmatch(part):
            return ".".join(parts[: i + 1])
    return None


def _relative(path: str, prefix: str) -> str:
    if path == prefix:
        return ""
    return path[len(prefix) + 1:] if path.startswith(prefix + ".") else path


def structural_hash(graph: Graph, layer: str, nodes: list[Node]) -> str:
    """A digest of everything that makes two layers copies of each other (see module docstring)."""
    position: dict[int, tuple[int, int]] = {}
    external: dict[int, int] = {}
    items: list[Any] = []

    def operand(v: Value) -> Any:
        if id(v) in position:
            return ("local", *position[id(v)])
        if v.kind in ("parameter", "buffer"):
            return (v.kind, _relative(v.name, layer), str(v.type), str(v.layout), v.requires_grad)
        return ("outside", external.setdefault(id(v), len(external)), str(v.type), str(v.layout))

    for k, node in enumerate(nodes):
        try:
            attrs = format_attrs(node.attrs)
        except TypeError:
            attrs = repr(sorted(node.attrs.items()))
        items.append((
            node.op, attrs, tuple(operand(v) for v in node.inputs),
            tuple((str(v.type), str(v.layout)) for v in node.outputs),
            str(node.partition), _relative(node.location.module_path, layer),
        ))
        for i, v in enumerate(node.outputs):
            position[id(v)] = (k, i)
    return hashlib.sha256(repr(items).encode()).hexdigest()


def assign_layers(graph: Graph) -> list[str]:
    """The layer name of every node, in graph order (rules in the module docstring)."""
    named = [layer_of_path(n.location.module_path) for n in graph.nodes]
    if not any(named):
        return ["model"] * len(named)
    before: list[str | None] = []
    running: str | None = None
    for name in named:
        before.append(running)
        running = name or running
    after: list[str | None] = [None] * len(named)
    running = None
    for i in range(len(named) - 1, -1, -1):
        after[i] = running
        running = named[i] or running
    taken_by_paths = set(filter(None, named))
    taken = taken_by_paths | {"embed", "head"}
    result: list[str] = []
    for i, name in enumerate(named):
        prev, nxt = before[i], after[i]
        if name is not None:
            result.append(name)
        elif prev is None:
            result.append("embed")
        elif nxt is None:
            result.append("head")
        elif prev == nxt or not graph.nodes[i].location.module_path:
            result.append(prev)  # inside a layer, or the parent's loop body right after one
        elif named[i - 1] is None and result[-1] not in taken_by_paths:  # continues a run between layers
            result.append(result[-1])
        else:
            top = graph.nodes[i].location.module_path.split(".")[0]
            run = top if top and top not in taken else f"between{len(taken)}"
            taken.add(run)
            result.append(run)
    return result


def group_layers(graph: Graph) -> Graph:
    """Set `node.layer` on every node and rebuild `graph.layers` with block classes."""
    names = assign_layers(graph)
    members: dict[str, list[Node]] = {}
    for node, name in zip(graph.nodes, names):
        node.layer = name
        members.setdefault(name, []).append(node)
    repeated = {layer_of_path(n.location.module_path) for n in graph.nodes} - {None}
    classes: dict[str, str] = {}
    layers: dict[str, Layer] = {}
    for name, nodes in members.items():
        if name in repeated:
            digest = structural_hash(graph, name, nodes)
            block = classes.setdefault(digest, f"block{len(classes)}")
        else:
            block = name
        old = graph.layers.get(name)
        layers[name] = Layer(name, block, old.annotation) if old is not None else Layer(name, block)
    graph.layers = layers
    return graph


@register_pass
@dataclass(frozen=True)
class GroupLayers(Pass):
    """`group-layers`: see the module docstring."""

    name: ClassVar[str] = "group-layers"

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        return group_layers(graph)
