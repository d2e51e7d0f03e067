"""What the torch backend lowers: one capability table per partition kind, read by both sides.

Rule. A node's partition lowers when no rule of `CAPABILITIES` that applies to it gives a
reason. The solver's candidate enumeration (`shardc.search.candidates`) drops every candidate
one of whose members a rule refuses, so the solver only offers what lowers; the backend's
codegen (`shardc.backends.torch.emit`) raises a `ShardcError` with the same reason when a
hand-edited or hand-written partition breaks a rule. One table, one message.

Each entry names a partition kind (`kind`: what the coverage test `tests/test_capabilities.py`
maps to the multi-process numerics test that trains it), says what the backend does for it
(`lowers`), when it applies (a predicate on the `Site`) and what it refuses (a predicate
returning None or the reason). The rules are data: adding a kind is adding one entry;
`kinds_of` names the kinds a partitioned node uses (a rule that applies), collectives included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from shardc.ir import Axis, Mesh, Node, Partition, TemporalSplit
from shardc.ops.registry import IterationSpace, get_op

# Op -> the iteration dim whose global position its local kernel reads (a contiguous shard only):
# the vocabulary range of an embedding table or of the classes, the queries' causal offset.
POSITIONAL_DIMS: Mapping[str, str] = {"embedding": "v", "cross_entropy": "v", "scaled_dot_product_attention": "s"}
# Ops a temporal chunk loop cannot run: their attributes hold whole shapes (split their consumers).
UNCHUNKED_OPS = frozenset({"reshape", "expand", "full", "arange"})
# Registry kinds whose split reduction a rotating loop accumulates (partial products summed locally).
ROTATING_KINDS = frozenset({"contraction"})
# Ops PrimePar's 2-D grid runs (`backends/torch/grid2d.py`): x @ W with W a 2-d weight.
GRID_OPS = frozenset({"linear", "matmul"})
# How a chunk loop (or a collective, with its gradient) combines a split reduction: sum or mean.
CHUNK_PARTIALS = frozenset({"sum", "avg"})


@dataclass(frozen=True, slots=True)
class Site:
    """A node's partition as the rules see it: its op (name and registry kind), iteration space,
    partition and mesh, and the iteration dims' roles (batch/seq) where the caller knows them
    (the solver does; codegen, reading a lowered graph, passes none and those checks are skipped)."""

    op: str
    kind: str
    space: IterationSpace
    partition: Partition
    mesh: Mesh
    roles: Mapping[str, str] | None = field(default=None, compare=False)

    @staticmethod
    def of(node: Node, mesh: Mesh, roles: Mapping[str, str] | None = None) -> Site | None:
        """The site of a partitioned compute node (None: no partition, or a collective)."""
        op = get_op(node.op)
        if node.partition is None or op.kind == "collective":
            return None
        space = op.iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs], node.attrs)
        return Site(node.op, op.kind, space, node.partition, mesh, roles)

    @property
    def special(self) -> dict[str, str]:
        return dict(self.space.special)

    @property
    def split(self) -> TemporalSplit | None:
        """The node's temporal split (the first; `one-temporal-split` refuses more)."""
        return self.partition.temporal[0] if self.partition.temporal else None


@dataclass(frozen=True, slots=True)
class Capability:
    """One partition kind: what the backend does for it, when it applies, what it refuses."""

    kind: str
    lowers: str
    applies: Callable[[Site], bool]
    refuses: Callable[[Site], str | None] = lambda site: None


def _axis_dims(site: Site, axes: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(a, d) for a, d in site.partition.spatial if a in axes]


def _model_axes(site: Site) -> list[tuple[str, str]]:
    return [(a, d) for a, d in site.partition.spatial if a not in (Axis.DP, Axis.CP)]


def _role_refusal(site: Site, axis: str, role: str) -> str | None:
    for _, d in _axis_dims(site, (axis,)):
        got = None if site.roles is None else site.roles.get(d)
        if site.roles is not None and got != role:
            return f"the {axis} axis splits a {role} dim only; {d} is {got or 'neither batch nor sequence'}"
    return _plain_split_refusal(site, (axis,))


def _plain_split_refusal(site: Site, axes: tuple[str, ...] | None = None) -> str | None:
    """A mesh axis (of `axes`; every model axis when None) splits no unsplittable dim, no ring dim,
    and no reduction that leaves Partial(max) (its all_reduce has no gradient rule)."""
    for a, d in _model_axes(site) if axes is None else _axis_dims(site, axes):
        if d in site.space.unsplittable:
            return f"{d} of {site.op} cannot be split (mesh axis {a})"
        if d in site.space.reductions and site.space.partial_op not in CHUNK_PARTIALS:
            return (f"splitting {site.op}'s reduction {d} (mesh axis {a}) leaves Partial({site.space.partial_op}), "
                    f"which the backend does not differentiate; keep {d} whole")
        rule = site.special.get(d)
        if rule == "ring":
            return f"{d} of {site.op} is split only in time, rotating (ring attention), not by mesh axis {a}"
    return None


