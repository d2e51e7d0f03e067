"""Lowering rules for elementwise math: arithmetic, comparisons, logical ops, unary functions,
clamp, masking and `where`. Each rule states the torch calls it covers in its `@rule`.

Scalars become attributes (`x * 0.125` is `mul(%x)[other=0.125]`, `1 - x` is
`sub(%x)[other=1, reverse=true]`); `binary` is that rule, shared with the other rule modules.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F

from shardc.frontend.emit import Emitter, Unsupported
from shardc.frontend.rules import aten, rule
from shardc.ir import Value


def _scalar(x: Any) -> Any:
    if isinstance(x, bool | int | float):
        return x
    raise Unsupported(f"operand {x!r} is neither a tensor nor a Python number")


def binary(e: Emitter, op: str, a: Any, b: Any, commutative: bool) -> Value:
    """`a op b` with a Python number as the `other` attribute (`reverse` when it stands first and the
    op does not commute); `x + 0` and `x * 1` are `x` itself."""
    if isinstance(a, Value) and a.type.dtype != "bool" and (
            (op in ("add", "sub") and b == 0 and (a.type.is_float or isinstance(b, int)))
            or (op == "mul" and b == 1 and isinstance(b, int))):
        return a  # x + 0, x * 1: no-ops that keep the dtype
    if isinstance(a, Value) and isinstance(b, Value):
        return e.emit(op, [a, b])
    if isinstance(a, Value):
        return e.emit(op, [a], other=_scalar(b))
    if isinstance(b, Value):
        if commutative:
            return e.emit(op, [b], other=_scalar(a))
        return e.emit(op, [b], other=_scalar(a), reverse=True)
    raise Unsupported(f"{op} of two Python numbers")


def _binary_rule(op: str, commutative: bool) -> Any:
    def lower(e: Emitter, res: Any, a: Any, b: Any, *rest: Any, alpha: Any = 1, rounding_mode: Any = None,
              **_: Any) -> Value:
        if rounding_mode is not None:
            raise Unsupported(f"{op} with rounding_mode={rounding_mode!r}")
        if alpha != 1:  # add(a, b, alpha) = a + alpha * b
            b = e.emit("mul", [b], other=alpha) if isinstance(b, Value) else b * alpha
        return binary(e, op, a, b, commutative)
    return lower


_BINARY: tuple[tuple[str, bool, tuple[Any, ...]], ...] = (
    ("add", True, (torch.add, operator.add, operator.iadd, "add", "add_", "__add__", "__iadd__", aten("add"))),
    ("sub", False, (torch.sub, torch.subtract, operator.sub, operator.isub, "sub", "sub_", "__sub__", aten("sub"))),
    ("mul", True, (torch.mul, torch.multiply, operator.mul, operator.imul, "mul", "mul_", "__mul__", aten("mul"))),
    ("div", False, (torch.div, torch.divide, torch.true_divide, operator.truediv, operator.itruediv, "div",
                    "div_", "__truediv__", "true_divide", aten("div"), aten("true_divide"))),
    ("pow", False, (torch.pow, operator.pow, "pow", "__pow__", aten("pow"))),
    ("maximum", True, (torch.maximum, "maximum", aten("maximum"))),
    ("minimum", True, (torch.minimum, "minimum", aten("minimum"))),
    ("eq", True, (torch.eq, operator.eq, "eq", "__eq__", aten("eq"))),
    ("ne", True, (torch.ne, operator.ne, "ne", "__ne__", aten("ne"))),
)
for _op, _comm, _keys in _BINARY:
    rule(*_keys)(_binary_rule(_op, _comm))

_FLIPPED = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le"}


def _compare_rule(op: str) -> Any:
    def lower(e: Emitter, res: Any, a: Any, b: Any, **_: Any) -> Value:
        if not isinstance(a, Value):  # 0 < x is x > 0
            return binary(e, _FLIPPED[op], b, a, True)
        return binary(e, op, a, b, True)
    return lower


for _op, _fn in (("lt", operator.lt), ("le", operator.le), ("gt", operator.gt), ("ge", operator.ge)):
    rule(getattr(torch, _op), _fn, _op, f"__{_op}__", aten(_op))(_compare_rule(_op))


@rule(torch.rsub, "rsub", aten("rsub"))
def _rsub(e: Emitter, res: Any, x: Any, other: Any, alpha: Any = 1, **_: Any) -> Value:
    if alpha != 1:
        x = e.emit("mul", [x], other=alpha)
    return binary(e, "sub", other, x, False)


def _logical(op: str) -> Any:
    def lower(e: Emitter, res: Any, a: Any, b: Any, **_: Any) -> Value:
        for v in (a, b):
            if isinstance(v, Value) and v.type.dtype != "bool":
                raise Unsupported(f"bitwise {op} of {v.type.dtype} tensors (only bool is supported)")
        return binary(e, f"logical_{op}", a, b, True)
    return lower


rule(torch.logical_and, operator.and_, operator.iand, "logical_and", "__and__", aten("logical_and"),
     aten("__and__"), aten("bitwise_and"))(_logical("and"))
rule(torch.logical_or, operator.or_, operator.ior, "logical_or", "__or__", aten("logical_or"),
     aten("__or__"), aten("bitwise_or"))(_logical("or"))


@rule(torch.logical_not, operator.invert, torch.bitwise_not, "logical_not", "__invert__", "bitwise_not",
      aten("logical_not"), aten("bitwise_not"))
def _not(e: Emitter, res: Any, x: Value, **_: Any) -> Value:
    if x.type.dtype != "bool":
        raise Unsupported(f"bitwise not of a {x.type.dtype} tensor (only bool is supported)")
    return e.emit("logical_not", [x])


def _unary(op: str) -> Any:
    def lower(e: Emitter, res: Any, x: Value, *_: Any, **__: Any) -> Value:
        return e.emit(op, [x])
    return lower


_UNARY: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("neg", (torch.neg, operator.neg, "neg", "__neg__", aten("neg"))),
    ("abs", (torch.abs, operator.abs, "abs", aten("abs"))),
    ("exp", (torch.exp, "exp", aten("exp"))),
    ("log", (torch.log, "log", aten("log"))),
    ("sqrt", (torch.sqrt, "sqrt", aten("sqrt"))),
    ("rsqrt", (torch.rsqrt, "rsqrt", aten("rsqrt"))),
    ("reciprocal", (torch.reciprocal, "reciprocal", aten("reciprocal"))),
    ("sin", (torch.sin, "sin", aten("sin"))),
    ("cos", (torch.cos, "cos", aten("cos"))),
    ("tanh", (torch.tanh, F.tanh, "tanh", aten("tanh"))),
    ("sigmoid", (torch.sigmoid, F.sigmoid, "sigmoid", aten("sigmoid"))),
    ("erf", (torch.erf, torch.special.erf, "erf", aten("erf"))),
    ("relu", (torch.relu, F.relu, "relu", "relu_", aten("relu"))),
    ("silu", (F.silu, aten("silu"))),
)
for _op, _unary_keys in _UNARY:
    rule(*_unary_keys)(_unary(_op))


@rule(F.gelu, aten("gelu"))
def _gelu(e: Emitter, res: Any, x: Value, approximate: str = "none", **_: Any) -> Value:
    return e.emit("gelu", [x], approximate=approximate) if approximate != "none" else e.emit("gelu", [x])


@rule(torch.clamp, torch.clip, "clamp", "clip", aten("clamp"), torch.clamp_min, "clamp_min", aten("clamp_min"))
def _clamp(e: Emitter, res: Any, x: Value, min: Any = None, max: Any = None, **_: Any) -> Value:
    if min is not None:
        x = binary(e, "maximum", x, min, True)
    if max is not None:
        x = binary(e, "minimum", x, max, True)
    return x


@rule(torch.masked_fill, "masked_fill", "masked_fill_", aten("masked_fill"))
def _masked_fill(e: Emitter, res: Any, x: Value, mask: Value, value: Any, **_: Any) -> Value:
    if isinstance(value, Value):
        return e.emit("where", [mask, value, x])
    return e.emit("masked_fill", [x, mask], value=_scalar(value))


@rule(torch.where, aten("where"))
def _where(e: Emitter, res: Any, cond: Value, x: Any = None, y: Any = None, **_: Any) -> Value:
    if x is None and y is None:
        raise Unsupported("torch.where(cond) with one argument (data-dependent shape)")
    tensors = [v for v in (x, y) if isinstance(v, Value)]
    attrs = {k: _scalar(v) for k, v in (("x", x), ("y", y)) if not isinstance(v, Value)}
    return e.emit("where", [cond, *tensors], **attrs)


@rule("where")
def _where_method(e: Emitter, res: Any, x: Value, cond: Value, y: Any, **_: Any) -> Value:
    return _where(e, res, cond, x, y)


@rule(torch.triu, "triu", aten("triu"))
def _triu(e: Emitter, res: Any, x: Value, diagonal: int = 0, **_: Any) -> Value:
    return e.emit("triu", [x], diagonal=diagonal)


@rule(torch.tril, "tril", aten("tril"))
def _tril(e: Emitter, res: Any, x: Value, diagonal: int = 0, **_: Any) -> Value:
    return e.emit("tril", [x], diagonal=diagonal)

