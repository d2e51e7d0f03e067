"""lower: make every resharding, gradient synchronisation and stage cut explicit in the IR.

Rule. Each node's partition fixes the layout it needs on every input and the layout it produces
(`shardc.analysis.propagate.io_layouts`, the registry's rules). Wherever a value's layout differs from
what a consumer needs, the pass inserts the steps `shardc.analysis.resharding.edge_steps` gives, the same
ones the cost model charges, one mesh axis at a time:

    P -> R  all_reduce        P -> S  reduce_scatter     S -> R  all_gather
    R -> S  chunk (local)     S(i) -> S(j)  all_to_all   R -> P  to_partial (local)
    S -> P  pad (local)       stage cut  send + recv

A node whose output value holds its partial sum resolved (the solver's candidates: "all_reduce
to Replicate or reduce_scatter onto a batch/sequence dim, inside the group";
`shardc.ops.verifier.resolves_partial`) gets that reduction right after it, in its layer, and
its readers read the reduced value: the same reduction the cost model charges where the value
is made, then the edges from there.

Gradients follow one convention per axis. On model axes (tp, ...) a replicated value's
gradient is replicated, so where a replicated input that needs a gradient enters a node split
along that axis, `grad_all_reduce` (identity forward, all_reduce backward) goes in front of it;
an all_gather just before it takes that role instead, with a reduce_scatter backward. On data
axes (dp, cp by default) every rank backpropagates its own loss and parameter gradients are
averaged by DDP (or FSDP2 when a layer asks for ZeRO): each such parameter passes through one
`grad_sync[axes, op="avg", via, zero]` node (via="ddp", or "fsdp" when any layer has zero>0),
and collectives carry the backward they need as their `grad` attribute. A parameter replicated
on a model axis whose readers all split it (the batch split over tp with replicated weights,
`shardc.analysis.summed`) gets no `grad_all_reduce` per use: its `grad_sync` lists the axis in
`sum_axes`, and the runtime sums the accumulated gradient there once per step, bucketed. Graph outputs are made replicated on model axes and stay local on
data axes (the loss is each rank's mean: `P(avg)`); under a pipeline an output made before the
last stage (a router's logits) is sent there, its recv and steps after the last node. Where an activation crosses pipeline
stages, a `send` (producer's layer) and `recv` (consumer's layer) pair cuts the graph: the send
goes right after its producer and the recv (with the steps after it) right before the first
consumer, so stages never decrease along the node list; the edges of one value that cross the
same cut at the producer's layout share that pair (one receive per stage input, as the cost
model sends each value once). A parameter read on several stages
(a tied embedding and head) is held by each of them: it gets one `grad_sync` per stage and is
never sent; the runtime sums its gradient over those stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from shardc.analysis.propagate import io_layouts
from shardc.analysis.resharding import (
    Edge,
    ReshardStep,
    edge_steps,
    node_stage,
    normalize,
    redistribute,
    with_gradients,
)
from shardc.analysis.summed import summed_per_step
from shardc.ir import (
    DATA_AXES,
    Axis,
    Graph,
    Layout,
    Location,
    Node,
    Partial,
    Placement,
    Replicate,
    Shard,
    Value,
)
from shardc.ir.diagnostics import ShardcError
from shardc.ops.verifier import resolves_partial
from shardc.passmanager import Pass, PassContext, register_pass


def splits_axis(node: Node, axis: str) -> bool:
    """Whether `node`'s partition splits mesh axis `axis` (in space or by rotating along it)."""
    part = node.partition
    if part is None:
        return False
    return any(a == axis for a, _ in part.spatial) or any(axis in t.axes for t in part.temporal)


def step_node_attrs(step: ReshardStep) -> tuple[str, dict[str, Any]]:
    """The IR op and attributes of one resharding step (`shardc.analysis.resharding`)."""
    axis = step.axis
    before, after = step.layout_before.on(axis), step.layout_after.on(axis)

    def strided(prefix: str, p: Any) -> dict[str, Any]:
        return {prefix + "interleave": p.interleave} if isinstance(p, Shard) and p.interleave > 1 else {}

    def shard(p: Placement) -> Shard:
        if not isinstance(p, Shard):
            raise ShardcError(f"resharding step {step} needs a Shard on {axis}, not {p}")
        return p

    def partial(p: Placement) -> Partial:
        if not isinstance(p, Partial):
            raise ShardcError(f"resharding step {step} needs a Partial on {axis}, not {p}")
        return p

    kind = step.kind
    if kind == "identity":
        return "grad_all_reduce", {"axis": axis}
    if kind == "all_gather":
        return kind, {"axis": axis, "dim": shard(before).dim, **strided("", before), "grad": step.backward}
    if kind == "chunk":
        return kind, {"axis": axis, "dim": shard(after).dim, **strided("", after), "grad": step.backward}
    if kind == "all_reduce":
        return kind, {"axis": axis, "op": partial(before).op, "grad": step.backward}
    if kind == "reduce_scatter":
        return kind, {"axis": axis, "dim": shard(after).dim, **strided("", after), "op": partial(before).op}
    if kind == "all_to_all":
        return kind, {"axis": axis, "src": shard(before).dim, "dst": shard(after).dim, **strided("src_", before),
                      **strided("dst_", after)}
    if kind == "pad":
        return kind, {"axis": axis, "dim": shard(before).dim, **strided("", before)}
    if kind == "to_partial":
        return kind, {"axis": axis}
    raise ShardcError(f"lower has no op for resharding step {step}")


