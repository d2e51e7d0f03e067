"""ONNX ops current exporters emit beyond the core set, imported as aten fallback nodes.

Rule. Each handler here maps one ONNX op onto the aten op with the same meaning and emits it
as an `aten[target=...]` node (`shardc.ops.fallback`): it runs as that aten op and splits as
torch's DTensor strategies allow, so no registry entry is needed. torch.onnx's dynamo exporter
guards attention with `Where(IsNaN(softmax), 0, softmax)`; masks and rotary tables bring
`IsInf`, `Sign`, `Floor`/`Ceil`/`Round`, `Mod`, `Or`/`Xor`, `Clip`, `Tile`, `CumSum`, `CastLike`,
`GatherND` (unoptimised exports); heads and
samplers `ArgMax`/`ArgMin`, `TopK`; padding `Pad` (constant mode) and `GatherElements`. A Gather
with computed indices off the embedding path is `aten.index.Tensor` too.
"""

from __future__ import annotations

from typing import Any

import torch

from shardc.frontend.onnx_import import HANDLERS, Importer, Operand
from shardc.frontend.onnx_ops import _const, _ints, _shape, handler
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import dtype_name, torch_dtype


def aten(imp: Importer, target: str, ins: list[Operand], args: tuple[Any, ...], outputs: int = 1) -> list[Operand]:
    """`torch.ops.aten.<target>` on the operands (`$k` in `args` is operand k)."""
    attrs: dict[str, Any] = {"target": f"torch.ops.aten.{target}", "args": args}
    if outputs > 1:
        attrs["outputs"] = outputs
    return imp.apply("aten", ins, attrs)


_UNARY = {"IsNaN": "isnan.default", "Sign": "sign.default", "Floor": "floor.default", "Ceil": "ceil.default",
          "Round": "round.default", "Softplus": "softplus.default", "BitwiseNot": "bitwise_not.default"}
_BINARY = {"Or": "logical_or.default", "Xor": "logical_xor.default", "BitwiseAnd": "bitwise_and.Tensor",
           "BitwiseOr": "bitwise_or.Tensor", "BitwiseXor": "bitwise_xor.Tensor"}


