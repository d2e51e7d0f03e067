"""The torch frontend: capture a model (fx, else export), then lower it node by node to the IR.

Lowering interprets the captured graph on meta tensors. Each call runs once as torch would
(its result, `res`, gives shapes and folds shape arithmetic such as `x.size(1) // 2` into plain
ints), then a rule from `rules.py` emits registry ops whose types come from the registry's own
impls; the two must agree. Calls that return no tensor (sizes, dtypes, asserts) leave no node.

Constants (calls that read no input, parameter or buffer) are folded on the CPU and lowered or
kept as `const.N` buffers (`shardc.frontend.constants`); their values are in
`TraceResult.constants`. Pass those to `shardc.backends.reference.model_state(model, graph, constants)`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from shardc.frontend import creation, moe, normalize, views  # noqa: F401  (fill the rule tables)
from shardc.frontend.aten import (
    emit_aten,
    encode_operands,
    lower_by_dispatch,
    write_back,
    writes_first_argument,
)
from shardc.frontend.capture import Captured, capture, module_path_of, source_of
from shardc.frontend.constants import (
    Const,
    ConstantFolding,
    call_node,
    flat_leaves,
    lookup,
    map_tree,
    tensors_in,
)
from shardc.frontend.emit import Emitter, Unsupported, tensor_type, typed_key
from shardc.frontend.rules import target_name
from shardc.ir import Graph, Location, Value
from shardc.ir.diagnostics import ShardcError
from shardc.ops.targets import resolve_target
from shardc.ops.verifier import shapes_only


@dataclass(frozen=True)
class TraceResult:
    """A traced graph, the values of its `const.N` buffers, which tracer captured it, and how long it took."""

    graph: Graph
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    tracer: str = "fx"
    seconds: float = 0.0


def trace(model: torch.nn.Module, example_inputs: Any, *, name: str | None = None, allow_opaque: bool = False,
          input_names: list[str] | tuple[str, ...] | None = None) -> Graph:
    """The model's forward as an IR graph (see `trace_with_state` for the constant values)."""
    return trace_with_state(model, example_inputs, name=name, allow_opaque=allow_opaque,
                            input_names=input_names).graph


def trace_with_state(model: torch.nn.Module, example_inputs: Any, *, name: str | None = None,
                     allow_opaque: bool = False,
                     input_names: list[str] | tuple[str, ...] | None = None) -> TraceResult:
    """Trace `model(*example_inputs)` to the IR: inputs named after forward's arguments (or
    `input_names`), parameters and buffers by their module paths, every node located.

    An op without a rule is a ShardcError naming it, its module and source line; with
    `allow_opaque=True` it becomes an `opaque` node (see `shardc.frontend.coverage`).
    """
    start = time.perf_counter()
    imported = getattr(model, "shardc_graph", None)
    if isinstance(imported, Graph):  # an imported model (ONNX's OnnxModule) already is IR
        # A copy (passes rewrite graphs in place, and the module keeps running its own), at the
        # shapes of these example inputs when the model can import itself again at others.
        inputs = tuple(example_inputs) if isinstance(example_inputs, tuple | list) else (example_inputs,)
        graph_for = getattr(model, "shardc_graph_for", None)
        graph = graph_for(inputs) if callable(graph_for) else copy.deepcopy(imported)
        return TraceResult(graph, {}, "import", time.perf_counter() - start)
    inputs = tuple(example_inputs) if isinstance(example_inputs, tuple | list) else (example_inputs,)
    names = list(input_names) if input_names is not None else _default_input_names(model, len(inputs))
    captured = capture(model, inputs, names)
    lowering = _Lowering(captured, name or type(model).__name__.lower(), allow_opaque)
    with shapes_only():  # the lowering runs ops on meta tensors (and folds constants)
        graph = lowering.run()
    return TraceResult(graph, dict(lowering.e.constants), captured.tracer, time.perf_counter() - start)


def _default_input_names(model: torch.nn.Module, n: int) -> list[str]:
    import inspect

    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"input{i}" for i in range(n)]