@dataclass
class _Emit:
    """Creates the new nodes, with fresh value names, into `nodes`."""

    graph: Graph
    taken: set[str]
    nodes: list[Node]
    # (source value, steps so far) -> the value they made: edges of one value whose steps begin
    # alike (readers that need the same layout with different gradients) share those nodes
    shared: dict[tuple[str, tuple[ReshardStep, ...]], Value] | None = None
    # sent value -> its recv: edges of one value that cross the same cut in the same layout (a
    # stage input read at two layouts, by a norm and by the residual) share one send and one recv
    received: dict[str, Value] | None = None

    def __call__(self, op: str, attrs: dict[str, Any], src: Value, layout: Layout, near: Node, tag: str) -> Value:
        name, k = f"{src.name}.{tag}", 1
        while name in self.taken:
            k += 1
            name = f"{src.name}.{tag}{k}"
        self.taken.add(name)
        out = Value(name, src.type, "activation", layout, requires_grad=src.requires_grad)
        self.nodes.append(Node(op, [src], [out], attrs, Location(near.location.module_path, near.location.source),
                               None, near.layer))
        return out

    def send(self, src: Value, edge: Edge, producer: Node) -> Value:
        """The producer's half of a stage cut (emitted right after the producer)."""
        attrs = {"axis": Axis.PP, "src": edge.src_stage, "dst": edge.dst_stage}
        return self("send", attrs, src, src.layout or Layout(), producer, "send")

    def chain(self, src: Value, edge: Edge, steps: list[ReshardStep], near: Node, sent: Value | None = None) -> Value:
        cur = src
        for k, step in enumerate(steps):
            key = (src.name, tuple(steps[:k + 1]))
            if self.shared is not None and sent is None and key in self.shared:
                cur = self.shared[key]
                continue
            if step.kind == "send_recv":
                attrs = {"axis": Axis.PP, "src": edge.src_stage, "dst": edge.dst_stage}
                if sent is None:
                    sent = self.send(cur, edge, src.producer or near)
                if self.received is not None and sent.name in self.received:
                    cur = self.received[sent.name]
                    continue
                cur = self("recv", attrs, sent, cur.layout or Layout(), near, "recv")
                if self.received is not None:
                    self.received[sent.name] = cur
                continue
            op, attrs = step_node_attrs(step)
            cur = self(op, attrs, cur, step.layout_after, near, op)
            if self.shared is not None and sent is None and all(s.kind != "send_recv" for s in steps[:k + 1]):
                self.shared[key] = cur
        return cur


def hold_layouts(graph: Graph) -> dict[Value, Layout]:
    """Outputs get what their partition produces; parameters, buffers and inputs without a layout
    are held as their first reader needs them, never partial. Returns the outputs that held
    their partial sum resolved (`resolves_partial`), with that resolved layout."""
    assert graph.mesh is not None
    resolved: dict[Value, Layout] = {}
    for node in graph.nodes:
        ins, outs = io_layouts(node, graph.mesh)
        for v, lay in zip(node.outputs, outs):
            if node.partition is not None and v.layout is not None and resolves_partial(lay, v.layout):
                resolved[v] = v.layout
            v.layout = lay
        for v, lay in zip(node.inputs, ins):
            if v.kind != "activation" and v.layout is None:
                v.layout = Layout(tuple((a, p) for a, p in lay.placements if not isinstance(p, Partial)))
    for v in list(graph.inputs) + graph.params + graph.buffers:
        v.layout = v.layout or Layout()
    return resolved


def resolve_partials(graph: Graph, resolved: dict[Value, Layout], data: tuple[str, ...], emit: _Emit) -> None:
    """Right after each node whose output held its partial sum resolved, the reduction
    (`all_reduce` or `reduce_scatter`, backward identity or all_gather; on data axes the
    partial-gradient conjugates), in the node's layer; every reader and the graph's outputs
    then read the reduced value, so edges start from the layout the cost model priced."""
    assert graph.mesh is not None
    mesh = graph.mesh
    nodes: list[Node] = []
    emit.nodes = nodes
    now: dict[Value, Value] = {}
    for node in graph.nodes:
        node.inputs = [now.get(v, v) for v in node.inputs]
        nodes.append(node)
        for v in node.outputs:
            if v in resolved:
                made = normalize(v.layout or Layout(), mesh)
                steps = with_gradients(redistribute(made, normalize(resolved[v], mesh), v.type, mesh),
                                       resolved[v], v, mesh, data, False, set())
                edge = Edge(v.name, made, resolved[v], ())
                now[v] = emit.chain(v, edge, steps, node)
    graph.outputs = [now.get(v, v) for v in graph.outputs]
    graph.nodes = nodes


