"""Communication costs: an alpha-beta model per collective and algorithm, on the cluster's links.

A collective over `n` ranks on one link level with per-step latency `alpha` and per-device
bandwidth `beta` (bytes/s, one direction, `LinkSpec.effective_bandwidth`) costs, for a buffer
of `nbytes` per device (the gathered size for all_gather, the input for reduce_scatter):

    ring   all_reduce      2(n-1) alpha + 2(n-1)/n nbytes / beta
    ring   all_gather,
           reduce_scatter,
           all_to_all      (n-1) alpha  + (n-1)/n nbytes / beta
    tree   all_reduce      2 ceil(log2 n) alpha + 2 nbytes / beta   (pipelined double binary tree)
    send/recv, rotate      alpha + nbytes / beta

(the ring rows read `shardc.ops.collectives.ring_traffic`, the one table of collective traffic),
so small messages are latency-bound and the block size matters. A link that measured a whole
collective at a group size (`LinkSpec.measured`: the calibrated local gloo profile) prices that
collective on one level by the measured fit instead. A group that spans nodes is
either a flat ring on the slowest link or hierarchical: reduce_scatter within each node, the
collective across nodes on 1/k of the buffer, all_gather within the node; `algorithm="auto"`
takes the fastest, as NCCL's tuner does. Which link a mesh axis uses follows from the
mesh-to-device mapping: ranks are row-major over the mesh axes (the last axis varies fastest)
and node-major over the cluster, so the innermost axes stay within a node.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardc.hardware import Cluster, LinkSpec
from shardc.ir import Layout, Mesh, Partial, Placement, Replicate, Shard, TensorType
from shardc.ir.diagnostics import ShardcError
from shardc.ops.collectives import POINT_TO_POINT, ring_traffic

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "rotate", "broadcast")
ALGORITHMS = ("auto", "ring", "tree", "hierarchical")

# A group as the link levels it crosses, innermost first: ((intra, 8), (inter, 4)) is 8 ranks
# per node on 4 nodes.
LinkLevels = tuple[tuple[LinkSpec, int], ...]


def _ring(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw = link.effective_bandwidth
    if kind == "broadcast":  # a pipelined tree, as NCCL and gloo broadcast: log2 n rounds, the whole buffer
        return math.ceil(math.log2(n)) * link.latency + nbytes / bw
    if kind in POINT_TO_POINT and link.p2p is not None:  # one neighbour transfer, measured as such
        return link.p2p[0] + nbytes / link.p2p[1]
    traffic = ring_traffic(kind, n)
    return traffic.steps * link.latency + traffic.fraction * nbytes / bw


def _tree(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    if kind != "all_reduce":
        return _ring(kind, nbytes, n, link)
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.latency + 2 * nbytes / link.effective_bandwidth


def _flat(kind: str, nbytes: float, levels: LinkLevels, algorithm: str) -> float:
    n = math.prod(size for _, size in levels)
    slowest = min((link for link, size in levels if size > 1), key=lambda l: l.effective_bandwidth,
                  default=levels[0][0])
    worst = LinkSpec(slowest.name, slowest.bandwidth, max(l.latency for l, s in levels if s > 1),
                     slowest.efficiency)
    return (_tree if algorithm == "tree" else _ring)(kind, nbytes, n, worst)


def _hierarchical(kind: str, nbytes: float, levels: LinkLevels) -> float:
    """Inner level first: reduce_scatter inside, the collective outside on 1/k, all_gather inside."""
    (inner, k), rest = levels[0], levels[1:]
    if not rest:
        return _ring(kind, nbytes, k, inner)
    if kind == "all_reduce":
        return (2 * _ring("reduce_scatter", nbytes, k, inner)
                + collective_time("all_reduce", nbytes / k, rest, "auto"))
    if kind in ("all_gather", "reduce_scatter"):
        # Across nodes on the 1/k piece each inner rank owns, then within the node on the whole.
        return _ring(kind, nbytes, k, inner) + collective_time(kind, nbytes / k, rest, "auto")
    return _flat(kind, nbytes, levels, "ring")


def collective_time(kind: str, nbytes: float, levels: LinkLevels | LinkSpec, algorithm: str = "auto",
                    group_size: int | None = None) -> float:
    """Seconds for one collective of `nbytes` per device over a group on `levels`.

    `levels` is the group as ((link, ranks at that level), ...) innermost first, or one
    `LinkSpec` with `group_size` ranks. `algorithm` is ring, tree, hierarchical or auto (the
    fastest of those). Groups of one rank and empty buffers cost nothing.
    """
    if kind not in COLLECTIVES:
        raise ShardcError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}")
    if algorithm not in ALGORITHMS:
        raise ShardcError(f"unknown collective algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
    if isinstance(levels, LinkSpec):
        levels = ((levels, group_size or 1),)
    levels = tuple((l, s) for l, s in levels if s > 1)
    if not levels or nbytes <= 0:
        return 0.0
    return _priced(kind, nbytes, levels, algorithm)


@functools.lru_cache(maxsize=1 << 16)
def _priced(kind: str, nbytes: float, levels: LinkLevels, algorithm: str) -> float:
    """`collective_time` on checked arguments (a pure function of them: a search prices the same
    buckets over the same groups for every plan it evaluates, so the answers are kept)."""
    if kind in ("send_recv", "rotate"):
        return _ring(kind, nbytes, 2, levels[-1][0])
    if len(levels) == 1:  # a calibrated link prices a collective it measured at this group size by its fit
        measured = levels[0][0].measured_time(kind, levels[0][1], nbytes)
        if measured is not None:
            return measured
    if algorithm == "ring":
        return _flat(kind, nbytes, levels, "ring")
    if algorithm == "tree":
        return _flat(kind, nbytes, levels, "tree")
    if algorithm == "hierarchical":
        return _hierarchical(kind, nbytes, levels)
    options = [_flat(kind, nbytes, levels, "ring"), _flat(kind, nbytes, levels, "tree")]
    if len(levels) > 1:
        options.append(_hierarchical(kind, nbytes, levels))
    return min(options)


def call_overhead(levels: LinkLevels) -> float:
    """Seconds one of shardc's autograd-aware collective wrappers adds to the raw collective over
    `levels` (forward and backward together) inside a training step: the largest of
    `LinkSpec.call_overhead` plus the wait a blocking call pays for its peers there
    (`LinkSpec.wait`, calibrated local links only) among the levels the group spans; 0 for a
    group of one rank."""
    return max((link.call_overhead + link.wait(size) for link, size in levels if size > 1), default=0.0)


def group_levels(mesh: Mesh, axes: Sequence[str], cluster: Cluster) -> LinkLevels:
    """The link levels a group along `axes` of `mesh` crosses on `cluster` (rank 0's group).

    Mesh ranks are row-major (last axis fastest) and placed node-major, so a group whose
    members all fall in one node uses only the intra-node link.
    """
    axes = [a for a in axes if mesh.axis_size(a) > 1]
    if not axes:
        return ()
    strides: dict[str, int] = {}
    stride = 1
    for name, size in reversed(mesh.axes):
        strides[name] = stride
        stride *= size
    members = [0]
    for a in axes:
        members = [m + i * strides[a] for m in members for i in range(mesh.axis_size(a))]
    per_node = cluster.devices_per_node
    nodes = len({m // per_node for m in members})
    if nodes == 1:
        return ((cluster.intra, len(members)),)
    inside = len(members) // nodes
    if inside == 1:
        return ((cluster.inter, nodes),)
    return ((cluster.intra, inside), (cluster.inter, nodes))


def neighbour_link(mesh: Mesh, axis: str, cluster: Cluster) -> LinkSpec:
    """The link between neighbouring ranks along `axis` (pipeline send/recv, ring rotation)."""
    stride = 1
    for name, size in reversed(mesh.axes):
        if name == axis:
            break
        stride *= size
    return cluster.inter if stride >= cluster.devices_per_node else cluster.intra


# ---- redistribution between layouts ---------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CommStep:
    """One collective on one mesh axis; `nbytes` per device in `collective_time`'s convention."""

    kind: str
    axis: str
    nbytes: float


def _step(src: Placement, dst: Placement) -> str | None:
    """The collective that turns placement `src` into `dst` on one axis (None: local or free)."""
    if src == dst:
        return None
    if isinstance(src, Partial):
        return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter" if isinstance(dst, Shard) else None
    if isinstance(src, Shard):
        return "all_gather" if isinstance(dst, Replicate) else "all_to_all" if isinstance(dst, Shard) else None
    return None  # Replicate -> Shard is a local slice; Replicate -> Partial keeps one copy


def reshard_steps(src: Layout, dst: Layout, ttype: TensorType, mesh: Mesh, elem_bytes: float) -> list[CommStep]:
    """Collectives that turn a tensor laid out `src` into `dst`, axis by axis in mesh order.

    Rules per axis: P->R all_reduce, P->S reduce_scatter, S->R all_gather, S(i)->S(j)
    all_to_all, R->S and R->P free. Bytes follow the local shard as it changes.
    """
    steps: list[CommStep] = []
    # The local shard as torch holds it (ceil division), the same rounding every local shape
    # in the model uses, so a batch smaller than dp is priced like the compute beside it.
    numel = float(math.prod(src.local_shape(ttype.shape, mesh)))
    for axis, size in mesh.axes:
        a, b = src.on(axis), dst.on(axis)
        kind = _step(a, b)
        if kind is None:
            if isinstance(a, Replicate) and isinstance(b, Shard):
                numel /= size
            continue
        if kind == "all_gather":
            numel *= size
            steps.append(CommStep(kind, axis, numel * elem_bytes))
        elif kind == "reduce_scatter":
            steps.append(CommStep(kind, axis, numel * elem_bytes))
            numel /= size
        else:
            steps.append(CommStep(kind, axis, numel * elem_bytes))
    return steps


def combine_gradients(contributions: Sequence[Layout], mesh: Mesh) -> Layout:
    """The layout of a sum of gradient contributions: Partial wins, then a common Shard, else R."""
    placements: list[tuple[str, Placement]] = []
    for axis in mesh.names:
        on = [c.on(axis) for c in contributions]
        if any(isinstance(p, Partial) for p in on):
            placements.append((axis, Partial("sum")))
        else:
            shards = {p for p in on if isinstance(p, Shard)}
            if len(shards) == 1:
                placements.append((axis, shards.pop()))
    return Layout(tuple(placements))
