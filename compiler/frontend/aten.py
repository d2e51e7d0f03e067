"""The frontend's side of the long tail: calls with no lowering rule become aten fallback nodes.

Rule. A call the rule tables cannot lower is lowered as the aten ops torch runs for it:
- an aten op (torch.export's graphs) becomes one `aten[target=...]` node (`shardc.ops.fallback`),
  an in-place op its out-of-place twin (`copy_` -> `copy`), whose result the frontend binds to
  the written tensor, and through `slice_scatter`/`select_scatter` to the tensor a written slice
  or select was taken from (`write_back`);
- a torch function or tensor method (torch.fx's graphs) runs once on fresh meta tensors under a
  dispatch recorder; each aten op it dispatches is lowered by its own rule when the tables have
  one (views, arithmetic) and as an `aten` node otherwise, so `x[idx]`, `torch.max(x, 1)` and
  `F.pad` become `index.Tensor`, `max.dim` and `constant_pad_nd` nodes.
A call it cannot express either (a tensor made inside the call that no op produced, an argument
with no IR form, an in-place write into a view of another tensor, which SSA cannot carry back to
the base) raises `Unsupported`, which
the frontend reports (or keeps opaque with `allow_opaque`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shardc.frontend.emit import Emitter, Unsupported
from shardc.frontend.rules import ATEN, target_name
from shardc.ir import Value
from shardc.ops.fallback import functional_variant

_SKIP = frozenset({"aten::detach", "aten::alias", "aten::lift_fresh", "aten::_to_copy_noop"})


def writes_first_argument(op: Any) -> bool:
    """Whether the aten op writes its first argument in place (`copy_`, `index_put_`)."""
    args = op._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def is_view(op: Any) -> bool:
    """Whether the aten op's result aliases an input (a view: writes into it reach the base)."""
    returns = op._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def encode_operands(x: Any, inputs: list[Value], layouts: bool = False) -> Any:
    """A call's argument in its IR form (`shardc.ops.targets.decode_operands` reads it back): an IR
    value becomes `$k` (appended to `inputs`), a dtype `$dtype:NAME`, a device `$device`, sequences
    tuples; with `layouts`, memory formats and layouts drop to None (the IR computes dense
    contiguous tensors). Anything else is `Unsupported`."""
    if isinstance(x, Value):
        inputs.append(x)
        return f"${len(inputs) - 1}"
    if isinstance(x, list | tuple | torch.Size):
        return tuple(encode_operands(y, inputs, layouts) for y in x)
    if isinstance(x, torch.dtype):
        return f"$dtype:{str(x).removeprefix('torch.')}"
    if isinstance(x, torch.device):
        return "$device"
    if layouts and isinstance(x, torch.memory_format | torch.layout):
        return None
    if x is None or isinstance(x, bool | int | float | str):
        return x
    raise Unsupported(f"argument {x!r} has no IR form")


def emit_aten(e: Emitter, op: Any, args: Any, kwargs: dict[str, Any], res: Any) -> Any:
    """One `aten` node for `op(*args, **kwargs)` (IR values among the arguments); its outputs
    shaped like `res` (a tensor, a tuple, or a torch return type such as `max`'s)."""
    twin = functional_variant(op)
    if twin is None:
        raise Unsupported(f"{target_name('call_function', op)} writes in place and torch has no out-of-place twin")
    inputs: list[Value] = []

    def encode(x: Any) -> Any:
        try:
            return encode_operands(x, inputs, layouts=True)
        except Unsupported as err:
            raise Unsupported(f"{err} (a call of {op})") from None
    attrs: dict[str, Any] = {"target": target_name("call_function", twin), "args": encode(tuple(args))}
    if kwargs:
        attrs["kwargs"] = tuple((k, encode(v)) for k, v in kwargs.items() if v is not None)
    tensors = [t for t in pytree.tree_leaves(res) if isinstance(t, torch.Tensor)]
    if not isinstance(res, torch.Tensor):
        if not (isinstance(res, tuple | list) and len(tensors) == len(res)):
            raise Unsupported(f"{op} returns {type(res).__name__}, not tensors")
        attrs["outputs"] = len(res)
    out = e.emit("aten", inputs, **attrs)
    if isinstance(res, tuple) and hasattr(res, "n_fields"):  # torch.return_types.max and friends
        return type(res)(tuple(out))
    return out