@handler(*_UNARY)
def _unary(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    return aten(imp, _UNARY[imp.node.op_type], ins[:1], ("$0",))


@handler(*_BINARY)
def _binary(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    return aten(imp, _BINARY[imp.node.op_type], ins[:2], ("$0", "$1"))


@handler("IsInf")
def _isinf(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    neg, pos = a.get("detect_negative", 1), a.get("detect_positive", 1)
    target = "isinf.default" if neg and pos else "isneginf.default" if neg else "isposinf.default"
    return aten(imp, target, ins[:1], ("$0",))


@handler("Mod")
def _mod(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    # fmod=1 takes the dividend's sign (C fmod); fmod=0 the divisor's (Python %, torch.remainder)
    return aten(imp, "fmod.Tensor" if a.get("fmod", 0) else "remainder.Tensor", ins[:2], ("$0", "$1"))


@handler("Clip")
def _clip(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    bounds = [None if o is None else float(_const(imp, o, "Clip's bound").item()) for o in (ins[1:] + [None, None])[:2]]
    if isinstance(ins[0], torch.Tensor):
        return [ins[0].clamp(*bounds)]
    return aten(imp, "clamp.default", ins[:1], ("$0", bounds[0], bounds[1]))


@handler("Tile")
def _tile(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    return aten(imp, "repeat.default", ins[:1], ("$0", tuple(_ints(imp, ins[1], "Tile's repeats"))))


@handler("CumSum")
def _cumsum(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    if a.get("exclusive", 0) or a.get("reverse", 0):
        raise ShardcError(f"ONNX CumSum {imp.node.name!r} with exclusive or reverse is not supported", where=imp.path)
    return imp.apply("cumsum", ins[:1], {"dim": _ints(imp, ins[1], "CumSum's axis")[0] % len(_shape(ins[0]))})


@handler("ArgMax", "ArgMin")
def _argmax(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    if a.get("select_last_index", 0):
        raise ShardcError(f"ONNX {imp.node.op_type} {imp.node.name!r} with select_last_index=1 is not supported",
                          where=imp.path)
    target = "argmax.default" if imp.node.op_type == "ArgMax" else "argmin.default"
    return aten(imp, target, ins[:1], ("$0", a.get("axis", 0), bool(a.get("keepdims", 1))))


@handler("TopK")
def _topk(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    k = _ints(imp, ins[1], "TopK's k")[0]
    return aten(imp, "topk.default", ins[:1], ("$0", k, a.get("axis", -1), bool(a.get("largest", 1)),
                                              bool(a.get("sorted", 1))), outputs=2)


@handler("GatherElements")
def _gather_elements(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    return imp.apply("gather", ins[:2], {"dim": a.get("axis", 0) % len(_shape(ins[0]))})


@handler("Pad")
def _pad(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    mode = a.get("mode", "constant")
    if mode != "constant":
        raise ShardcError(f"ONNX Pad {imp.node.name!r} in mode {mode!r}: only constant padding is supported",
                          where=imp.path)
    rank = len(_shape(ins[0]))
    pads = _ints(imp, ins[1], "Pad's pads")
    axes = _ints(imp, ins[3], "Pad's axes") if len(ins) > 3 and ins[3] is not None else list(range(rank))
    value = float(_const(imp, ins[2], "Pad's value").item()) if len(ins) > 2 and ins[2] is not None else 0.0
    n = len(axes)
    by_dim = {ax % rank: (pads[i], pads[i + n]) for i, ax in enumerate(axes)}
    # aten's pad list runs from the last dim backwards: (last_begin, last_end, second_last_begin, ...)
    flat: list[int] = []
    for d in range(rank - 1, min(by_dim, default=rank) - 1, -1):
        flat += list(by_dim.get(d, (0, 0)))
    return aten(imp, "constant_pad_nd.default", ins[:1], ("$0", tuple(flat), value))


_core_gather = HANDLERS["Gather"]


@handler("Gather")
def _gather(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    """Constant picks and embedding lookups as `onnx_ops` imports them; any other Gather is
    `data[:, ..., indices]` (`aten.index.Tensor`; constant indices wrapped into range first)."""
    data, indices = ins
    axis = a.get("axis", 0) % len(_shape(data))
    embedding = axis == 0 and len(_shape(data)) == 2 and not isinstance(indices, torch.Tensor)
    if embedding or (isinstance(indices, torch.Tensor) and (indices.dim() == 0 or isinstance(data, torch.Tensor))):
        return _core_gather(imp, ins, a)
    if isinstance(indices, torch.Tensor):
        indices = indices % _shape(data)[axis]
    return aten(imp, "index.Tensor", [data, indices], ("$0", (None,) * axis + ("$1",)))


@handler("CastLike")
def _cast_like(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    dtype = ins[1].dtype if isinstance(ins[1], torch.Tensor) else torch_dtype(ins[1].type.dtype)
    if isinstance(ins[0], torch.Tensor):
        return [ins[0].to(dtype)]
    return imp.apply("cast", ins[:1], {"dtype": dtype_name(dtype)})


@handler("GatherND")
def _gather_nd(imp: Importer, ins: list[Any], a: dict[str, Any]) -> list[Operand]:
    """`data[idx[..., 0], idx[..., 1], ...]` (batch_dims=0): one index tensor per indexed dim."""
    data, indices = ins
    if a.get("batch_dims", 0):
        raise ShardcError(f"ONNX GatherND {imp.node.name!r} with batch_dims > 0 is not supported", where=imp.path)
    if isinstance(data, torch.Tensor) and isinstance(indices, torch.Tensor):
        return [data[tuple(indices.unbind(-1))]]
    depth = _shape(indices)[-1]
    pieces = [imp.apply("select", [indices], {"dim": len(_shape(indices)) - 1, "index": k})[0] for k in range(depth)] \
        if not isinstance(indices, torch.Tensor) else list(indices.unbind(-1))
    return aten(imp, "index.Tensor", [data, *pieces], ("$0", tuple(f"${k + 1}" for k in range(depth))))
