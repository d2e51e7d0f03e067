"""The long tail: an aten op with no registry entry of its own, priced and partitioned by torch.

Rule. A node `aten[target=torch.ops.aten.NAME.OVERLOAD, args=..., kwargs=...]` runs the aten op
itself on its inputs (`$k` in `args`/`kwargs` is input k, encoded as opaque nodes encode them).
Its iteration space comes from torch's own DTensor sharding propagation: the strategies torch
registers for the op on one mesh dim (single-dim strategies, or the op's strategy function fed
every placement of every input) become iteration dims, one per strategy that
- shards some operand (a `Shard(d)` of an input or an output) and leaves no input `Partial`;
- gives every operand it shards the same extent, an operand dim no earlier strategy claimed;
- shards an output (a parallel dim: operands it does not shard are `Replicate()`), or leaves
  every output `Partial(op)` (a reduction, `op` one the IR knows and the first such op seen);
- survives running the aten op on meta tensors cut to their local shapes: the outputs must come
  out cut the same way (an op with a shape argument, a view, fails this and is not split).
Every other operand dim is an unsplittable dim of its own, so an op torch cannot shard (no
strategy, a random op, an op whose shape arguments DTensor rewrites) stays replicated; the
coverage report lists it. FLOPs come from torch's flop counter on the meta device, bytes are
the operands', and what backward saves is what torch's autograd saves (its saved-tensor hooks
on meta tensors). A registry entry for the op, where one is written, replaces all of this.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from shardc.ir import TensorType
from shardc.ir.dtypes import torch_dtype
from shardc.ops.registry import IterationSpace, OpDef, register
from shardc.ops.targets import decode_operands, resolve_target
from shardc.ops.verifier import recording_saved, shapes_only

Types = Sequence[TensorType]
# One placement on one mesh dim: ("S", dim), ("R",) or ("P", op).
Place = tuple[Any, ...]
Row = tuple[tuple[Place, ...], tuple[Place, ...]]  # (outputs, inputs)

_PARTIAL_OPS = ("sum", "avg", "max")


def overload_of(target: str) -> Any:
    """The aten OpOverload `target` names (`torch.ops.aten.index.Tensor`), or None."""
    fn = resolve_target(target)
    return fn if isinstance(fn, torch._ops.OpOverload) else None


def functional_variant(op: Any) -> Any:
    """The out-of-place twin of an in-place aten op (`copy_` -> `copy`), the op itself when it
    writes nothing, None when torch has no twin (shardc's IR is SSA: nothing is written in place)."""
    if not any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
        return op
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if twin is None or any(a.alias_info is not None and a.alias_info.is_write for a in twin._schema.arguments):
        return None
    return twin


def _in_place_twin(op: Any) -> Any:
    """`aten.copy.default` -> `aten.copy_.default` (same arguments, writes its first), or None."""
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1] + "_", None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _decode(x: Any, tensors: Sequence[Any], device: Any) -> Any:
    return decode_operands(x, tensors, device, list)


# Out-of-place ops autograd has no derivative for (DeepSeek-V3's attention writes a slice with
# `copy_`, which the frontend makes `copy`): run as their in-place twin on a copy, which it has.
_VIA_IN_PLACE_TWIN = frozenset({"torch.ops.aten.copy.default"})


def call(target: str, tensors: Sequence[Any], args: Any, kwargs: Any) -> Any:
    """Run the aten op with `$k` replaced by `tensors[k]`."""
    op = overload_of(target)
    if op is None:
        raise ValueError(f"aten fallback: {target!r} is not an aten op overload")
    device = tensors[0].device if tensors else torch.device("cpu")
    decoded = _decode(tuple(args), tensors, device)
    named = {k: _decode(v, tensors, device) for k, v in kwargs}
    if target in _VIA_IN_PLACE_TWIN:
        return _in_place_twin(op)(decoded[0].clone(), *decoded[1:], **named)
    return op(*decoded, **named)


def _impl(*tensors: torch.Tensor, target: str, args: Any = (), kwargs: Any = (), outputs: int = 1) -> Any:
    out = call(target, tensors, args, kwargs)
    return tuple(out) if isinstance(out, list) else out


def _freeze(x: Any) -> Any:
    return tuple(_freeze(y) for y in x) if isinstance(x, list | tuple) else x


