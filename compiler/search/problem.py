"""One planning problem: a mesh shape and micro-batch size, its node groups, priced candidates
and edges, in the form the CP-SAT model and the plan evaluator both read.

Layer structure (`shardc.analysis.stages.layering`, uniform): a prefix of singleton layers
(embedding), a run of copies of one block class, and a suffix (final norm, head, loss). The block is represented by
one copy, enumerated and priced once per distinct block; the CP-SAT model chooses its
candidates once per stage class (`shardc.search.sections.stage_classes`), so copies on one
stage share a partition and stages may differ. Models without such a run are planned with pp=1.

Edges carry an activation from one group to another. Their kinds say where their costs go:
the forward redistribution to the consumer's layer, the gradient back to the producer's:
`pre`, `block`, `post` inside a section; `chain` from one block copy to the next (charged per
copy); `first` from the prefix into the first block, `last` from the last block into the
suffix, `skip` from the prefix into the suffix. Edges that read the same produced value from
the same producer `share` one gradient (their contributions are summed, then redistributed once).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from shardc.analysis.dims import batch_scale
from shardc.analysis.groups import NodeGroup, build_groups
from shardc.analysis.roles import Roles
from shardc.analysis.stages import Layering, layering
from shardc.cost.context import CostContext
from shardc.cost.fusion import is_cpu
from shardc.cost.layer import attention_core
from shardc.hardware import Cluster
from shardc.ir import Axis, Graph, Layout, Mesh, Node, Value
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import ir_dtype
from shardc.plan.parallel import ZB_SCHEDULES, ParallelPlan
from shardc.search.costs import CandCost, ExternalGrad, Pricer
from shardc.search.follow import Candidate
from shardc.search.table import CandidateTable


@dataclass(frozen=True, slots=True)
class MeshShape:
    """The degrees of a `ParallelPlan` the solver varies: pipeline, data, context and tensor
    parallelism (outermost first); `tq` > 1 splits tensor parallelism over a second axis
    (tp x tq), as PrimePar's grids need, which a plan writes as tp = tp*tq. `vpp` > 1 gives
    every pipeline device that many model chunks (interleaved 1F1B: pp*vpp virtual stages,
    virtual stage s on device s % pp); it is no mesh axis. `schedule` names a zero-bubble
    schedule (`ZB_SCHEDULES`: zbv and dualpipev with vpp=2, interleaved-zb with any vpp), empty
    for Megatron's (1F1B, interleaved when vpp > 1); no mesh axis either. `of` and `plan` are the
    one conversion between the two; `mesh` is the plan's mesh with tq split off tp. `ep` > 1 is
    expert parallelism (the plan's `ep` axis, inside dp): an MoE model's `experts` ops may split
    their experts over it, every other op splits its batch over it as over dp."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    tq: int = 1
    vpp: int = 1
    schedule: str = ""
    ep: int = 1

    @classmethod
    def of(cls, plan: ParallelPlan, tq: int = 1) -> MeshShape:
        """`plan`'s degrees, `tq` of its tensor parallelism on the second tensor axis."""
        if plan.tp % tq:
            raise ShardcError(f"plan {plan}: tq={tq} does not divide tp={plan.tp}")
        return cls(plan.pp, plan.dp, plan.cp, plan.tp // tq, tq, plan.vpp,
                   plan.schedule if plan.schedule in ZB_SCHEDULES else "", plan.ep)

    def plan(self, mb: int, gbs: int, zero: int = 0, dtype: str = "bf16", compile: bool | None = None) -> ParallelPlan:
        """The plan with these degrees (tp*tq as tp, vpp, schedule) and the given micro-batch,
        batch, ZeRO and `compile` key (None: auto)."""
        return ParallelPlan(dp=self.dp, tp=self.tp * self.tq, pp=self.pp, vpp=self.vpp, cp=self.cp, mb=mb, gbs=gbs,
                            zero=zero, dtype=dtype, compile=compile, schedule=self.schedule or "1f1b", ep=self.ep)

    @property
    def stages(self) -> int:
        """Virtual pipeline stages: pp * vpp."""
        return self.pp * self.vpp

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.ep * self.cp * self.tp * self.tq

    def _tq(self) -> tuple[tuple[str, int], ...]:
        return ((Axis.TQ, self.tq),) if self.tq > 1 else ()

    def mesh(self) -> Mesh:
        """The plan's mesh (`ParallelPlan.mesh`: pp, dp, ep when > 1, cp, tp), then tq innermost when > 1."""
        axes = ParallelPlan(pp=self.pp, dp=self.dp, cp=self.cp, tp=self.tp, ep=self.ep).mesh().axes
        return Mesh(axes + self._tq())

    def intra(self) -> Mesh:
        """The mesh without pp, and without axes of size 1: the axes inside one stage."""
        return Mesh(tuple((a, s) for a, s in self.mesh().axes if s > 1 and a != Axis.PP))

    def __str__(self) -> str:
        return (f"pp={self.pp}, dp={self.dp}, cp={self.cp}, tp={self.tp}" + (f", tq={self.tq}" if self.tq > 1 else "")
                + (f", ep={self.ep}" if self.ep > 1 else "")
                + (f", vpp={self.vpp}" if self.vpp > 1 else "") + (f", schedule={self.schedule}" if self.schedule else ""))


@dataclass
class GroupVar:
    key: tuple[str, int]
    section: str  # pre | block | post
    group: NodeGroup
    cands: list[Candidate]
    costs: list[CandCost]


@dataclass
class EdgeVar:
    """Edge from group `producer` (output `out_index`) to group `consumer` (member, input),
    priced per (produced layout class, required layout class): seconds by category."""

    producer: int
    consumer: int
    kind: str  # pre | block | post | chain | first | last | skip
    value: Value
    out_index: int
    member: int  # the consumer's member and input index that read the value
    index: int
    core: bool  # the consumer is in an attention core (selective recomputation repeats it)
    prod_class: list[int]
    cons_class: list[int]
    prod_info: list[tuple[Layout, bool, frozenset[str], Layout]]
    cons_required: list[Layout]
    cons_grad: list[Layout]
    fwd: list[list[dict[str, float]]]
    regather: list[list[dict[str, float]]]
    bwd: list[list[dict[str, float]]]
    share: int = -1  # index into Problem.shares

    def fwd_s(self, a: int, b: int) -> float:
        return sum(self.fwd[a][b].values())

    def bwd_s(self, a: int, b: int) -> float:
        return sum(self.bwd[a][b].values()) + sum(self.regather[a][b].values())


@dataclass
class GraphFacts:
    """What is computed once per graph: groups, roles, dataflow facts, the layering."""

    graph: Graph
    groups: list[NodeGroup]
    roles: Roles
    layering: Layering
    batch: int
    core: frozenset[Node]
    ctx: CostContext
    candidates: CandidateTable
    by_layer: dict[str | None, list[NodeGroup]] = field(default_factory=dict)


def compile_key(facts: GraphFacts) -> bool | None:
    """The `compile` key of the plans priced on `facts`: None (auto) when they are priced as auto
    runs them on their cluster, else the choice `graph_facts` was given."""
    ctx = facts.ctx
    return None if ctx.compiled == (not is_cpu(ctx.device)) else ctx.compiled


def graph_facts(graph: Graph, cluster: Cluster, dtype: str = "bf16",
                candidates: CandidateTable | None = None, compiled: bool | None = None) -> GraphFacts:
    """The facts of `graph` on `cluster`. `candidates`: a table an earlier enumeration filled
    (the enumerate-candidates pass); used when it was made for this graph, else a fresh one.
    `compiled`: price the rank modules run through torch.compile (None: the plan key's auto,
    fused on GPUs, eager on CPU processes; the plans written say so when it is not auto)."""
    groups = build_groups(graph)
    if candidates is None or not candidates.fits(graph):
        candidates = CandidateTable.of(graph)
    roles, batch = candidates.roles, candidates.batch
    auto = not is_cpu(cluster.device)
    ctx = CostContext.build(graph, cluster, ir_dtype(dtype), compiled=auto if compiled is None else compiled)
    core: set[Node] = set()
    by_layer: dict[str | None, list[NodeGroup]] = {}
    for g in groups:
        by_layer.setdefault(g.layer, []).append(g)
    nodes_of: dict[str | None, list] = {}
    for n in graph.nodes:
        nodes_of.setdefault(n.layer, []).append(n)
    for nodes in nodes_of.values():
        core |= attention_core(ctx, nodes)
    return GraphFacts(graph, groups, roles, layering(graph, "<graph>").uniform(), batch, frozenset(core), ctx,
                      candidates, by_layer)


@dataclass
class Problem:
    facts: GraphFacts
    shape: MeshShape
    mb: int
    gbs: int
    micro_batches: int
    dtype: str
    pricer: Pricer
    groups: list[GroupVar]
    edges: list[EdgeVar]
    shares: list[list[int]]  # edges summed into one gradient
    owner: dict[Value, tuple[int, int]] = field(default_factory=dict)  # value -> (group var, output index)
    reference: Pricer | None = None  # the pricer on the `pricing_shape` (default: `pricer`)
    # What `shardc.search.evaluate` derives from one layer's vector (its terms, its memory
    # timelines), shared by the problems of one pricing and keyed by their `layer_shape`.
    memo: dict[tuple[object, ...], Any] = field(default_factory=dict)

    @property
    def layer_shape(self) -> MeshShape:
        """The part of the shape one layer's terms and memory depend on: every mesh degree but
        pp's size (no layout uses pp; whether the shape pipelines matters, the head and loss
        unfused under a schedule, `pricing_shape`), nor vpp and the schedule (no mesh axes)."""
        return replace(self.shape, pp=min(self.shape.pp, 2), vpp=1, schedule="")

    @property
    def prices(self) -> Pricer:
        """The pricer candidates and edges were priced with (gradients are priced with it too)."""
        return self.reference or self.pricer

    @property
    def layers(self) -> int:
        return self.facts.layering.count


@dataclass
class Priced:
    """The part of a problem that depends only on its `pricing_key`: the represented groups with
    their priced candidates, the priced edges, the shared gradients, the value owners."""

    groups: list[GroupVar]
    edges: list[EdgeVar]
    shares: list[list[int]]
    owner: dict[Value, tuple[int, int]]
    pricer: Pricer  # on the `pricing_shape`
    memo: dict[tuple[object, ...], Any] = field(default_factory=dict)  # `Problem.memo`, shared


PricingCache = dict[tuple[object, ...], Priced]


def pricing_shape(facts: GraphFacts | CandidateTable, shape: MeshShape) -> MeshShape:
    """The mesh candidates and edges are priced on. Rule: prices depend on the intra-stage axes
    present, the sizes of cp and tp (the innermost axes: their link levels do not depend on the
    outer ones) and the micro-batch, not on pp or the dp size: dp only splits batch dims, one
    replica holds `mb` sequences whatever the dp size, and dp's own collectives (gradient sync,
    ZeRO) and the pipeline sends are priced per shape in `shardc.search.linear.coefficients`.
    So a shape whose dp is at least the traced batch is priced with dp equal to the traced
    batch (one traced sequence per replica, scaled to `mb` by `shardc.analysis.dims.batch_scale`,
    as on the shape itself), where every local shape divides exactly; a smaller dp is priced as
    it is. `ep` splits the batch further (and the experts), so its size is priced as it is, dp
    capped at the traced batch over ep. Whether the shape pipelines does matter (pp priced as 2
    when > 1): under a pipeline torch's schedule calls the loss apart from the last stage's
    module, so the LM head and its loss run unfused (`shardc.cost.head.head_regions`)."""
    dp = max(min(shape.dp, facts.batch // shape.ep), 2) if shape.dp > 1 else 1
    return MeshShape(min(shape.pp, 2), dp, shape.cp, shape.tp, shape.tq, ep=shape.ep)


def pricing_key(facts: GraphFacts, shape: MeshShape, mb: int, dtype: str, rotate: bool,
                chunk: bool) -> tuple[object, ...]:
    return (pricing_shape(facts, shape), mb, dtype, rotate, chunk)


def _pricer(facts: GraphFacts, cluster: Cluster, shape: MeshShape, mb: int, dtype: str) -> Pricer:
    ctx = facts.ctx.rescoped(shape.mesh(), batch_scale(facts.batch, mb, shape.dp).factor)
    return Pricer(cluster, shape.mesh(), dtype, ctx, facts.core)


def build_problem(facts: GraphFacts, cluster: Cluster, shape: MeshShape, mb: int, gbs: int,
                  dtype: str = "bf16", rotate: bool = True, chunk: bool = True,
                  cache: PricingCache | None = None) -> Problem:
    """Enumerate and price every group of the represented layers on `shape` at micro-batch `mb`
    (on its `pricing_shape`); with `cache`, shapes of equal `pricing_key` share one pricing."""
    key = pricing_key(facts, shape, mb, dtype, rotate, chunk)
    priced = cache.get(key) if cache is not None else None
    if priced is None:
        ref = pricing_shape(facts, shape)
        priced = _price(facts, ref, mb, _pricer(facts, cluster, ref, mb, dtype), rotate, chunk)
        if cache is not None:
            cache[key] = priced
    return Problem(facts, shape, mb, gbs, gbs // (shape.dp * mb), dtype, _pricer(facts, cluster, shape, mb, dtype),
                   priced.groups, priced.edges, priced.shares, priced.owner, priced.pricer, priced.memo)


def _price(facts: GraphFacts, shape: MeshShape, mb: int, pricer: Pricer, rotate: bool, chunk: bool) -> Priced:
    lay = facts.layering
    rep = (lay.blocks[1] if len(lay.blocks) > 1 else lay.blocks[0]) if lay.blocks else None
    sections = [(name, "pre") for name in lay.pre] + ([(rep, "block")] if rep else []) + [(n, "post") for n in lay.post]
    vars_: list[GroupVar] = []
    index: dict[tuple[str, int], int] = {}
    intra = shape.intra()
    for layer, section in sections:
        for g in facts.by_layer.get(None if layer == "<graph>" else layer, []):
            index[(layer, g.position)] = len(vars_)
            cands = facts.candidates.candidates(g, intra, shape.dp, mb, rotate, chunk)
            vars_.append(GroupVar((layer, g.position), section, g, cands, []))
    for var in vars_:
        var.costs = [pricer.candidate(var.group, c) for c in var.cands]
    edges = _edges(facts, vars_, index, rep, pricer)
    shares: dict[tuple[str, int, int], list[int]] = {}
    for i, e in enumerate(edges):
        shares.setdefault((e.kind, e.producer, e.out_index), []).append(i)
    groups = [ids for ids in shares.values()]
    for k, ids in enumerate(groups):
        for i in ids:
            edges[i].share = k
    owner: dict[Value, tuple[int, int]] = {}
    for g in facts.groups:  # every copy's values, mapped to the represented groups
        layer = "<graph>" if g.layer is None else g.layer
        at = index.get((rep, g.position) if layer in lay.blocks and rep is not None else (layer, g.position))
        k = 0
        for node in g.members:
            for v in node.outputs:
                if at is not None:
                    owner[v] = (at, k)
                k += 1
    return Priced(vars_, edges, groups, owner, pricer)


def _edges(facts: GraphFacts, vars_: list[GroupVar], index: dict[tuple[str, int], int], rep: str | None,
           pricer: Pricer) -> list[EdgeVar]:
    lay = facts.layering
    blocks = lay.blocks
    section_of = {name: "pre" for name in lay.pre} | {name: "post" for name in lay.post}
    owner: dict[Value, tuple[NodeGroup, int]] = {}
    for g in facts.groups:
        k = 0
        for node in g.members:
            for v in node.outputs:
                owner[v] = (g, k)
                k += 1

    def where(g: NodeGroup) -> tuple[str, int | None]:
        layer = "<graph>" if g.layer is None else g.layer
        if layer in section_of:
            return section_of[layer], index.get((layer, g.position))
        if layer in blocks and rep is not None:
            return f"block{blocks.index(layer)}", index.get((rep, g.position))
        return "none", None

    consumers: list[tuple[NodeGroup, int, str]] = [(v.group, i, v.section) for i, v in enumerate(vars_)]
    if blocks and rep is not None and rep != blocks[0]:
        consumers += [(g, index[(rep, g.position)], "first") for g in facts.by_layer.get(blocks[0], [])]
    rep_at = blocks.index(rep) if rep in blocks else -1
    out: list[EdgeVar] = []
    for g, ci, section in consumers:
        for j, node in enumerate(g.members):
            for k, v in enumerate(node.inputs):
                if v.kind != "activation" or v not in owner or owner[v][0] is g:
                    continue
                pg, out_idx = owner[v]
                place, pi = where(pg)
                if pi is None:
                    continue
                kind = _kind(section, place, rep_at)
                if kind is None:
                    continue
                out.append(_edge(pricer, vars_, pi, ci, j, k, out_idx, v, kind, node in facts.core))
    return out


def _kind(consumer: str, producer: str, rep_at: int) -> str | None:
    """The edge kind for a consumer section (pre, block, post, or `first`: the first block's
    groups) and a producer place (pre, post, blockN)."""
    if consumer == "pre":
        return "pre" if producer == "pre" else None
    if consumer == "post":
        return {"post": "post", "pre": "skip"}.get(producer, "last" if producer.startswith("block") else None)
    if consumer == "first":
        return "first" if producer == "pre" else None
    if producer == f"block{rep_at}":
        return "block"
    if producer == f"block{rep_at - 1}":
        return "chain"
    if producer == "pre" and rep_at == 0:
        return "first"
    return None


def _edge(pricer: Pricer, vars_: list[GroupVar], pi: int, ci: int, member: int, index: int, out_idx: int,
          value: Value, kind: str, core: bool) -> EdgeVar:
    prod_info: list[tuple[Layout, bool, frozenset[str], Layout]] = []
    prod_class = []
    for cost in vars_[pi].costs:
        info = cost.produced[out_idx] if out_idx < len(cost.produced) else (Layout(), False, frozenset(), Layout())
        if info not in prod_info:
            prod_info.append(info)
        prod_class.append(prod_info.index(info))
    cons_ext: list[ExternalGrad | None] = []
    cons_class: list[int] = []
    for cost in vars_[ci].costs:
        ext = next((e for e in cost.ext if e.member == member and e.index == index), None)
        key = (ext.required, ext.contribution, ext.regather) if ext else None
        keys = [(e.required, e.contribution, e.regather) if e else None for e in cons_ext]
        if key not in keys:
            cons_ext.append(ext)
            keys.append(key)
        cons_class.append(keys.index(key))
    fwd: list[list[dict[str, float]]] = [[{} for _ in cons_ext] for _ in prod_info]
    regather: list[list[dict[str, float]]] = [[{} for _ in cons_ext] for _ in prod_info]
    bwd: list[list[dict[str, float]]] = [[{} for _ in cons_ext] for _ in prod_info]
    for a, info in enumerate(prod_info):
        for b, ext in enumerate(cons_ext):
            if ext is None:
                continue
            fwd[a][b], regather[a][b] = pricer.edge_forward(value, info[0], ext)
            bwd[a][b] = pricer.edge_backward(value, info, [ext.contribution])
    grads = [ext.contribution if ext else Layout() for ext in cons_ext]
    required = [ext.required if ext else Layout() for ext in cons_ext]
    return EdgeVar(pi, ci, kind, value, out_idx, member, index, core, prod_class, cons_class, prod_info, required,
                   grads, fwd, regather, bwd)
