"""The IR verifier: every invariant a pass may rely on, checked in one walk over the graph.

Rules (each violation is a `VerificationError` naming the node, value or layer):
- SSA: every value name is defined once; a node reads only values defined before it (the very
  objects declared, not look-alikes); a node's outputs point back to it as their producer;
  declared values have the kind of their declaration and no producer; returned values exist.
- Ops: every op has a registry entry, the registry's number of outputs, and output types equal
  to what the op's torch implementation gives on meta tensors (cached per signature, so a
  96-layer model costs a few dozen inferences). Opaque ops are not inferred.
- Layouts: name only mesh axes, shard a dim the tensor has, and (unless `allow_uneven`) split
  it evenly: the product of the sizes of the mesh axes sharding a dim divides that dim.
- Partitions: name mesh axes; split only iteration dims that are splittable (a `ring` dim
  only in time, with rotation); temporal steps divide the dim's local extent; the layouts of a
  partitioned node's outputs equal what the partition implies (`registry.node_layouts`), and
  so do its inputs' when `check_input_layouts` (after lowering has inserted the collectives).
- Layers: a node names only declared layers; pipeline stages are all set or all unset, number
  0..S-1 without gaps, never decrease along the graph, and S is a multiple of the `pp` axis.
- Resolved partial sums: before lowering, a partitioned node's output may hold the `Partial`
  its partition makes resolved (`resolves_partial`: reduced to Replicate, or reduce-scattered
  onto a Shard, on the partial axes only), as the solver's candidates choose and the cost model
  prices it (the reduction is charged where the value is made); `lower` inserts that reduction
  right after the node, so a lowered graph (`check_input_layouts`) holds exactly what the
  partition gives.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch

from shardc.ir import Axis, Graph, Layout, Mesh, Node, Partial, Replicate, Shard, TensorType, Value
from shardc.ir.diagnostics import VerificationError
from shardc.ir.dtypes import dtype_name, torch_dtype
from shardc.ops.registry import IterationSpace, OpDef, get_op, has_op, node_layouts

# Ops that stand for unknown code (collectives are the identity on one device: inferred).
UNINFERRED_KINDS = frozenset({"opaque"})


def meta_tensor(type_: TensorType) -> torch.Tensor:
    """An unallocated tensor with this type (shape inference and alias analysis use these)."""
    return torch.empty(type_.shape, dtype=torch_dtype(type_.dtype), device="meta")


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Meta tensors carry shapes, not values: a caller's `torch.use_deterministic_algorithms(True)`
    (which refuses e.g. `histc` on meta as on CUDA) has nothing to guard while they run."""
    if not torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)


