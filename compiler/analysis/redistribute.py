"""Redistributing one tensor: the collectives that turn one layout into another.

One mesh axis at a time, placement `src` on that axis becomes `dst` by (TVM Relax style):

    S -> R        all_gather       (input the shard, output the gathered tensor)
    P -> R        all_reduce
    P -> S        reduce_scatter   (input the partial tensor, output the shard)
    R -> S        chunk            (local slice, no communication)
    S(i) -> S(j)  all_to_all       (also S(d) <-> S(d/k): a strided shard of the same dim)
    R -> P        to_partial       (local: every rank but the first zeroes its copy; only when a
                                    consumer needs it, e.g. the bias of a row-parallel linear)
    S -> P        pad              (local: the shard placed in a zero tensor of the full size)
    P -> P        nothing (same op; a different op is an error), R -> R, S -> S: nothing

Point-to-point kinds share the dataclass: `send_recv` (a pipeline stage cut, axis `pp`),
`rotate` / `rotate_reverse` (a ring shift along an axis: ring attention, PrimePar), and
`identity`, a forward no-op whose backward is an all_reduce (Megatron's `f`: a replicated
activation entering a node split along a model axis gets a partial gradient there).

Order: when several axes change, the sequence sending the fewest bytes (ring algorithms)
wins, then the one with fewest steps, then the rule order (local chunks, reduce_scatter,
all_to_all, all_reduce, all_gather, the local partial kinds); so a tensor is sliced before it
is reduced and gathered last. Shards of one tensor dim nest in mesh order (outer axis first),
so a step that adds or removes a shard of dim d on axis a needs no axis inside a to shard d;
a shard in the way is all-gathered first and sliced again later. Axes of size 1 change
placement for free and get no step.

Where a partitioned graph needs these steps is `shardc.analysis.resharding` (`edge_steps`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from shardc.ir import DTYPE_BYTES, Layout, Mesh, Partial, Placement, Replicate, Shard, TensorType
from shardc.ir.diagnostics import ShardcError
from shardc.ops.collectives import ring_traffic

COMMUNICATING = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all", "send_recv", "rotate",
                           "rotate_reverse"})
LOCAL = frozenset({"chunk", "to_partial", "pad", "identity"})
KINDS = tuple(sorted(COMMUNICATING | LOCAL))

# Forward kind -> backward kind (Megatron's convention: the gradient of an all_gather output is
# partial, that of an all_reduce output replicated); see `conjugate` for the general rule.
_CONJUGATE = {
    "all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_reduce": "identity",
    "identity": "all_reduce", "chunk": "all_gather", "to_partial": "identity", "pad": "chunk",
    "all_to_all": "all_to_all", "send_recv": "send_recv", "rotate": "rotate_reverse", "rotate_reverse": "rotate",
}
# Order in which pending per-axis changes are taken (cheapest first).
_PRIORITY = {"chunk": 0, "reduce_scatter": 1, "all_to_all": 2, "all_reduce": 3, "all_gather": 4,
             "to_partial": 5, "pad": 5}


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One collective (or local step) on one mesh axis, with exact per-device byte counts.

    `bytes_in_per_device` / `bytes_out_per_device` are the local buffers before and after
    (for all_gather the shard and the gathered tensor, for reduce_scatter the partial tensor
    and the shard). `backward` is the kind backward runs for it (see `conjugate`).
    """

    kind: str
    axis: str
    layout_before: Layout
    layout_after: Layout
    bytes_in_per_device: int
    bytes_out_per_device: int
    group_size: int
    backward: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown reshard kind {self.kind!r}; known: {', '.join(KINDS)}")

    @property
    def communicates(self) -> bool:
        return self.kind in COMMUNICATING and self.group_size > 1

    @property
    def buffer_bytes(self) -> int:
        """The buffer in `shardc.cost.comm.collective_time`'s convention (gathered size for an
        all_gather, the input for a reduce_scatter): the larger of the two."""
        return max(self.bytes_in_per_device, self.bytes_out_per_device)

    @property
    def wire_bytes(self) -> int:
        """Bytes one device sends with ring algorithms (`ring_traffic`; 0 for local steps)."""
        if not self.communicates:
            return 0
        n = self.group_size
        kind = "rotate" if self.kind == "rotate_reverse" else self.kind
        # The ring's buffer of an all_gather is the gathered tensor: n shards as this device holds one.
        buffer = self.bytes_in_per_device * (n if kind == "all_gather" else 1)
        return ring_traffic(kind, n).sent_bytes(buffer)

    def __str__(self) -> str:
        return (f"{self.kind}[{self.axis}] {self.layout_before} -> {self.layout_after} "
                f"({self.bytes_in_per_device} -> {self.bytes_out_per_device} B, group {self.group_size})")


