"""Candidate partitions of a node group on an intra-stage mesh, with their layouts.

Candidates carry no costs of their own: `shardc.search.costs` prices each with the analytical
model (`shardc.cost`), node by node, as `estimate` would price the graph partitioned so.

Rules (one place):
- Spatial: every mesh axis is assigned one iteration dim of the anchor or none. The data
  axis `dp` always splits a batch dim, the context axis `cp` a sequence dim (or none), the
  expert axis `ep` an `experts` op's expert dim (expert parallelism: dispatch and combine by
  all-to-all, `shardc.ops.moe`) or, like dp, a batch dim (every other op: ep ranks are data
  ranks outside the experts), any other axis (`tp`) any splittable dim; a dim split by several axes must be divisible by the
  product of their sizes. Special-rule dims split only by their rule: "ring" (attention's key
  dim, rotated) and "vocab" (cross entropy's classes, with max/sum-exp all-reduces).
- Rotating (PrimePar's temporal primitive; ring attention): for an axis A splitting d1, a
  reduction dim d2 (or attention's ring dim) of the operands that A would otherwise replicate is
  cut into |A| steps and those operands' shards move one neighbour along A per step:
  `partition<tp:n; time k/4 rotate tp>`. No operand is replicated, partial sums stay local, and
  the ring transfers overlap with compute.
- Grids (PrimePar's P(q x q), `shardc.search.primepar`): on a mesh with the model axes tp and
  tq of equal size, contractions by a 2-d weight also get `time k/q rotate (tp, tq)` grids.
  Otherwise the second model axis `tq` splits whatever `tp` splits (tp x tq acts as one tp).
- Temporal chunks: a sequence dim cut into 4 steps on the same devices lowers the node's
  working memory (`time e1/4`), at a kernel-launch cost per step. The LM head's chunks extend
  to the loss in its group (`shardc.analysis.groups`): the two run as one chunked linear cross
  entropy that never holds the whole logits (`shardc.analysis.head_loss`), as the backend lowers
  it and the cost model prices it.
- A linear whose output a member splits into k equal pieces (a fused qkv) splits that dim
  strided (`tp:n/3`), so the split follows with every piece sharded alike.
- A reduction split leaves the anchor's output Partial(sum); each candidate resolves it inside
  the group, by all_reduce to Replicate or reduce_scatter onto a batch/sequence dim.
- Followers inherit the partition through their first in-group input's layout
  (`shardc.search.follow`); what cannot be inherited is gathered first (an in-group all_gather, priced like any redistribution).
- An op without a registry rule is kept replicated (one candidate) and reported.
- Only what lowers: a candidate any of whose members' partitions the backend's capability table
  (`shardc.ops.lowering`) refuses is never offered, nor one whose members split a dim unevenly at
  the micro-batch (batch dims scaled), which the micro-batch's own trace could not take.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from shardc.analysis.groups import NodeGroup
from shardc.analysis.roles import Roles, iteration_roles
from shardc.ir import Axis, Layout, Mesh, Partial, Partition, Shard, TemporalSplit, Value
from shardc.ops.lowering import Site, refusal
from shardc.ops.registry import IterationSpace, get_op, has_op, node_layouts
from shardc.search.follow import Candidate, complete, has_dim, replicated
from shardc.search.primepar import GRID_AXES, grid_partitions, without_axes

CHUNK_STEPS = 4
FLOAT_BYTES = 2  # bf16/fp16 compute; the planner prices every float tensor at this size


@dataclass(frozen=True, slots=True)
class Shapes:
    """How tensor sizes are priced: batch dims scaled to the micro-batch, floats at 2 bytes."""

    roles: Roles
    batch_scale: float = 1.0

    def scales(self, value: Value) -> bool:
        """Whether the value's size scales with the batch (it has a batch dim)."""
        return "batch" in self.roles.get(value, ())

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
        if axis == Axis.DP:
            batch_dims = [d for d in plain if roles.get(d) == "batch"]
            opts: list[str | None] = [batch_dims[0] if batch_dims else None]
        elif axis == Axis.CP:
            opts = [None] + [d for d in plain if roles.get(d) == "seq"]
        elif axis == Axis.EP:
            experts = [d for d, rule in special.items() if rule == "expert" and sizes[d] > 1]
            batch_dims = [d for d in plain if roles.get(d) == "batch"]
            opts = [*experts, *batch_dims[:1]] or [None]
        else:
            opts = [None] + plain + [d for d, rule in special.items() if rule == "vocab"]
        per_axis.append(opts)
    out = []
    for choice in itertools.product(*per_axis):
        picked = dict(zip(mesh.names, choice))
        if Axis.TQ in picked and picked[Axis.TQ] != picked.get(Axis.TP):
            continue  # tq follows tp outside grids
        spatial = tuple((a, d) for a, d in zip(mesh.names, choice) if d is not None)
        if _divisible(space, spatial, mesh, sizes):
            out.append(spatial)
    return out