def insert_grad_sync(graph: Graph, data: tuple[str, ...], emit: _Emit, summed: dict[str, tuple[str, ...]]) -> None:
    """One `grad_sync` per trainable parameter replicated on a data axis its readers split, or
    summed once per step over model axes (`summed`, `shardc.analysis.summed`: its `sum_axes`),
    one per pipeline stage reading it."""
    zero = {name: layer.annotation.zero for name, layer in graph.layers.items()}
    via = "fsdp" if any(zero.values()) else "ddp"
    synced: dict[tuple[Value, int | None], Value] = {}
    nodes: list[Node] = []
    emit.nodes = nodes
    for node in graph.nodes:
        key_stage = node_stage(graph, node)
        for i, v in enumerate(node.inputs):
            key = (v, key_stage)
            if v.kind == "parameter" and v.requires_grad and key not in synced:
                axes = tuple(a for a in data if isinstance((v.layout or Layout()).on(a), Replicate)
                             and splits_axis(node, a))
                if axes or v.name in summed:
                    attrs = {"axes": axes, "op": "avg", "via": via, "zero": zero.get(node.layer or "", 0)}
                    if v.name in summed:
                        attrs["sum_axes"] = summed[v.name]
                    synced[key] = emit("grad_sync", attrs, v, v.layout or Layout(), node, "grad_sync")
            node.inputs[i] = synced.get(key, v)
        nodes.append(node)
    graph.nodes = nodes


def lower(graph: Graph, data_axes: tuple[str, ...] = DATA_AXES) -> Graph:
    """Insert collectives, gradient markers, parameter grad_sync and stage cuts (in place; returns `graph`)."""
    if graph.mesh is None:
        raise ShardcError(f"graph @{graph.name} has no mesh; run apply-plan (or the solver) before lower")
    mesh = graph.mesh
    if any(n.op == "grad_sync" for n in graph.nodes):
        return graph  # already lowered
    data = tuple(a for a in data_axes if a in mesh.names and mesh.axis_size(a) > 1)
    resolved = hold_layouts(graph)
    for node, flag in zip(graph.nodes, _grads(graph)):
        for v in node.outputs:
            v.requires_grad = v.requires_grad or flag
    emit = _Emit(graph, {v.name for v in graph.values()}, [])
    resolve_partials(graph, resolved, data_axes, emit)
    insert_grad_sync(graph, data, emit, summed_per_step(graph, data_axes))
    edges = edge_steps(graph, data_axes)
    by_name = {v.name: v for v in graph.values()}
    before: dict[int, list[Edge]] = {}
    for edge in edges:
        if edge.consumers:
            before.setdefault(min(i for i, _ in edge.consumers), []).append(edge)
    old = list(graph.nodes)
    position = {n: i for i, n in enumerate(old)}
    after: dict[int, list[Edge]] = {}  # producer index -> edges whose send goes right after it
    for edge in edges:
        producer = by_name[edge.value].producer
        if edges[edge][0].kind == "send_recv" and producer is not None:
            after.setdefault(position[producer], []).append(edge)
    sent: dict[Edge, Value] = {}
    sends: dict[tuple[str, int | None, int | None], Value] = {}  # (value, src, dst stage) -> its one send
    emit.nodes = []
    emit.shared = {}
    emit.received = {}
    for index, node in enumerate(old):
        for edge in before.get(index, []):
            new = emit.chain(by_name[edge.value], edge, edges[edge], node, sent.get(edge))
            for i, pos in edge.consumers:
                old[i].inputs[pos] = new
        emit.nodes.append(node)
        for edge in after.get(index, []):
            key = (edge.value, edge.src_stage, edge.dst_stage)
            if key not in sends:
                sends[key] = emit.send(by_name[edge.value], edge, node)
            sent[edge] = sends[key]
    emit.shared = None
    for edge, steps in edges.items():  # after the last node: an output carried to the last stage is there
        if not edge.consumers:
            k = next(j for j, v in enumerate(graph.outputs) if v.name == edge.value)
            src = graph.outputs[k]
            near = old[-1] if edge.src_stage != edge.dst_stage else (src.producer or old[-1])
            graph.outputs[k] = emit.chain(src, edge, steps, near, sent.get(edge))
    emit.received = None
    graph.nodes = emit.nodes
    return graph


def _grads(graph: Graph) -> list[bool]:
    """Per node: whether its outputs carry a gradient (they read a trainable parameter, transitively)."""
    flags: dict[Value, bool] = {p: p.requires_grad for p in graph.params}
    out = []
    for node in graph.nodes:
        flag = any(flags.get(v, False) for v in node.inputs)
        for v in node.outputs:
            flags[v] = flag and v.type.is_float
        out.append(flag)
    return out


@register_pass
@dataclass(frozen=True)
class Lower(Pass):
    """`lower` in a pipeline string: the rule in the module docstring."""

    name: ClassVar[str] = "lower"

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        return lower(graph)

