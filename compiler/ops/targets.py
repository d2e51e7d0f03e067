"""Torch callables by importable name (`torch.cumsum`, `Tensor.masked_fill`,
`torch.ops.aten.cumsum.default`): how an opaque op names the torch call it stands for, so the
IR prints it and the op runs it without the frontend.
"""

from __future__ import annotations

import importlib
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
