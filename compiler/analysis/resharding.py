"""Resharding rules: the collectives that turn one layout into another, and where a graph needs them.

One mesh axis at a time, placement `src` on that axis becomes `dst` by (TVM Relax style):

    S -> R        all_gather       (input the shard, output the gathered tensor)
    P -> R        all_reduce
    P -> S        reduce_scatter   (input the partial tensor, output the shard)
    R -> S        chunk            (local slice, no communication)
    S(i) -> S(j)  all_to_all       (also S(d) <-> S(d/k): a strided shard of the same dim)
    R -> P        to_partial       (local: every rank but the first zeroes its copy; only when a
                                    consumer needs it, e.g. the bias of a row-parallel linear)
    S -> P        pad              (local: the shard placed in a zero tensor of the full size)
    P -> P        nothing (same op; a different op is an error), R -> R, S -> S: nothing

Point-to-point kinds share the dataclass: `send_recv` (a pipeline stage cut, axis `pp`),
`rotate` / `rotate_reverse` (a ring shift along an axis: ring attention, PrimePar), and
`identity`, a forward no-op whose backward is an all_reduce (Megatron's `f`: a replicated
activation entering a node split along a model axis gets a partial gradient there).

Order: when several axes change, the sequence sending the fewest bytes (ring algorithms)
wins, then the one with fewest steps, then the rule order (local chunks, reduce_scatter,
all_to_all, all_reduce, all_gather, the local partial kinds); so a tensor is sliced before it
is reduced and gathered last. Shards of one tensor dim nest in mesh order (outer axis first),
so a step that adds or removes a shard of dim d on axis a needs no axis inside a to shard d;
a shard in the way is all-gathered first and sliced again later. Axes of size 1 change
placement for free and get no step.

`edge_steps(graph)` applies these rules to every value of a partitioned graph and each layout
its consumers need; it is what the cost model charges and what the lowering inserts.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

from shardc.analysis.propagate import io_layouts, iteration_space, requires_grad
from shardc.analysis.summed import parameter_of, summed_per_step
from shardc.ir import (
    DATA_AXES,
    DTYPE_BYTES,
    Axis,
    Graph,
    Layout,
    Mesh,
    Node,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorType,
    Value,
)
from shardc.ir.diagnostics import ShardcError
from shardc.ops.collectives import ring_traffic

COMMUNICATING = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all", "send_recv", "rotate",
                           "rotate_reverse"})
LOCAL = frozenset({"chunk", "to_partial", "pad", "identity"})
KINDS = tuple(sorted(COMMUNICATING | LOCAL))

# Forward kind -> backward kind (Megatron's convention: the gradient of an all_gather output is
# partial, that of an all_reduce output replicated); see `conjugate` for the general rule.
_CONJUGATE = {
    "all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_reduce": "identity",
    "identity": "all_reduce", "chunk": "all_gather", "to_partial": "identity", "pad": "chunk",
    "all_to_all": "all_to_all", "send_recv": "send_recv", "rotate": "rotate_reverse", "rotate_reverse": "rotate",
}
# Order in which pending per-axis changes are taken (cheapest first).
_PRIORITY = {"chunk": 0, "reduce_scatter": 1, "all_to_all": 2, "all_reduce": 3, "all_gather": 4,
             "to_partial": 5, "pad": 5}


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One collective (or local step) on one mesh axis, with exact per-device byte counts.

    `bytes_in_per_device` / `bytes_out_per_device` are the local buffers before and after
    (for all_gather the shard and the gathered tensor, for reduce_scatter the partial tensor
    and the shard). `backward` is the kind backward runs for it (see `conjugate`).
    """

    kind: str
    axis: str
    layout_before: Layout
    layout_after: Layout
    bytes_in_per_device: int
    bytes_out_per_device: int
    group_size: int
    backward: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown reshard kind {self.kind!r}; known: {', '.join(KINDS)}")

    @property
    def communicates(self) -> bool:
        return self.kind in COMMUNICATING and self.group_size > 1

    @property
    def buffer_bytes(self) -> int:
        """The buffer in `shardc.cost.comm.collective_time`'s convention (gathered size for an
        all_gather, the input for a reduce_scatter): the larger of the two."""
        return max(self.bytes_in_per_device, self.bytes_out_per_device)

    @property
    def wire_bytes(self) -> int:
        """Bytes one device sends with ring algorithms (`ring_traffic`; 0 for local steps)."""
        if not self.communicates:
            return 0
        n = self.group_size
        kind = "rotate" if self.kind == "rotate_reverse" else self.kind
        # The ring's buffer of an all_gather is the gathered tensor: n shards as this device holds one.
        buffer = self.bytes_in_per_device * (n if kind == "all_gather" else 1)
        return ring_traffic(kind, n).sent_bytes(buffer)

    def __str__(self) -> str:
        return (f"{self.kind}[{self.axis}] {self.layout_before} -> {self.layout_after} "
                f"({self.bytes_in_per_device} -> {self.bytes_out_per_device} B, group {self.group_size})")


