"""Node groups and dim roles: the units the solver chooses partitions for.

Rule: an elementwise or view node joins the group of the latest producer among its
activation inputs when that producer is in the same layer (among the inputs of the output's
own shape, when there are any: a broadcast addend does not decide); every other node anchors
a new group. A group's partition is its anchor's; followers inherit it through their inputs'
layouts (see `shardc.search.candidates`).

Dim roles: the graph's integer inputs are `[batch, seq]` token ids; roles flow forward
through every node's iteration space (an output dim takes the role of the iteration factor
that is its major factor), so every tensor dim that is a batch or a sequence dim is known.
The data-parallel mesh axis always splits batch dims, the context-parallel axis sequence dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.ir import Graph, Node, Value
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


def node_space(node: Node) -> IterationSpace | None:
    """The node's iteration space, or None for an op the registry has no rule for."""
    if not has_op(node.op):
        return None
    try:
        return get_op(node.op).iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs],
                                               node.attrs)
    except (ValueError, KeyError, IndexError):
        return None


def build_groups(graph: Graph) -> list[NodeGroup]:
    """Merge elementwise and view nodes into their producers' groups (see the module rule)."""
    group_of: dict[int, NodeGroup] = {}
    order: dict[int, int] = {}
    groups: list[NodeGroup] = []
    for i, node in enumerate(graph.nodes):
        order[id(node)] = i
        target: NodeGroup | None = None
        kind = get_op(node.op).kind if has_op(node.op) else "opaque"
        if kind in FOLLOWER_KINDS:
            inputs = [v for v in node.inputs if v.producer is not None and id(v.producer) in group_of
                      and v.producer.layer == node.layer]
            # Prefer an input of the output's own shape over a broadcast one (a position embedding).
            full = [v for v in inputs if node.outputs and v.type.shape == node.outputs[0].type.shape]
            producers = [v.producer for v in (full or inputs) if v.producer is not None]
            if producers:
                target = group_of[id(max(producers, key=lambda p: order[id(p)]))]
        if target is None:
            target = NodeGroup(len(groups), [], node.layer)
            groups.append(target)
        target.members.append(node)
        target.spaces.append(node_space(node))
        group_of[id(node)] = target
    per_layer: dict[str | None, int] = {}
    for g in groups:
        g.position = per_layer.get(g.layer, 0)
        per_layer[g.layer] = g.position + 1
    return groups


def dim_roles(graph: Graph) -> dict[int, tuple[str | None, ...]]:
    """id(value) -> role ("batch", "seq" or None) of each tensor dim (see the module rule)."""
    roles: dict[int, tuple[str | None, ...]] = {}
    for v in graph.inputs:
        if not v.type.is_float and v.type.rank >= 1:
            roles[id(v)] = (("batch", "seq") + (None,) * v.type.rank)[: v.type.rank]
        elif v.type.rank >= 2:
            roles[id(v)] = ("batch", "seq") + (None,) * (v.type.rank - 2)
    for node in graph.nodes:
        space = node_space(node)
        if space is None:
            continue
        it_roles = iteration_roles(node, space, roles)
        lead = [roles.get(id(v), (None,))[:1] == ("batch",) and v.type.rank >= 1 for v in node.inputs]
        for operand, out in zip(space.outputs, node.outputs):
            out_roles = [it_roles.get(f[0]) if f else None for f in operand]
            # A batch of one binds as a broadcast dim: keep the batch role on dim 0 by position.
            if out_roles and out_roles[0] is None and any(
                    ok and v.type.shape[0] == out.type.shape[0] for ok, v in zip(lead, node.inputs)):
                out_roles[0] = "batch"
            roles[id(out)] = tuple(out_roles)
    return roles


def iteration_roles(node: Node, space: IterationSpace, roles: dict[int, tuple[str | None, ...]]) -> dict[str, str]:
    """Iteration dim -> role, read off the node's operands (inputs first, then outputs)."""
    out: dict[str, str] = {}
    for operand, v in list(zip(space.inputs, node.inputs)) + list(zip(space.outputs, node.outputs)):
        for factors, role in zip(operand, roles.get(id(v), ())):
            if factors and role and factors[0] not in out:
                out[factors[0]] = role
    return out


def storage_root(value: Value) -> Value:
    """Follow view ops back to the value whose storage a view aliases."""
    while value.producer is not None and has_op(value.producer.op) and get_op(value.producer.op).kind == "view" \
            and value.producer.inputs:
        value = value.producer.inputs[0]
    return value