def _rotations(space: IterationSpace, spatial: tuple[tuple[str, str], ...], mesh: Mesh,
               sizes: dict[str, int], roles: dict[str, str]) -> list[TemporalSplit]:
    """Rotating splits: for an axis splitting d1, a dim d2 of the operands it replicates; d2 is a
    reduction (partial sums stay local) or the ring dim (what the backend's loops rotate)."""
    out = []
    reductions = set(space.reductions)
    used = {d for _, d in spatial}
    rules = dict(space.special)
    for axis, d1 in spatial:
        if axis == Axis.DP:
            continue
        for d2 in space.dims:
            if d2 in used or d2 in space.unsplittable or (d2 in rules and rules[d2] != "ring"):
                continue
            if not (d2 in reductions or rules.get(d2) == "ring"):
                continue
            if sizes[d2] % mesh.axis_size(axis) or sizes[d2] < mesh.axis_size(axis):
                continue
            rotating = [op for op in space.inputs if has_dim(op, d2) and not has_dim(op, d1)]
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
    carried = {out}
    for node in group.members[1:]:
        if not any(v in carried for v in node.inputs):
            continue
        sizes = node.attrs.get("sizes", ())
        if node.op == "split" and node.attrs.get("dim", -1) % out.type.rank == out.type.rank - 1 \
                and len(sizes) > 1 and len(set(sizes)) == 1:
            return len(sizes)
        if node.op != "split" and len(node.outputs) == 1 and node.outputs[0].type.shape[-1:] == out.type.shape[-1:]:
            carried.add(node.outputs[0])
    return 1


def _expands(group: NodeGroup) -> bool:
    """A contraction whose output is at least twice its first input (LM head, MLP up-projection)."""
    a = group.anchor
    return bool(a.inputs) and a.outputs[0].type.numel >= 2 * a.inputs[0].type.numel



def _major(operand: tuple[tuple[str, ...], ...], dim: str) -> bool:
    return any(f and f[0] == dim for f in operand)


