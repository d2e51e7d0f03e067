"""Node groups: the units the solver chooses partitions for.

Rule: an elementwise or view node joins the group of the latest producer among its
activation inputs when that producer is in the same layer (among the inputs of the output's
own shape, when there are any: a broadcast addend does not decide); a loss the LM head feeds
through reshapes (`shardc.analysis.head_loss.head_chain`) joins the head's group, so that the
two are chosen together (the head's chunks run fused with the loss); every other node anchors
a new group. A group's partition is its anchor's; followers inherit it through their inputs'
layouts (see `shardc.search.candidates`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.analysis.head_loss import head_chain
from shardc.analysis.roles import node_space
from shardc.ir import Graph, Node
from shardc.ops.registry import IterationSpace, get_op, has_op

FOLLOWER_KINDS = frozenset({"elementwise", "view"})


@dataclass(eq=False)
class NodeGroup:
    """An anchor node and the elementwise/view nodes merged into it, in graph order."""

    index: int
    members: list[Node]
    layer: str | None
    position: int = 0  # index of the group inside its layer
    spaces: list[IterationSpace | None] = field(default_factory=list)

    @property
    def anchor(self) -> Node:
        return self.members[0]

    @property
    def name(self) -> str:
        return f"{self.anchor.op}@{self.anchor.location.module_path or self.anchor.outputs[0].name}"


def build_groups(graph: Graph) -> list[NodeGroup]:
    """Merge elementwise and view nodes into their producers' groups (see the module rule)."""
    group_of: dict[Node, NodeGroup] = {}
    order: dict[Node, int] = {}
    groups: list[NodeGroup] = []
    users = graph.users()
    for i, node in enumerate(graph.nodes):
        order[node] = i
        target: NodeGroup | None = None
        kind = get_op(node.op).kind if has_op(node.op) else "opaque"
        chain = head_chain(node, users, graph.outputs) if kind == "loss" else None
        if chain is not None and chain[0] in group_of:
            target = group_of[chain[0]]
        elif kind in FOLLOWER_KINDS:
            inputs = [v for v in node.inputs if v.producer is not None and v.producer in group_of
                      and v.producer.layer == node.layer]
            # Prefer an input of the output's own shape over a broadcast one (a position embedding).
            full = [v for v in inputs if node.outputs and v.type.shape == node.outputs[0].type.shape]
            producers = [v.producer for v in (full or inputs) if v.producer is not None]
            if producers:
                target = group_of[max(producers, key=lambda p: order[p])]
        if target is None:
            target = NodeGroup(len(groups), [], node.layer)
            groups.append(target)
        target.members.append(node)
        target.spaces.append(node_space(node))
        group_of[node] = target
    per_layer: dict[str | None, int] = {}
    for g in groups:
        g.position = per_layer.get(g.layer, 0)
        per_layer[g.layer] = g.position + 1
    return groups
