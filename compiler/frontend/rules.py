"""The lowering table: torch function, tensor method or aten op -> a rule that emits registry ops.

A rule is `rule(e, res, *args, **kwargs)`: `e` is the `Emitter`, `res` the call's own result
computed on meta tensors (its shapes and dtypes are the truth the rule may read), and `args`
the call's arguments with tensors replaced by IR `Value`s. It returns a `Value`, a tuple of
them, or the input value itself when the call is a no-op. Rules live in `normalize.py`,
`views.py` and `creation.py`; they are filled in when those modules are imported (`lookup` imports them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

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


def lookup(kind: str, target: Any) -> Rule | None:
    """The rule for an fx node (`call_function` or `call_method`), or None."""
    from shardc.frontend import creation, normalize, views  # noqa: F401  (fill the tables)

    if kind == "call_method":
        return METHODS.get(target)
    if isinstance(target, torch._ops.OpOverload):
        return ATEN.get(target.overloadpacket)
    try:
        return FUNCTIONS.get(target)
    except TypeError:  # an unhashable callable
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
        if module.startswith("torch") and _resolve(f"{home}.{short}") is target:
            return f"{home}.{short}"
    return f"{module}.{qualname}" if module else str(qualname)


def _resolve(name: str) -> Any:
    import importlib

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