def _vocab_dims(site: Site) -> list[tuple[str, str]]:
    return [(a, d) for a, d in site.partition.spatial if site.special.get(d) == "vocab"]


def _vocab_refusal(site: Site) -> str | None:
    axes = _vocab_dims(site)
    if site.op != "cross_entropy":
        return f"a vocab-parallel split runs cross entropy only, not {site.op}"
    if len(axes) > 1:
        return "cross entropy with classes split over more than one mesh axis"
    return None


def _expert_dims(site: Site) -> list[tuple[str, str]]:
    return [(a, d) for a, d in site.partition.spatial if site.special.get(d) == "expert"]


def _expert_refusal(site: Site) -> str | None:
    if site.op != "experts":
        return f"an expert-parallel split runs the experts op only, not {site.op}"
    if len(_expert_dims(site)) > 1:
        return "experts split over more than one mesh axis"
    if site.partition.temporal:
        return "a temporal split of experts split over a mesh axis"
    return None


def _strided_refusal(site: Site) -> str | None:
    dim = POSITIONAL_DIMS.get(site.op)
    split = dict(site.partition.spatial)
    for axis, _ in site.partition.strides:
        if dim is not None and split.get(axis) == dim:
            return f"{site.op} reads the global position of its piece of {dim}; a strided split ({site.partition}) has none"
    return None


def _zigzag_refusal(site: Site) -> str | None:
    dim = POSITIONAL_DIMS.get(site.op)
    if dim is not None and not _rotates(site) and any(d == dim for a, d in site.partition.spatial
                                                      if a in site.partition.zigzag):
        return (f"{site.op} reads the global position of its piece of {dim}; a zig-zag shard reaches it only "
                f"through ring attention")
    return None


def _one_split_refusal(site: Site) -> str | None:
    return None if len(site.partition.temporal) <= 1 else "codegen runs one temporal split per node"


def _steps_refusal(site: Site) -> str | None:
    split = site.split
    assert split is not None
    for axis in split.axes:
        if axis not in site.mesh.names:
            return f"rotating split {split} names mesh axis {axis}, which {site.mesh} lacks"
        if split.steps != site.mesh.axis_size(axis):
            return f"rotating split {split} needs steps == size of mesh axis {axis} ({site.mesh.axis_size(axis)})"
    return None


def _rotates(site: Site) -> bool:
    split = site.split
    return split is not None and split.rotate is not None and split.grid is None


def _ring_refusal(site: Site) -> str | None:
    split = site.split
    assert split is not None
    if site.special.get(split.dim) != "ring":
        return f"ring attention rotates the key dim; {split.dim} is not {site.op}'s key dim"
    return None


def _rotating_refusal(site: Site) -> str | None:
    split = site.split
    assert split is not None
    if split.dim not in site.space.reductions:
        return f"a rotating split must cut a reduction dim; {split.dim} is parallel"
    if site.kind not in ROTATING_KINDS:
        return f"a rotating split runs contractions only; {site.op} is a {site.kind}"
    if site.space.partial_op != "sum":
        return f"a rotating split sums partial products; {site.op} reduces by {site.space.partial_op}"
    return None


def _grid_refusal(site: Site) -> str | None:
    split = site.split
    assert split is not None
    if site.op not in GRID_OPS or len(site.space.inputs) < 2 or len(site.space.inputs[1]) != 2:
        return f"a grid split {split} runs a linear or matmul by a 2-d weight, not {site.op}"
    if split.dim not in site.space.reductions:
        return f"a grid split must cut a reduction dim; {split.dim} is parallel"
    return None


def _chunk_refusal(site: Site) -> str | None:
    split = site.split
    assert split is not None
    if site.op in UNCHUNKED_OPS:
        return f"a temporal split of {site.op} is not supported; split its consumers instead"
    if split.dim in site.special:
        return f"a temporal chunk of {site.op} cannot cut {split.dim} (its {site.special[split.dim]} rule)"
    if site.kind == "loss" and _vocab_dims(site):
        return (f"a temporal chunk of {site.op} with its classes split (vocab-parallel) is not lowered; keep the "
                f"classes whole or the rows unchunked")
    if split.dim in site.space.reductions and site.space.partial_op not in CHUNK_PARTIALS:
        return f"a temporal chunk of {site.op}'s reduction {split.dim} cannot combine by {site.space.partial_op}"
    if split.dim in site.space.unsplittable:
        return f"a temporal chunk of {site.op} cannot cut {split.dim} (it cannot be split)"
    return None