def conjugate(kind: str, partial_grad: bool | None = None) -> str:
    """The kind backward runs for forward step `kind`.

    Without `partial_grad`: Megatron's table (all_gather <-> reduce_scatter, all_reduce ->
    identity, identity -> all_reduce, chunk -> all_gather, rotate <-> rotate_reverse, ...).
    With it, the gradient of a replicated value on the step's axis is partial (True: data axes,
    or a value read by a node split along that axis) or replicated (False), and the backward of
    S->R is P->S (reduce_scatter) or R->S (chunk), of P->R is P->R (all_reduce) or nothing, of
    R->S is S->P (pad) or S->R (all_gather), of identity all_reduce or nothing.
    """
    if kind not in _CONJUGATE:
        raise ValueError(f"unknown reshard kind {kind!r}; known: {', '.join(KINDS)}")
    if partial_grad is None:
        return _CONJUGATE[kind]
    table = {
        "all_gather": ("reduce_scatter", "chunk"), "all_reduce": ("all_reduce", "identity"),
        "chunk": ("pad", "all_gather"), "identity": ("all_reduce", "identity"),
    }
    if kind in table:
        return table[kind][0 if partial_grad else 1]
    return _CONJUGATE[kind]


def local_bytes(type: TensorType, layout: Layout, mesh: Mesh) -> int:
    """Bytes one device holds of a `type` tensor laid out `layout`."""
    return math.prod(layout.local_shape(type.shape, mesh)) * DTYPE_BYTES[type.dtype]


def with_placement(layout: Layout, axis: str, placement: Placement, mesh: Mesh) -> Layout:
    """`layout` with `axis` set to `placement`, in mesh order, without Replicate entries."""
    table = dict(layout.placements)
    table[axis] = placement
    return Layout(tuple((a, table[a]) for a in mesh.names if a in table)).without_replicate()


def normalize(layout: Layout, mesh: Mesh) -> Layout:
    """The same layout in mesh order without Replicate entries (what `==` should compare)."""
    for a, _ in layout.placements:
        mesh.axis_size(a)
    return Layout(tuple((a, layout.on(a)) for a in mesh.names if a in dict(layout.placements))).without_replicate()


def step_kind(src: Placement, dst: Placement) -> str | None:
    """The kind that turns placement `src` into `dst` on one axis (None: nothing to do)."""
    if src == dst:
        return None
    if isinstance(src, Partial):
        if isinstance(dst, Partial):
            raise ValueError(f"no step turns {src} into {dst}: partial values of different reductions")
        return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter"
    if isinstance(src, Shard):
        return {Replicate: "all_gather", Shard: "all_to_all", Partial: "pad"}[type(dst)]
    return "chunk" if isinstance(dst, Shard) else "to_partial"


def _dims_of(*placements: Placement) -> set[int]:
    return {p.dim for p in placements if isinstance(p, Shard)}


