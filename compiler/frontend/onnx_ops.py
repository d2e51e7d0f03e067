"""ONNX op -> registry op handlers, one small function per ONNX op type.

Each handler receives the importer, the node's operands (IR values or constant tensors; None
for an absent optional input) and its attributes, and returns one operand per ONNX output.
Handlers call `imp.apply(op, operands, attrs)`, which folds constants and emits IR nodes.
"""

from __future__ import annotations

from typing import Any

import torch

from shardc.frontend.onnx_import import HANDLERS, Importer, Operand, onnx_torch_dtype
from shardc.ir import Value
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import dtype_name


def _shape(o: Operand) -> tuple[int, ...]:
    return tuple(o.type.shape) if isinstance(o, Value) else tuple(o.shape)


def _const(imp: Importer, o: Operand | None, what: str) -> torch.Tensor:
    if not isinstance(o, torch.Tensor):
        raise ShardcError(f"ONNX node {imp.node.name!r} ({imp.node.op_type}): {what} must be a constant after "
                          "folding, but it depends on the model inputs", where=imp.path,
                          hint="give static input shapes with --input-shape so shape computations fold")
    return o


def _ints(imp: Importer, o: Operand | None, what: str) -> list[int]:
    return [int(x) for x in _const(imp, o, what).reshape(-1).tolist()]


def handler(*names: str) -> Any:
    def deco(fn: Any) -> Any:
        for n in names:
            HANDLERS[n] = fn
        return fn
    return deco


_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "Max": "maximum",
           "Min": "minimum", "Equal": "eq", "Less": "lt", "LessOrEqual": "le", "Greater": "gt",
           "GreaterOrEqual": "ge", "And": "logical_and"}
_UNARY = {"Sqrt": "sqrt", "Erf": "erf", "Tanh": "tanh", "Exp": "exp", "Neg": "neg", "Relu": "relu",
          "Sigmoid": "sigmoid", "Reciprocal": "reciprocal", "Log": "log", "Abs": "abs", "Sin": "sin",
          "Cos": "cos", "Not": "logical_not"}


