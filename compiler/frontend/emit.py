"""The graph builder the torch frontend's rules write into.

An `Emitter` owns the `Graph` being built, a meta tensor per value (for shapes and for running
registry impls), the location of the torch node being lowered, and the values for parameters,
buffers and constants. `emit(op, inputs, **attrs)` infers output types by running the op's
registry `impl` on meta tensors, so every type in the IR is what the registry computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardc.ir import Graph, Location, Node, TensorType, Value, dtypes
from shardc.ops.registry import get_op, has_op


class Unsupported(Exception):
    """A rule cannot lower this call; the frontend turns it into a ShardcError or an opaque node."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return dtypes.dtype_name(dtype)
    except KeyError as e:
        raise Unsupported(str(e.args[0])) from None


def tensor_type(t: torch.Tensor) -> TensorType:
    return TensorType(tuple(int(d) for d in t.shape), dtype_name(t.dtype))


def to_meta(t: torch.Tensor) -> torch.Tensor:
    """A contiguous meta tensor like `t`: the IR has no strides, so `.view` after a transpose
    traces as the reshape it is (`.contiguous()` leaves no node behind)."""
    if t.device.type == "meta" and t.is_contiguous():
        return t
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def typed_key(x: Any) -> Any:
    """A hashable key that tells 1, 1.0 and True apart and sees tensors as shape, dtype and strides."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype, tuple(x.stride()), x.device.type)
    if isinstance(x, list | tuple):
        return (type(x).__name__,) + tuple(typed_key(y) for y in x)
    if isinstance(x, dict):
        return ("D",) + tuple((k, typed_key(v)) for k, v in x.items())
    if isinstance(x, slice):
        return ("S", typed_key(x.start), typed_key(x.stop), typed_key(x.step))
    hash(x)  # TypeError for what cannot be a key
    return (type(x).__name__, x)


def clean_attr(value: Any) -> Any:
    """Attributes are plain Python: ints, floats, bools, strings, None and tuples of them."""
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, torch.Size | list | tuple):
        return tuple(clean_attr(v) for v in value)
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    raise Unsupported(f"attribute value {value!r} of type {type(value).__name__} has no IR form")


class Emitter:
    """Builds one Graph; rules call `emit`, `meta`, `type_of`."""

    def __init__(self, name: str) -> None:
        self.graph = Graph(name)
        self.location = Location()
        self._meta: dict[Value, torch.Tensor] = {}
        self._names: set[str] = set()
        self._counter = 0
        self.constants: dict[str, torch.Tensor] = {}
        # (op, input metas, attrs) -> result metas: a 96-layer model runs each distinct op once
        self._results: dict[Any, Any] = {}

    # ---- values ------------------------------------------------------------------------
    def _fresh(self, prefix: str = "x") -> str:
        while f"{prefix}{self._counter}" in self._names:
            self._counter += 1
        name = f"{prefix}{self._counter}"
        self._counter += 1
        return name

    def declare(self, name: str, meta: torch.Tensor, kind: str, requires_grad: bool = False) -> Value:
        """A graph input, parameter or buffer (constants are buffers whose value the trace keeps)."""
        if name in self._names:
            raise ValueError(f"value name {name!r} is declared twice")
        value = Value(name, tensor_type(meta), kind, requires_grad=requires_grad)
        self._names.add(name)
        self._meta[value] = to_meta(meta)
        {"input": self.graph.inputs, "parameter": self.graph.params, "buffer": self.graph.buffers}[kind].append(value)
        return value

    def constant(self, tensor: torch.Tensor) -> Value:
        """A tensor the model computes from nothing it is given: a buffer whose value is kept."""
        name = self._fresh("const.")
        value = self.declare(name, tensor, "buffer")
        self.constants[name] = tensor.detach()
        return value

    def meta(self, value: Value) -> torch.Tensor:
        return self._meta[value]

    def type_of(self, value: Value) -> TensorType:
        return value.type

    def shape(self, value: Value) -> tuple[int, ...]:
        return value.type.shape

    # ---- nodes -------------------------------------------------------------------------
    def emit(self, op: str, inputs: Sequence[Value], **attrs: Any) -> Any:
        """Append `op(inputs)[attrs]`; returns its output value (a tuple for several outputs)."""
        if not has_op(op):
            raise Unsupported(f"the registry has no op {op!r}")
        attrs = {k: clean_attr(v) for k, v in attrs.items()}
        metas = [self._meta[v] for v in inputs]
        key = (op, typed_key(metas), typed_key(attrs))
        result = self._results.get(key)
        if result is None:
            try:
                with torch.device("meta"):
                    result = get_op(op).impl(*metas, **attrs)
            except Exception as err:  # a rule built a call the op's impl rejects: say which
                raise Unsupported(f"registry op {op}{attrs} rejects inputs "
                                  f"{[str(v.type) for v in inputs]}: {type(err).__name__}: {err}") from err
            self._results[key] = result
        many = isinstance(result, tuple | list)
        results = list(result) if many else [result]
        outs = []
        for r in results:
            value = Value(self._fresh(), tensor_type(r))
            self._names.add(value.name)
            self._meta[value] = to_meta(r)
            outs.append(value)
        self.graph.nodes.append(Node(op, list(inputs), outs, attrs, self.location))
        return tuple(outs) if many else outs[0]

    def checkpoint(self) -> int:
        return len(self.graph.nodes)

    def rollback(self, mark: int) -> None:
        """Forget nodes emitted since `mark` (a constant that could not be lowered after all)."""
        del self.graph.nodes[mark:]