def conjugate(kind: str, partial_grad: bool | None = None) -> str:
    """The kind backward runs for forward step `kind`.

    Without `partial_grad`: Megatron's table (all_gather <-> reduce_scatter, all_reduce ->
    identity, identity -> all_reduce, chunk -> all_gather, rotate <-> rotate_reverse, ...).
    With it, the gradient of a replicated value on the step's axis is partial (True: data axes,
    or a value read by a node split along that axis) or replicated (False), and the backward of
    S->R is P->S (reduce_scatter) or R->S (chunk), of P->R is P->R (all_reduce) or nothing, of
    R->S is S->P (pad) or S->R (all_gather), of identity all_reduce or nothing.
    """
    if kind not in _CONJUGATE:
        raise ValueError(f"unknown reshard kind {kind!r}; known: {', '.join(KINDS)}")
    if partial_grad is None:
        return _CONJUGATE[kind]
    table = {
        "all_gather": ("reduce_scatter", "chunk"), "all_reduce": ("all_reduce", "identity"),
        "chunk": ("pad", "all_gather"), "identity": ("all_reduce", "identity"),
    }
    if kind in table:
        return table[kind][0 if partial_grad else 1]
    return _CONJUGATE[kind]


def local_bytes(type: TensorType, layout: Layout, mesh: Mesh) -> int:
    """Bytes one device holds of a `type` tensor laid out `layout`."""
    return math.prod(layout.local_shape(type.shape, mesh)) * DTYPE_BYTES[type.dtype]


def with_placement(layout: Layout, axis: str, placement: Placement, mesh: Mesh) -> Layout:
    """`layout` with `axis` set to `placement`, in mesh order, without Replicate entries."""
    table = dict(layout.placements)
    table[axis] = placement
    return Layout(tuple((a, table[a]) for a in mesh.names if a in table)).without_replicate()


def normalize(layout: Layout, mesh: Mesh) -> Layout:
    """The same layout in mesh order without Replicate entries (what `==` should compare)."""
    for a, _ in layout.placements:
        mesh.axis_size(a)
    return Layout(tuple((a, layout.on(a)) for a in mesh.names if a in dict(layout.placements))).without_replicate()


def step_kind(src: Placement, dst: Placement) -> str | None:
    """The kind that turns placement `src` into `dst` on one axis (None: nothing to do)."""
    if src == dst:
        return None
    if isinstance(src, Partial):
        if isinstance(dst, Partial):
            raise ValueError(f"no step turns {src} into {dst}: partial values of different reductions")
        return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter"
    if isinstance(src, Shard):
        return {Replicate: "all_gather", Shard: "all_to_all", Partial: "pad"}[type(dst)]
    return "chunk" if isinstance(dst, Shard) else "to_partial"


def _dims_of(*placements: Placement) -> set[int]:
    return {p.dim for p in placements if isinstance(p, Shard)}