class _Recorder(TorchDispatchMode):
    """Every aten op a call dispatches, with its arguments and result (meta tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, Any, dict[str, Any], Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def lower_by_dispatch(e: Emitter, fn: Any, args: Any, kwargs: dict[str, Any], res: Any) -> Any:
    """Lower `fn(*args, **kwargs)` (a torch function or method call, IR values among the
    arguments) as the aten ops it dispatches (see the module docstring); returns values shaped
    like `res`."""
    known: dict[int, Value] = {}
    keep: list[torch.Tensor] = []  # ids stay valid while the tensors live

    def fresh(x: Any) -> Any:
        if isinstance(x, Value):
            meta = e.meta(x)
            t = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
            known[id(t)] = x
            keep.append(t)
            return t
        return x
    margs, mkwargs = pytree.tree_map(fresh, (args, kwargs), is_leaf=lambda x: isinstance(x, Value))
    recorder = _Recorder()
    try:
        with recorder:
            got = fn(*margs, **mkwargs)
    except Exception as err:
        raise Unsupported(f"torch cannot run it under a dispatch recorder ({type(err).__name__}: {err})") from err
    views: set[int] = set()  # tensors that alias another: a write into one would reach its base
    for func, cargs, ckwargs, out in recorder.calls:
        if func._schema.name in _SKIP:
            _alias(known, keep, out, cargs)
            continue
        if writes_first_argument(func) and isinstance(cargs[0], torch.Tensor) and id(cargs[0]) in views:
            raise Unsupported(f"{func} writes in place into a view of another tensor")

        if any(isinstance(t, torch.Tensor) and id(t) not in known for t in pytree.tree_leaves((cargs, ckwargs))):
            raise Unsupported(f"{func} reads a tensor made inside the call that no op produced")
        vargs, vkwargs = pytree.tree_map(lambda x: known[id(x)] if isinstance(x, torch.Tensor) else x, (cargs, ckwargs))
        lowered = lower_aten(e, func, vargs, vkwargs, out)
        if writes_first_argument(func) and isinstance(cargs[0], torch.Tensor):
            known[id(cargs[0])] = lowered if isinstance(lowered, Value) else lowered[0]
        for t, v in zip(_flat(out), _flat(lowered)):
            if isinstance(t, torch.Tensor) and isinstance(v, Value):
                known[id(t)] = v
                keep.append(t)
                if is_view(func):
                    views.add(id(t))

    def result(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in known:
                raise Unsupported("its result is a tensor no recorded aten op produced")
            return known[id(x)]
        return x
    out = pytree.tree_map(result, got)
    return type(res)(tuple(out)) if isinstance(res, tuple) and hasattr(res, "n_fields") else out


def _flat(x: Any) -> list[Any]:
    return list(x) if isinstance(x, tuple | list) else [x]


def _alias(known: dict[int, Value], keep: list[torch.Tensor], out: Any, args: Any) -> None:
    """detach/alias: the result stands for its input."""
    if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor) and id(args[0]) in known:
        known[id(out)] = known[id(args[0])]
        keep.append(out)


def lower_aten(e: Emitter, op: Any, args: Any, kwargs: dict[str, Any], res: Any) -> Any:
    """An aten op call: its rule from the tables when it has one and accepts, else an `aten` node."""
    rule = ATEN.get(op.overloadpacket)
    if rule is not None and not writes_first_argument(op):
        try:
            return rule(e, res, *args, **kwargs)
        except Unsupported:
            pass
    return emit_aten(e, op, args, kwargs, res)


def write_back(e: Emitter, env: dict[Any, Any], written: Any, value: Value) -> None:
    """An in-place write (an aten op in torch.export's graph) made `value` the new content of the
    fx node `written` in the lowering's `env`: later reads of it see `value`, and when it is a
    slice or a select of another tensor (`x[:, 1:] = y`), that base is rebuilt around it
    (`slice_scatter`, `select_scatter`), up the chain of views. Views of the base taken before
    the write keep the old values (SSA: they are not derived again)."""
    while True:
        env[written] = value
        target = written.target
        if not (isinstance(target, torch._ops.OpOverload) and is_view(target)):
            return
        base_node = written.args[0]
        base = env.get(base_node) if isinstance(base_node, torch.fx.Node) else None
        if not isinstance(base, Value):
            raise Unsupported(f"it writes in place into a view ({target}) of something that is not a tensor")
        packet, rest = target.overloadpacket, list(written.args[1:])
        if packet is torch.ops.aten.slice:
            dim, start, end, step = (rest + [0, None, None, 1][len(rest):])[:4]
            scatter, extra = torch.ops.aten.slice_scatter.default, (dim, start, end, step)
        elif packet is torch.ops.aten.select:
            scatter, extra = torch.ops.aten.select_scatter.default, tuple(rest[:2])
        else:
            raise Unsupported(f"it writes in place into a view ({target}) of another tensor; only slices and "
                              "selects are written back")
        value = emit_aten(e, scatter, (base, value, *extra), {}, e.meta(base))
        written = base_node

