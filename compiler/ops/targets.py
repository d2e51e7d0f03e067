"""Torch callables by importable name (`torch.cumsum`, `Tensor.masked_fill`,
`torch.ops.aten.cumsum.default`): how an opaque op names the torch call it stands for, so the
IR prints it and the op runs it without the frontend, and how its arguments are written in the
IR's attributes (`decode_operands`: `$k` input k, `$dtype:NAME` a torch dtype, `$device`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch


def _resolve(name: str) -> Any:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def resolve_target(name: str) -> Any:
    """The callable `target_name` named (method names resolve to `torch.Tensor.<name>`)."""
    if name.startswith("Tensor."):
        return getattr(torch.Tensor, name[len("Tensor."):], None)
    return _resolve(name)


def decode_operands(x: Any, tensors: Sequence[Any], device: Any, sequence: type = tuple) -> Any:
    """A call's arguments from their IR form: `$k` is `tensors[k]`, `$dtype:NAME` the torch dtype,
    `$device` `device`; tuples become `sequence` (aten's int[] arguments take lists)."""
    if isinstance(x, tuple):
        return sequence(decode_operands(y, tensors, device, sequence) for y in x)
    if isinstance(x, str) and x.startswith("$"):
        if x == "$device":
            return device
        if x.startswith("$dtype:"):
            return getattr(torch, x[len("$dtype:"):])
        return tensors[int(x[1:])]
    return x
