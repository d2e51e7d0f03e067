"""Where a partitioned graph needs resharding: the steps of every edge, and of rotations inside nodes.

`edge_steps(graph)` applies the rules of `shardc.analysis.redistribute` (which collectives turn
one layout into another, with their backward kinds) to every value of a partitioned graph and
each layout its consumers need; it is what the cost model charges and what the lowering
inserts. `node_rotations(node)` lists the ring shifts a rotating temporal split makes inside a
node. The rules' names (`ReshardStep`, `redistribute`, `conjugate`, ...) are re-exported here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardc.analysis.propagate import io_layouts, iteration_space, requires_grad
from shardc.analysis.redistribute import (
    COMMUNICATING,
    KINDS,
    LOCAL,
    ReshardStep,
    backward_step,
    conjugate,
    local_bytes,
    normalize,
    redistribute,
    step_kind,
    with_placement,
)
from shardc.analysis.summed import parameter_of, summed_per_step
from shardc.ir import DATA_AXES, Axis, Graph, Layout, Mesh, Node, Replicate, Shard, Value
from shardc.ir.diagnostics import ShardcError

__all__ = ["COMMUNICATING", "KINDS", "LOCAL", "Edge", "ReshardStep", "backward_step", "conjugate", "edge_steps",
           "local_bytes", "markers", "node_rotations", "node_stage", "normalize", "redistribute", "step_kind",
           "with_gradients", "with_placement"]


@dataclass(frozen=True, slots=True)
class Edge:
    """A value and one layout its consumers need: the key of `edge_steps`.

    `consumers` are (node index in graph.nodes, operand position); `()` is a graph output.
    `src_stage`/`dst_stage` are pipeline stages when the graph has them.
    """

    value: str
    src: Layout
    dst: Layout
    consumers: tuple[tuple[int, int], ...]
    src_stage: int | None = None
    dst_stage: int | None = None


def node_stage(graph: Graph, node: Node) -> int | None:
    """The pipeline stage of the layer `node` belongs to; None when it has no stage-annotated layer."""
    layer = graph.layers.get(node.layer) if node.layer else None
    return layer.annotation.stage if layer is not None else None


def edge_steps(graph: Graph, data_axes: tuple[str, ...] = DATA_AXES) -> dict[Edge, list[ReshardStep]]:
    """Every (value, needed layout) of a partitioned graph whose producer layout differs from what
    its consumers need, or that crosses a pipeline stage, or whose gradient needs an all_reduce,
    with the steps: one `send_recv` on `pp` first (in the producer's layout; the edge's
    `dst_stage - src_stage` says how many stage boundaries it crosses), then `redistribute`.

    Backward: on data axes (`data_axes`, default dp and cp) the gradient of a replicated value is
    partial (every rank backpropagates its own loss; parameters are averaged by the gradient
    sync). On model axes it is replicated, except where a trainable activation that is
    replicated on the axis enters a node split along it: then the last step on that axis gets
    the partial-gradient conjugate (an all_gather's backward is a reduce_scatter), or an
    `identity` step is added whose backward is the all_reduce. Consumers that need the same
    layout share one edge (one collective, as the lowering emits it), unless some of them split a
    model axis on which the value is replicated and others do not: the gradient reaching the value
    is then the sum of partial ones (the splitting readers') and replicated ones (the others'), so
    the others get the edge with replicated-gradient conjugates and the splitting readers the same
    steps plus an `identity` marker (backward all_reduce) per such axis; the lowering emits the
    shared steps once (`lower`'s chain sharing). A parameter whose gradient is summed once per
    step over an axis (`shardc.analysis.summed`) gets no marker on that axis. Graph outputs are
    made replicated on model axes and kept on data axes (edges with no consumers); under a
    pipeline an output made before the last stage is first sent there.
    """
    mesh = graph.mesh
    if mesh is None:
        raise ShardcError(f"graph @{graph.name} has no mesh; run apply-plan (or the solver) first")
    grads = requires_grad(graph)
    stage_of: dict[Value, int | None] = {}
    groups: dict[tuple[Value, Layout, int | None, frozenset[str]], list[tuple[int, int]]] = {}
    splits: dict[int, set[str]] = {}
    model = {a for a in mesh.names if a not in data_axes and mesh.axis_size(a) > 1}
    once = summed_per_step(graph, data_axes)  # parameters summed once per step there: no marker per use

    def deferred(v: Value) -> set[str]:
        return set(once.get((parameter_of(v) or v).name, ()))

    for index, node in enumerate(graph.nodes):
        stage = node_stage(graph, node)
        ins, _ = io_layouts(node, mesh)
        part = node.partition
        splits[index] = ({a for a, _ in part.spatial} | {a for t in part.temporal for a in t.axes}) if part else set()
        for pos, (v, need) in enumerate(zip(node.inputs, ins)):
            need = normalize(need, mesh)
            cut = frozenset(a for a in splits[index] & model if isinstance(need.on(a), Replicate)) - deferred(v)
            groups.setdefault((v, need, stage, cut), []).append((index, pos))
        for v in node.outputs:
            stage_of[v] = stage
    cuts: dict[tuple[Value, Layout, int | None], set[frozenset[str]]] = {}
    for v, need, stage, cut in groups:
        cuts.setdefault((v, need, stage), set()).add(cut)
    out: dict[Edge, list[ReshardStep]] = {}
    for (v, need, stage, cut), consumers in groups.items():
        src = normalize(v.layout or Layout(), mesh)
        src_stage = stage_of.get(v)
        steps: list[ReshardStep] = []
        if src_stage is not None and stage is not None and src_stage != stage:
            nbytes = local_bytes(v.type, src, mesh)
            steps.append(ReshardStep("send_recv", Axis.PP, src, src, nbytes, nbytes, 2, "send_recv"))
        trainable = grads.get(v, False)
        if len(cuts[(v, need, stage)]) > 1:  # mixed readers (see docstring): shared steps, then the markers
            shared = with_gradients(redistribute(src, need, v.type, mesh), need, v, mesh, data_axes, trainable, set(),
                                    deferred(v))
            steps += shared + markers(need, v, mesh, data_axes, trainable, set(cut), set())
        else:
            steps += with_gradients(redistribute(src, need, v.type, mesh), need, v, mesh, data_axes, trainable,
                                    set().union(*(splits[i] for i, _ in consumers)) - deferred(v), deferred(v))
        if steps:
            out[Edge(v.name, src, need, tuple(consumers), src_stage, stage)] = steps
    last = max((s for s in stage_of.values() if s is not None), default=None)
    for v in graph.outputs:
        src = normalize(v.layout or Layout(), mesh)
        need = Layout(tuple((a, p) for a, p in src.placements if a in data_axes))
        src_stage = stage_of.get(v)
        steps = []
        if src_stage is not None and last is not None and src_stage != last:
            # a pipeline returns what its last stage returns: an output made earlier (a router's
            # logits on stage 0) is carried there
            nbytes = local_bytes(v.type, src, mesh)
            steps.append(ReshardStep("send_recv", Axis.PP, src, src, nbytes, nbytes, 2, "send_recv"))
        steps += with_gradients(redistribute(src, need, v.type, mesh), need, v, mesh, data_axes, False, set())
        if steps:
            out[Edge(v.name, src, need, (), src_stage, last if src_stage is not None else None)] = steps
    return out


def with_gradients(steps: list[ReshardStep], need: Layout, value: Value, mesh: Mesh,
                   data_axes: tuple[str, ...], trainable: bool, split_axes: set[str],
                   summed: set[str] | frozenset[str] = frozenset()) -> list[ReshardStep]:
    """Set each step's backward kind and add the `identity` markers (see `edge_steps`): `trainable`
    says whether `value` carries a gradient, `split_axes` the axes its readers split, `summed` the
    axes its gradient is summed over once per step (partial there, as on data axes)."""
    marked = _marked(need, mesh, data_axes, trainable, split_axes)
    last_on = {s.axis: k for k, s in enumerate(steps)}
    result = []
    for k, s in enumerate(steps):
        partial = s.axis in data_axes or s.axis in summed or (s.axis in marked and last_on[s.axis] == k)
        result.append(dataclasses.replace(s, backward=conjugate(s.kind, partial)))
    covered = {s.axis for s in result if s.axis in marked and s.backward in ("reduce_scatter", "all_reduce")}
    return result + markers(need, value, mesh, data_axes, trainable, split_axes, covered)


def _marked(need: Layout, mesh: Mesh, data_axes: tuple[str, ...], trainable: bool, split_axes: set[str]) -> set[str]:
    """The model axes on which a trainable value replicated in `need` is read split: its gradient is partial there."""
    return {a for a in mesh.names if a not in data_axes and mesh.axis_size(a) > 1 and a in split_axes
            and trainable and isinstance(need.on(a), Replicate)}


def markers(need: Layout, value: Value, mesh: Mesh, data_axes: tuple[str, ...], trainable: bool,
            split_axes: set[str], covered: set[str]) -> list[ReshardStep]:
    """An `identity` step (forward nothing, backward all_reduce) per marked axis (`_marked`) not
    `covered` by a step whose backward already reduces."""
    nbytes = local_bytes(value.type, need, mesh)
    return [ReshardStep("identity", a, need, need, nbytes, nbytes, mesh.axis_size(a), "all_reduce")
            for a in mesh.names if a in _marked(need, mesh, data_axes, trainable, split_axes) and a not in covered]


def node_rotations(node: Node, mesh: Mesh) -> list[ReshardStep]:
    """The point-to-point shifts a rotating temporal split makes inside `node`: for each input
    sharded along the rotation axis on the rotated dim, `steps - 1` `rotate` steps of its
    local shard (backward: the same number of `rotate_reverse`)."""
    if node.partition is None or not node.partition.temporal:
        return []
    ins, _ = io_layouts(node, mesh)
    space = iteration_space(node)
    out = []
    for split in node.partition.temporal:
        for axis in split.axes:  # one axis, or both of a grid (each operand moves along its own)
            if mesh.axis_size(axis) == 1:
                continue
            for operand, v, layout in zip(space.inputs, node.inputs, ins):
                p = layout.on(axis)
                if isinstance(p, Shard) and operand[p.dim][:1] == (split.dim,):
                    nbytes = local_bytes(v.type, layout, mesh)
                    out += [ReshardStep("rotate", axis, layout, layout, nbytes, nbytes,
                                        mesh.axis_size(axis), "rotate_reverse")] * (split.steps - 1)
    return out
