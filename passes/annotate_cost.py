"""annotate-cost: per node, the FLOPs, bytes moved, activation bytes saved for backward and
parameter bytes the analytical model (`shardc.cost`) charges it, written to `node.annotations`
(the IR changes in place), so that what `shardc inspect` shows is what `shardc estimate` prices.

Rules: the figures come from the cost model's own functions, at the traced batch.
- Local shapes: `shardc.cost.compute.localize` (the node's partition on the graph's mesh, the
  registry's layouts; a node without a partition works on whole tensors), each step of a
  rotating split on `grid2d.step_types`'s pieces.
- `flops` and `bytes`: the forward of `node_compute_time` (the registry's FLOP formula on local
  shapes; what the kernel reads and writes, nothing for a view, a copy for a view PyTorch
  cannot make), repeated per rotation step and scaled to the slowest rank of a causal ring
  (`rotation_steps`, `causal_ring_cost`); a dropout that drops nothing costs nothing.
- `saved_bytes`: the op's `saved_bytes_of` entries; a view counts as the storage it aliases
  (`shardc.analysis.aliasing`) at that storage's own layout, each storage once per layer, at
  the first node of the layer that saves it, as `cost.layer.layer_terms` charges it.
  Parameters and buffers, and views of them, are not activations and cost nothing here.
- `param_bytes` (and `params`, the element count) go to the first node that reads a
  parameter, so tied weights count once: its local shard at its own dtype.
- The `dtype` option counts float tensors at that element size (`annotate-cost{dtype=bf16}`,
  as the model does at a plan's compute dtype); by default every tensor counts at its own dtype.
- The device's rules apply as the model applies them: `ctx.cluster`'s device when set (a
  calibrated local CPU charges views no bytes), else a roofline H100 (FLOPs and bytes only).

The cost model does not read these annotations back: it prices a plan at its compute dtype and
micro-batch (`shardc.analysis.dims.batch_scale`), and the solver prices candidates the IR does
not hold (`CostContext.with_overlay`), so it calls the same functions on what it prices.
`cost_table(graph)` sums the annotations per layer for `shardc inspect`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shardc.analysis.aliasing import aliasing
from shardc.cost.compute import (
    NodeCost,
    local_type,
    localize,
    node_compute_time,
    saved_bytes_of,
)
from shardc.cost.grid2d import step_types
from shardc.cost.ring import as_run
from shardc.hardware import DeviceSpec, parse_cluster
from shardc.ir import DTYPE_BYTES, Graph, Layout, Node, TensorType, Value
from shardc.ops.registry import CostRow, get_op, has_op
from shardc.passmanager import Pass, PassContext, register_pass

COST_KEYS = ("flops", "bytes", "saved_bytes", "param_bytes", "params")
ROOFLINE_DEVICE = "1xH100"  # the device whose rules apply without a cluster (FLOPs and bytes only)
_NO_LAYOUT = Layout()


def _own_dtype(types: tuple[TensorType, ...], values: list[Value], dtype: str | None) -> tuple[TensorType, ...]:
    """Local types at `dtype` (localize's), or at each value's own dtype when None."""
    if dtype is not None:
        return types
    return tuple(TensorType(t.shape, v.type.dtype) for t, v in zip(types, values))


def forward_cost(node: Node, graph: Graph, device: DeviceSpec, dtype: str | None, copies: bool) -> tuple[
        NodeCost, tuple[TensorType, ...], tuple[TensorType, ...]]:
    """The forward the cost model charges `node` (see the module rules), with its local input
    and output types."""
    compute = dtype or "f32"
    try:
        local = localize(node, graph.mesh, compute)
    except (ValueError, KeyError, IndexError):  # the verifier explains a partition that does not fit
        local = localize(node, graph.mesh, compute, None)
    ins = _own_dtype(local.in_types, node.inputs, dtype)
    outs = _own_dtype(local.out_types, node.outputs, dtype)
    part = node.partition if local.space is not None else None
    cost = node_compute_time(local.op, step_types(local.space, part, ins), outs, node.attrs,
                             device, compute, needs_grad=[False] * len(ins), copies=copies)
    cost = as_run(cost, node, part)
    return cost, ins, outs


def node_costs(graph: Graph, dtype: str | None = None, device: DeviceSpec | None = None) -> list[CostRow]:
    """One `CostRow` per node, in graph order (`extra["params"]` is the parameter count), on
    `device` (a roofline H100 when None)."""
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    device = device or parse_cluster(ROOFLINE_DEVICE).device
    mesh = graph.mesh
    storage = aliasing(graph)
    copies = set(storage.copies)
    seen_params: set[Value] = set()
    saved_storages: set[tuple[str | None, Value]] = set()  # (layer, storage) charged
    rows = []
    for node in graph.nodes:
        if not has_op(node.op):
            rows.append(CostRow(extra={"params": 0.0}))
            continue
        cost, ins, outs = forward_cost(node, graph, device, dtype, node in copies)
        saved = 0.0
        for where, index, nbytes in saved_bytes_of(get_op(node.op), ins, outs, node.attrs):
            if where == "bytes":
                saved += nbytes
                continue
            root = storage.root(node.inputs[index] if where == "in" else node.outputs[index])
            if root.kind in ("parameter", "buffer") or (node.layer, root) in saved_storages:
                continue
            saved_storages.add((node.layer, root))
            local = local_type(root.type, root.layout or _NO_LAYOUT, mesh, dtype or root.type.dtype)
            saved += local.nbytes
        param_bytes = params = 0
        for v in node.inputs:
            if v.kind == "parameter" and v not in seen_params:
                seen_params.add(v)
                local = local_type(v.type, v.layout or _NO_LAYOUT, mesh, v.type.dtype)
                param_bytes += local.nbytes
                params += local.numel
        rows.append(CostRow(int(cost.fwd_flops), int(cost.fwd_bytes), int(saved), param_bytes,
                            {"params": float(params)}))
    return rows


def annotate_cost(graph: Graph, dtype: str | None = None, device: DeviceSpec | None = None) -> Graph:
    """Write `flops`, `bytes`, `saved_bytes`, `param_bytes` and `params` into every node's annotations."""
    for node, row in zip(graph.nodes, node_costs(graph, dtype, device)):
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
    node count, parameters, FLOPs, bytes moved and saved activation bytes. The figures are the
    annotations annotate-cost wrote; a graph it has not annotated is costed now at `dtype`."""
    annotated = all(all(k in n.annotations for k in COST_KEYS) for n in graph.nodes)
    figures = ([tuple(int(n.annotations[k]) for k in COST_KEYS) for n in graph.nodes] if annotated else
               [(r.flops, r.bytes, r.saved_bytes, r.param_bytes, int(r.extra["params"]))
                for r in node_costs(graph, dtype)])
    totals: dict[str, list[int]] = {}
    for node, (flops, moved, saved, param_bytes, params) in zip(graph.nodes, figures):
        acc = totals.setdefault(node.layer if node.layer is not None else UNGROUPED, [0] * 6)
        for i, x in enumerate((1, params, param_bytes, flops, moved, saved)):
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
        cluster = ctx.the_cluster()
        return annotate_cost(graph, self.dtype, cluster.device if cluster is not None else None)
