"""A candidate's layouts: the anchor's partition completed over the rest of its node group.

Rules: every operand read from outside the group is an `ExternalInput` with the layout the
reading member requires and its gradient's layout (Partial(sum) on every axis the member
splits but the operand does not, unless the operand rotates along that axis); the anchor's
outputs take their resolved layouts; each follower inherits the partition through its first
in-group input's layout (a loss following the LM head, `shardc.analysis.groups`, inherits a
split of the classes: vocab-parallel cross entropy; a strided shard of a fused dim splits into
its pieces; what cannot be inherited is not split); an op without a rule runs replicated on
every device.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.analysis.groups import NodeGroup
from shardc.ir import Layout, Mesh, Partial, Partition, Replicate, Shard, Value
from shardc.ops.registry import IterationSpace, node_layouts


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
    """One way to run a group: per-member partitions and layouts, and what it needs from outside
    (priced by `shardc.search.costs` with the analytical model)."""

    label: str
    partitions: tuple[Partition | None, ...]
    inputs: tuple[ExternalInput, ...]
    outputs: tuple[tuple[Value, Layout], ...]
    layouts: tuple[tuple[tuple[Layout, ...], tuple[Layout, ...]], ...]  # per member: (inputs, outputs)

    def output_layout(self, value: Value) -> Layout | None:
        for v, layout in self.outputs:
            if v is value:
                return layout
        return None


def has_dim(operand: tuple[tuple[str, ...], ...], dim: str) -> bool:
    """Whether the iteration dim `dim` is among the operand's (possibly flattened) dims."""
    return any(dim in f for f in operand)


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
    return frozenset(a for t in partition.temporal if has_dim(operand, t.dim) for a in t.axes)


class _Acc:
    """Accumulates one candidate's layouts while walking the group's members."""

    def __init__(self) -> None:
        self.known: dict[Value, Layout] = {}
        self.inputs: list[ExternalInput] = []
        self.outputs: list[tuple[Value, Layout]] = []
        self.layouts: list[tuple[tuple[Layout, ...], tuple[Layout, ...]]] = []

    def read(self, member: int, index: int, value: Value, required: Layout, grad: Layout) -> None:
        if value not in self.known:
            self.inputs.append(ExternalInput(member, index, value, required, grad))


def complete(group: NodeGroup, partition: Partition, ins: list[Layout], resolved: list[tuple[Layout, Layout]],
              mesh: Mesh) -> Candidate:
    """The candidate of `group` whose anchor runs `partition`, reading its inputs in `ins` and
    producing its outputs as `resolved` (produced, resolved) pairs; followers by the module rule."""
    acc = _Acc()
    anchor, space = group.anchor, group.spaces[0]
    assert space is not None
    for i, v in enumerate(anchor.inputs):
        req = ins[i] if i < len(ins) else Layout()
        acc.read(0, i, v, req, grad_layout(req, partition, mesh, _rotating_axes(space, partition, i)))
    acc.layouts.append((tuple(e.required for e in acc.inputs), tuple(p for p, _ in resolved)))
    for (_, final), v in zip(resolved, anchor.outputs):
        acc.known[v] = final
        acc.outputs.append((v, final))
    partitions: list[Partition | None] = [partition]
    for j, node in enumerate(group.members[1:], start=1):
        partitions.append(_follow(node, group.spaces[j], acc, mesh))
    label = str(partition) + "".join(f" ->{f}" for p, f in resolved if p != f)
    return Candidate(label, tuple(partitions), tuple(acc.inputs), tuple(acc.outputs), tuple(acc.layouts))


def _follow(node, space: IterationSpace | None, acc: _Acc, mesh: Mesh) -> Partition | None:
    """A follower's partition, inherited from its first in-group input's layout."""
    member = len(acc.layouts)
    src_index = next((k for k, v in enumerate(node.inputs) if v in acc.known), None)
    spatial: list[tuple[str, str]] = []
    if space is not None and src_index is not None:
        layout = acc.known[node.inputs[src_index]]
        operand = space.inputs[src_index]
        for axis, p in layout.placements:
            if not isinstance(p, Shard) or p.dim >= len(operand):
                continue
            factors = operand[p.dim]
            dim = factors[0] if factors else None
            if dim is not None and dim not in space.unsplittable and dict(space.special).get(dim, "vocab") == "vocab":
                spatial.append((axis, dim))  # a loss following its head keeps the classes split (vocab-parallel)
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
    acc.layouts.append((tuple(ins[k] if k < len(ins) else Layout() for k in range(len(node.inputs))), tuple(outs)))
    for v, lay in zip(node.outputs, outs):
        acc.known[v] = lay
        acc.outputs.append((v, lay))
    return partition


def replicated(group: NodeGroup, mesh: Mesh) -> Candidate:
    """The fallback for ops without a rule: every member computes the whole tensor on every device."""
    acc = _Acc()
    for j, node in enumerate(group.members):
        for k, v in enumerate(node.inputs):
            acc.read(j, k, v, Layout(), Layout())
        acc.layouts.append((tuple(Layout() for _ in node.inputs), tuple(Layout() for _ in node.outputs)))
        for v in node.outputs:
            acc.known[v] = Layout()
            acc.outputs.append((v, Layout()))
    return Candidate("replicated", (None,) * len(group.members), tuple(acc.inputs), tuple(acc.outputs),
                     tuple(acc.layouts))
