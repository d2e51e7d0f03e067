"""Aliasing: which storage every value lives in, as eager PyTorch allocates it.

One analysis, read by annotate-cost (saved bytes) and the cost model (saved activations, live
memory, copying views) alike.

Storage rule: every op runs on meta tensors with its operands' strides (cached per op, operand
types and strides, attributes); an output whose `_base` is an operand, or that is the operand
itself (dropout that drops nothing), shares that operand's storage; any other output is a
storage of its own, with the strides torch gave it. So a view of a view aliases the first
storage, and a reshape PyTorch cannot view (the attention output's transpose then reshape) is
a copy. Graph inputs, parameters and buffers are contiguous storages of their own; collective
and opaque ops, and ops that cannot run on meta tensors, make fresh contiguous storage.

Gradient rule (`passes_gradient`): an input's gradient is the output's own, with nothing
allocated, for views (except split and concat, whose backward concatenates or slices),
dropout that drops nothing, and an `add` of operands of the output's shape.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from shardc.ir import Graph, Node, TensorType, Value
from shardc.ops.registry import get_op, has_op
from shardc.ops.verifier import meta_tensor, run_on_meta

# Ops whose output is a new buffer even when their one-device implementation returns the input.
_FRESH_KINDS = frozenset({"collective", "opaque"})
_PASS_THROUGH = frozenset({"add"})  # d(a + b)/da = d(a + b)/db = the output gradient itself

Strides = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Aliasing:
    """The storage owner of every value, the view nodes that copy when they run, and every
    value's strides as eager PyTorch lays it out (global shapes)."""

    roots: Mapping[Value, Value]
    copies: frozenset[Node]
    strides: Mapping[Value, Strides] = field(default_factory=dict)

    def root(self, value: Value) -> Value:
        """The value owning `value`'s storage (itself unless torch makes it a view)."""
        return self.roots.get(value, value)


def contiguous_strides(shape: tuple[int, ...]) -> Strides:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=16384)
def _behaviour(op_name: str, inputs: tuple[tuple[TensorType, Strides], ...],
               attrs: tuple[tuple[str, Any], ...]) -> tuple[tuple[int | None, Strides], ...] | None:
    """Per output: the index of the input whose storage it shares (None: its own) and its strides;
    None when the op cannot run on meta tensors."""
    op = get_op(op_name)
    try:
        tensors = [torch.empty_strided(t.shape, strides, dtype=meta_tensor(t).dtype, device="meta")
                   for t, strides in inputs]
        outs = run_on_meta(op, tensors, dict(attrs))
    except Exception:  # the verifier reports broken nodes; here they just get fresh storage
        return None
    result = []
    for out in outs:
        base = out._base if out._base is not None else out
        source = next((j for j, t in enumerate(tensors) if t is base), None)
        result.append((source, tuple(out.stride())))
    return tuple(result)


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    hash(value)
    return value


def node_behaviour(node: Node, strides: Mapping[Value, Strides]) -> tuple[tuple[int | None, Strides], ...] | None:
    """Per output of `node` run on inputs of the given strides (contiguous where not given): the
    input whose storage it shares (None: its own) and its strides; None when unknown."""
    if not has_op(node.op) or get_op(node.op).kind in _FRESH_KINDS:
        return None
    key = tuple((v.type, strides.get(v) or contiguous_strides(v.type.shape)) for v in node.inputs)
    try:
        found = _behaviour(node.op, key, tuple((k, _freeze(a)) for k, a in node.attrs.items()))
    except TypeError:  # unhashable attributes: no aliasing known
        return None
    return found if found is not None and len(found) == len(node.outputs) else None


def aliasing(graph: Graph) -> Aliasing:
    """Storage owners and copying views of every value of `graph` (see the module rule)."""
    roots: dict[Value, Value] = {}
    strides: dict[Value, Strides] = {}
    copies: set[Node] = set()
    for v in (*graph.inputs, *graph.params, *graph.buffers):
        roots[v], strides[v] = v, contiguous_strides(v.type.shape)
    for node in graph.nodes:
        behaviour = node_behaviour(node, strides)
        for k, v in enumerate(node.outputs):
            source, out_strides = behaviour[k] if behaviour is not None else (None, None)
            if out_strides is None or len(out_strides) != v.type.rank:
                out_strides = contiguous_strides(v.type.shape)
            roots[v] = roots.get(node.inputs[source], node.inputs[source]) if source is not None else v
            strides[v] = out_strides
        if node.op != "concat" and has_op(node.op) and get_op(node.op).kind == "view" and behaviour is not None \
                and any(source is None for source, _ in behaviour):
            copies.add(node)
    return Aliasing(roots, frozenset(copies), strides)


def aliases(node: Node) -> bool:
    """Whether the node's first output is its first input's storage, its inputs contiguous (a
    view, or dropout that drops nothing: no kernel runs)."""
    behaviour = node_behaviour(node, {})
    return behaviour is not None and len(behaviour) > 0 and behaviour[0][0] == 0


def passes_gradient(node: Node, i: int) -> bool:
    """Whether input `i`'s gradient is the output's own, with nothing allocated (module rule)."""
    if node.op in ("split", "concat"):
        return False
    if has_op(node.op) and get_op(node.op).kind == "view":
        return True
    if node.op == "dropout":
        return aliases(node)
    if node.op in _PASS_THROUGH and node.outputs:
        return node.inputs[i].type.shape == node.outputs[0].type.shape
    return False
