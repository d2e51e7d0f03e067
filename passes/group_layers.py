"""group-layers: find the repeated blocks of a model and file every node under a layer.

Rules:
- A layer is the set of nodes whose module path starts `P.i`, where `i` is the first integer
  component of the path and `P` the components before it (`blocks.3`, `transformer.h.3`,
  `model.layers.3`, `bert.encoder.layer.3`). The outermost index wins, so experts inside a
  block stay in the block. A model with no indexed path at all is one layer, `model`.
- A run of nodes with no such path goes to `embed` before the first layer and to `head` after
  the last. Between two layers of the same container (`blocks.2`, `blocks.3`) it joins the
  layer before it: it is the container's loop body (`x = drop(relu(layer(x)))` in the parent's
  forward) or code inside one layer. When every such run of a container is the same, the same
  nodes right after its last layer join that layer too, so all its layers look alike. Any
  other run between layers becomes a layer named after the first top module in it (or
  `between<k>`).
- Nodes inside a layer's span that come from no indexed module and read nothing the layer
  computed (a mask that torch.export materialised lazily) first move to just before the layer.
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
from shardc.ir.printer import format_attrs
from shardc.passmanager import Pass, PassContext, register_pass

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
    position: dict[Value, tuple[int, int]] = {}
    external: dict[Value, int] = {}
    items: list[Any] = []

    def operand(v: Value) -> Any:
        if v in position:
            return ("local", *position[v])
        if v.kind in ("parameter", "buffer"):
            return (v.kind, _relative(v.name, layer), str(v.type), str(v.layout), v.requires_grad)
        return ("outside", external.setdefault(v, len(external)), str(v.type), str(v.layout))

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
            position[v] = (k, i)
    return hashlib.sha256(repr(items).encode()).hexdigest()


def _container(layer: str) -> str:
    return layer.rsplit(".", 1)[0] if "." in layer else ""


def _run_signature(graph: Graph, start: int, end: int) -> tuple[Any, ...]:
    sig = []
    for node in graph.nodes[start:end]:
        try:
            attrs = format_attrs(node.attrs)
        except TypeError:
            attrs = repr(sorted(node.attrs.items()))
        sig.append((node.op, attrs, node.location.module_path, tuple(str(v.type) for v in node.outputs)))
    return tuple(sig)


def assign_layers(graph: Graph) -> list[str]:
    """The layer name of every node, in graph order (rules in the module docstring)."""
    named = [layer_of_path(n.location.module_path) for n in graph.nodes]
    if not any(named):
        return ["model"] * len(named)
    # Runs of nodes without an indexed path: (start, end, layer before, layer after).
    runs: list[tuple[int, int, str | None, str | None]] = []
    i = 0
    while i < len(named):
        if named[i] is not None:
            i += 1
            continue
        j = i
        while j < len(named) and named[j] is None:
            j += 1
        runs.append((i, j, named[i - 1] if i > 0 else None, named[j] if j < len(named) else None))
        i = j
    # The loop body of a container: what runs between two of its layers, when always the same.
    bodies: dict[str, set[tuple[Any, ...]]] = {}
    for start, end, prev, nxt in runs:
        if prev is not None and nxt is not None and _container(prev) == _container(nxt) and prev != nxt:
            bodies.setdefault(_container(prev), set()).add(_run_signature(graph, start, end))
    result: list[str] = [name or "" for name in named]
    taken = set(filter(None, named)) | {"embed", "head"}
    between = 0
    for start, end, prev, nxt in runs:
        if prev is None:
            result[start:end] = ["embed"] * (end - start)
            continue
        if nxt is not None and _container(prev) == _container(nxt):
            result[start:end] = [prev] * (end - start)  # inside a layer, or its container's loop body
            continue
        body = bodies.get(_container(prev), set())
        if len(body) == 1:  # the last layer of a container keeps its loop-body tail too
            tail = len(next(iter(body)))
            if end - start >= tail and _run_signature(graph, start, start + tail) in body:
                result[start:start + tail] = [prev] * tail
                start += tail
        if start == end:
            continue
        if nxt is None:
            name = "head"
        else:
            tops = [n.location.module_path.split(".")[0] for n in graph.nodes[start:end]]
            name = next((t for t in tops if t and t not in taken), "")
            while not name or name in taken:
                name, between = f"between{between}", between + 1
            taken.add(name)
        result[start:end] = [name] * (end - start)
    return result


def hoist_foreign_nodes(graph: Graph) -> None:
    """Move nodes that sit inside a layer's span but neither come from an indexed module nor
    read anything the layer computed to just before the layer (order among them kept)."""
    named = [layer_of_path(n.location.module_path) for n in graph.nodes]
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, name in enumerate(named):
        if name is not None:
            first.setdefault(name, i)
            last[name] = i
    moves: dict[int, list[Node]] = {}  # index of a layer's first node -> nodes to put before it
    moved: set[int] = set()
    depends: set[Value] = set()  # values computed from the current layer
    current: str | None = None
    for i, (node, name) in enumerate(zip(graph.nodes, named)):
        if name is not None:
            if name != current:
                current, depends = name, set()
            depends.update(node.outputs)
            continue
        inside = current is not None and i < last[current]
        if inside and not any(v in depends for v in node.inputs):
            moves.setdefault(first[current], []).append(node)  # type: ignore[index]
            moved.add(i)
        else:
            depends.update(node.outputs)
    if not moved:
        return
    nodes: list[Node] = []
    for i, node in enumerate(graph.nodes):
        nodes.extend(moves.get(i, []))
        if i not in moved:
            nodes.append(node)
    graph.nodes = nodes


def group_layers(graph: Graph) -> Graph:
    """Set `node.layer` on every node and rebuild `graph.layers` with block classes."""
    hoist_foreign_nodes(graph)
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
