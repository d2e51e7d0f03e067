"""What particular ops hold while they run, beyond their outputs, in the live-memory timeline
(`shardc.cost.timeline`): a loss (its fp32 log-probabilities and their gradients, a graph without
its own loss's training-loop loss, a vocabulary-parallel loss's in-place gradient) and the
column-parallel linears that share one gathered input under sequence parallelism (their gathered
copy in forward; in backward the input gradient at the gathered size and what the backend's loop
still holds of its weight gradients). Each term names the tensor it is.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardc.analysis.head_loss import HeadLoss
from shardc.cost.context import CostContext
from shardc.cost.edges import regather_group
from shardc.cost.head import head_working, loss_logits_bytes, vocab_parallel_loss
from shardc.ir import Axis, Layout, Node, Value
from shardc.ops.registry import get_op


def default_loss_bytes(ctx: CostContext, nodes: Sequence[Node]) -> float:
    """Bytes a graph without its own loss (its first output not a scalar: `shardc.train.default_loss`)
    holds in the training loop's loss at that loss's backward, when `nodes` make that output.
    The runtime hands the loss the output gathered to the data-parallel share (every other mesh
    axis gathered: G bytes); next-token cross entropy on logits over token ids holds G, its fp32
    log-probabilities (saved), the gradient of the negative log-likelihood and of the
    log-softmax (three fp32 copies); a mean square holds G, its fp32 square and that gradient.
    A pipelined graph's G is the last stage's output torch's schedule keeps for the loss
    (`output_chunks`), priced with the pipeline's buffers (`peak.pipeline_buffers`): not again here."""
    graph = ctx.graph
    if not graph.outputs or graph.outputs[0].type.rank == 0:
        return 0.0
    out = graph.outputs[0]
    if out.producer is None or out.producer not in set(nodes):
        return 0.0
    kept = Layout(tuple((a, p) for a, p in ctx.layout(out).placements if a == Axis.DP))
    gathered = ctx.local_bytes(out, kept)
    fp32 = gathered / max(1, ctx.elem_bytes(out)) * 4
    first = graph.inputs[0].type if graph.inputs else None
    tokens = (out.type.is_float and out.type.rank >= 2 and first is not None and not first.is_float
              and tuple(first.shape) == tuple(out.type.shape[:-1]))
    pipelined = ctx.mesh is not None and Axis.PP in ctx.mesh.names and ctx.mesh.axis_size(Axis.PP) > 1
    held = 0.0 if pipelined else gathered
    return held + (3 if tokens else 2) * fp32


def loss_extra(ctx: CostContext, node: Node, regions: dict[Node, HeadLoss] | None = None,
                backward: bool = False) -> float:
    """A loss holds log-probabilities (forward) or their gradient (backward) the size of its input;
    a fused head and loss one chunk's working set (`head_working`); a vocabulary-parallel loss
    nothing in backward (`vocab_parallel_loss`: its softmax becomes the logits' gradient)."""
    if get_op(node.op).kind != "loss" or not node.inputs:
        return 0.0
    if regions and node in regions:
        return head_working(ctx, regions[node], backward)
    if backward and vocab_parallel_loss(ctx, node):
        return 0.0
    read = loss_logits_bytes(ctx, node)
    # Backward: the log-probabilities' gradient, and the logits' own made in fp32 too before it
    # is cast back (beyond the compute-dtype gradient `_backward` allocates for the logits).
    return read + (read - ctx.local_bytes(node.inputs[0])) if backward else read


def in_place_gradient(ctx: CostContext, node: Node, saved: dict, recomputed: dict,
                       allocs: dict[Value, float]) -> float:
    """Bytes of the input gradient `node` writes over a tensor it saved rather than allocating:
    a vocabulary-parallel loss's logits' gradient, in its saved softmax (`vocab_parallel_loss`)."""
    if not vocab_parallel_loss(ctx, node) or node.inputs[0] not in allocs:
        return 0.0
    key = ctx.root(node.inputs[0])
    return min(allocs[node.inputs[0]], saved.get(key, recomputed.get(key, 0.0)))


def gathered_readers(ctx: CostContext, nodes: Sequence[Node], inside: set[Node]) -> dict[Node, tuple[list[Node], float]]:
    """Column-parallel readers of one gathered input that save its shard (`edges.regather_group`),
    by their first reader: (the readers, the gathered copy's bytes). Their forward holds the copy
    while they run; their one backward runs at the first reader's turn and holds the input
    gradient at the gathered size and the pieces gathered again (or, after them, the reduce-
    scatter's full-size sum) beside it."""
    out: dict[Node, tuple[list[Node], float]] = {}
    for node in nodes:
        members = regather_group(ctx, node)
        if members and members[0] is node and all(m in inside for m in members):
            out[node] = (members, ctx.local_bytes(node.inputs[0], ctx.local(node).in_layouts[0]))
    return out


def last_piece(ctx: CostContext, node: Node, last: Node) -> float:
    """What the backward of gathered column-parallel linears (`collectives.gather_linears`) still
    holds of its weight gradients' loop when it reduce-scatters the input gradient: the last
    reader's last weight-gradient piece, and the rows of that reader's output gradient for that
    piece, a copy unless the pieces are split along the leading dim (the loop's locals live to
    the backward's end)."""
    weight = ctx.local_bytes(last.inputs[1]) if len(last.inputs) > 1 else 0.0
    shard = ctx.layout(node.inputs[0]).sharded_dims()
    gathered = ctx.local(node).in_layouts[0].sharded_dims()
    dims = [d for d, axes in shard.items() if axes != gathered.get(d)]
    local = ctx.local(last).out_types[0].shape if ctx.local(last).out_types else ()
    leading = 1
    for size in local[:dims[0]] if dims else ():
        leading *= size
    pieces = ctx.local_bytes(node.inputs[0], ctx.local(node).in_layouts[0]) / max(1.0, ctx.local_bytes(node.inputs[0]))
    rows = ctx.local_bytes(last.outputs[0]) / max(1.0, pieces) if leading * ctx.scale_of(last.outputs[0]) > 1 else 0.0
    return weight + rows
