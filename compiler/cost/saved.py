"""What a layer's ops save for backward, each storage once, by the key it is kept under.

`saved_for_backward` fills a layer's saved entries (raw bytes keyed by the storage's root value,
or by (node, k) for what has no value of its own), with whether selective recomputation drops
each (the attention core's own tensors). Keys besides values: a rotating node's received shards
(node, -1 - input index) (`received_entries`), causal ring attention's extra blocks (node,
RING_SAVED), sdpa's bool mask as the float copy its kernel saves (node, MASK_SAVED), the gathered
copy eager autograd keeps of an all-gathered input (where, GATHERED - i) (`edges.gathered_source`),
the copy a batched matmul saves of an input it cannot view (node, COPIED - i) (`matmul_copy`).
Moved from `cost.layer`, which charges the rest of a layer's cost.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence

import torch

from shardc.cost.context import CostContext
from shardc.cost.edges import GATHERED, gathered_source
from shardc.cost.head import loss_logits_bytes
from shardc.cost.ring import causal_ring_saved
from shardc.ir import Node, TensorType, Value
from shardc.ops.registry import rotating_operands
from shardc.ops.verifier import meta_tensor, recording_saved

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
COPIED = -200  # (node, COPIED - i): the copy a matmul saves of its input i (`matmul_copy`)


@functools.lru_cache(maxsize=4096)
def _saved_copy_ratio(types: tuple[TensorType, TensorType], strides: tuple[tuple[int, ...], ...],
                      idx: int) -> float | None:
    """torch.matmul on meta tensors of these types and strides, only the other operand needing
    a gradient: the bytes of what it saves of operand `idx` over that operand's own when that is
    a new storage (a copy), else None (a view of the operand, or nothing saved)."""
    tensors = [torch.empty_strided(t.shape, st, dtype=meta_tensor(t).dtype, device="meta")
               for t, st in zip(types, strides)]
    other = tensors[1 - idx].requires_grad_()
    try:
        with recording_saved() as saved:
            torch.matmul(*tensors)
    except RuntimeError:
        return None
    mine = tensors[idx].untyped_storage()._cdata
    copies = [t for t in saved if t.untyped_storage()._cdata not in (mine, other.untyped_storage()._cdata)]
    if not copies or types[idx].numel == 0:
        return None
    return max(t.numel() for t in copies) / types[idx].numel


def matmul_copy(ctx: CostContext, node: Node, idx: int) -> float | None:
    """Local bytes of the copy a batched matmul saves of its input `idx`, when torch cannot view
    that input as the 3-d operand of `bmm` (or the 2-d one of a folded `mm`): `torch.matmul`
    expands and reshapes it, and a reshape of a permuted view (attention's query, key and value
    read per head from one projection) is a new storage, which is what autograd saves, not the
    projection's. None when it saves a view (or for any other op). Strides are the graph's
    (`aliasing`, global shapes): a shard keeps its tensor's layout."""
    if node.op != "matmul" or len(node.inputs) != 2 or not all(v.type.rank >= 2 for v in node.inputs):
        return None
    strides = tuple(ctx.storage.strides.get(v) for v in node.inputs)
    if any(st is None for st in strides):
        return None
    ratio = _saved_copy_ratio((node.inputs[0].type, node.inputs[1].type), strides, idx)  # type: ignore[arg-type]
    return None if ratio is None else ratio * ctx.local_bytes(node.inputs[idx], ctx.local(node).in_layouts[idx])


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
        copied = matmul_copy(ctx, node, idx) if kind == "in" else None
        if copied is not None:
            # Kept under selective recomputation too: the core's checkpoint keeps instead the
            # storage the copy was made from (its argument), which the copies of its pieces
            # (query, key and value of one projection) add up to.
            entries[(node, COPIED - idx)] = (copied, False)
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
