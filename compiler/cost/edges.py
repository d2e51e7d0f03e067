"""Redistribution on the edges of a partitioned graph: forward into the layout a node requires,
the gradient back into the layout its producer's backward needs (the conjugates).

Rules: the gradient a consumer sends back to its input is `Partial` on each mesh axis that
splits a dim the operand does not index (a broadcast operand's gradient is a sum); the
consumers' contributions are summed (`combine_gradients`) and redistributed into the
producer's output layout with Partial read as Replicate (`needed_gradient`), so all_reduce
forward <-> nothing backward, nothing forward <-> all_reduce backward, all_gather <->
reduce_scatter. A node that resolves its own partial sum (a row-parallel linear whose value
is held reduced) needs its gradient as it made it (`gradient_layout`). A parameter's gradient
is Partial on the axes its readers' contributions leave it summed over (`layer_params`): the
gradient sync reduces it there. Used by `layer_terms` on a graph and by the solver on its
candidates' edges alike.

Sequence parallelism as Megatron runs it (`saves_shard`): an input all-gathered on its way into
column-parallel linears is saved for backward as its shard and gathered again in backward (the
backend's `collectives.gather_linears`); any other op that reads a gathered copy saves that copy,
a storage of its own (`gathered_source`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from shardc.analysis.resharding import normalize
from shardc.cost.comm import CommStep, call_overhead, collective_time, combine_gradients, reshard_steps
from shardc.cost.context import CostContext, axis_category
from shardc.cost.moe import TOKEN_OPERANDS, dispatcher_axes
from shardc.ir import Layout, Node, Partial, Placement, Replicate, Shard, Value


def _operand_dims(ctx: CostContext, node: Node, i: int) -> set[str]:
    space = ctx.local(node).space
    if space is None or i >= len(space.inputs):
        return set()
    return {f for factors in space.inputs[i] for f in factors}


def gradient_contribution(ctx: CostContext, node: Node, i: int) -> Layout:
    """The layout of the gradient `node` sends back to its input `i`."""
    local = ctx.local(node)
    layout = local.in_layouts[i]
    partition = ctx.partition(node)
    if partition is None or ctx.mesh is None:
        return layout
    indexed = _operand_dims(ctx, node, i)
    # Megatron's MoE dispatcher returns its tokens' gradients split as the tokens came (`shardc.cost.moe`)
    dispatched = dispatcher_axes(ctx, node) if i in TOKEN_OPERANDS else ()
    placements: list[tuple[str, Placement]] = []
    for axis in ctx.mesh.names:
        split = [d for a, d in partition.spatial if a == axis]
        p = layout.on(axis)
        if axis in dispatched:
            p = ctx.layout(node.inputs[i]).on(axis)
        elif split and isinstance(p, Replicate) and split[0] not in indexed:
            p = Partial("sum")
        if not isinstance(p, Replicate):
            placements.append((axis, p))
    return Layout(tuple(placements))


def needed_gradient(layout: Layout, passthrough: Collection[str] = ()) -> Layout:
    """The gradient layout a producer's backward needs: its output layout, Partial read as R;
    on `passthrough` axes a Partial gradient is accepted as it is."""
    return Layout(tuple((a, p) for a, p in layout.placements if isinstance(p, Shard))
                  + tuple((a, Partial("sum")) for a in sorted(passthrough)))


def _output_gradient(ctx: CostContext, v: Value) -> Layout | None:
    contributions = [gradient_contribution(ctx, u, i) for u in ctx.users.get(v, [])
                     for i, w in enumerate(u.inputs) if w is v]
    return combine_gradients(contributions, ctx.mesh) if contributions and ctx.mesh is not None else None


def feeds_only_parameters(node: Node, needs_grad: Collection[Value]) -> bool:
    """A single-output node whose only inputs needing a gradient are parameters."""
    return len(node.outputs) == 1 and not any(v in needs_grad and v.kind != "parameter" for v in node.inputs)


def passthrough_axes(ctx: CostContext, node: Node) -> set[str]:
    """Axes on which a node that only differentiates into parameters (a position embedding)
    and is not split there takes its Partial output gradient as it is: backward is linear in
    the output gradient, so its weight gradient is Partial too and joins the step's gradient
    sync instead of costing an all_reduce per micro-batch."""
    if ctx.mesh is None or not feeds_only_parameters(node, ctx.needs_grad):
        return set()
    partition = ctx.partition(node)
    split = {a for a, _ in partition.spatial} if partition else set()
    grad = _output_gradient(ctx, node.outputs[0])
    if grad is None:
        return set()
    return {a for a, p in grad.placements if isinstance(p, Partial) and a not in split}


def resolves(made: Layout, held: Layout) -> bool:
    """The node makes a partial sum (`made`) that its output value holds reduced (`held`)."""
    return any(isinstance(p, Partial) and not isinstance(held.on(a), Partial) for a, p in made.placements)


def gradient_layout(made: Layout, held: Layout) -> Layout:
    """The layout a producer's backward needs its output gradient in (before `needed_gradient`):
    the value's, or, when the node resolved its partial sum, what the node made (a reduce_scatter
    forward is an all_gather of the gradient backward)."""
    return made if resolves(made, held) else held


def input_steps(ctx: CostContext, value: Value, have: Layout, required: Layout) -> list[CommStep]:
    """Forward collectives that turn `value` laid out `have` into `required` (batch-scaled)."""
    if ctx.mesh is None:
        return []
    return [CommStep(s.kind, s.axis, s.nbytes * ctx.scale_of(value))
            for s in reshard_steps(have, required, value.type, ctx.mesh, ctx.elem_bytes(value))]


def gradient_steps(ctx: CostContext, value: Value, contributions: Sequence[Layout], layout: Layout,
                   passthrough: bool = False, split: Collection[str] = ()) -> list[CommStep]:
    """Backward collectives that bring the sum of the consumers' gradient `contributions` of
    `value` (laid out `layout`) into the layout its producer's backward needs. `passthrough`:
    the producer only differentiates into parameters and is split on the axes `split` only
    (see `passthrough_axes`)."""
    if not contributions or ctx.mesh is None:
        return []
    have = combine_gradients(contributions, ctx.mesh)
    through = {a for a, p in have.placements if isinstance(p, Partial) and a not in split} if passthrough else ()
    return input_steps(ctx, value, have, needed_gradient(layout, through))


def layer_params(ctx: CostContext, nodes: Sequence[Node]) -> dict[str, tuple[Value, float, frozenset[str]]]:
    """Parameters the layer reads: name -> (value, local elements, mesh axes its gradient is
    Partial over, i.e. must be summed across)."""
    out: dict[str, tuple[Value, float, frozenset[str]]] = {}
    for node in nodes:
        for i, v in enumerate(node.inputs):
            if v.kind != "parameter":
                continue
            axes: set[str] = set()
            if ctx.mesh is not None:
                contribution = gradient_contribution(ctx, node, i)
                axes = {a for a, p in contribution.placements if isinstance(p, Partial)}
                axes |= passthrough_axes(ctx, node)
            layout = ctx.layouts.get(v, v.layout)
            layout = layout if layout is not None else ctx.local(node).in_layouts[i]
            numel = ctx.local_bytes(v, layout) / ctx.elem_bytes(v)
            prev = out.get(v.name)
            out[v.name] = (v, numel, frozenset(axes) | (prev[2] if prev else frozenset()))
    return out


def steps_time(ctx: CostContext, steps: Sequence[CommStep]) -> dict[str, float]:
    """Seconds of `steps` by time category."""
    out: dict[str, float] = {}
    for step in steps:
        _add(out, axis_category(step.axis), comm_time(ctx, step))
    return out


def comm_time(ctx: CostContext, step: CommStep) -> float:
    """Seconds of one collective over the link levels of its mesh axis, plus the per-call cost of
    the backend's collective wrapper (`comm.call_overhead`, 0 except for calibrated links)."""
    levels = ctx.levels((step.axis,))
    t = collective_time(step.kind, step.nbytes, levels, ctx.algorithm)
    return t + call_overhead(levels) if t > 0 else t


