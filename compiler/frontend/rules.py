"""The lowering table: torch function, tensor method or aten op -> a rule that emits registry ops.

A rule is `rule(e, res, *args, **kwargs)`: `e` is the `Emitter`, `res` the call's own result
computed on meta tensors (its shapes and dtypes are the truth the rule may read), and `args`
the call's arguments with tensors replaced by IR `Value`s. It returns a `Value`, a tuple of
them, or the input value itself when the call is a no-op. Rules live in `elementwise.py`, `normalize.py`,
`views.py` and `creation.py`; they are filled in when those modules are imported (`torch_trace` imports them;
`normalize` imports `elementwise`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardc.ops.targets import resolve_target

Rule = Callable[..., Any]

FUNCTIONS: dict[Any, Rule] = {}
METHODS: dict[str, Rule] = {}
ATEN: dict[Any, Rule] = {}


def rule(*keys: Any) -> Callable[[Rule], Rule]:
    """Register a rule under torch functions (objects), tensor methods (str) and aten ops (packets).

    `None` keys are skipped, so an aten op missing from this torch build costs nothing.
    """
    def deco(fn: Rule) -> Rule:
        for key in keys:
            if key is None:
                continue
            if isinstance(key, str):
                METHODS[key] = fn
            elif isinstance(key, torch._ops.OpOverloadPacket):
                ATEN[key] = fn
            else:
                FUNCTIONS[key] = fn
        return fn
    return deco


def aten(name: str) -> Any:
    """The aten op packet `name`, or None when this torch build lacks it."""
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


def target_name(kind: str, target: Any) -> str:
    """A readable, importable name: `torch.cumsum`, `Tensor.masked_fill`, `torch.ops.aten.cumsum.default`."""
    if kind == "call_method":
        return f"Tensor.{target}"
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    short = getattr(target, "__name__", qualname)
    for home in ("torch", "torch.nn.functional", "torch.special", "torch.linalg", "torch.fft"):
        if module.startswith("torch") and resolve_target(f"{home}.{short}") is target:
            return f"{home}.{short}"
    return f"{module}.{qualname}" if module else str(qualname)
