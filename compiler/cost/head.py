"""A fused LM head and loss as the cost model sees it (`shardc.analysis.head_loss`: the rule
codegen runs): the regions among a layer's nodes, read through the context's partitions and
layouts, and the sizes the backend's `chunked_linear_cross_entropy` allocates. `layer.py` prices
its time and saved bytes, `timeline.py` its live memory. Also the unfused loss with its classes
split (`vocab_parallel_loss`), which the backend runs as Megatron's vocab-parallel cross entropy.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardc.analysis.head_loss import HeadLoss, fused_heads
from shardc.cost.context import CostContext
from shardc.ir import Axis, Layout, Node

LOSS_BYTES = 4.0  # the loss reads its logits in fp32 whatever the compute dtype


def head_regions(ctx: CostContext, nodes: Sequence[Node]) -> dict[Node, HeadLoss]:
    """The fused heads and losses among `nodes` (`shardc.analysis.head_loss`, the rule codegen
    runs), by each of their nodes, read through the context's partitions and layouts."""
    def layouts(node: Node) -> tuple[tuple[Layout, ...], tuple[Layout, ...]]:
        local = ctx.local(node)
        return local.in_layouts, local.out_layouts

    if ctx.mesh is not None and ctx.mesh.degree(Axis.PP) > 1:
        return {}  # pipelined: torch's schedule runs the loss apart from the last stage's module
    return fused_heads(nodes, ctx.users, ctx.partition, ctx.layout, layouts, ctx.graph.outputs)


def loss_logits_bytes(ctx: CostContext, node: Node) -> float:
    """Bytes of a loss's logits as it reads them, on one device: fp32 whatever the compute dtype
    (the runtime casts them: `backends.torch.precision`). What an unfused loss keeps for backward
    (its log-probabilities, or a vocabulary-parallel loss's softmax) and each logits-sized tensor
    it makes are this size; under mixed precision twice the logits the head made."""
    logits = node.inputs[0]
    return ctx.local_bytes(logits) / max(1, ctx.elem_bytes(logits)) * LOSS_BYTES


def head_chunk_bytes(ctx: CostContext, region: HeadLoss) -> float:
    """One chunk of the region's logits in fp32 (as the loss reads them), on one device."""
    logits = region.loss.inputs[0]
    return ctx.local(region.loss).in_types[0].numel * ctx.scale_of(logits) * LOSS_BYTES / region.steps


def head_saved_bytes(ctx: CostContext, region: HeadLoss) -> float:
    """What the fused loss saves besides its inputs x and targets: an fp32 log-sum-exp per row."""
    target = region.loss.inputs[1]
    return ctx.local(region.loss).in_types[1].numel * ctx.scale_of(target) * LOSS_BYTES


def head_working(ctx: CostContext, region: HeadLoss, backward: bool) -> float:
    """What the fused loss holds beyond its inputs and gradients while it runs, one chunk at a time:
    forward, the chunk's fp32 logits and log-sum-exp's two temporaries (the shifted logits and
    their exponentials); backward, the chunk's fp32 logits turned in place into their gradient,
    plus that gradient in the compute dtype under mixed precision (the matmuls' operand)."""
    chunk = head_chunk_bytes(ctx, region)
    if not backward:
        return 3 * chunk
    compute = ctx.elem_bytes(region.loss.inputs[0])
    return chunk + (chunk * compute / LOSS_BYTES if compute < LOSS_BYTES else 0.0)


def vocab_parallel_loss(ctx: CostContext, node: Node) -> bool:
    """Whether `node` is a cross entropy, not fused with its head, whose classes are split over a
    mesh axis: codegen runs it as `backends.torch.local_ops.vocab_parallel_cross_entropy`, which
    makes one logits-sized tensor beside the logits in forward (the softmax, a loss's usual
    log-probabilities), keeps it instead of the logits, and in backward turns it in place into the
    logits' gradient: no further logits-sized allocation, where an unsplit loss allocates the
    gradient of its log-probabilities and then the logits' own."""
    if node.op != "cross_entropy" or not node.inputs:
        return False
    local = ctx.local(node)
    layout = local.in_layouts[0] if local.in_layouts else ctx.layout(node.inputs[0])
    return bool(layout.sharded_dims().get(node.inputs[0].type.rank - 1))
