"""The textual form of the IR. `shardc.ir.parser.parse(print_graph(g))` gives back an equal graph.

    graph @gpt mesh<dp=2, tp=4> [microbatches=4] {
      input %idx : i64[8,1024]{dp:S(0)}
      param %blocks.0.mlp.fc1.weight : f32[3072,768]{tp:S(0)}
      buffer %mask : bool[1,1,1024,1024]
      layer blocks.0 block=block stage=0 recompute=none zero=0
      %x3 = linear(%x2, %blocks.0.mlp.fc1.weight) : f32[8,1024,3072]{dp:S(0), tp:S(2)} partition<dp:e0, tp:n> layer=blocks.0 @blocks.0.mlp.fc1 "gpt.py:57"
      %x4, %x5 = split[sizes=(768, 768), dim=2](%x3) : f32[8,1024,768], f32[8,1024,768] @blocks.0.attn
      return %x9
    }

Layouts print after a type only when set (`S(2/3)`: a shard interleaved in 3 blocks; `S(1, zigzag)`: see `Shard`);
`ann[...]` holds analysis results (annotate-cost); graph attributes follow the mesh.
Names made only of letters, digits, `_`, `.` and `-` print bare; any other name prints as a
JSON string (`%"onnx::MatMul_7"`). A node without outputs prints without `%... =` and types.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from shardc.ir import Graph, Layer, Location, Node, Value

_BARE_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def format_name(name: str) -> str:
    """A value, layer, block or graph name: bare when simple, else a JSON string."""
    return name if _BARE_NAME.fullmatch(name) else json.dumps(name)


def format_location(location: Location) -> str:
    """`@module.path "source"`; the source is a JSON string so quotes inside it survive."""
    text = f"@{location.module_path}"
    return text + (f" {json.dumps(location.source)}" if location.source else "")


def format_attr(value: Any) -> str:
    """Attribute values: ints, floats, bools, none, strings and tuples of those."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        text = repr(value)
        return text if any(c in text for c in ".e") else text + ".0"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple | list):
        inner = ", ".join(format_attr(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    raise TypeError(f"attribute value {value!r} of type {type(value).__name__} has no textual form")


def format_attrs(attrs: dict[str, Any]) -> str:
    if not attrs:
        return ""
    return "[" + ", ".join(f"{k}={format_attr(v)}" for k, v in attrs.items()) + "]"


def format_typed(value: Value) -> str:
    text = str(value.type)
    if value.layout is not None:
        text += str(value.layout)
    return text


def format_layer(layer: Layer) -> str:
    a = layer.annotation
    stage = "none" if a.stage is None else str(a.stage)
    return (f"layer {format_name(layer.name)} block={format_name(layer.block)} stage={stage} "
            f"recompute={a.recompute} zero={a.zero}")


def format_node(node: Node) -> str:
    outs = ", ".join(f"%{format_name(v.name)}" for v in node.outputs)
    ins = ", ".join(f"%{format_name(v.name)}" for v in node.inputs)
    text = f"{node.op}{format_attrs(node.attrs)}({ins})"
    if node.outputs:
        text = f"{outs} = {text} : " + ", ".join(format_typed(v) for v in node.outputs)
    if node.partition is not None:
        text += f" {node.partition}"
    if node.layer is not None:
        text += f" layer={format_name(node.layer)}"
    if node.annotations:
        text += " ann" + format_attrs(node.annotations)
    text += f" {format_location(node.location)}"
    return text


def print_graph(graph: Graph) -> str:
    """The whole graph as text, one declaration or node per line."""
    header = f"graph @{format_name(graph.name)}" + (f" {graph.mesh}" if graph.mesh is not None else "")
    header += (" " + format_attrs(graph.attrs) if graph.attrs else "") + " {"
    lines = [header]
    for kind, values in (("input", graph.inputs), ("param", graph.params), ("buffer", graph.buffers)):
        for v in values:
            frozen = " frozen" if kind == "param" and not v.requires_grad else ""
            lines.append(f"  {kind}{frozen} %{format_name(v.name)} : {format_typed(v)}")
    for layer in graph.layers.values():
        lines.append("  " + format_layer(layer))
    for node in graph.nodes:
        lines.append("  " + format_node(node))
    lines.append(("  return " + ", ".join(f"%{format_name(v.name)}" for v in graph.outputs)).rstrip())
    lines.append("}")
    return "\n".join(lines) + "\n"
