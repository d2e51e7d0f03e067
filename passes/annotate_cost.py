"""annotate-cost: per node, the FLOPs, bytes moved, activation bytes saved for backward and
parameter bytes it brings in, written to `node.annotations` (the IR changes in place).

Rules:
- Sizes are per device: in a graph with a mesh each operand counts at its local shard shape,
  from the layouts the node's partition implies (or the values' own layouts when it has none).
- `flops` is the registry's forward count; `bytes` what a plain kernel reads and writes.
- `saved_bytes` follows `OpDef.saved_for_backward`. A tensor saved by several nodes counts
  once, at the first. Views alias their source exactly where torch makes a view
  (`shardc.analysis.aliasing`: the graph is run on meta tensors): a saved view costs its own
  size, and all the saved aliases of one storage together never cost more than that storage.
  Parameters and buffers, and views of them, are not activations and cost nothing here.
- `param_bytes` (and `params`, the element count) go to the first node that reads a
  parameter, so tied weights count once.
- The `dtype` option counts float tensors at that element size (`annotate-cost{dtype=bf16}`
  for mixed precision); by default every tensor counts at its own dtype. Parameter bytes are
  always at the parameter's own dtype.

`cost_table(graph)` sums the same figures per layer for `shardc inspect`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shardc.analysis.aliasing import aliasing
from shardc.ir import DTYPE_BYTES, Graph, Layout, Mesh, Node, TensorType, Value
from shardc.ops.registry import CostRow, OpDef, get_op, has_op, node_layouts
from shardc.ops.verifier import layouts_agree
from shardc.passmanager import Pass, PassContext, register_pass

COST_KEYS = ("flops", "bytes", "saved_bytes", "param_bytes", "params")


def _bytes(t: TensorType, dtype: str | None) -> int:
    if dtype is not None and t.is_float:
        return t.numel * DTYPE_BYTES[dtype]
    return t.nbytes


def _local(t: TensorType, layout: Layout | None, mesh: Mesh | None) -> TensorType:
    if mesh is None or layout is None:
        return t
    return TensorType(layout.local_shape(t.shape, mesh), t.dtype)


def node_local_layouts(node: Node, op: OpDef, mesh: Mesh | None) -> tuple[list[Layout | None], list[Layout | None]]:
    """The layouts a node computes on: its partition's, else its values' own."""
    ins: list[Layout | None] = [v.layout for v in node.inputs]
    outs: list[Layout | None] = [v.layout for v in node.outputs]
    if mesh is not None and node.partition is not None:
        try:
            space = op.iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs], node.attrs)
            want_in, want_out = node_layouts(space, node.partition, mesh)
            ins = list(want_in) + ins[len(want_in):]
            outs = list(want_out) + outs[len(want_out):]
        except (ValueError, KeyError, IndexError):
            pass  # the verifier explains a partition that does not fit; cost the value layouts
    return ins, outs


def node_costs(graph: Graph, dtype: str | None = None) -> list[CostRow]:
    """One `CostRow` per node, in graph order (`extra["params"]` is the parameter count)."""
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    mesh = graph.mesh
    storage = aliasing(graph)
    seen_params: set[Value] = set()
    saved_values: set[tuple[Value, str]] = set()
    charged: dict[Any, int] = {}  # storage key -> bytes charged so far
    rows = []
    for node in graph.nodes:
        if not has_op(node.op):
            rows.append(CostRow(extra={"params": 0.0}))
            continue
        op = get_op(node.op)
        in_layouts, out_layouts = node_local_layouts(node, op, mesh)
        in_local = [_local(v.type, lay, mesh) for v, lay in zip(node.inputs, in_layouts)]
        out_local = [_local(v.type, lay, mesh) for v, lay in zip(node.outputs, out_layouts)]
        flops = op.count_flops(in_local, out_local, node.attrs)
        as_dtype = [TensorType(t.shape, dtype) if dtype and t.is_float else t for t in (*in_local, *out_local)]
        moved = op.count_bytes(as_dtype[: len(in_local)], as_dtype[len(in_local):], node.attrs)
        saved = 0
        for where, index in op.saved_for_backward(in_local, out_local, node.attrs):
            if where == "bytes":
                saved += index
                continue
            value, local, layout = ((node.inputs[index], in_local[index], in_layouts[index]) if where == "in"
                                    else (node.outputs[index], out_local[index], out_layouts[index]))
            root = storage.root(value)
            if root.kind in ("parameter", "buffer"):
                continue
            resharded = not layouts_agree(layout, value.layout)
            key = (value, str(layout) if resharded else "")
            if key in saved_values:
                continue
            saved_values.add(key)
            size = _bytes(local, dtype)
            owner: Any
            if resharded:  # the node works on a resharded copy: storage of its own
                owner, cap = key, size
            else:
                owner, cap = root, _bytes(_local(root.type, root.layout, mesh), dtype)
            before = charged.get(owner, 0)
            charged[owner] = min(cap, before + min(size, cap))
            saved += charged[owner] - before
        param_bytes = params = 0
        for v in node.inputs:
            if v.kind == "parameter" and v not in seen_params:
                seen_params.add(v)
                local = _local(v.type, v.layout, mesh)
                param_bytes += local.nbytes
                params += local.numel
        rows.append(CostRow(int(flops), int(moved), int(saved), param_bytes, {"params": float(params)}))
    return rows


def annotate_cost(graph: Graph, dtype: str | None = None) -> Graph:
    """Write `flops`, `bytes`, `saved_bytes`, `param_bytes` and `params` into every node's annotations."""
    for node, row in zip(graph.nodes, node_costs(graph, dtype)):
        node.annotations.update(flops=row.flops, bytes=row.bytes, saved_bytes=row.saved_bytes,
                                param_bytes=row.param_bytes, params=int(row.extra["params"]))
    return graph


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One row of `shardc inspect`'s table: a layer's nodes, parameters, FLOPs and saved bytes."""

    layer: str
    block: str
    nodes: int = 0
    params: int = 0
    param_bytes: int = 0
    flops: int = 0
    bytes: int = 0
    saved_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "block": self.block, "nodes": self.nodes, "params": self.params,
                "param_bytes": self.param_bytes, "flops": self.flops, "bytes": self.bytes,
                "saved_bytes": self.saved_bytes}


UNGROUPED = "(ungrouped)"


def cost_table(graph: Graph, dtype: str | None = None) -> list[LayerCost]:
    """Per layer (in order of first appearance; nodes without a layer form `(ungrouped)`):
    node count, parameters, FLOPs, bytes moved and saved activation bytes."""
    totals: dict[str, list[int]] = {}
    for node, row in zip(graph.nodes, node_costs(graph, dtype)):
        acc = totals.setdefault(node.layer if node.layer is not None else UNGROUPED, [0] * 6)
        for i, x in enumerate((1, int(row.extra["params"]), row.param_bytes, row.flops, row.bytes, row.saved_bytes)):
            acc[i] += x
    rows = []
    for name, acc in totals.items():
        layer = graph.layers.get(name)
        rows.append(LayerCost(name, layer.block if layer is not None else "-", *acc))
    return rows


@register_pass
@dataclass(frozen=True)
class AnnotateCost(Pass):
    """`annotate-cost{dtype=bf16}`: see the module docstring."""

    name: ClassVar[str] = "annotate-cost"
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        return annotate_cost(graph, self.dtype)
