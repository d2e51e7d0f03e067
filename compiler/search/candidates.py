"""Candidate partitions of a node group on an intra-stage mesh, with their layouts and raw costs.

Rules (one place):
- Spatial: every mesh axis is assigned one iteration dim of the anchor or none. The data
  axis `dp` always splits a batch dim, the context axis `cp` a sequence dim (or none), any
  other axis (`tp`) any splittable dim; a dim split by several axes must be divisible by the
  product of their sizes. Special-rule dims split only by their rule: "ring" (attention's key
  dim, rotated) and "vocab" (cross entropy's classes, with max/sum-exp all-reduces).
- Rotating (PrimePar's temporal primitive; ring attention): for an axis A splitting d1, a dim
  d2 of the operands that A would otherwise replicate is cut into |A| steps and those operands'
  shards move one neighbour along A per step: `partition<tp:n; time k/4 rotate tp>`. No operand
  is replicated, partial sums stay local, and the ring transfers overlap with compute.
- Temporal chunks: a sequence dim cut into 4 steps on the same devices lowers the group's
  working memory (`time e1/4`), at a kernel-launch cost per step.
- A reduction split leaves the anchor's output Partial(sum); each candidate resolves it inside
  the group, by all_reduce to Replicate or reduce_scatter onto a batch/sequence dim.
- Followers inherit the partition through their inputs' layouts; what cannot be inherited is
  gathered first (an in-group all_gather).
- An op without a registry rule is kept replicated (one candidate) and reported.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from shardc.ir import Layout, Mesh, Partial, Partition, Replicate, Shard, TemporalSplit, Value
from shardc.registry import IterationSpace, get_op, has_op, node_layouts
from shardc.search.groups import NodeGroup, iteration_roles, storage_root

CHUNK_STEPS = 4
FLOAT_BYTES = 2  # bf16/fp16 compute; the planner prices every float tensor at this size


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective a candidate runs: `nbytes` is the per-device full-size buffer it moves."""

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | rotate
    axis: str
    nbytes: float
    backward: bool = False
    steps: int = 1  # rotate: transfers, each overlapping one compute step


@dataclass(frozen=True, slots=True)
class ExternalInput:
    """An operand read from outside the group: the layout required and its gradient's layout."""

    member: int
    index: int
    value: Value
    required: Layout
    grad: Layout


@dataclass(frozen=True, slots=True)
class Candidate:
    """One way to run a group: per-member partitions, external layouts, and raw per-device costs."""

    label: str
    partitions: tuple[Partition | None, ...]
    inputs: tuple[ExternalInput, ...]
    outputs: tuple[tuple[Value, Layout], ...]
    flops: tuple[float, ...]  # per member, one device, one micro-batch, forward
    moved: tuple[float, ...]  # bytes read and written per member
    layouts: tuple[tuple[tuple[Layout, ...], tuple[Layout, ...]], ...]  # per member: (inputs, outputs)
    collectives: tuple[Collective, ...]
    saved: tuple[tuple[int, float, bool], ...]  # (id(root), bytes, saved by a contraction)
    transient: float
    steps: int = 1

    def output_layout(self, value: Value) -> Layout | None:
        for v, layout in self.outputs:
            if v is value:
                return layout
        return None


