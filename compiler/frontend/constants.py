"""Constants while lowering a traced graph: calls that read no input, parameter or buffer.

Such a call (`torch.arange(s)`, a causal mask built from sizes) is evaluated for real on the CPU
(`ConstantFolding.fold`) and carried as a `Const`. When the graph needs its value, its
computation is lowered to IR ops if every step has a rule; otherwise (transformers' mask helpers
use cumsum and gathers) it becomes a buffer named `const.N` (`ConstantFolding.materialize`).
Also here: the small tree helpers the lowering shares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from shardc.frontend.capture import module_path_of, source_of
from shardc.frontend.emit import Emitter, Unsupported, to_meta
from shardc.frontend.rules import ATEN, FUNCTIONS, METHODS, Rule
from shardc.ir import Location, Value


def lookup(kind: str, target: Any) -> Rule | None:
    """The rule for an fx node (`call_function` or `call_method`), or None."""
    if kind == "call_method":
        return METHODS.get(target)
    if isinstance(target, torch._ops.OpOverload):
        return ATEN.get(target.overloadpacket)
    try:
        return FUNCTIONS.get(target)
    except TypeError:  # an unhashable callable
        return None


@dataclass(eq=False)
class Const:
    """A tensor computed from constants only: its real value and where in which call it came from."""

    value: torch.Tensor
    node: torch.fx.Node | None
    path: tuple[int, ...] = ()


def flat_leaves(tree: Any) -> list[Any]:
    """Every leaf of nested lists, tuples, dicts and slices."""
    out: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, list | tuple):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)
        elif isinstance(x, slice):
            walk((x.start, x.stop, x.step))
        else:
            out.append(x)
    walk(tree)
    return out


def map_tree(tree: Any, fn: Any) -> Any:
    """`fn` applied to every leaf, keeping the containers (torch's named return tuples too)."""
    if isinstance(tree, tuple) and hasattr(tree, "n_fields"):  # torch.return_types.max and friends
        return type(tree)(tuple(map_tree(x, fn) for x in tree))
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(map_tree(x, fn) for x in tree)
    if isinstance(tree, list):
        return [map_tree(x, fn) for x in tree]
    if isinstance(tree, dict):
        return {k: map_tree(v, fn) for k, v in tree.items()}
    if isinstance(tree, slice):
        return slice(map_tree(tree.start, fn), map_tree(tree.stop, fn), map_tree(tree.step, fn))
    return fn(tree)


def call_node(node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
    """Run an fx call (a function or a tensor method) on these arguments."""
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    return node.target(*args, **kwargs)  # type: ignore[operator]


def tensors_in(res: Any) -> list[torch.Tensor]:
    """The tensors in a call's result, in pytree order."""
    return [t for t in pytree.tree_leaves(res) if isinstance(t, torch.Tensor)]


_ONE_ROW_ELEMENTS = 1 << 24  # folds this large are computed on one row when the rows are alike
# `&`, `|`, `^` on tensors: elementwise, but torch tags only their bitwise_* names pointwise
_BITWISE_ALIASES = (torch.ops.aten.__and__, torch.ops.aten.__or__, torch.ops.aten.__xor__)


def _one_row(node: torch.fx.Node, args: Any, kwargs: Any) -> torch.Tensor | None:
    """A large elementwise aten op on tensors that are each the same along the result's dim 0,
    computed on one row and expanded (a stride-0 view); None when that does not apply. A causal
    mask built from `arange(batch)` differs along the batch only by broadcasting, and folding it
    at a solver's global batch materialised (256, 1, 4096, 4096) bools per op (issue 15)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or kwargs or not (
            torch.Tag.pointwise in target.tags or target.overloadpacket in _BITWISE_ALIASES):
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or any(not isinstance(a, torch.Tensor | int | float | bool) for a in args):
        return None
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    if len(shape) == 0 or shape[0] <= 1 or math.prod(shape) < _ONE_ROW_ELEMENTS:
        return None
    rows = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() == len(shape) and a.shape[0] > 1:
            if a.stride(0) != 0 and not bool((a == a[:1]).all()):  # stride 0: this path's own output
                return None
            a = a[:1]
        rows.append(a)
    out = target(*rows)
    return out.expand(shape[0], *out.shape[1:])


def _broadcast(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a large constant broadcast along some dim (stride 0, as `_one_row` folds a
    batch-wide mask): kept as that view while the model is planned, since copying it out is the
    trace's largest cost (the causal mask at a solver's global batch, (256, 1, 4096, 4096) bools:
    4 GiB and 7.7 s of Mixtral-8x7B's `shardc plan`), and made contiguous only to run
    (`runnable_constants`)."""
    return tensor.numel() >= _ONE_ROW_ELEMENTS and any(s == 0 and n > 1 for s, n in zip(tensor.stride(), tensor.shape))


def runnable_constants(constants: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A trace's `const.N` values as a module holds them: contiguous, each its own storage (a buffer
    is written in place: DDP broadcasts buffers), where planning kept a broadcast one as a view."""
    return {name: t.contiguous() for name, t in constants.items()}  # a contiguous one is returned as is


class ConstantFolding:
    """The constant half of the lowering (`torch_trace._Lowering` is the rest): folds calls on
    constants and materialises a constant the graph reads, as ops or as a `const.N` buffer."""

    e: Emitter
    env: dict[torch.fx.Node, Any]
    const_values: dict[Const, Value]
    const_nodes: dict[torch.fx.Node, Any]

    def lower(self, node: torch.fx.Node, args: Any, kwargs: Any, res: Any, strict: bool = False) -> Any:
        raise NotImplementedError  # the lowering's own

    def env_args(self, tree: Any) -> Any:
        """fx arguments with every node replaced by what it lowered to."""
        return torch.fx.node.map_arg(tree, lambda n: self.env[n])

    def fold(self, node: torch.fx.Node, args: Any, kwargs: Any) -> tuple[Any] | None:
        """Evaluate a call on constants and Python values only; None when it cannot be."""
        def real(x: Any) -> Any:
            if isinstance(x, Const):
                return x.value
            return torch.device("cpu") if isinstance(x, torch.device) else x
        try:
            res = _one_row(node, map_tree(args, real), map_tree(kwargs, real))
            if res is None:
                res = call_node(node, map_tree(args, real), map_tree(kwargs, real))
        except Exception:
            return None
        tensors = tensors_in(res)
        if not tensors:
            return (res,)
        if any(t.device.type == "meta" for t in tensors):
            return None
        if isinstance(res, torch.Tensor):
            return (Const(res, node),)
        if isinstance(res, tuple | list) and all(isinstance(t, torch.Tensor) for t in res):
            return (tuple(Const(t, node, (i,)) for i, t in enumerate(res)),)
        return None

    def as_value(self, x: Any) -> Any:
        return self.materialize(x) if isinstance(x, Const) else x

    def materialize(self, c: Const) -> Value:
        """A constant as a graph value: its computation lowered to ops when every step of it has a
        rule (an `arange`, a `full`), else one `const.N` buffer holding its value."""
        if c in self.const_values:
            return self.const_values[c]
        value: Value | None = None
        if c.node is not None and self.lowerable(c.node):
            mark, location = self.e.checkpoint(), self.e.location
            saved = dict(self.const_values), dict(self.const_nodes)
            try:
                out = self.lower_const_node(c.node)
                for i in c.path:
                    out = out[i]
                value = out if isinstance(out, Value) else None
            except Unsupported:
                value = None
            if value is None:  # a rule refused after all: forget what this attempt emitted
                self.e.rollback(mark)
                self.const_values, self.const_nodes = saved
            self.e.location = location
        if value is None:  # the runtime makes it contiguous (`runnable_constants`): a buffer is written in place
            value = self.e.constant(c.value if _broadcast(c.value) else c.value.contiguous())
        self.const_values[c] = value
        return value

    def lowerable(self, node: torch.fx.Node) -> bool:
        """Whether every call computing this constant has a rule (constants from outside do not)."""
        if node in self.const_nodes:
            return True
        if node.op not in ("call_function", "call_method") or lookup(node.op, node.target) is None:
            return False
        for leaf in flat_leaves((self.env_args(node.args), self.env_args(node.kwargs))):
            if isinstance(leaf, Const) and leaf not in self.const_values and (
                    leaf.node is None or not self.lowerable(leaf.node)):
                return False
        return True

    def lower_const_node(self, node: torch.fx.Node) -> Any:
        if node not in self.const_nodes:
            args = map_tree(self.env_args(node.args), self.as_value)
            kwargs = map_tree(self.env_args(node.kwargs), self.as_value)
            self.e.location = Location(module_path_of(node), source_of(node.stack_trace))
            res = map_tree(self.env[node], lambda x: to_meta(x.value) if isinstance(x, Const) else x)
            self.const_nodes[node] = self.lower(node, args, kwargs, res, strict=True)
        return self.const_nodes[node]