def _metas(types: Types, cut: dict[tuple[int, int], int] | None = None, k: int = 1) -> list[torch.Tensor]:
    cut = cut or {}
    return [torch.empty(tuple(s // k if (i, d) in cut else s for d, s in enumerate(t.shape)),
                        dtype=torch_dtype(t.dtype), device="meta") for i, t in enumerate(types)]


# ---- torch's strategies ---------------------------------------------------------------------

def _place(p: Any) -> Place:
    from torch.distributed.tensor import Partial, Replicate

    if isinstance(p, Replicate):
        return ("R",)
    if isinstance(p, Partial):
        return ("P", str(p.reduce_op))
    dim = getattr(p, "dim", None)  # Shard and the single-dim strategies' placeholders
    return ("S", int(dim)) if isinstance(dim, int) and type(p).__name__ in ("Shard", "_ShardingPlaceholder") else ("?",)


def _schema(op: Any, args: Any, kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    """An OpSchema on a two-device mesh (no process group) whose tensor arguments may take any placement."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy

    mesh = DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0)

    def strategy(t: torch.Tensor) -> OpStrategy:
        meta = TensorMeta(t.shape, t.stride(), t.dtype)
        return OpStrategy([OpSpec(DTensorSpec(mesh, (p,), meta))
                           for p in [Replicate(), *[Shard(d) for d in range(t.dim())]]])

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return strategy(x)
        if isinstance(x, list | tuple) and any(isinstance(y, torch.Tensor) for y in x):
            if all(isinstance(y, torch.Tensor) for y in x):
                return TupleStrategy([strategy(y) for y in x])
            return [wrap(y) for y in x]
        return x
    return OpSchema(op, tuple(wrap(a) for a in args), {k: wrap(v) for k, v in kwargs.items()})


def torch_rows(op: Any, args: Any, kwargs: dict[str, Any], n_out: int) -> list[Row]:
    """The one-mesh-dim strategies torch registers for `op` at these arguments (meta tensors)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import OpStrategy

    prop = DTensor._op_dispatcher.sharding_propagator
    if op not in prop.op_single_dim_strategy_funcs and op not in prop.op_strategy_funcs:
        op = _in_place_twin(op) or op  # torch registers `copy_`'s strategies, not `copy`'s
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    schema = _schema(op, args, kwargs, tensors)
    rows: list[Row] = []
    single = prop.op_single_dim_strategy_funcs.get(op)
    if single is not None:
        for row in single.func(op, schema.args_meta, schema.kwargs_meta):
            places = tuple(_place(p) for p in row)
            rows.append((places[:n_out], places[n_out:]))
        return rows
    func = prop.op_strategy_funcs.get(op)
    if func is None:
        return rows
    result = func(schema)
    if not isinstance(result, OpStrategy):
        return rows  # a tuple of strategies (list outputs): left replicated
    for spec in result.strategies:
        given = spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)
        outs = [o for o in given if o is not None]
        if spec.input_specs is None or len(outs) != len(given):
            continue
        rows.append((tuple(_place(o.placements[0]) for o in outs),
                     tuple(_place(i.placements[0]) for i in spec.input_specs)))
    return rows


# ---- the iteration space --------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _space(target: str, in_types: tuple[TensorType, ...], out_types: tuple[TensorType, ...], args: Any,
           kwargs: Any) -> IterationSpace:
    op = overload_of(target)
    dims: list[tuple[str, int]] = []
    claimed: dict[tuple[int, int], str] = {}  # (operand, tensor dim) -> iteration dim; outputs first
    partial_op = "sum"
    reductions = 0
    splittable = op is not None and torch.Tag.nondeterministic_seeded not in op.tags
    rows: list[Row] = []
    if splittable:
        try:
            metas = _metas(in_types)
            call_args = _decode(tuple(args), metas, torch.device("meta"))
            call_kwargs = {k: _decode(v, metas, torch.device("meta")) for k, v in kwargs}
            with shapes_only():
                rows = torch_rows(op, call_args, call_kwargs, len(out_types))
        except Exception:  # torch's propagation rejects these arguments: no strategy, replicated
            rows = []
    n_out = len(out_types)
    types = list(out_types) + list(in_types)
    for outs, ins in rows:
        places = list(outs) + list(ins)
        if len(outs) != n_out or len(ins) != len(in_types) or any(p[0] == "?" for p in places):
            continue
        if any(p[0] == "P" for p in ins) or not any(p[0] == "S" for p in places):
            continue
        shards = [(i, p[1]) for i, p in enumerate(places) if p[0] == "S"]
        extents = {types[i].shape[d] for i, d in shards if d < types[i].rank}
        if len(extents) != 1 or any(d >= types[i].rank for i, d in shards) or any(k in claimed for k in shards):
            continue
        partial = [p for p in outs if p[0] == "P"]
        if partial:
            if len(partial) != n_out or len({p[1] for p in partial}) != 1 or partial[0][1] not in _PARTIAL_OPS:
                continue
            if reductions and partial[0][1] != partial_op:
                continue
        elif not any(p[0] == "S" for p in outs):
            continue
        size = extents.pop()
        if size < 2 or not _runs_locally(target, in_types, out_types, args, kwargs, shards, size, bool(partial)):
            continue
        name = f"s{len(dims)}"
        dims.append((name, size))
        claimed.update({k: name for k in shards})
        if partial:
            partial_op, reductions = partial[0][1], reductions + 1
    fixed: list[str] = []

    def operand(i: int, t: TensorType) -> tuple[tuple[str, ...], ...]:
        out = []
        for d, extent in enumerate(t.shape):
            name = claimed.get((i, d))
            if name is None:
                name = f"o{i}_{d}"
                dims.append((name, extent))
                fixed.append(name)
            out.append((name,))
        return tuple(out)
    outputs = tuple(operand(i, t) for i, t in enumerate(out_types))
    inputs = tuple(operand(n_out + i, t) for i, t in enumerate(in_types))
    return IterationSpace(tuple(dims), inputs, outputs, frozenset(fixed), partial_op=partial_op)


