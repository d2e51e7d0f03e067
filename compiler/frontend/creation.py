"""Lowering rules for tensor creation: ones, zeros, full, arange, scalar tensors -> `full`/`arange`.

The shape and dtype come from the call's own result, so `torch.ones(b, s)`, `x.new_zeros(...)`
and `torch.zeros_like(x)` all become one `full[shape, value, dtype]`.
"""

from __future__ import annotations

from typing import Any

import torch

from shardc.frontend.emit import Emitter, Unsupported, dtype_name
from shardc.frontend.rules import aten, rule
from shardc.ir import Value


def _scalar(x: Any) -> Any:
    if isinstance(x, bool | int | float):
        return x
    raise Unsupported(f"fill value {x!r} is not a Python number")


def _fill(e: Emitter, res: Any, value: Any) -> Value:
    dtype = dtype_name(res.dtype)
    value = bool(value) if dtype == "bool" else (float(value) if res.dtype.is_floating_point else int(value))
    return e.emit("full", [], shape=tuple(res.shape), value=value, dtype=dtype)


@rule(torch.ones, torch.ones_like, "new_ones", aten("ones"), aten("ones_like"), aten("new_ones"))
def _ones(e: Emitter, res: Any, *_: Any, **__: Any) -> Value:
    return _fill(e, res, 1)


@rule(torch.zeros, torch.zeros_like, torch.empty, torch.empty_like, "new_zeros", "new_empty", aten("zeros"),
      aten("zeros_like"), aten("new_zeros"), aten("empty"), aten("empty_like"), aten("new_empty"))
def _zeros(e: Emitter, res: Any, *_: Any, **__: Any) -> Value:
    return _fill(e, res, 0)


@rule(torch.full, aten("full"))
def _full(e: Emitter, res: Any, size: Any, fill_value: Any, **_: Any) -> Value:
    return _fill(e, res, _scalar(fill_value))


@rule(torch.full_like, "new_full", aten("full_like"), aten("new_full"))
def _full_like(e: Emitter, res: Any, x: Any, fill_value: Any, *_: Any, **__: Any) -> Value:
    return _fill(e, res, _scalar(fill_value))


@rule(torch.tensor, torch.as_tensor, aten("scalar_tensor"))
def _tensor(e: Emitter, res: Any, data: Any, *_: Any, **__: Any) -> Value:
    if not isinstance(data, bool | int | float):
        raise Unsupported("torch.tensor of a sequence (kept as a constant)")
    return _fill(e, res, data)


@rule(torch.arange, aten("arange"))
def _arange(e: Emitter, res: Any, *args: Any, start: Any = None, end: Any = None, step: Any = None,
            **_: Any) -> Value:
    nums = [a for a in args if isinstance(a, int | float) and not isinstance(a, bool)]
    if len(nums) == 1 and end is None:
        end = nums[0]
    elif nums:
        start, end = nums[0], nums[1]
        step = nums[2] if len(nums) > 2 else step
    attrs: dict[str, Any] = {"start": start if start is not None else 0, "end": end}
    if step not in (None, 1):
        attrs["step"] = step
    return e.emit("arange", [], **attrs, dtype=dtype_name(res.dtype))
