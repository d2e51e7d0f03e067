"""What a layer's ops save for backward, each storage once, by the key it is kept under.

`saved_for_backward` fills a layer's saved entries (raw bytes keyed by the storage's root value,
or by (node, k) for what has no value of its own), with whether selective recomputation drops
each (the attention core's own tensors). Keys besides values: a rotating node's received shards
(node, -1 - input index) (`received_entries`), causal ring attention's extra blocks (node,
RING_SAVED), sdpa's bool mask as the float copy its kernel saves (node, MASK_SAVED), the gathered
copy eager autograd keeps of an all-gathered input (where, GATHERED - i) (`edges.gathered_source`).
Moved from `cost.layer`, which charges the rest of a layer's cost.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from shardc.cost.context import CostContext
from shardc.cost.edges import GATHERED, gathered_source
from shardc.cost.head import loss_logits_bytes
from shardc.cost.ring import causal_ring_saved
from shardc.ir import Node, Value
from shardc.ops.registry import rotating_operands

SavedKey = Value | tuple[Node, int]


def batched_scale(ctx: CostContext, values: Sequence[Value]) -> float:
    """The batch scale when any of `values` depends on the batch, else 1."""
    return ctx.batch_scale if any(v in ctx.batched for v in values) else 1.0


def rotation(ctx: CostContext, node: Node) -> tuple[int, list[int], list[int]] | None:
    """(steps, rotating inputs, indexed inputs) of a node whose temporal split rotates an operand
    along a mesh axis as `rotating_loop` runs it (not attention's ring, not a grid); else None.
    Rotating inputs hold their shard of the rotated dim and move; indexed ones hold it whole."""
    local, part = ctx.local(node), ctx.partition(node)
    if part is None or local.space is None or local.op.kind == "attention":
        return None
    for split in part.temporal:
        if split.rotate is not None and split.grid is None and split.steps > 1:
            moving = rotating_operands(local.space, part, split)
            holding = [i for i, operand in enumerate(local.space.inputs)
                       if any(f and f[0] == split.dim for f in operand)]
            return split.steps, moving, [i for i in holding if i not in moving]
    return None


RING_SAVED = -100  # a saved-entry key (node, RING_SAVED): causal ring attention's blocks (`ring.causal_ring_saved`)
MASK_SAVED = -101  # (node, MASK_SAVED): sdpa's bool mask as the float copy its kernel saves (one per call)


def received_entries(ctx: CostContext, node: Node, saves: Sequence[tuple[str, int, float]]) -> dict[int, float]:
    """Input index -> bytes of the rotated shards a rotating node saves for backward: each step
    receives its operand's next shard into a new buffer, and an op that saves that operand saves
    the buffer, so the `steps - 1` received shards stay until the node's backward (the first
    shard is the input itself, counted where it is made)."""
    rot = rotation(ctx, node)
    if rot is None:
        return {}
    steps, moving, _ = rot
    local = ctx.local(node)
    saved = {idx for kind, idx, _ in saves if kind == "in"}
    return {i: (steps - 1) * local.in_types[i].nbytes * ctx.scale_of(node.inputs[i]) for i in moving if i in saved}


def saved_for_backward(ctx: CostContext, node: Node, saves: Sequence[tuple[str, int, float]], in_core: bool,
                       core: Collection[Node], produced: Collection[Value], internal_only: bool,
                       entries: dict[SavedKey, tuple[float, bool]], roots: set[Value]) -> None:
    """Saved for backward, each storage once (raw bytes keyed by (node, k)), parameters and
    buffers excluded, with whether selective recomputation drops it; a rotating node's received
    shards keyed by (node, -1 - input index) (`received_entries`)."""
    for i, nbytes in received_entries(ctx, node, saves).items():
        entries[(node, -1 - i)] = (nbytes, in_core)
    ring = causal_ring_saved(ctx, node)
    if ring:  # eager causal ring attention's blocks beyond the fused kernel's saves (`ring.causal_ring_saved`)
        entries[(node, RING_SAVED)] = (ring, in_core)
    mask = node.inputs[3] if node.op == "scaled_dot_product_attention" and len(node.inputs) > 3 else None
    if mask is not None and not mask.type.is_float:  # the kernel saves a bool mask converted to the query's dtype
        copy = ctx.local_bytes(mask) / max(1, ctx.elem_bytes(mask)) * ctx.elem_bytes(node.inputs[0])
        entries[(node, MASK_SAVED)] = (copy, in_core)
    for k, (kind, idx, nbytes) in enumerate(saves):
        if kind == "bytes":
            entries[(node, k)] = (nbytes * batched_scale(ctx, node.outputs), in_core)
            continue
        v = node.inputs[idx] if kind == "in" else node.outputs[idx]
        found = gathered_source(ctx, node, idx) if kind == "in" else None
        if found is not None:  # the gathered copy eager autograd keeps (`gathered_source`)
            where, j, copy = found
            entries[(where, GATHERED - j)] = (copy, in_core and where in core and where not in heads(core))
            continue
        root = ctx.root(v)
        if root.kind in ("parameter", "buffer"):
            continue
        # Dropped under selective recomputation: what the core saves of its own tensors
        # (the core's output, saved by the projection after it, is kept).
        root_in_core = in_core and root.producer is not None and root.producer in core
        # A fragment does not know how a storage made elsewhere is laid out: the view it reads.
        known = not internal_only or root in produced or root in ctx.layouts
        if internal_only and root not in produced:
            roots.add(root)
        nbytes = ctx.local_bytes(root if known else v)
        if kind == "in" and idx == 0 and ctx.local(node).op.kind == "loss" and v.type.is_float:
            nbytes = loss_logits_bytes(ctx, node)  # the fp32 log-probabilities it keeps in the logits' place
        entries[root] = (nbytes, root_in_core)


def heads(core: Collection[Node]) -> set[Node]:
    """The nodes that open an attention core (read nothing the core makes): what is gathered on
    their inputs is gathered before the core runs, so selective recomputation keeps it."""
    return {n for n in core if not any(v.producer in core for v in n.inputs if v.producer is not None)}