def _add(acc: dict[str, float], key: str, value: float) -> None:
    if value:
        acc[key] = acc.get(key, 0.0) + value


GATHERED = -1000  # a saved-entry key (node, GATHERED - i): the copy of node's input i all-gathered on its edge


def regathered_by(readers: Sequence[tuple[Node, int]], plain: Callable[[Node], bool],
                  weight: Callable[[Value], bool] = lambda v: v.kind == "parameter") -> bool:
    """The rule the backend executes and the cost model prices: the readers of one all-gathered
    copy save the shard and gather it again in backward when every one of them is a linear
    reading it as its input (column-parallel; `plain`: no temporal split) and weights (`weight`:
    a parameter; in a lowered graph also one through its data-parallel `grad_sync` marker), all
    in one layer."""
    return bool(readers) and len({n.layer for n, _ in readers}) == 1 and all(
        i == 0 and plain(n) and (n.op == "linear" or (n.op == "matmul" and n.inputs[1].type.rank == 2))
        and all(weight(v) for v in n.inputs[1:]) for n, i in readers)


def _gather_readers(ctx: CostContext, node: Node, idx: int) -> list[tuple[Node, int]]:
    """The readers that share the collective on `node`'s input `idx` (lowering emits one per
    value and required layout: `shardc.analysis.resharding.edge_steps`)."""
    assert ctx.mesh is not None
    v = node.inputs[idx]
    need = normalize(ctx.local(node).in_layouts[idx], ctx.mesh)
    return [(u, j) for u in ctx.users.get(v, []) for j, w in enumerate(u.inputs)
            if w is v and normalize(ctx.local(u).in_layouts[j], ctx.mesh) == need]


