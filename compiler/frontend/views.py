"""Lowering rules for shapes and data movement: reshape, permute, expand, casts, indexing,
slicing, split and concatenation. No-ops (contiguous, clone, detach, a cast to the same dtype,
a reshape to the same shape, a full slice) return their input and leave no node behind.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from shardc.frontend.emit import Emitter, Unsupported, dtype_name
from shardc.frontend.rules import aten, rule
from shardc.ir import Value


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def reshape(e: Emitter, x: Value, shape: tuple[int, ...]) -> Value:
    shape = tuple(int(d) for d in shape)
    return x if shape == x.type.shape else e.emit("reshape", [x], shape=shape)


@rule(torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze, torch.unflatten, "view", "reshape", "flatten",
      "unsqueeze", "squeeze", "unflatten", "view_as", "reshape_as", "unsqueeze_", "squeeze_", aten("view"),
      aten("reshape"), aten("_unsafe_view"), aten("unsqueeze"), aten("squeeze"), aten("flatten"), aten("unflatten"))
def _reshape(e: Emitter, res: Any, x: Value, *_: Any, **__: Any) -> Value:
    if dtype_name(res.dtype) != x.type.dtype:
        raise Unsupported(f"a view that reinterprets {x.type.dtype} as {res.dtype}")
    return reshape(e, x, tuple(res.shape))


def permute(e: Emitter, x: Value, dims: tuple[int, ...]) -> Value:
    dims = tuple(_dim(d, x.type.rank) for d in dims)
    return x if dims == tuple(range(x.type.rank)) else e.emit("permute", [x], dims=dims)


@rule(torch.permute, "permute", aten("permute"))
def _permute(e: Emitter, res: Any, x: Value, *dims: Any, **kwargs: Any) -> Value:
    if "dims" in kwargs:
        dims = kwargs["dims"]
    if len(dims) == 1 and isinstance(dims[0], list | tuple | torch.Size):
        dims = tuple(dims[0])
    return permute(e, x, tuple(dims))


@rule(torch.transpose, torch.swapaxes, "transpose", "swapaxes", "transpose_", aten("transpose"))
def _transpose(e: Emitter, res: Any, x: Value, dim0: int, dim1: int, **_: Any) -> Value:
    order = list(range(x.type.rank))
    a, b = _dim(dim0, x.type.rank), _dim(dim1, x.type.rank)
    order[a], order[b] = order[b], order[a]
    return permute(e, x, tuple(order))


@rule(torch.t, "t", aten("t"), aten("numpy_T"))
def _t(e: Emitter, res: Any, x: Value, **_: Any) -> Value:
    return permute(e, x, tuple(reversed(range(x.type.rank))))


@rule(torch.broadcast_to, "expand", "expand_as", "broadcast_to", aten("expand"), aten("broadcast_to"))
def _expand(e: Emitter, res: Any, x: Value, *_: Any, **__: Any) -> Value:
    shape = tuple(int(d) for d in res.shape)
    return x if shape == x.type.shape else e.emit("expand", [x], shape=shape)


@rule("contiguous", "clone", "detach", "detach_", "requires_grad_", "cpu", "cuda", torch.clone, torch.detach,
      aten("contiguous"), aten("clone"), aten("alias"), aten("detach"), aten("lift_fresh_copy"), aten("lift_fresh"))
def _identity(e: Emitter, res: Any, x: Value, *_: Any, **__: Any) -> Value:
    return x


@rule("to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int", "bool", "short", "byte",
      aten("to"), aten("_to_copy"), aten("type_as"), aten("_to_dtype"))
def _cast(e: Emitter, res: Any, x: Value, *_: Any, **__: Any) -> Value:
    if not isinstance(res, torch.Tensor):
        raise Unsupported(f"a conversion whose result is {type(res).__name__}")
    dtype = dtype_name(res.dtype)
    return x if dtype == x.type.dtype else e.emit("cast", [x], dtype=dtype)


# ---- indexing --------------------------------------------------------------------------------

def slice_dim(e: Emitter, x: Value, dim: int, start: Any, end: Any, step: Any = 1) -> Value:
    size = x.type.shape[dim]
    if step is None:
        step = 1
    if step < 1:
        raise Unsupported(f"a slice with step {step}")
    lo, hi, st = slice(start, end, step).indices(size)
    hi = max(hi, lo)
    if (lo, hi, st) == (0, size, 1):
        return x
    attrs: dict[str, Any] = {"dim": dim, "start": lo, "end": hi}
    if st != 1:
        attrs["step"] = st
    return e.emit("slice", [x], **attrs)


def select_dim(e: Emitter, x: Value, dim: int, index: int) -> Value:
    size = x.type.shape[dim]
    if not -size <= index < size:
        raise Unsupported(f"index {index} out of range for dim {dim} of size {size}")
    return e.emit("select", [x], dim=dim, index=index + size if index < 0 else index)


@rule(operator.getitem)
def _getitem(e: Emitter, res: Any, x: Any, index: Any, **_: Any) -> Any:
    """`x[...]` with ints, slices, None and `...`; a tensor index (gather) is not supported."""
    if not isinstance(x, Value):
        return x[index]  # a tuple of values (split's pieces)
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, Value | list | torch.Tensor) for i in items):
        raise Unsupported("indexing with a tensor or a list (advanced indexing, a gather)")
    if Ellipsis in items:
        at = items.index(Ellipsis)
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[at : at + 1] = [slice(None)] * (x.type.rank - used)
    dim = 0
    out = x
    for item in items:
        if item is None:
            continue
        if isinstance(item, slice):
            out = slice_dim(e, out, dim, item.start, item.stop, item.step)
            dim += 1
        elif isinstance(item, int):
            out = select_dim(e, out, dim, item)
        else:
            raise Unsupported(f"index of type {type(item).__name__}")
    return reshape(e, out, tuple(res.shape))  # None entries add size-one dims


@rule(aten("slice"))
def _aten_slice(e: Emitter, res: Any, x: Value, dim: int = 0, start: Any = None, end: Any = None, step: int = 1,
                **_: Any) -> Value:
    return slice_dim(e, x, _dim(dim, x.type.rank), start, end, step)


@rule(torch.narrow, "narrow", aten("narrow"))
def _narrow(e: Emitter, res: Any, x: Value, dim: int, start: int, length: int, **_: Any) -> Value:
    d = _dim(dim, x.type.rank)
    start = start + x.type.shape[d] if start < 0 else start
    return slice_dim(e, x, d, start, start + length)


@rule(torch.select, "select", aten("select"))
def _select(e: Emitter, res: Any, x: Value, dim: int, index: int, **_: Any) -> Value:
    return select_dim(e, x, _dim(dim, x.type.rank), index)


# ---- split and concatenation -----------------------------------------------------------------

def split(e: Emitter, x: Value, sizes: tuple[int, ...], dim: int) -> tuple[Value, ...]:
    if len(sizes) == 1:
        return (x,)
    return tuple(e.emit("split", [x], sizes=sizes, dim=dim))


@rule(torch.split, torch.chunk, torch.tensor_split, "split", "chunk", "split_with_sizes", "tensor_split",
      aten("split"), aten("split_with_sizes"), aten("chunk"), aten("tensor_split"))
def _split(e: Emitter, res: Any, x: Value, sections: Any = None, dim: int = 0, **kwargs: Any) -> tuple[Value, ...]:
    d = _dim(kwargs.get("dim", dim), x.type.rank)
    return split(e, x, tuple(int(r.shape[d]) for r in res), d)


@rule(torch.unbind, "unbind", aten("unbind"))
def _unbind(e: Emitter, res: Any, x: Value, dim: int = 0, **_: Any) -> tuple[Value, ...]:
    d = _dim(dim, x.type.rank)
    pieces = split(e, x, (1,) * x.type.shape[d], d)
    return tuple(reshape(e, p, tuple(r.shape)) for p, r in zip(pieces, res))


def _tensors(xs: Any, what: str) -> list[Value]:
    xs = list(xs)
    if not all(isinstance(v, Value) for v in xs):
        raise Unsupported(f"{what} of something that is not a tensor")
    return xs


@rule(torch.cat, torch.concat, torch.concatenate, aten("cat"), aten("concat"), aten("concatenate"))
def _cat(e: Emitter, res: Any, xs: Any, dim: int = 0, **kwargs: Any) -> Value:
    values = [v for v in _tensors(xs, "cat") if v.type.numel > 0 or v.type.rank == res.dim()]
    d = _dim(kwargs.get("axis", dim), res.dim())
    return values[0] if len(values) == 1 else e.emit("concat", values, dim=d)


@rule(torch.stack, aten("stack"))
def _stack(e: Emitter, res: Any, xs: Any, dim: int = 0, **_: Any) -> Value:
    values = _tensors(xs, "stack")
    d = _dim(dim, res.dim())
    unsqueezed = [reshape(e, v, v.type.shape[:d] + (1,) + v.type.shape[d:]) for v in values]
    return unsqueezed[0] if len(unsqueezed) == 1 else e.emit("concat", unsqueezed, dim=d)