def redistribute(src: Layout, dst: Layout, type: TensorType, mesh: Mesh) -> list[ReshardStep]:
    """The steps turning a `type` tensor laid out `src` into `dst` on `mesh` (rules in the module
    docstring); `[]` when they already agree. Each step's `backward` is `conjugate(kind)`."""
    for given in (src, dst):
        for a, p in given.placements:
            mesh.axis_size(a)
            if isinstance(p, Shard) and p.dim >= type.rank:
                raise ShardcError(f"layout {given} shards dim {p.dim} of a rank-{type.rank} tensor {type}")
    names = mesh.names
    cur = {a: src.on(a) for a in names}
    want = {a: dst.on(a) for a in names}
    for a in names:
        if mesh.axis_size(a) == 1:
            cur[a] = want[a]
    try:
        for a in names:
            step_kind(cur[a], want[a])
    except ValueError as err:
        raise ShardcError(f"cannot redistribute {type} from {src} to {dst}: {err}") from None

    start, goal = tuple(cur[a] for a in names), tuple(want[a] for a in names)

    def ready(state: tuple[Placement, ...], k: int, target: Placement) -> bool:
        dims = _dims_of(state[k], target)
        return not any(isinstance(p, Shard) and p.dim in dims for p in state[k + 1:])

    def layout(state: tuple[Placement, ...]) -> Layout:
        return Layout(tuple(zip(names, state))).without_replicate()

    # Cheapest sequence first (bytes on the wire, then fewest steps, then the rule order), over
    # moves that take an axis straight to its target or gather a shard that is in the way.
    count = 0
    heap: list[tuple[int, int, tuple[tuple[int, int], ...], int, tuple[Placement, ...], list[ReshardStep]]]
    heap = [(0, 0, (), count, start, [])]
    seen: set[tuple[Placement, ...]] = set()
    while heap:
        cost, n, key, _, state, steps = heapq.heappop(heap)
        if state == goal:
            return steps
        if state in seen:
            continue
        seen.add(state)
        for k, axis in enumerate(names):
            targets = [goal[k]] if state[k] != goal[k] else []
            if isinstance(state[k], Shard) and not isinstance(goal[k], Replicate):
                targets.append(Replicate())
            for target in targets:
                if not ready(state, k, target):
                    continue
                new = state[:k] + (target,) + state[k + 1:]
                kind = step_kind(state[k], target) or ""
                before, after = layout(state), layout(new)
                step = ReshardStep(kind, axis, before, after, local_bytes(type, before, mesh),
                                   local_bytes(type, after, mesh), mesh.axis_size(axis), conjugate(kind))
                count += 1
                order = (_PRIORITY[kind], -k if kind == "all_gather" else k)
                heapq.heappush(heap, (cost + step.wire_bytes, n + 1, key + (order,), count, new, steps + [step]))
    raise AssertionError(f"redistribute found no way from {src} to {dst}")  # pragma: no cover


def backward_step(step: ReshardStep, mesh: Mesh) -> ReshardStep | None:
    """The step backward runs for `step`: its `backward` kind from the gradient layout on the
    forward output side (Shard stays, Partial is Replicate, Replicate is Partial when that kind
    reduces) to the one on the input side; None when backward does nothing. Other axes keep
    their forward placements; the byte counts are the forward's, swapped."""
    kind = step.backward or conjugate(step.kind)
    if kind == "identity":
        return None
    p, q = step.layout_before.on(step.axis), step.layout_after.on(step.axis)
    if isinstance(q, Partial):
        q = Replicate()
    elif isinstance(q, Replicate) and kind in ("reduce_scatter", "all_reduce"):
        q = Partial("sum")
    if kind in ("all_gather", "all_reduce"):
        p = Replicate()
    elif kind == "pad":
        p = Partial("sum")
    before = with_placement(step.layout_after, step.axis, q, mesh)
    after = with_placement(step.layout_before, step.axis, p, mesh)
    return ReshardStep(kind, step.axis, before, after, step.bytes_out_per_device, step.bytes_in_per_device,
                       step.group_size, step.kind)


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
    made replicated on model axes and kept on data axes (edges with no consumers).
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
    for v in graph.outputs:
        src = normalize(v.layout or Layout(), mesh)
        need = Layout(tuple((a, p) for a, p in src.placements if a in data_axes))
        steps = with_gradients(redistribute(src, need, v.type, mesh), need, v, mesh, data_axes, False, set())
        if steps:
            out[Edge(v.name, src, need, (), stage_of.get(v), stage_of.get(v))] = steps
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