def _runs_locally(target: str, in_types: Types, out_types: Types, args: Any, kwargs: Any,
                  shards: list[tuple[int, int]], size: int, partial: bool) -> bool:
    """The aten op on inputs cut into `k` pieces along the strategy's dims gives outputs cut the
    same way (reductions: whole outputs)."""
    k = next((f for f in range(2, size + 1) if size % f == 0), size)
    n_out = len(out_types)
    cut_in = {(i - n_out, d) for i, d in shards if i >= n_out}
    try:
        metas = _metas(in_types, dict.fromkeys(cut_in, 1), k)
        got = call(target, metas, args, kwargs)
    except Exception:
        return False
    got = list(got) if isinstance(got, tuple | list) else [got]
    cut_out = {i for i, _ in shards if i < n_out}
    for i, (t, g) in enumerate(zip(out_types, got)):
        want = [s // k if (i, d) in shards and i in cut_out and not partial else s for d, s in enumerate(t.shape)]
        if not isinstance(g, torch.Tensor) or list(g.shape) != want:
            return False
    return len(got) == n_out


def fallback_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    """The iteration space torch's DTensor strategies give this node (see the module docstring)."""
    return _space(str(a["target"]), tuple(i), tuple(o), _freeze(a.get("args", ())), _freeze(a.get("kwargs", ())))


# ---- costs ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _flops(target: str, in_types: tuple[TensorType, ...], args: Any, kwargs: Any) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            call(target, _metas(in_types), args, kwargs)
        return int(counter.get_total_flops())
    except Exception:
        return 0


@functools.lru_cache(maxsize=4096)
def _saves(target: str, in_types: tuple[TensorType, ...], args: Any, kwargs: Any) -> tuple[tuple[str, int], ...]:
    """What autograd keeps for backward when the float inputs require grad: inputs and outputs by
    position, anything else as bytes; every input when torch cannot run it on meta tensors."""
    metas = [m.requires_grad_() if m.is_floating_point() else m for m in _metas(in_types)]
    try:
        with recording_saved() as saved:
            out = call(target, metas, args, kwargs)
    except Exception:
        return tuple(("in", k) for k in range(len(in_types)))
    outs = list(out) if isinstance(out, tuple | list) else [out]
    found: list[tuple[str, int]] = []
    for t in saved:
        where = next((("in", k) for k, m in enumerate(metas) if t is m), None) or \
            next((("out", k) for k, m in enumerate(outs) if t is m), None) or \
            ("bytes", t.numel() * t.element_size())
        if where not in found or where[0] == "bytes":
            found.append(where)
    return tuple(found)


register(OpDef(
    "aten", "aten", fallback_space, _impl,
    flops=lambda i, o, a: _flops(str(a["target"]), tuple(i), _freeze(a.get("args", ())), _freeze(a.get("kwargs", ()))),
    saves=lambda i, o, a: list(_saves(str(a["target"]), tuple(i), _freeze(a.get("args", ())),
                                      _freeze(a.get("kwargs", ())))),
    num_outputs=lambda a: a.get("outputs", 1),
    doc="an aten op with no registry entry: runs as `target`; split as torch's DTensor strategies allow",
))
