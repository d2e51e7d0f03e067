"""The op registry: one entry per op kind, holding everything the compiler knows about it.

An entry gives the op's iteration space in einsum style (`"... k, n k -> ... n"`), which dims
cannot be split, special partition rules, a torch implementation (used by the reference
backend and for shape inference on the meta device), FLOPs, bytes moved and what backward
saves. Adding an op is adding one `OpDef` with `register`.

Signature grammar: operands separated by `,`, inputs and outputs by `->`; each operand is a
list of dims; `...` stands for leading dims aligned from the right (numpy broadcasting);
`(a d)` is one tensor dim made of the factors `a` (major) and `d` (minor); `1` is a size-one
dim that takes part in no iteration. A dim in inputs but in no output is a reduction: split,
it leaves the output `Partial(sum)` unless the op says otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardc.ir import Layout, Mesh, Partial, Partition, Placement, Replicate, Shard, TemporalSplit, TensorType

# One tensor dim as the iteration factors it is made of, major first; () means broadcast.
DimFactors = tuple[str, ...]
OperandDims = tuple[DimFactors, ...]


@dataclass(frozen=True, slots=True)
class IterationSpace:
    """A node's iteration dims with sizes, and how each operand's tensor dims map onto them."""

    sizes: tuple[tuple[str, int], ...]
    inputs: tuple[OperandDims, ...]
    outputs: tuple[OperandDims, ...]
    unsplittable: frozenset[str] = frozenset()
    # dim -> rule name, for dims whose split needs more than Shard/Partial (see OpDef.rules)
    special: tuple[tuple[str, str], ...] = ()
    # How a split reduction leaves the outputs: "sum", "avg" (a mean) or "max".
    partial_op: str = "sum"
    # Inputs added to the result (a bias): partial wherever a split reduction makes the result partial.
    additive: tuple[int, ...] = ()

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.sizes)

    def size(self, dim: str) -> int:
        for d, s in self.sizes:
            if d == dim:
                return s
        raise KeyError(dim)

    @property
    def reductions(self) -> tuple[str, ...]:
        produced = {f for operand in self.outputs for dim in operand for f in dim}
        return tuple(d for d in self.dims if d not in produced)

    @property
    def parallel(self) -> tuple[str, ...]:
        reduced = set(self.reductions)
        return tuple(d for d in self.dims if d not in reduced)

    def splittable(self) -> tuple[str, ...]:
        """Dims a mesh axis may split plainly (special-rule dims need their rule, see OpDef.rules)."""
        special = {d for d, _ in self.special}
        return tuple(d for d in self.dims if d not in self.unsplittable and d not in special and self.size(d) > 1)


@dataclass(frozen=True, slots=True)
class OpDef:
    """Everything known about one op kind. `impl(*tensors, **attrs)` runs it with torch."""

    name: str
    kind: str  # contraction | elementwise | norm | reduction | view | creation | attention | loss | index | collective
    signature: str | Callable[[Sequence[TensorType], Sequence[TensorType], dict[str, Any]], IterationSpace]
    impl: Callable[..., Any]
    unsplittable: frozenset[str] = frozenset()
    # dim -> rule: "ring" (split only in time with rotation: attention's key dim), "vocab" (a
    # reduction whose split needs max/sum-exp all-reduces: cross entropy's classes), "expert"
    # (the experts of an MoE layer: tokens dispatched to them by all-to-all, `shardc.ops.moe`).
    rules: tuple[tuple[str, str], ...] = ()
    flops: Callable[[Sequence[TensorType], Sequence[TensorType], dict[str, Any]], int] | None = None
    # What backward keeps: ("in", i), ("out", i) or ("bytes", n); None means by kind.
    saves: Callable[[Sequence[TensorType], Sequence[TensorType], dict[str, Any]], list[tuple[str, int]]] | None = None
    num_outputs: int | Callable[[dict[str, Any]], int] = 1
    doc: str = ""
    # Input positions added to the result (linear's bias), see IterationSpace.additive.
    additive: tuple[int, ...] = ()
    # A contraction's multiplied inputs, one per backward matmul of the forward's size when it
    # needs a gradient (dgrad, wgrad); the others (a bias, routing weights) are cheap.
    operands: tuple[int, ...] = (0, 1)

    def iteration_space(
        self, in_types: Sequence[TensorType], out_types: Sequence[TensorType], attrs: dict[str, Any]
    ) -> IterationSpace:
        if callable(self.signature):
            space = self.signature(in_types, out_types, attrs)
        else:
            space = space_from_signature(self.signature, in_types, out_types)
        if self.unsplittable or self.rules or self.additive:
            space = dataclasses.replace(
                space,
                unsplittable=space.unsplittable | frozenset(d for d in self.unsplittable if d in space.dims),
                special=space.special + tuple((d, r) for d, r in self.rules if d in space.dims),
                additive=space.additive + tuple(i for i in self.additive if i < len(in_types)),
            )
        return space

    def count_flops(self, in_types: Sequence[TensorType], out_types: Sequence[TensorType], attrs: dict[str, Any]) -> int:
        if self.flops is not None:
            return int(self.flops(in_types, out_types, attrs))
        if self.kind == "contraction":
            space = self.iteration_space(in_types, out_types, attrs)
            return 2 * math.prod(s for _, s in space.sizes)
        if self.kind in ("elementwise", "norm", "reduction", "loss"):
            return sum(t.numel for t in out_types) if self.kind != "reduction" else sum(t.numel for t in in_types)
        return 0

    def count_bytes(self, in_types: Sequence[TensorType], out_types: Sequence[TensorType], attrs: dict[str, Any]) -> int:
        """Bytes read and written by a straightforward kernel (views move nothing)."""
        if self.kind in ("view", "creation"):
            return 0
        return sum(t.nbytes for t in in_types) + sum(t.nbytes for t in out_types)

    def saved_for_backward(
        self, in_types: Sequence[TensorType], out_types: Sequence[TensorType], attrs: dict[str, Any]
    ) -> list[tuple[str, int]]:
        if self.saves is not None:
            return self.saves(in_types, out_types, attrs)
        if self.kind in ("contraction", "norm", "attention", "loss"):
            return [("in", i) for i in range(len(in_types))]
        return []


_REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    """Add an op kind; registering a name twice is an error (rules live in one place)."""
    if op.name in _REGISTRY:
        raise ValueError(f"op {op.name!r} is registered twice")
    _REGISTRY[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"no registry entry for op {name!r}; add one with shardc.ops.registry.register(OpDef(...)) "
            "in compiler/ops/builtin.py"
        ) from None


def has_op(name: str) -> bool:
    return name in _REGISTRY


# ---- signatures -----------------------------------------------------------------------------

def _parse_operand(text: str) -> list[str | tuple[str, ...]]:
    """`"... (a d) k 1"` -> ['...', ('a', 'd'), 'k', '1']."""
    out: list[str | tuple[str, ...]] = []
    tokens = text.replace("(", " ( ").replace(")", " ) ").split()
    i = 0
    while i < len(tokens):
        if tokens[i] == "(":
            j = tokens.index(")", i)
            out.append(tuple(tokens[i + 1 : j]))
            i = j + 1
        else:
            out.append(tokens[i])
            i += 1
    return out


def space_from_signature(
    signature: str, in_types: Sequence[TensorType], out_types: Sequence[TensorType]
) -> IterationSpace:
    """Bind an einsum-style signature to concrete operand shapes."""
    lhs, rhs = signature.split("->")
    in_specs = [_parse_operand(s) for s in lhs.split(",")] if lhs.strip() else []
    out_specs = [_parse_operand(s) for s in rhs.split(",")] if rhs.strip() else []
    # Inputs may be fewer than the signature (optional bias): bind the first ones.
    in_specs = in_specs[: len(in_types)]
    if len(out_specs) == 1 and len(out_types) > 1:
        out_specs = out_specs * len(out_types)
    ellipsis_rank = 0
    for spec, t in list(zip(in_specs, in_types)) + list(zip(out_specs, out_types)):
        if "..." in spec:
            ellipsis_rank = max(ellipsis_rank, t.rank - (len(spec) - 1))
    ell_names = [f"e{i}" for i in range(ellipsis_rank)]
    sizes: dict[str, int] = {}

    def bind(spec: list[str | tuple[str, ...]], t: TensorType, where: str) -> OperandDims:
        dims: list[DimFactors] = []
        expanded: list[str | tuple[str, ...]] = []
        for item in spec:
            if item == "...":
                n = t.rank - (len(spec) - 1)
                expanded.extend(ell_names[ellipsis_rank - n :] if n > 0 else [])
            else:
                expanded.append(item)
        if len(expanded) != t.rank:
            raise ValueError(f"{where} has rank {t.rank} but signature {signature!r} gives it {len(expanded)} dims")
        for item, extent in zip(expanded, t.shape):
            # An input's size-one dim against a larger output dim is a broadcast, not a split-able
            # dim; a size-one dim the output shares (a batch of one) stays a real iteration dim.
            broadcast = (isinstance(item, str) and item in ell_names and extent == 1
                         and where.startswith("input") and sizes.get(item, 1) != 1)
            if item == "1" or broadcast:
                dims.append(())
                continue
            if isinstance(item, tuple):
                dims.append(item)
                continue
            if item in sizes and sizes[item] != extent:
                if extent == 1 and where.startswith("input"):
                    dims.append(())  # broadcast
                    continue
                if sizes[item] == 1:
                    sizes[item] = extent
                else:
                    raise ValueError(f"{where}: dim {item} is {extent} here but {sizes[item]} elsewhere ({signature!r})")
            sizes.setdefault(item, extent)
            dims.append((item,))
        return tuple(dims)

    outputs = tuple(bind(s, t, f"output {i}") for i, (s, t) in enumerate(zip(out_specs, out_types)))
    inputs = tuple(bind(s, t, f"input {i}") for i, (s, t) in enumerate(zip(in_specs, in_types)))
    # Composite dims: infer one unknown factor from the tensor extent.
    for operand, t in list(zip(inputs, in_types)) + list(zip(outputs, out_types)):
        for factors, extent in zip(operand, t.shape):
            if len(factors) > 1:
                unknown = [f for f in factors if f not in sizes]
                known = math.prod(sizes[f] for f in factors if f in sizes)
                if len(unknown) == 1:
                    sizes[unknown[0]] = extent // max(known, 1)
                elif unknown:
                    raise ValueError(f"cannot size factors {unknown} of composite dim in {signature!r}")
    order = [d for d in ell_names if d in sizes] + [d for d in sizes if d not in ell_names]
    return IterationSpace(tuple((d, sizes[d]) for d in order), inputs, outputs)


# ---- layouts from partitions ----------------------------------------------------------------

def _factor_position(operand: OperandDims, dim: str) -> tuple[int, int] | None:
    """(tensor dim, factor index) where `operand` holds iteration dim `dim`, or None."""
    for i, factors in enumerate(operand):
        if dim in factors:
            return i, factors.index(dim)
    return None


def operand_layout(
    operand: OperandDims, partition: Partition, space: IterationSpace, mesh: Mesh, is_output: bool,
    additive: bool = False,
) -> Layout:
    """The layout one operand has under a partition (mesh axes in mesh order).

    Rules, per mesh axis that splits iteration dim `f` (with stride `k`, see `Partition`):
    - `f` is factor j of tensor dim i: `Shard(i, interleave)` with interleave = k times the
      local extent of the factors before j (axes earlier in the mesh that split those factors
      already divided them); a plain `Shard(i)` when that is 1. An earlier axis splitting a
      more minor factor of the same tensor dim cannot be expressed and is rejected.
    - `f` is a reduction the operand lacks: outputs are `Partial(space.partial_op)` (not for a
      "vocab" dim, whose op reduces across the axis itself); additive inputs (a bias) likewise
      (zero on all but one rank); other inputs `Replicate()`.
    - `f` has the rule "expert" (`shardc.ops.moe`) and the operand lacks it: `Shard(0)`, the
      operand's tokens: the op dispatches and combines them over the axis itself.
    - A temporal split rotating along the axis (`time t/4 rotate cp`, or either axis of a grid
      `time k/2 rotate (tp, tq)`): inputs indexing `t` as a major factor, neither split on that
      axis in space nor partial on it, are `Shard` on `t`'s tensor dim (`rotating_operands`):
      they move one neighbour along the axis per step. This is the one rotation rule: apply-plan,
      the cost model and the solver's candidates all take their layouts from here.
    """
    placements: list[tuple[str, Placement]] = []
    reductions = set(space.reductions)
    special = dict(space.special)
    taken: dict[int, list[tuple[str, int]]] = {}  # tensor dim -> (axis, factor index), outer axes first
    for axis in mesh.names:
        dims = [d for a, d in partition.spatial if a == axis]
        rotating = [t.dim for t in partition.temporal if axis in t.axes]
        if not dims and not rotating:
            continue
        placement: Placement = Replicate()
        if dims:
            dim = dims[0]
            found = _factor_position(operand, dim)
            if found is not None:
                i, j = found
                factors = operand[i]
                outer = taken.setdefault(i, [])
                if any(k > j for _, k in outer):
                    raise ValueError(f"mesh axis {axis} splits {dim}, a more major factor of tensor dim {i} than "
                                     "an outer mesh axis splits: the nesting is not expressible")
                interleave = partition.stride_of(axis)
                for g in factors[:j]:
                    divided = math.prod(mesh.axis_size(a) for a, k in outer if factors[k] == g)
                    interleave *= max(space.size(g) // divided, 1)
                outer.append((axis, j))
                placement = Shard(i, interleave, axis in partition.zigzag)
            elif special.get(dim) == "expert" and operand:
                placement = Shard(0)  # expert parallelism: the op exchanges its tokens over the axis
            elif dim in reductions and special.get(dim) != "vocab" and (is_output or additive):
                placement = Partial(space.partial_op)
        if rotating and not is_output:
            moving = _rotation(operand, additive, space, partition, axis, rotating[0])
            if moving is not None:
                placement = Shard(moving, zigzag=axis in partition.zigzag)
        placements.append((axis, placement))
    return Layout(tuple(placements)).without_replicate()


def _rotation(operand: OperandDims, additive: bool, space: IterationSpace, partition: Partition, axis: str,
              dim: str) -> int | None:
    """The tensor dim along which an input rotates on `axis` through iteration dim `dim`, or None:
    the tensor dim whose major factor is `dim`, when the axis neither splits the operand in space
    (that operand stays put) nor leaves it partial (a bias of a split reduction)."""
    held = [d for a, d in partition.spatial if a == axis]
    if held and (_factor_position(operand, held[0]) is not None or (
            additive and held[0] in space.reductions and dict(space.special).get(held[0]) != "vocab")):
        return None
    return next((i for i, factors in enumerate(operand) if factors and factors[0] == dim), None)


def rotating_operands(space: IterationSpace, partition: Partition, split: TemporalSplit) -> list[int]:
    """The inputs that move one neighbour along `split.rotate` per step (the rotation rule of
    `operand_layout`: they are sharded on `split.dim`'s tensor dim along that axis)."""
    if split.rotate is None:
        return []
    return [k for k, operand in enumerate(space.inputs)
            if _rotation(operand, k in space.additive, space, partition, split.rotate, split.dim) is not None]


def node_layouts(
    space: IterationSpace, partition: Partition, mesh: Mesh
) -> tuple[list[Layout], list[Layout]]:
    """Required input layouts and produced output layouts of a node under `partition`
    (rules in `operand_layout`)."""
    for axis, dim in partition.spatial:
        if dim not in space.dims:
            raise ValueError(f"partition splits {dim!r}, not an iteration dim of {space.dims}")
        if dim in space.unsplittable:
            raise ValueError(f"iteration dim {dim!r} cannot be split")
        mesh.axis_size(axis)
    ins = [operand_layout(op, partition, space, mesh, False, k in space.additive) for k, op in enumerate(space.inputs)]
    outs = [operand_layout(op, partition, space, mesh, True) for op in space.outputs]
    return ins, outs


@dataclass(frozen=True, slots=True)
class CostRow:
    """The cost of one node on one device, filled in by annotate-cost."""

    flops: int = 0
    bytes: int = 0
    saved_bytes: int = 0
    param_bytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)