def _has_temporal(site: Site) -> bool:
    return bool(site.partition.temporal)


CAPABILITIES: tuple[Capability, ...] = (
    Capability("spatial-dp", "the data axis splits the batch: per-rank micro-batches, gradients synced by DDP/FSDP",
               lambda s: bool(_axis_dims(s, (Axis.DP,))), lambda s: _role_refusal(s, Axis.DP, "batch")),
    Capability("spatial-cp", "the context axis splits the sequence (keys gathered, or a ring for attention)",
               lambda s: bool(_axis_dims(s, (Axis.CP,))), lambda s: _role_refusal(s, Axis.CP, "seq")),
    Capability("spatial-tp", "a model axis (tp, tq) splits any dim: Megatron's column/row split, heads",
               lambda s: bool(_model_axes(s)), _plain_split_refusal),
    Capability("strided", "a fused output split as k equal pieces (qkv), every piece sharded alike",
               lambda s: bool(s.partition.strides), _strided_refusal),
    Capability("zigzag-shard", "a dim split zig-zag (2n chunks, rank c holds c and 2n-1-c): collectives permute",
               lambda s: bool(s.partition.zigzag), _zigzag_refusal),
    Capability("vocab-parallel-loss", "cross entropy over split classes: row max and sum-exp all-reduced",
               lambda s: bool(_vocab_dims(s)), _vocab_refusal),
    Capability("vocab-parallel-embedding", "an embedding table split by rows: each rank looks up its range",
               lambda s: s.op == "embedding" and any(d in s.space.reductions for _, d in s.partition.spatial)),
    Capability("expert-parallel", "an MoE layer's experts split over an axis: its tokens dispatched to their "
               "experts and combined back by all-to-all (dropless)", lambda s: bool(_expert_dims(s)), _expert_refusal),
    Capability("one-temporal-split", "a node runs at most one temporal split (one loop)",
               _has_temporal, _one_split_refusal),
    Capability("rotating-steps", "a rotating or grid split takes one step per device of its axes",
               lambda s: s.split is not None and s.split.rotate is not None, _steps_refusal),
    Capability("ring-attention", "attention's keys and values rotate around the axis, online softmax",
               lambda s: _rotates(s) and s.kind == "attention", _ring_refusal),
    Capability("ring-attention-zigzag", "ring attention on zig-zag shards (balanced causal work)",
               lambda s: _rotates(s) and s.kind == "attention" and bool(s.partition.zigzag), _ring_refusal),
    Capability("rotating-contraction", "PrimePar's rotation: a reduction dim's shards move along the axis",
               lambda s: _rotates(s) and s.kind != "attention", _rotating_refusal),
    Capability("primepar-grid", "PrimePar's P(q x q) grid over two equal model axes",
               lambda s: s.split is not None and s.split.grid is not None, _grid_refusal),
    Capability("temporal-chunk", "a dim cut into steps on the same devices (a loop; outputs joined)",
               lambda s: s.split is not None and s.split.rotate is None, _chunk_refusal),
)

# Kinds the lowered graph shows as collectives, not as partitions: how a Partial is resolved.
RESOLUTIONS: Mapping[str, str] = {
    "partial-all-reduce": "a Partial(sum) resolved to Replicate by an all_reduce (Megatron's row split)",
    "partial-reduce-scatter": "a Partial(sum) resolved onto a sequence/batch shard by a reduce_scatter (SP)",
}


def refusal(site: Site) -> str | None:
    """The first reason a rule of `CAPABILITIES` refuses `site`, None when it lowers."""
    for cap in CAPABILITIES:
        if cap.applies(site):
            reason = cap.refuses(site)
            if reason is not None:
                return reason
    return None


def kinds_of(site: Site) -> list[str]:
    """The partition kinds `site` uses (every table entry that applies to it), table order."""
    return [cap.kind for cap in CAPABILITIES if cap.applies(site)]


def all_kinds() -> tuple[str, ...]:
    """Every partition kind the backend lowers: the table's entries, then the resolutions."""
    return tuple(cap.kind for cap in CAPABILITIES) + tuple(RESOLUTIONS)


def resolution_kind(node: Node) -> str | None:
    """The resolution kind a lowered forward collective is (all_reduce / reduce_scatter of a
    Partial(sum) on a model or context axis; data-parallel gradient syncs are not)."""
    if node.op == "all_reduce" and node.attrs.get("op", "sum") == "sum":
        return "partial-all-reduce"
    if node.op == "reduce_scatter":
        return "partial-reduce-scatter"
    return None