@dataclass(frozen=True, slots=True)
class Shapes:
    """How tensor sizes are priced: batch dims scaled to the micro-batch, floats at 2 bytes."""

    roles: dict[int, tuple[str | None, ...]]
    batch_scale: float = 1.0
    batched: frozenset[int] | None = None  # ids of values that scale with the batch (default: by role)

    def scales(self, value: Value) -> bool:
        if self.batched is not None:
            return id(value) in self.batched
        return "batch" in self.roles.get(id(value), ())

    def nbytes(self, value: Value, layout: Layout | None, mesh: Mesh) -> float:
        n = float(value.type.numel)
        if self.scales(value):
            n *= self.batch_scale
        if layout is not None:
            for axis, p in layout.placements:
                if isinstance(p, Shard):
                    n /= mesh.axis_size(axis)
        return n * (FLOAT_BYTES if value.type.is_float else value.type.nbytes // max(value.type.numel, 1))


def _divisible(space: IterationSpace, spatial: tuple[tuple[str, str], ...], mesh: Mesh, sizes: dict[str, int]) -> bool:
    per_dim: dict[str, int] = {}
    for axis, dim in spatial:
        per_dim[dim] = per_dim.get(dim, 1) * mesh.axis_size(axis)
    return all(sizes[d] % k == 0 for d, k in per_dim.items())


def _sizes(space: IterationSpace, roles: dict[str, str], batch_scale: float) -> dict[str, int]:
    return {d: max(1, round(s * batch_scale)) if roles.get(d) == "batch" else s for d, s in space.sizes}


def spatial_options(group: NodeGroup, mesh: Mesh, shapes: Shapes) -> list[tuple[tuple[str, str], ...]]:
    """Every legal assignment of the mesh axes to the anchor's dims (see the module rule)."""
    space = group.spaces[0]
    if space is None:
        return [()]
    roles = iteration_roles(group.anchor, space, shapes.roles)
    sizes = _sizes(space, roles, shapes.batch_scale)
    special = dict(space.special)
    # Sizes are the scaled ones: a graph traced at batch 1 still splits its batch.
    plain = [d for d in space.dims if d not in space.unsplittable and d not in special and sizes[d] > 1]
    per_axis: list[list[str | None]] = []
    for axis in mesh.names:
        if axis == "dp":
            opts: list[str | None] = [d for d in plain if roles.get(d) == "batch"][:1] or [None]
        elif axis == "cp":
            opts = [None] + [d for d in plain if roles.get(d) == "seq"]
        else:
            opts = [None] + plain + [d for d, rule in special.items() if rule == "vocab"]
        per_axis.append(opts)
    out = []
    for choice in itertools.product(*per_axis):
        spatial = tuple((a, d) for a, d in zip(mesh.names, choice) if d is not None)
        if _divisible(space, spatial, mesh, sizes):
            out.append(spatial)
    return out


def _rotations(space: IterationSpace, spatial: tuple[tuple[str, str], ...], mesh: Mesh,
               sizes: dict[str, int], roles: dict[str, str]) -> list[TemporalSplit]:
    """Rotating splits: for an axis splitting d1, a dim d2 of the operands it replicates; d2 is a
    reduction (partial sums stay local), the ring dim, or a sequence dim (an overlapped gather)."""
    out = []
    reductions = set(space.reductions)
    used = {d for _, d in spatial}
    rules = dict(space.special)
    for axis, d1 in spatial:
        if axis == "dp":
            continue
        for d2 in space.dims:
            if d2 in used or d2 in space.unsplittable or (d2 in rules and rules[d2] != "ring"):
                continue
            if not (d2 in reductions or rules.get(d2) == "ring" or roles.get(d2) == "seq"):
                continue
            if sizes[d2] % mesh.axis_size(axis) or sizes[d2] < mesh.axis_size(axis):
                continue
            rotating = [op for op in space.inputs if _has(op, d2) and not _has(op, d1)]
            if rotating and all(_major(op, d2) for op in rotating):
                out.append(TemporalSplit(d2, mesh.axis_size(axis), axis))
    return out


def _split_pieces(group: NodeGroup) -> int:
    """k when a member splits the anchor's output (directly or through members that keep its last
    dim) along the last dim into k equal pieces, as a fused qkv projection is read; else 1. Such
    an anchor splits that dim strided (`tp:n/3`), so that every piece is sharded alike."""
    out = group.anchor.outputs[0] if group.anchor.outputs else None
    if out is None or not out.type.rank:
        return 1
    carried = {id(out)}
    for node in group.members[1:]:
        if not any(id(v) in carried for v in node.inputs):
            continue
        sizes = node.attrs.get("sizes", ())
        if node.op == "split" and node.attrs.get("dim", -1) % out.type.rank == out.type.rank - 1 \
                and len(sizes) > 1 and len(set(sizes)) == 1:
            return len(sizes)
        if node.op != "split" and len(node.outputs) == 1 and node.outputs[0].type.shape[-1:] == out.type.shape[-1:]:
            carried.add(id(node.outputs[0]))
    return 1


def _expands(group: NodeGroup) -> bool:
    """A contraction whose output is at least twice its first input (LM head, MLP up-projection)."""
    a = group.anchor
    return bool(a.inputs) and a.outputs[0].type.numel >= 2 * a.inputs[0].type.numel


def _has(operand: tuple[tuple[str, ...], ...], dim: str) -> bool:
    return any(dim in f for f in operand)


def _major(operand: tuple[tuple[str, ...], ...], dim: str) -> bool:
    return any(f and f[0] == dim for f in operand)


def _with_rotation(space: IterationSpace, partition: Partition, layouts: list[Layout], mesh: Mesh) -> list[Layout]:
    """Rotating operands are sharded on the rotated dim along the rotation axis."""
    out = list(layouts)
    for t in partition.temporal:
        if t.rotate is None:
            continue
        d1 = [d for a, d in partition.spatial if a == t.rotate][0]
        for i, operand in enumerate(space.inputs):
            if _has(operand, t.dim) and not _has(operand, d1):
                tensor_dim = [k for k, f in enumerate(operand) if f and f[0] == t.dim][0]
                placements = dict(out[i].placements)
                placements[t.rotate] = Shard(tensor_dim)
                out[i] = Layout(tuple((a, placements[a]) for a in mesh.names if a in placements))
    return out


def enumerate_group(group: NodeGroup, mesh: Mesh, shapes: Shapes, rotate: bool = True,
                    chunk: bool = True) -> list[Candidate]:
    """All candidates of one group on `mesh` (intra-stage axes only), each fully priced in bytes/FLOPs."""
    space = group.spaces[0]
    if space is None or not has_op(group.anchor.op):
        return [_replicated(group, mesh, shapes)]
    roles = iteration_roles(group.anchor, space, shapes.roles)
    sizes = _sizes(space, roles, shapes.batch_scale)
    kind = get_op(group.anchor.op).kind
    out: list[Candidate] = []
    pieces = _split_pieces(group)
    last = space.outputs[0][-1][0] if space.outputs and space.outputs[0] and space.outputs[0][-1] else None
    for spatial in spatial_options(group, mesh, shapes):
        strides = tuple((a, pieces) for a, d in spatial if pieces > 1 and d == last and a not in ("dp", "cp")
                        and sizes[d] % (pieces * mesh.axis_size(a)) == 0)
        temporals: list[tuple[TemporalSplit, ...]] = [()]
        if rotate and kind in ("contraction", "attention"):
            temporals += [(t,) for t in _rotations(space, spatial, mesh, sizes, roles)]
        if chunk and (kind == "loss" or (kind == "contraction" and _expands(group))):
            seq = [d for d in space.dims if roles.get(d) == "seq" and d not in space.unsplittable]
            local = {d: sizes[d] // math.prod(mesh.axis_size(a) for a, e in spatial if e == d) for d in seq}
            temporals += [(TemporalSplit(d, CHUNK_STEPS),) for d in seq[:1] if local[d] % CHUNK_STEPS == 0]
        for temporal in temporals:
            partition = Partition(spatial, temporal, strides)
            try:
                ins, outs = node_layouts(space, partition, mesh)
            except ValueError:
                continue
            ins = _with_rotation(space, partition, ins, mesh)
            for resolved in _resolutions(group, outs, mesh, shapes, roles):
                cand = _complete(group, partition, ins, resolved, mesh, shapes, kind)
                if cand is not None:
                    out.append(cand)
    return out or [_replicated(group, mesh, shapes)]


def _resolutions(group: NodeGroup, outs: list[Layout], mesh: Mesh, shapes: Shapes,
                 roles: dict[str, str]) -> list[list[tuple[Layout, Layout]]]:
    """Ways to resolve Partial outputs: (produced, resolved) per output."""
    per_output: list[list[tuple[Layout, Layout]]] = []
    for layout, value in zip(outs, group.anchor.outputs):
        partial_axes = [a for a, p in layout.placements if isinstance(p, Partial)]
        if not partial_axes or value.type.rank == 0:
            per_output.append([(layout, layout)])
            continue
        value_roles = shapes.roles.get(id(value), ())
        sharded = {p.dim for _, p in layout.placements if isinstance(p, Shard)}
        targets = [i for i, r in enumerate(value_roles) if r in ("batch", "seq") and i not in sharded]
        options = []
        for choice in itertools.product([None] + targets, repeat=len(partial_axes)):
            placements = dict(layout.placements)
            for axis, dim in zip(partial_axes, choice):
                if dim is None:
                    placements.pop(axis)
                else:
                    placements[axis] = Shard(dim)
            resolved = Layout(tuple((a, placements[a]) for a in mesh.names if a in placements))
            if _shardable(value, resolved, mesh, shapes):
                options.append((layout, resolved))
        per_output.append(options)
    return [list(c) for c in itertools.product(*per_output)]


def _shardable(value: Value, layout: Layout, mesh: Mesh, shapes: Shapes) -> bool:
    shape = list(value.type.shape)
    for i, r in enumerate(shapes.roles.get(id(value), ())):
        if r == "batch":
            shape[i] = max(1, round(shape[i] * shapes.batch_scale))
    for dim, axes in layout.sharded_dims().items():
        if shape[dim] % math.prod(mesh.axis_size(a) for a in axes):
            return False
    return True


def reshard(src: Layout, dst: Layout, value: Value, mesh: Mesh, shapes: Shapes, backward: bool = False
            ) -> list[Collective]:
    """The collectives that turn `src` into `dst`, axis by axis (S->R all_gather, S->S' all_to_all,
    P->R all_reduce, P->S reduce_scatter; R->S and anything->P are local and free)."""
    out = []
    current = src
    for axis in mesh.names:
        a, b = current.on(axis), dst.on(axis)
        if a == b:
            continue
        after = Layout(tuple((x, (b if x == axis else current.on(x))) for x in mesh.names)).without_replicate()
        if isinstance(a, Shard) and isinstance(b, Replicate):
            out.append(Collective("all_gather", axis, shapes.nbytes(value, after, mesh), backward))
        elif isinstance(a, Shard) and isinstance(b, Shard):
            out.append(Collective("all_to_all", axis, shapes.nbytes(value, current, mesh), backward))
        elif isinstance(a, Partial) and isinstance(b, Replicate):
            out.append(Collective("all_reduce", axis, shapes.nbytes(value, current, mesh), backward))
        elif isinstance(a, Partial) and isinstance(b, Shard):
            out.append(Collective("reduce_scatter", axis, shapes.nbytes(value, current, mesh), backward))
        current = after
    return out


def grad_layout(required: Layout, partition: Partition | None, mesh: Mesh, rotating: frozenset[str]) -> Layout:
    """An operand's gradient layout: Partial(sum) on every axis the node splits but the operand
    does not (unless the operand rotates along it), the operand's own placement elsewhere."""
    if partition is None:
        return required
    used = {a for a, _ in partition.spatial}
    placements = []
    for axis in mesh.names:
        p = required.on(axis)
        if axis in used and isinstance(p, Replicate) and axis not in rotating:
            p = Partial("sum")
        if not isinstance(p, Replicate):
            placements.append((axis, p))
    return Layout(tuple(placements))


def _rotating_axes(space: IterationSpace, partition: Partition, index: int) -> frozenset[str]:
    operand = space.inputs[index] if index < len(space.inputs) else ()
    return frozenset(t.rotate for t in partition.temporal if t.rotate and _has(operand, t.dim))


class _Acc:
    """Accumulates one candidate's layouts and costs while walking the group's members."""

    def __init__(self, mesh: Mesh, shapes: Shapes) -> None:
        self.mesh, self.shapes = mesh, shapes
        self.known: dict[int, Layout] = {}
        self.inputs: list[ExternalInput] = []
        self.outputs: list[tuple[Value, Layout]] = []
        self.partitions: list[Partition | None] = []
        self.flops: list[float] = []
        self.moved: list[float] = []
        self.collectives: list[Collective] = []
        self.saved: dict[int, tuple[float, bool]] = {}
        self.transient = 0.0
        self.layouts: list[tuple[tuple[Layout, ...], tuple[Layout, ...]]] = []

    def read(self, member: int, index: int, value: Value, required: Layout, grad: Layout) -> None:
        if id(value) in self.known:
            have = self.known[id(value)]
            self.collectives += reshard(have, required, value, self.mesh, self.shapes)
            self.collectives += reshard(grad, have, value, self.mesh, self.shapes, backward=True)
        else:
            self.inputs.append(ExternalInput(member, index, value, required, grad))

    def account(self, node_index: int, node, partition: Partition | None, ins: list[Layout], outs: list[Layout]) -> None:
        op = get_op(node.op) if has_op(node.op) else None
        self.layouts.append((tuple(ins), tuple(outs)))
        split = math.prod(self.mesh.axis_size(a) for a, _ in partition.spatial) if partition else 1
        scale = self.shapes.batch_scale if any(self.shapes.scales(v) for v in node.outputs) else 1.0
        in_t, out_t = [v.type for v in node.inputs], [v.type for v in node.outputs]
        self.flops.append(op.count_flops(in_t, out_t, node.attrs) * scale / split if op else 0.0)
        is_view = op is not None and op.kind in ("view", "creation")
        moved = 0.0 if is_view else sum(self.shapes.nbytes(v, lay, self.mesh) for v, lay in zip(node.inputs, ins)) \
            + sum(self.shapes.nbytes(v, lay, self.mesh) for v, lay in zip(node.outputs, outs))
        self.moved.append(moved)
        if not is_view:
            self.transient += sum(self.shapes.nbytes(v, lay, self.mesh) for v, lay in zip(node.outputs, outs))
            if op is not None and op.kind == "loss" and node.inputs:
                self.transient += 2 * self.shapes.nbytes(node.inputs[0], ins[0], self.mesh)
        if op is None:
            return
        contraction = op.kind == "contraction"
        for what, k in op.saved_for_backward(in_t, out_t, node.attrs):
            if what == "bytes":
                key, nbytes = -(node_index + 1) * 1000003 - k, k * scale / split
            else:
                value, lay = (node.inputs[k], ins[k]) if what == "in" else (node.outputs[k], outs[k])
                key, nbytes = id(storage_root(value)), self.shapes.nbytes(value, lay, self.mesh)
            old = self.saved.get(key)
            self.saved[key] = (max(nbytes, old[0]) if old else nbytes, contraction or (old[1] if old else False))


def _complete(group: NodeGroup, partition: Partition, ins: list[Layout], resolved: list[tuple[Layout, Layout]],
              mesh: Mesh, shapes: Shapes, kind: str) -> Candidate | None:
    acc = _Acc(mesh, shapes)
    anchor, space = group.anchor, group.spaces[0]
    assert space is not None
    for i, v in enumerate(anchor.inputs):
        req = ins[i] if i < len(ins) else Layout()
        acc.read(0, i, v, req, grad_layout(req, partition, mesh, _rotating_axes(space, partition, i)))
    acc.account(id(anchor), anchor, partition, [e.required for e in acc.inputs], [p for p, _ in resolved])
    for (produced, final), v in zip(resolved, anchor.outputs):
        if produced != final:
            acc.collectives += reshard(produced, final, v, mesh, shapes)
            acc.collectives += reshard(final, produced.without_replicate(), v, mesh, shapes, backward=True) \
                if any(isinstance(p, Shard) and not isinstance(produced.on(a), Shard) for a, p in final.placements) else []
        acc.known[id(v)] = final
        acc.outputs.append((v, final))
    for t in partition.temporal:
        if t.rotate:
            for i, v in enumerate(anchor.inputs):
                if t.rotate in _rotating_axes(space, partition, i):
                    nbytes = shapes.nbytes(v, ins[i], mesh)
                    acc.collectives.append(Collective("rotate", t.rotate, nbytes, False, t.steps - 1))
                    acc.collectives.append(Collective("rotate", t.rotate, 2 * nbytes, True, t.steps - 1))
    rules = dict(space.special)
    for axis, dim in partition.spatial:
        if rules.get(dim) == "vocab":  # max, sum-exp and target logit per row, fp32
            rows = shapes.nbytes(anchor.inputs[0], ins[0], mesh) / max(anchor.inputs[0].type.shape[-1], 1) * 2
            acc.collectives.append(Collective("all_reduce", axis, 3 * rows))
    partitions: list[Partition | None] = [partition]
    for j, node in enumerate(group.members[1:], start=1):
        p_j = _follow(node, group.spaces[j], acc, mesh)
        partitions.append(p_j)
    steps = max([t.steps for t in partition.temporal if t.rotate is None] or [1])
    label = str(partition) + "".join(f" ->{f}" for p, f in resolved if p != f)
    return Candidate(label, tuple(partitions), tuple(acc.inputs), tuple(acc.outputs), tuple(acc.flops),
                     tuple(acc.moved), tuple(acc.layouts), tuple(acc.collectives),
                     tuple((k, b, c) for k, (b, c) in acc.saved.items()), acc.transient / steps, steps)


def _follow(node, space: IterationSpace | None, acc: _Acc, mesh: Mesh) -> Partition | None:
    """A follower's partition, inherited from its first in-group input's layout."""
    member = len(acc.flops)
    src_index = next((k for k, v in enumerate(node.inputs) if id(v) in acc.known), None)
    spatial: list[tuple[str, str]] = []
    if space is not None and src_index is not None:
        layout = acc.known[id(node.inputs[src_index])]
        operand = space.inputs[src_index]
        for axis, p in layout.placements:
            if not isinstance(p, Shard) or p.dim >= len(operand):
                continue
            factors = operand[p.dim]
            dim = factors[0] if factors else None
            if dim is not None and dim not in space.unsplittable and dim not in dict(space.special):
                spatial.append((axis, dim))
            elif dim in space.unsplittable and len(factors) > 1 and p.interleave == space.size(dim):
                spatial.append((axis, factors[1]))  # a strided shard split into its pieces (fused qkv)
    partition = Partition(tuple(spatial)) if space is not None else None
    try:
        ins, outs = node_layouts(space, partition, mesh) if space is not None and partition is not None else (
            [Layout()] * len(node.inputs), [Layout()] * len(node.outputs))
    except ValueError:
        partition = Partition()
        ins, outs = [Layout()] * len(node.inputs), [Layout()] * len(node.outputs)
    for k, v in enumerate(node.inputs):
        req = ins[k] if k < len(ins) else Layout()
        rot = _rotating_axes(space, partition, k) if space is not None and partition is not None else frozenset()
        acc.read(member, k, v, req, grad_layout(req, partition, mesh, rot))
    acc.account(member, node, partition, [ins[k] if k < len(ins) else Layout() for k in range(len(node.inputs))],
                list(outs))
    for v, lay in zip(node.outputs, outs):
        acc.known[id(v)] = lay
        acc.outputs.append((v, lay))
    return partition


def _replicated(group: NodeGroup, mesh: Mesh, shapes: Shapes) -> Candidate:
    """The fallback for ops without a rule: every member computes the whole tensor on every device."""
    acc = _Acc(mesh, shapes)
    for j, node in enumerate(group.members):
        for k, v in enumerate(node.inputs):
            acc.read(j, k, v, Layout(), Layout())
        acc.account(j, node, None, [Layout()] * len(node.inputs), [Layout()] * len(node.outputs))
        for v in node.outputs:
            acc.known[id(v)] = Layout()
            acc.outputs.append((v, Layout()))
    return Candidate("replicated", (None,) * len(group.members), tuple(acc.inputs), tuple(acc.outputs),
                     tuple(acc.flops), tuple(acc.moved), tuple(acc.layouts), tuple(acc.collectives),
                     tuple((k, b, c) for k, (b, c) in acc.saved.items()), acc.transient)