@contextlib.contextmanager
def recording_saved() -> Iterator[list[torch.Tensor]]:
    """The tensors autograd saves for backward while the block runs, in order, as saved (a probe
    on meta tensors: what an op keeps, an input, an output or a copy)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def run_on_meta(op: OpDef, inputs: Sequence[torch.Tensor], attrs: dict[str, Any]) -> list[torch.Tensor]:
    """Run `op.impl` on meta tensors; creation ops make meta tensors too (default device)."""
    with torch.device("meta"), shapes_only():
        result = op.impl(*inputs, **attrs)
    results = list(result) if isinstance(result, tuple | list) else [result]
    if not all(isinstance(r, torch.Tensor) for r in results):
        raise TypeError(f"op {op.name} returned {type(result).__name__}, not tensors")
    return results


def tensor_type(tensor: torch.Tensor) -> TensorType:
    return TensorType(tuple(int(d) for d in tensor.shape), dtype_name(tensor.dtype))


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    hash(value)
    return value


@functools.lru_cache(maxsize=16384)
def _infer(op_name: str, in_types: tuple[TensorType, ...], attrs: tuple[tuple[str, Any], ...]) -> tuple | str | None:
    """Output types, an error message, or None when the op cannot run on meta tensors."""
    op = get_op(op_name)
    try:
        outs = run_on_meta(op, [meta_tensor(t) for t in in_types], dict(attrs))
        return tuple(tensor_type(t) for t in outs)
    except NotImplementedError:
        return None
    except Exception as err:  # the op's own complaint is the most useful message
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


def infer_output_types(op: OpDef, in_types: Sequence[TensorType], attrs: dict[str, Any]) -> tuple | str | None:
    """What the registry says `op` produces from these operands: types, an error, or None."""
    if op.kind in UNINFERRED_KINDS:
        return None
    try:
        key = tuple((k, _freeze(v)) for k, v in attrs.items())
    except TypeError:  # an unhashable attribute: infer without the cache
        return _infer.__wrapped__(op.name, tuple(in_types), tuple(attrs.items()))
    return _infer(op.name, tuple(in_types), key)


def _placements(layout: Layout | None) -> dict[str, Any]:
    return {} if layout is None else {a: p for a, p in layout.placements if not isinstance(p, Replicate)}


def layouts_agree(a: Layout | None, b: Layout | None) -> bool:
    """Equal up to replicated axes being named or left out (None is replicated everywhere)."""
    return _placements(a) == _placements(b)


def resolves_partial(made: Layout, held: Layout | None) -> bool:
    """`held` is `made` with its Partial sums resolved: on at least one axis where `made` is
    Partial, `held` is Replicate (all_reduce) or a Shard (reduce_scatter); every other axis,
    and every Partial left unresolved, agrees."""
    want, have = _placements(made), _placements(held)
    resolved = False
    for axis in set(want) | set(have):
        p, q = want.get(axis, Replicate()), have.get(axis, Replicate())
        if p == q:
            continue
        if not (isinstance(p, Partial) and isinstance(q, Replicate | Shard)):
            return False
        resolved = True
    return resolved


class _Verifier:
    def __init__(self, graph: Graph, allow_uneven: bool, check_input_layouts: bool) -> None:
        self.graph = graph
        self.mesh = graph.mesh
        self.allow_uneven = allow_uneven
        self.check_input_layouts = check_input_layouts
        self.defined: set[Value] = set()
        self.names: set[str] = set()

    def fail(self, message: str, node: Node | None = None, hint: str = "") -> NoReturn:
        raise VerificationError(f"graph @{self.graph.name}: {message}", node=node, hint=hint)

    def run(self) -> None:
        g = self.graph
        for kind, values in (("input", g.inputs), ("parameter", g.params), ("buffer", g.buffers)):
            for v in values:
                self.define(v, None)
                if v.kind != kind:
                    self.fail(f"%{v.name} is declared as {kind} but has kind {v.kind}")
                if v.producer is not None:
                    self.fail(f"{kind} %{v.name} has a producer node; declared values have none")
                self.check_layout(v, None)
        for name, layer in g.layers.items():
            if layer.name != name:
                self.fail(f"layer {layer.name} is filed under the name {name}")
        for node in g.nodes:
            self.check_node(node)
        for v in g.outputs:
            if v not in self.defined:
                self.fail(f"returned value %{v.name} is not defined in the graph")
        self.check_stages()

    def define(self, v: Value, node: Node | None) -> None:
        if v.name in self.names:
            self.fail(f"value %{v.name} is defined twice", node, "give every value a unique name")
        self.names.add(v.name)
        self.defined.add(v)

    def check_node(self, node: Node) -> None:
        for i, v in enumerate(node.inputs):
            if v not in self.defined:
                known = v.name in self.names
                self.fail(f"operand {i} %{v.name} of {node.op} is used before its definition"
                          if not known else f"operand {i} %{v.name} of {node.op} is not the value of that name "
                          "defined in the graph (a stale copy)", node)
        if not has_op(node.op):
            self.fail(f"unknown op {node.op!r}", node,
                      "register it with shardc.ops.registry.register(OpDef(...)) in compiler/ops.py")
        op = get_op(node.op)
        arity = op.num_outputs(node.attrs) if callable(op.num_outputs) else op.num_outputs
        if len(node.outputs) != arity:
            self.fail(f"op {node.op} has {arity} outputs in the registry but the node has {len(node.outputs)}", node)
        for v in node.outputs:
            self.define(v, node)
            if v.producer is not node:
                self.fail(f"output %{v.name} does not name its node as producer", node)
            if v.kind != "activation":
                self.fail(f"output %{v.name} has kind {v.kind}; node outputs are activations", node)
        if node.layer is not None and node.layer not in self.graph.layers:
            self.fail(f"node names layer {node.layer}, which the graph does not declare", node,
                      "declare it in graph.layers (group-layers does this)")
        in_types = [v.type for v in node.inputs]
        inferred = infer_output_types(op, in_types, node.attrs)
        if isinstance(inferred, str):
            self.fail(f"op {node.op} rejects its operands {', '.join(map(str, in_types))}: {inferred}", node)
        if inferred is not None:
            for i, (v, t) in enumerate(zip(node.outputs, inferred)):
                if v.type != t:
                    self.fail(f"output {i} %{v.name} has type {v.type} but {node.op} gives {t}", node)
        for v in node.outputs:
            self.check_layout(v, node)
        if node.partition is not None:
            self.check_partition(node, op)

    def check_layout(self, v: Value, node: Node | None) -> None:
        if v.layout is None or not v.layout.placements:
            return
        mesh = self.mesh
        if mesh is None:
            self.fail(f"%{v.name} has layout {v.layout} but the graph has no mesh", node)
        assert mesh is not None
        for axis, p in v.layout.placements:
            if axis not in mesh.names:
                self.fail(f"layout {v.layout} of %{v.name} names mesh axis {axis}, which {mesh} lacks", node)
            if isinstance(p, Shard) and p.dim >= v.type.rank:
                self.fail(f"layout {v.layout} of %{v.name} shards dim {p.dim} of a rank-{v.type.rank} tensor", node)
        if not self.allow_uneven:
            for dim, axes in v.layout.sharded_dims().items():
                ways = 1
                for a in axes:
                    placement = v.layout.on(a)
                    ways *= mesh.axis_size(a) * (placement.interleave if isinstance(placement, Shard) else 1)
                if v.type.shape[dim] % ways:
                    self.fail(f"%{v.name} : {v.type}{v.layout} splits dim {dim} of size {v.type.shape[dim]} "
                              f"{ways} ways, unevenly", node, "pick mesh axes whose sizes divide the dim")

    def check_partition(self, node: Node, op: OpDef) -> None:
        partition = node.partition
        assert partition is not None
        mesh = self.mesh
        if mesh is None:
            self.fail(f"node has {partition} but the graph has no mesh", node)
        assert mesh is not None
        try:
            space = op.iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs], node.attrs)
        except (ValueError, KeyError, IndexError) as err:
            self.fail(f"the iteration space of {node.op} does not fit its operands: {err}", node)
        special = dict(space.special)
        for axis, dim in partition.spatial:
            self.check_axis(axis, mesh, node, partition)
            self.check_dim(dim, space, node, partition)
            if special.get(dim) == "ring":
                self.fail(f"{partition} splits {dim} in space, but {node.op} allows {dim} only in time "
                          "with rotation", node, f"write it as 'time {dim}/N rotate AXIS'")
        for split in partition.temporal:
            self.check_dim(split.dim, space, node, partition)
            for axis in split.axes:
                self.check_axis(axis, mesh, node, partition)
            if split.grid is not None and not (mesh.axis_size(split.grid) == mesh.axis_size(split.rotate or "")
                                               == split.steps):
                self.fail(f"{partition}: a grid split needs two mesh axes of equal size and as many steps", node)
            local = space.size(split.dim)
            for a in partition.axes_of(split.dim):
                local //= mesh.axis_size(a)
            if local % split.steps:
                self.fail(f"{partition} cuts {split.dim} (local size {local}) into {split.steps} steps, unevenly", node)
        try:
            in_layouts, out_layouts = node_layouts(space, partition, mesh)
        except ValueError as err:
            self.fail(f"{partition} cannot be applied: {err}", node)
        for i, (v, want) in enumerate(zip(node.outputs, out_layouts)):
            if layouts_agree(v.layout, want) or (not self.check_input_layouts and resolves_partial(want, v.layout)):
                continue
            self.fail(f"output {i} %{v.name} has layout {v.layout or Layout()} but {partition} gives {want}"
                      + ("" if self.check_input_layouts else ", nor its partial sum resolved"), node,
                      "write what the partition gives (or, for a Partial, its all_reduce or reduce_scatter)")
        if self.check_input_layouts:
            for i, (v, want) in enumerate(zip(node.inputs, in_layouts)):
                if not layouts_agree(v.layout, want):
                    self.fail(f"operand {i} %{v.name} has layout {v.layout or Layout()} but {partition} needs "
                              f"{want}", node, "lowering must insert the resharding collective")

    def check_axis(self, axis: str, mesh: Mesh, node: Node, partition: Any) -> None:
        if axis not in mesh.names:
            self.fail(f"{partition} names mesh axis {axis}, which {mesh} lacks", node)

    def check_dim(self, dim: str, space: IterationSpace, node: Node, partition: Any) -> None:
        if dim not in space.dims:
            self.fail(f"{partition} splits {dim}, which is not an iteration dim of {node.op} "
                      f"(its dims: {', '.join(space.dims)})", node)
        if dim in space.unsplittable:
            self.fail(f"{partition} splits {dim}, which {node.op} cannot split", node)

    def check_stages(self) -> None:
        layers = self.graph.layers
        staged = {name: layer.annotation.stage for name, layer in layers.items() if layer.annotation.stage is not None}
        if not staged:
            return
        for name in layers:
            if name not in staged:
                self.fail(f"layer {name} has no pipeline stage while other layers have one")
        count = max(staged.values()) + 1
        missing = sorted(set(range(count)) - set(staged.values()))
        if missing:
            self.fail(f"pipeline stages run 0..{count - 1} but no layer is on stage {missing[0]}")
        if self.mesh is not None and count % self.mesh.degree(Axis.PP):
            self.fail(f"{count} pipeline stages do not fill {self.mesh} (a multiple of pp="
                      f"{self.mesh.degree(Axis.PP)} is needed)")
        last: tuple[int, str] | None = None
        for node in self.graph.nodes:
            if node.layer is None:
                continue
            stage = staged[node.layer]
            if last is not None and stage < last[0]:
                self.fail(f"layer {node.layer} is on stage {stage} but comes after layer {last[1]} on stage "
                          f"{last[0]}; stages must not decrease along the graph", node)
            last = (stage, node.layer)


def verify(graph: Graph, *, allow_uneven: bool = False, check_input_layouts: bool = False) -> None:
    """Check every invariant in the module docstring; raise `VerificationError` on the first broken one."""
    _Verifier(graph, allow_uneven, check_input_layouts).run()

