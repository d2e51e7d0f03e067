"""The LM head and its loss as one chunked region: which graph pattern runs fused, one rule for
the candidates, the backend and the cost model.

Rule. A `cross_entropy` node and the LM head form a region when its logits come, through
reshapes only, from a `linear` of the same layer, each value on the way read by nothing but the
next node and none a graph output (`head_chain`: the shape of the graph; such a loss joins the
head's node group, `shardc.analysis.groups`, so the solver chooses the two together). A region
runs fused (`fused_head`) when, besides, the linear's partition cuts its token rows into
`steps` chunks on the same devices (a temporal split without rotation, of a dim that is neither
the contraction nor the classes), the loss has no temporal split, the linear's output is made
in the layout it is held in (no partial sum resolved) and every value on the way already has
the layout its reader requires (no collective in between; classes split over a mesh axis stay
split: vocab-parallel, the linear's `n` and the loss's `v` alike). Then the backend runs the three
as `backends.torch.fused_loss.chunked_linear_cross_entropy` (one chunk's logits live at a time,
recomputed in backward) and the cost model prices exactly that: no logits storage, one chunk's
fp32 logits (and their compute-dtype copy under mixed precision) as working memory in both
passes, a log-sum-exp per row saved, the head's matmul once more in backward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from shardc.ir import Layout, Node, Partition, Value

HEAD_OPS = frozenset({"linear"})
CHAIN_OPS = frozenset({"reshape"})
LOSS_OPS = frozenset({"cross_entropy"})
Layouts = tuple[Sequence[Layout], Sequence[Layout]]  # a node's required input and produced output layouts


@dataclass(frozen=True, slots=True)
class HeadLoss:
    """A fused head and loss: the linear, the reshapes between (graph order), the loss, the chunks."""

    linear: Node
    views: tuple[Node, ...]
    loss: Node
    steps: int

    @property
    def nodes(self) -> tuple[Node, ...]:
        return (self.linear, *self.views, self.loss)


def head_chain(loss: Node, users: Mapping[Value, Sequence[Node]],
               outputs: Sequence[Value] = ()) -> tuple[Node, tuple[Node, ...]] | None:
    """(linear, reshapes) when `loss` reads a linear of its layer through reshapes only, each value
    on the way read once and not a graph output (the module rule's graph shape); else None."""
    if loss.op not in LOSS_OPS or not loss.inputs:
        return None
    views: list[Node] = []
    v = loss.inputs[0]
    while True:
        node = v.producer
        if node is None or node.layer != loss.layer or v in outputs:
            return None
        if [u for u in users.get(v, [])] != [views[-1] if views else loss]:
            return None
        if node.op in HEAD_OPS:
            return node, tuple(reversed(views))
        if node.op not in CHAIN_OPS:
            return None
        views.append(node)
        v = node.inputs[0]


def chunk_steps(partition: Partition | None) -> int:
    """The steps of a partition's temporal split without rotation (1 when it has none)."""
    for split in partition.temporal if partition is not None else ():
        if split.rotate is None and split.grid is None:
            return split.steps
    return 1


def fused_head(loss: Node, users: Mapping[Value, Sequence[Node]], partition: Callable[[Node], Partition | None],
               layout: Callable[[Value], Layout], layouts: Callable[[Node], Layouts],
               outputs: Sequence[Value] = ()) -> HeadLoss | None:
    """The fused region `loss` heads under the partitions (module rule), None when its nodes run
    apart. `partition`, `layout` and `layouts` read a node's partition, a value's layout and the
    layouts a node requires of its inputs and makes of its outputs (a partitioned or lowered
    graph, or the solver's overlay)."""
    chain = head_chain(loss, users, outputs)
    if chain is None:
        return None
    linear, views = chain
    head, part = partition(linear), partition(loss)
    steps = chunk_steps(head)
    if steps <= 1 or head is None or len(head.temporal) != 1 or head.temporal[0].dim in ("k", "n"):
        return None
    if part is not None and part.temporal:
        return None
    if layouts(linear)[1][0] != layout(linear.outputs[0]):
        return None
    for node in (*views, loss):
        if layouts(node)[0][0] != layout(node.inputs[0]):
            return None
    return HeadLoss(linear, views, loss, steps)


def fused_heads(nodes: Sequence[Node], users: Mapping[Value, Sequence[Node]],
                partition: Callable[[Node], Partition | None], layout: Callable[[Value], Layout],
                layouts: Callable[[Node], Layouts], outputs: Sequence[Value] = ()) -> dict[Node, HeadLoss]:
    """Every fused region among `nodes`, by each of its nodes (`fused_head`)."""
    out: dict[Node, HeadLoss] = {}
    for node in nodes:
        if node.op in LOSS_OPS:
            region = fused_head(node, users, partition, layout, layouts, outputs)
            if region is not None:
                out.update(dict.fromkeys(region.nodes, region))
    return out