@handler(*_BINARY)
def _binary(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    if len(ins) == 2 and all(isinstance(o, torch.Tensor) for o in ins):
        return imp.apply(_BINARY[imp.node.op_type], ins)
    return imp.apply(_BINARY[imp.node.op_type], ins, scalar_attr=True)


@handler(*_UNARY)
def _unary(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    return imp.apply(_UNARY[imp.node.op_type], ins[:1])


@handler("Identity", "Dropout")
def _identity(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    return [ins[0]]


@handler("Constant")
def _constant(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    if "value" in a:
        return [a["value"]]
    for key, dtype in (("value_float", torch.float32), ("value_floats", torch.float32), ("value_int", torch.int64),
                       ("value_ints", torch.int64)):
        if key in a:
            return [torch.tensor(a[key], dtype=dtype)]
    raise ShardcError(f"ONNX Constant node {imp.node.name!r} has no supported value attribute", where=imp.path)


@handler("Shape")
def _shape_op(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    shape = list(_shape(ins[0]))
    return [torch.tensor(shape[a.get("start", 0): a.get("end", len(shape))], dtype=torch.int64)]


@handler("ConstantOfShape")
def _constant_of_shape(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    value = a.get("value", torch.zeros(1))
    return [torch.full(tuple(_ints(imp, ins[0], "the shape")), value.reshape(-1)[0].item(), dtype=value.dtype)]


@handler("Range")
def _range(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    start, limit, delta = (_const(imp, o, "Range's operands") for o in ins)
    return [torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)]


@handler("Cast")
def _cast(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    return imp.apply("cast", ins[:1], {"dtype": dtype_name(onnx_torch_dtype(a["to"]))})


@handler("MatMul")
def _matmul(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    return imp.apply("matmul", ins)


@handler("Gemm")
def _gemm(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    x, w = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    if a.get("transA", 0):
        x = imp.apply("permute", [x], {"dims": (1, 0)})[0]
    alpha, beta = float(a.get("alpha", 1.0)), float(a.get("beta", 1.0))
    if a.get("transB", 0) and beta == 1.0 and (bias is None or len(_shape(bias)) == 1):
        y = imp.apply("linear", [x, w] + ([bias] if bias is not None else []))[0]
        return [y if alpha == 1.0 else imp.apply("mul", [y], {"other": alpha})[0]]
    if a.get("transB", 0):
        w = imp.apply("permute", [w], {"dims": (1, 0)})[0]
    y = imp.apply("matmul", [x, w])[0]
    if alpha != 1.0:
        y = imp.apply("mul", [y], {"other": alpha})[0]
    if bias is not None:
        if beta != 1.0:
            bias = imp.apply("mul", [bias], {"other": beta})[0]
        y = imp.apply("add", [y, bias])[0]
    return [y]


@handler("Reshape")
def _reshape(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    src = _shape(ins[0])
    target = _ints(imp, ins[1], "Reshape's shape")
    if not a.get("allowzero", 0):
        target = [src[i] if d == 0 else d for i, d in enumerate(target)]
    numel = 1
    for d in src:
        numel *= d
    if -1 in target:
        known = 1
        for d in target:
            if d != -1:
                known *= d
        target[target.index(-1)] = numel // max(known, 1)
    return imp.apply("reshape", ins[:1], {"shape": tuple(target)})


@handler("Unsqueeze", "Squeeze")
def _unsqueeze(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    shape = list(_shape(ins[0]))
    axes = _ints(imp, ins[1], "the axes") if len(ins) > 1 and ins[1] is not None else list(a.get("axes", []))
    if imp.node.op_type == "Unsqueeze":
        rank = len(shape) + len(axes)
        for ax in sorted(x + rank if x < 0 else x for x in axes):
            shape.insert(ax, 1)
    else:
        drop = {x + len(shape) if x < 0 else x for x in axes} if axes else {i for i, d in enumerate(shape) if d == 1}
        shape = [d for i, d in enumerate(shape) if i not in drop]
    return imp.apply("reshape", ins[:1], {"shape": tuple(shape)})


@handler("Flatten")
def _flatten(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    shape = _shape(ins[0])
    axis = a.get("axis", 1) % max(len(shape), 1)
    lead = 1
    for d in shape[:axis]:
        lead *= d
    rest = 1
    for d in shape[axis:]:
        rest *= d
    return imp.apply("reshape", ins[:1], {"shape": (lead, rest)})


@handler("Transpose")
def _transpose(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    rank = len(_shape(ins[0]))
    return imp.apply("permute", ins[:1], {"dims": tuple(a.get("perm", range(rank - 1, -1, -1)))})


@handler("Split")
def _split(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    shape = _shape(ins[0])
    axis = a.get("axis", 0) % len(shape)
    if len(ins) > 1 and ins[1] is not None:
        sizes = _ints(imp, ins[1], "Split's sizes")
    else:
        n = a.get("num_outputs", len(imp.node.output))
        chunk = -(-shape[axis] // n)
        sizes = [min(chunk, shape[axis] - i * chunk) for i in range(n)]
    return imp.apply("split", ins[:1], {"sizes": tuple(sizes), "dim": axis})


@handler("Concat")
def _concat(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    rank = len(_shape(ins[0]))
    return imp.apply("concat", ins, {"dim": a["axis"] % rank})


@handler("Slice")
def _slice(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    x = ins[0]
    shape = _shape(x)
    starts = _ints(imp, ins[1], "Slice's starts")
    ends = _ints(imp, ins[2], "Slice's ends")
    axes = _ints(imp, ins[3], "Slice's axes") if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
    steps = _ints(imp, ins[4], "Slice's steps") if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis %= len(shape)
        size = _shape(x)[axis]
        lo, hi, _ = slice(start, end, step).indices(size)
        if step != 1 and step < 0:
            raise ShardcError(f"ONNX Slice {imp.node.name!r}: negative steps are not supported", where=imp.path)
        if (lo, hi, step) == (0, size, 1):
            continue
        x = imp.apply("slice", [x], {"dim": axis, "start": lo, "end": hi, "step": step})[0]
    return [x]


@handler("Gather")
def _gather(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    data, indices = ins
    axis = a.get("axis", 0) % len(_shape(data))
    if isinstance(indices, torch.Tensor) and indices.dim() == 0:
        return imp.apply("select", [data], {"dim": axis, "index": int(indices.item())})
    if isinstance(data, torch.Tensor) and isinstance(indices, torch.Tensor):
        return [torch.index_select(data, axis, indices.reshape(-1)).reshape(
            data.shape[:axis] + indices.shape + data.shape[axis + 1:])]
    if axis == 0 and len(_shape(data)) == 2 and not isinstance(indices, torch.Tensor):
        return imp.apply("embedding", [indices, data])
    raise ShardcError(f"ONNX Gather {imp.node.name!r} on axis {axis} with computed indices is not supported "
                      "(only embedding lookups and constant indices)", where=imp.path)


@handler("Softmax", "LogSoftmax")
def _softmax(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    op = "softmax" if imp.node.op_type == "Softmax" else "log_softmax"
    return imp.apply(op, ins[:1], {"dim": a.get("axis", -1) % len(_shape(ins[0]))})


@handler("LayerNormalization")
def _layer_norm(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    rank = len(_shape(ins[0]))
    if a.get("axis", -1) % rank != rank - 1:
        raise ShardcError(f"ONNX LayerNormalization {imp.node.name!r} normalises from axis {a.get('axis')}; only "
                          "the last axis is supported", where=imp.path)
    return imp.apply("layer_norm", [o for o in ins if o is not None], {"eps": float(a.get("epsilon", 1e-5))})[:1]


@handler("Gelu")
def _gelu(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    return imp.apply("gelu", ins[:1], {"approximate": a.get("approximate", "none")})


@handler("Where")
def _where(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    cond, x, y = ins
    if all(isinstance(o, torch.Tensor) for o in ins):
        return [torch.where(cond, x, y)]
    attrs: dict[str, Any] = {}
    operands: list[Operand] = [cond]
    for key, o in (("x", x), ("y", y)):
        if isinstance(o, torch.Tensor) and o.numel() == 1:
            attrs[key] = o.item()
        else:
            operands.append(o)
    return imp.apply("where", operands, attrs)


@handler("Expand")
def _expand(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    target = torch.broadcast_shapes(_shape(ins[0]), tuple(_ints(imp, ins[1], "Expand's shape")))
    if isinstance(ins[0], torch.Tensor):
        return [ins[0].expand(target)]
    return imp.apply("expand", ins[:1], {"shape": tuple(target)})


@handler("ReduceMean", "ReduceSum", "ReduceMax")
def _reduce(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    op = {"ReduceMean": "mean", "ReduceSum": "sum", "ReduceMax": "amax"}[imp.node.op_type]
    rank = len(_shape(ins[0]))
    if len(ins) > 1 and ins[1] is not None:
        axes = _ints(imp, ins[1], "the axes")
    else:
        axes = list(a.get("axes", []))
    if not axes and a.get("noop_with_empty_axes", 0):
        return [ins[0]]
    dims = tuple(sorted(x % rank for x in axes)) if axes else tuple(range(rank))
    return imp.apply(op, ins[:1], {"dim": dims, "keepdim": bool(a.get("keepdims", 1))})


@handler("Trilu")
def _trilu(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    k = _ints(imp, ins[1], "Trilu's k")[0] if len(ins) > 1 and ins[1] is not None else 0
    return imp.apply("triu" if a.get("upper", 1) else "tril", ins[:1], {"diagonal": k})