def enumerate_group(group: NodeGroup, mesh: Mesh, shapes: Shapes, rotate: bool = True,
                    chunk: bool = True) -> list[Candidate]:
    """All candidates of one group on `mesh` (intra-stage axes only), each fully priced in bytes/FLOPs."""
    space = group.spaces[0]
    if space is None or not has_op(group.anchor.op):
        return [replicated(group, mesh)]
    roles = iteration_roles(group.anchor, space, shapes.roles)
    sizes = _sizes(space, roles, shapes.batch_scale)
    kind = get_op(group.anchor.op).kind
    out: list[Candidate] = []
    pieces = _split_pieces(group)
    last = space.outputs[0][-1][0] if space.outputs and space.outputs[0] and space.outputs[0][-1] else None
    spatials = spatial_options(group, mesh, shapes)
    grids: dict[tuple[tuple[str, str], ...], list[TemporalSplit]] = {}
    if rotate and kind == "contraction" and pieces == 1:
        base = spatial_options(group, without_axes(mesh, GRID_AXES), shapes)
        for spatial, split in grid_partitions(space, mesh, base, sizes):
            grids.setdefault(spatial, []).append(split)
    for spatial in spatials + [s for s in grids if s not in spatials]:
        strides = tuple((a, pieces) for a, d in spatial if pieces > 1 and d == last and a not in (Axis.DP, Axis.CP)
                        and sizes[d] % (pieces * mesh.axis_size(a)) == 0)
        plain = spatial in spatials
        temporals: list[tuple[TemporalSplit, ...]] = [()] if plain else []
        if rotate and kind in ("contraction", "attention") and plain:
            temporals += [(t,) for t in _rotations(space, spatial, mesh, sizes, roles) if t.rotate not in GRID_AXES
                          or Axis.TQ not in mesh.names or kind == "attention"]
        temporals += [(t,) for t in grids.get(spatial, [])]
        if plain and chunk and (kind == "loss" or (kind == "contraction" and _expands(group))):
            seq = [d for d in space.dims if roles.get(d) == "seq" and d not in space.unsplittable]
            local = {d: sizes[d] // math.prod(mesh.axis_size(a) for a, e in spatial if e == d) for d in seq}
            temporals += [(TemporalSplit(d, CHUNK_STEPS),) for d in seq[:1] if local[d] % CHUNK_STEPS == 0]
        for temporal in temporals:
            partition = Partition(spatial, temporal, strides)
            try:
                ins, outs = node_layouts(space, partition, mesh)
            except ValueError:
                continue
            for resolved in _resolutions(group, outs, mesh, shapes, roles):
                candidate = complete(group, partition, ins, resolved, mesh)
                if lowering_refusal(group, candidate, mesh, roles) is None and _fits_micro_batch(
                        group, candidate, mesh, shapes):
                    out.append(candidate)
    return out or [replicated(group, mesh)]


def _fits_micro_batch(group: NodeGroup, candidate: Candidate, mesh: Mesh, shapes: Shapes) -> bool:
    """Whether every member's split divides its dims at the micro-batch (batch dims scaled): a
    follower inheriting a shard of a flattened (batch seq) dim splits the batch factor, which a
    micro-batch of fewer sequences than the axes' product cannot take."""
    for node, space, partition in zip(group.members, group.spaces, candidate.partitions):
        if space is None or partition is None or not partition.spatial:
            continue
        sizes = _sizes(space, iteration_roles(node, space, shapes.roles), shapes.batch_scale)
        if not _divisible(space, partition.spatial, mesh, sizes):
            return False
    return True


def lowering_refusal(group: NodeGroup, candidate: Candidate, mesh: Mesh,
                     roles: dict[str, str] | None = None) -> str | None:
    """Why the backend would not lower `candidate` (the first member's partition its capability
    table refuses, `shardc.ops.lowering`), None when it lowers. `roles` are the anchor's
    iteration dims' roles (the data and context axes' rules read them)."""
    for j, (node, space, partition) in enumerate(zip(group.members, group.spaces, candidate.partitions)):
        if space is None or partition is None or not has_op(node.op):
            continue
        kind = get_op(node.op).kind
        reason = refusal(Site(node.op, kind, space, partition, mesh, roles if j == 0 else None))
        if reason is not None:
            return f"{node.op} {partition}: {reason}"
    return None


def _resolutions(group: NodeGroup, outs: list[Layout], mesh: Mesh, shapes: Shapes,
                 roles: dict[str, str]) -> list[list[tuple[Layout, Layout]]]:
    """Ways to resolve Partial outputs: (produced, resolved) per output."""
    per_output: list[list[tuple[Layout, Layout]]] = []
    for layout, value in zip(outs, group.anchor.outputs):
        partial_axes = [a for a, p in layout.placements if isinstance(p, Partial)]
        if not partial_axes or value.type.rank == 0:
            per_output.append([(layout, layout)])
            continue
        value_roles = shapes.roles.get(value, ())
        sharded = {p.dim for _, p in layout.placements if isinstance(p, Shard)}
        targets = [i for i, r in enumerate(value_roles) if r in ("batch", "seq") and i not in sharded]
        options = []
        dims: list[int | None] = [None, *targets]
        for choice in itertools.product(dims, repeat=len(partial_axes)):
            picked = dict(zip(partial_axes, choice))
            if Axis.TQ in picked and Axis.TP in picked and picked[Axis.TQ] != picked[Axis.TP]:
                continue  # tq resolves as tp does (the two act as one tp)
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
    for i, r in enumerate(shapes.roles.get(value, ())):
        if r == "batch":
            shape[i] = max(1, round(shape[i] * shapes.batch_scale))
    for dim, axes in layout.sharded_dims().items():
        if shape[dim] % math.prod(mesh.axis_size(a) for a in axes):
            return False
    return True