def saves_shard(ctx: CostContext, node: Node, idx: int) -> bool:
    """`node`'s input `idx` arrives by exactly one all_gather whose readers save the shard and
    gather it again in backward (`regathered_by`; Megatron's sequence parallelism)."""
    if ctx.mesh is None or node.op not in ("linear", "matmul") or idx != 0 or node.inputs[idx].kind != "activation":
        return False
    v = node.inputs[idx]
    steps = input_steps(ctx, v, ctx.layout(v), ctx.local(node).in_layouts[idx])
    if len(steps) != 1 or steps[0].kind != "all_gather":
        return False

    def plain(n: Node) -> bool:
        part = ctx.partition(n)
        return part is None or not part.temporal

    return regathered_by(_gather_readers(ctx, node, idx), plain)


def regather_group(ctx: CostContext, node: Node) -> list[Node]:
    """The readers (graph order) that share `node`'s input 0 gathered and save the shard
    (`saves_shard`); [] when `node` does not. The backend runs them as one autograd node, whose
    backward runs once every reader's output gradient has arrived."""
    return [u for u, _ in _gather_readers(ctx, node, 0)] if saves_shard(ctx, node, 0) else []


def gathered_source(ctx: CostContext, node: Node, idx: int) -> tuple[Node, int, float] | None:
    """Where the tensor `node` saves as its input `idx` was all-gathered, when it was and the
    copy is what is saved: (the node on whose input edge the gather runs, that input's index,
    the gathered local bytes). Eager autograd saves the tensor the op read; when that edge (or an
    edge of the views it was read through) gathers a sharded value (context parallelism's keys
    and values, a norm's output read by anything but column-parallel linears), the saved tensor
    is the gathered copy, a new storage, not the shard. Column-parallel linears save the shard
    (`saves_shard`): None."""
    if ctx.mesh is None:
        return None
    while True:
        v = node.inputs[idx]
        if v.kind != "activation":
            return None
        local = ctx.local(node)
        required = local.in_layouts[idx]
        if any(step.kind == "all_gather" for step in input_steps(ctx, v, ctx.layout(v), required)):
            return None if saves_shard(ctx, node, idx) else (node, idx, ctx.local_bytes(v, required))
        producer = v.producer
        if producer is None or ctx.root(v) is v or not producer.inputs:
            return None
        node, idx = producer, 0  # a view: read through to the value it aliases