def redistribute(src: Layout, dst: Layout, type: TensorType, mesh: Mesh) -> list[ReshardStep]:
    """The steps turning a `type` tensor laid out `src` into `dst` on `mesh` (rules in the module
    docstring); `[]` when they already agree. Each step's `backward` is `conjugate(kind)`."""
    for given in (src, dst):
        for a, p in given.placements:
            mesh.axis_size(a)
            if isinstance(p, Shard) and p.dim >= type.rank:
                raise ShardcError(f"layout {given} shards dim {p.dim} of a rank-{type.rank} tensor {type}")
    names = mesh.names
    cur = {a: src.on(a) for a in names}
    want = {a: dst.on(a) for a in names}
    for a in names:
        if mesh.axis_size(a) == 1:
            cur[a] = want[a]
    try:
        for a in names:
            step_kind(cur[a], want[a])
    except ValueError as err:
        raise ShardcError(f"cannot redistribute {type} from {src} to {dst}: {err}") from None

    start, goal = tuple(cur[a] for a in names), tuple(want[a] for a in names)

    def ready(state: tuple[Placement, ...], k: int, target: Placement) -> bool:
        dims = _dims_of(state[k], target)
        return not any(isinstance(p, Shard) and p.dim in dims for p in state[k + 1:])

    def layout(state: tuple[Placement, ...]) -> Layout:
        return Layout(tuple(zip(names, state))).without_replicate()

    # Cheapest sequence first (bytes on the wire, then fewest steps, then the rule order), over
    # moves that take an axis straight to its target or gather a shard that is in the way.
    count = 0
    heap: list[tuple[int, int, tuple[tuple[int, int], ...], int, tuple[Placement, ...], list[ReshardStep]]]
    heap = [(0, 0, (), count, start, [])]
    seen: set[tuple[Placement, ...]] = set()
    while heap:
        cost, n, key, _, state, steps = heapq.heappop(heap)
        if state == goal:
            return steps
        if state in seen:
            continue
        seen.add(state)
        for k, axis in enumerate(names):
            targets = [goal[k]] if state[k] != goal[k] else []
            if isinstance(state[k], Shard) and not isinstance(goal[k], Replicate):
                targets.append(Replicate())
            for target in targets:
                if not ready(state, k, target):
                    continue
                new = state[:k] + (target,) + state[k + 1:]
                kind = step_kind(state[k], target) or ""
                before, after = layout(state), layout(new)
                step = ReshardStep(kind, axis, before, after, local_bytes(type, before, mesh),
                                   local_bytes(type, after, mesh), mesh.axis_size(axis), conjugate(kind))
                count += 1
                order = (_PRIORITY[kind], -k if kind == "all_gather" else k)
                heapq.heappush(heap, (cost + step.wire_bytes, n + 1, key + (order,), count, new, steps + [step]))
    raise AssertionError(f"redistribute found no way from {src} to {dst}")  # pragma: no cover


def backward_step(step: ReshardStep, mesh: Mesh) -> ReshardStep | None:
    """The step backward runs for `step`: its `backward` kind from the gradient layout on the
    forward output side (Shard stays, Partial is Replicate, Replicate is Partial when that kind
    reduces) to the one on the input side; None when backward does nothing. Other axes keep
    their forward placements; the byte counts are the forward's, swapped."""
    kind = step.backward or conjugate(step.kind)
    if kind == "identity":
        return None
    p, q = step.layout_before.on(step.axis), step.layout_after.on(step.axis)
    if isinstance(q, Partial):
        q = Replicate()
    elif isinstance(q, Replicate) and kind in ("reduce_scatter", "all_reduce"):
        q = Partial("sum")
    if kind in ("all_gather", "all_reduce"):
        p = Replicate()
    elif kind == "pad":
        p = Partial("sum")
    before = with_placement(step.layout_after, step.axis, q, mesh)
    after = with_placement(step.layout_before, step.axis, p, mesh)
    return ReshardStep(kind, step.axis, before, after, step.bytes_out_per_device, step.bytes_in_per_device,
                       step.group_size, step.kind)
