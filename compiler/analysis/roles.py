"""Dim roles: which tensor dims of every value are the batch and which the sequence.

One rule, read by apply-plan (dp splits the batch, cp the sequence), the solver's candidates
(the same, plus which dims a batch scale multiplies) and the cost of a plan alike:
- Graph inputs: dim 0 is the batch when its extent is the first input's dim 0, dim 1 the
  sequence when its extent is the first input's dim 1 (token ids `[batch, seq]`; a mask
  `[batch, 1, seq, seq]` has no sequence on dim 1).
- Through every node's iteration space: an iteration dim takes the role of the input tensor
  dim whose major factor it is (inputs in order; the first that gives a dim a role wins), and
  an output tensor dim the role of its major factor. Several iteration dims may share a role
  (the query and the key sequence of attention written as matmuls).
- A batch of one binds as a broadcast dim: an output whose dim 0 has no role keeps the batch
  there when an input with the batch on dim 0 has the same extent.
- A node the registry has no rule for (or whose operands its signature cannot bind) gives its
  outputs no roles.
"""

from __future__ import annotations

from shardc.ir import Graph, Node, Value
from shardc.ops.registry import IterationSpace, get_op, has_op

ROLES = ("batch", "seq")
Roles = dict[Value, tuple[str | None, ...]]


def node_space(node: Node) -> IterationSpace | None:
    """The node's iteration space, or None for an op the registry has no rule for."""
    if not has_op(node.op):
        return None
    try:
        return get_op(node.op).iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs],
                                               node.attrs)
    except (ValueError, KeyError, IndexError):
        return None


def input_roles(graph: Graph) -> Roles:
    """Roles of the graph inputs (see the module rule)."""
    out: Roles = {}
    first: tuple[int, ...] = graph.inputs[0].type.shape if graph.inputs else ()
    for v in graph.inputs:
        roles: list[str | None] = [None] * v.type.rank
        if v.type.rank >= 1 and first and v.type.shape[0] == first[0]:
            roles[0] = "batch"
        if v.type.rank >= 2 and len(first) >= 2 and v.type.shape[1] == first[1]:
            roles[1] = "seq"
        out[v] = tuple(roles)
    return out


def iteration_roles(node: Node, space: IterationSpace, roles: Roles) -> dict[str, str]:
    """Iteration dim -> role, read off the node's inputs in order (the first role a dim gets wins)."""
    out: dict[str, str] = {}
    for operand, v in zip(space.inputs, node.inputs):
        for factors, role in zip(operand, roles.get(v, ())):
            if factors and role is not None and factors[0] not in out:
                out[factors[0]] = role
    return out


def dim_roles(graph: Graph) -> Roles:
    """Value -> per tensor dim its role ("batch", "seq" or None); see the module rule."""
    roles = input_roles(graph)
    for node in graph.nodes:
        space = node_space(node)
        if space is None:
            continue
        it = iteration_roles(node, space, roles)
        batched = [roles.get(v, (None,))[:1] == ("batch",) and v.type.rank >= 1 for v in node.inputs]
        for operand, out in zip(space.outputs, node.outputs):
            out_roles = [it.get(f[0]) if f else None for f in operand]
            if out_roles and out_roles[0] is None and any(
                    ok and v.type.shape[0] == out.type.shape[0] for ok, v in zip(batched, node.inputs)):
                out_roles[0] = "batch"
            roles[out] = tuple(out_roles)
    return roles