class _Lowering(ConstantFolding):
    def __init__(self, captured: Captured, name: str, allow_opaque: bool) -> None:
        self.captured = captured
        self.allow_opaque = allow_opaque
        self.e = Emitter(name)
        self.env: dict[torch.fx.Node, Any] = {}
        self.declared: dict[str, Value] = {}
        self.const_values: dict[Const, Value] = {}
        self.const_nodes: dict[torch.fx.Node, Any] = {}
        self.results: dict[Any, Any] = {}  # a call's meta result by its argument types

    def run(self) -> Graph:
        outputs: list[Value] = []
        for node in self.captured.graph.nodes:
            self.e.location = Location(module_path_of(node), source_of(node.stack_trace))
            if node.op in ("placeholder", "get_attr"):
                self.env[node] = self.leaf(node)
            elif node.op in ("call_function", "call_method"):
                self.env[node] = self.call(node)
            elif node.op == "output":
                result = self.env_args(node.args[0])
                if self.captured.user_outputs is not None:
                    result = [result[i] for i in self.captured.user_outputs]
                for leaf in pytree.tree_leaves(result):
                    if isinstance(leaf, Const):
                        leaf = self.materialize(leaf)
                    if isinstance(leaf, Value):
                        outputs.append(leaf)
            else:
                raise ShardcError(f"unexpected fx node kind {node.op} ({node.target})")
        self.e.graph.outputs = outputs
        self._eliminate_dead_code()
        self._order_declarations()
        return self.e.graph

    def _eliminate_dead_code(self) -> None:
        """Drop nodes nothing uses (sizes computed for a mask that is a constant after all, say)
        and declarations no node reads."""
        graph = self.e.graph
        live = set(graph.outputs)
        kept = []
        for node in reversed(graph.nodes):
            if any(v in live for v in node.outputs):
                kept.append(node)
                live.update(node.inputs)
        graph.nodes = kept[::-1]
        graph.params = [v for v in graph.params if v in live]
        graph.buffers = [v for v in graph.buffers if v in live]
        for name in [n for n in self.e.constants if not any(v.name == n for v in graph.buffers)]:
            del self.e.constants[name]

    # ---- leaves ---------------------------------------------------------------------------
    def leaf(self, node: torch.fx.Node) -> Any:
        kind, *rest = self.captured.leaves.get(node.name, ("python", None))
        if kind == "python":
            return rest[0]
        if kind == "constant":
            return Const(rest[0], None)
        name, tensor = rest
        if kind == "input" and not isinstance(tensor, torch.Tensor):
            return tensor
        if name not in self.declared:
            requires_grad = bool(kind == "parameter" and tensor.requires_grad)
            self.declared[name] = self.e.declare(name, tensor, kind, requires_grad)
        return self.declared[name]

    def _order_declarations(self) -> None:
        """Inputs in forward's order; parameters and buffers in first-use order, constants last."""
        self.e.graph.buffers.sort(key=lambda v: v.name.startswith("const."))

    # ---- calls ----------------------------------------------------------------------------
    def call(self, node: torch.fx.Node) -> Any:
        args, kwargs = self.env_args(node.args), self.env_args(node.kwargs)
        leaves = flat_leaves((args, kwargs))
        if not any(isinstance(x, Value) for x in leaves):
            folded = self.fold(node, args, kwargs)
            if folded is not None:
                return folded[0]
        args, kwargs = map_tree(args, self.as_value), map_tree(kwargs, self.as_value)
        out = self.lower(node, args, kwargs, None)
        if node.op == "call_method" and str(node.target).endswith("_") and not str(node.target).startswith("__") \
                and isinstance(node.args[0], torch.fx.Node) and isinstance(out, Value):
            self.env[node.args[0]] = out  # an in-place method rebinds its receiver
        return out

    def lower(self, node: torch.fx.Node, args: Any, kwargs: Any, res: Any, strict: bool = False) -> Any:
        def meta(x: Any) -> Any:
            if isinstance(x, torch.device):
                return torch.device("meta")
            return self.e.meta(x) if isinstance(x, Value) else x
        if res is None:
            margs, mkwargs = map_tree(args, meta), map_tree(kwargs, meta)
            in_place = node.op == "call_method" and str(node.target).endswith("_")
            try:
                key: Any = None if in_place else (node.op, node.target, typed_key(margs), typed_key(mkwargs))
            except TypeError:
                key = None
            if key is not None and key in self.results:
                res = self.results[key]
            else:
                if in_place and isinstance(margs[0], torch.Tensor):
                    margs = (margs[0].clone(),) + tuple(margs[1:])
                try:
                    res = call_node(node, margs, mkwargs)
                except Exception as err:
                    raise self.error(node, f"torch cannot run it on meta tensors ({type(err).__name__}: {err})") from err
                if key is not None:
                    self.results[key] = res
        if not tensors_in(res):
            return res
        rule = lookup(node.op, node.target)
        try:
            if rule is None:
                raise Unsupported("no lowering rule")
            out = rule(self.e, res, *args, **kwargs)
        except Unsupported as why:
            if strict:
                raise
            out = self.fallback(node, args, kwargs, res, str(why))
        self.check(node, out, res)
        return out

    def fallback(self, node: torch.fx.Node, args: Any, kwargs: Any, res: Any, why: str) -> Any:
        """A call no rule lowers, as the aten ops torch runs for it (`shardc.frontend.aten`); else an
        error naming it, or an opaque node with `allow_opaque`."""
        mark = self.e.checkpoint()
        target = node.target
        try:
            if isinstance(target, torch._ops.OpOverload):
                written = node.args[0] if writes_first_argument(target) and node.args else None
                out = emit_aten(self.e, target, args, kwargs, res)
                if isinstance(written, torch.fx.Node) and isinstance(out, Value):
                    write_back(self.e, self.env, written, out)
                return out
            if node.op == "call_method":
                name = str(target)
                return lower_by_dispatch(self.e, lambda *a, **k: getattr(a[0], name)(*a[1:], **k), args, kwargs, res)
            return lower_by_dispatch(self.e, target, args, kwargs, res)
        except Unsupported as more:
            self.e.rollback(mark)
            if not self.allow_opaque:
                raise self.error(node, f"{why}; as aten ops: {more}") from None
            return self.opaque(node, args, kwargs, res, f"{why}; as aten ops: {more}")

    def check(self, node: torch.fx.Node, out: Any, res: Any) -> None:
        got = [v.type for v in pytree.tree_leaves(out) if isinstance(v, Value)]
        want = [tensor_type(t) for t in tensors_in(res)]
        if got != want:
            raise ShardcError(
                f"frontend bug: lowering {target_name(node.op, node.target)} gave {[str(t) for t in got]} "
                f"but torch computes {[str(t) for t in want]}",
                where=f"{module_path_of(node) or '<root>'} {source_of(node.stack_trace)}".strip())

    def error(self, node: torch.fx.Node, why: str) -> ShardcError:
        name = target_name(node.op, node.target)
        loc = self.e.location
        return ShardcError(
            f"unsupported op {name} ({node.op}) in module {loc.module_path or '<root>'}"
            + (f" at {loc.source}" if loc.source else "") + f": {why}",
            hint="register the op: add `register(OpDef(...))` to compiler/ops.py (shardc.ops.registry.register) "
                 "and a lowering rule in compiler/frontend/normalize.py; or trace with allow_opaque=True "
                 "(--allow-opaque) to keep it as an opaque node that stays replicated")

    # ---- opaque ---------------------------------------------------------------------------
    def opaque(self, node: torch.fx.Node, args: Any, kwargs: Any, res: Any, why: str) -> Any:
        """Keep the call as it is: inputs are its tensors, attrs name the torch target and the rest."""
        name = target_name(node.op, node.target)
        if resolve_target(name) is None:
            raise self.error(node, f"{why}; it cannot be kept opaque either, {name} is not importable by name")
        inputs: list[Value] = []

        def encode(x: Any) -> Any:
            try:
                return encode_operands(x, inputs)
            except Unsupported as err:
                raise self.error(node, f"{why}; it cannot be kept opaque either: {err}") from None
        attrs: dict[str, Any] = {"target": name, "args": encode(tuple(args))}
        if kwargs:
            attrs["kwargs"] = tuple((k, encode(v)) for k, v in kwargs.items())
        if not isinstance(res, torch.Tensor):
            if not (isinstance(res, tuple | list) and all(isinstance(t, torch.Tensor) for t in res)):
                raise self.error(node, f"{why}; it cannot be kept opaque either: it returns {type(res).__name__}")
            attrs["outputs"] = len(res)
        return self.e.emit("opaque", inputs, **attrs)
