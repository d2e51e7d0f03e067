"""One planning problem: a mesh shape and micro-batch size, its node groups, priced candidates
and edges, in the form the CP-SAT model and the plan evaluator both read.

Layer structure: the graph's layers in order are a prefix of singleton layers (embedding), a
run of copies of one block, and a suffix (final norm, head, loss). The block is represented by
one copy; its candidates are shared by all copies (solved once per distinct block), so a
layer's time and memory are the same numbers on every stage. Models without such a run are
planned with pp=1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.cost.context import CostContext
from shardc.cost.layer import attention_core
from shardc.hardware import Cluster
from shardc.ir import Graph, Layout, Mesh, Value
from shardc.search.candidates import Candidate, Shapes, enumerate_group
from shardc.search.costs import Pricer
from shardc.search.groups import NodeGroup, build_groups, dim_roles

ZEROS = (0, 1, 2, 3)


@dataclass(frozen=True, slots=True)
class MeshShape:
    """Degrees of pipeline, data, context and tensor parallelism (outermost first)."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def mesh(self) -> Mesh:
        return Mesh((("pp", self.pp), ("dp", self.dp), ("cp", self.cp), ("tp", self.tp)))

    def intra(self) -> Mesh:
        return Mesh(tuple((a, s) for a, s in (("dp", self.dp), ("cp", self.cp), ("tp", self.tp)) if s > 1))

    def __str__(self) -> str:
        return f"pp={self.pp}, dp={self.dp}, cp={self.cp}, tp={self.tp}"


@dataclass(frozen=True, slots=True)
class CandCost:
    """A candidate's coefficients: seconds per micro-batch and bytes, by ZeRO stage where it matters."""

    time: float  # forward + backward
    fwd: float
    fwd_core: float
    bwd: float
    saved: float
    saved_core: float
    layer_input: float
    transient: float
    state: tuple[float, ...]  # model-state bytes per ZeRO stage
    sync_step: tuple[float, ...]  # gradient sync per step, per ZeRO stage
    sync_mb: tuple[float, ...]  # per micro-batch parameter traffic (ZeRO 3)


@dataclass
class GroupVar:
    key: tuple[str, int]
    section: str  # pre | block | post
    group: NodeGroup
    cands: list[Candidate]
    costs: list[CandCost]


@dataclass
class EdgeVar:
    """Edge from group `producer` to group `consumer`, priced per (produced, required) layout class."""

    producer: int
    consumer: int
    section: str  # block | pre | post
    value: Value
    prod_class: list[int]
    cons_class: list[int]
    fwd: list[list[float]]
    bwd: list[list[float]]


@dataclass
class Layering:
    """The graph's layers: prefix singletons, a run of one block class, suffix singletons."""

    pre: list[str]
    blocks: list[str]
    post: list[str]

    @property
    def count(self) -> int:
        return len(self.blocks)


@dataclass
class GraphFacts:
    """What is computed once per graph: groups, roles, dataflow facts, the layering."""

    graph: Graph
    groups: list[NodeGroup]
    roles: dict[int, tuple[str | None, ...]]
    layering: Layering
    batch: int
    batched: frozenset[int]
    needs_grad: frozenset[int]
    core: frozenset[int]
    by_layer: dict[str | None, list[NodeGroup]] = field(default_factory=dict)


def layering(graph: Graph) -> Layering:
    order: list[str] = []
    for n in graph.nodes:
        name = n.layer if n.layer is not None else "<graph>"
        if not order or order[-1] != name:
            if name not in order:
                order.append(name)
    block_of = {name: (graph.layers[name].block if name in graph.layers else name) for name in order}
    counts: dict[str, int] = {}
    for name in order:
        counts[block_of[name]] = counts.get(block_of[name], 0) + 1
    best = max(counts, key=lambda b: counts[b]) if counts else None
    idx = [i for i, name in enumerate(order) if block_of[name] == best]
    if best is None or counts[best] < 2 or idx != list(range(idx[0], idx[-1] + 1)):
        return Layering(order, [], [])
    return Layering(order[: idx[0]], order[idx[0]: idx[-1] + 1], order[idx[-1] + 1:])


def graph_facts(graph: Graph, cluster: Cluster, dtype: str = "bf16") -> GraphFacts:
    groups = build_groups(graph)
    roles = dim_roles(graph)
    ctx = CostContext.build(graph, cluster, dtype)
    batch = next((v.type.shape[0] for v in graph.inputs if roles.get(id(v), (None,))[0] == "batch"), 1)
    core: set[int] = set()
    by_layer: dict[str | None, list[NodeGroup]] = {}
    for g in groups:
        by_layer.setdefault(g.layer, []).append(g)
    nodes_of: dict[str | None, list] = {}
    for n in graph.nodes:
        nodes_of.setdefault(n.layer, []).append(n)
    for nodes in nodes_of.values():
        core |= attention_core(ctx, nodes)
    return GraphFacts(graph, groups, roles, layering(graph), batch, frozenset(ctx.batched),
                      frozenset(ctx.needs_grad), frozenset(core), by_layer)


@dataclass
class Problem:
    facts: GraphFacts
    shape: MeshShape
    mb: int
    micro_batches: int
    pricer: Pricer
    groups: list[GroupVar]
    edges: list[EdgeVar]
    boundary_bytes: float  # activation sent between pipeline stages per micro-batch

    @property
    def layers(self) -> int:
        return self.facts.layering.count


def _layer_key(facts: GraphFacts, layer: str | None) -> str:
    return "<graph>" if layer is None else layer


def build_problem(facts: GraphFacts, cluster: Cluster, shape: MeshShape, mb: int, gbs: int,
                  dtype: str = "bf16", rotate: bool = True, chunk: bool = True) -> Problem:
    """Enumerate and price every group of the represented layers on `shape` at micro-batch `mb`."""
    lay = facts.layering
    scale = mb * shape.dp / facts.batch
    shapes = Shapes(facts.roles, scale, facts.batched)
    pricer = Pricer(cluster, shape.mesh(), dtype, shapes, facts.needs_grad, facts.core)
    intra = shape.intra()
    block_class = None
    rep = None
    if lay.blocks:
        rep = lay.blocks[1] if len(lay.blocks) > 1 else lay.blocks[0]
        block_class = rep
    sections = [(name, "pre") for name in lay.pre] + ([(rep, "block")] if rep else []) + [(n, "post") for n in lay.post]
    vars_: list[GroupVar] = []
    index: dict[tuple[str, int], int] = {}
    group_index: dict[int, int] = {}
    for layer, section in sections:
        for g in facts.by_layer.get(None if layer == "<graph>" else layer, []):
            cands = enumerate_group(g, intra, shapes, rotate, chunk)
            key = (layer, g.position)
            index[key] = len(vars_)
            group_index[id(g)] = len(vars_)
            vars_.append(GroupVar(key, section, g, cands, []))
    block_set = set(lay.blocks)
    owner: dict[int, tuple[NodeGroup, int]] = {}
    for g in facts.groups:
        k = 0
        for node in g.members:
            for v in node.outputs:
                owner[id(v)] = (g, k)
                k += 1

    def var_of(g: NodeGroup) -> int | None:
        if id(g) in group_index:
            return group_index[id(g)]
        if g.layer in block_set and block_class is not None:
            return index.get((block_class, g.position))
        return None

    # Edges: inside the represented block and from the previous copy (per layer), pre -> first
    # block (from copy 0), last block -> post.
    consumers: list[tuple[NodeGroup, int, str]] = [(v.group, i, v.section) for i, v in enumerate(vars_)]
    if lay.blocks and rep != lay.blocks[0] and block_class is not None:
        for g in facts.by_layer.get(lay.blocks[0], []):
            consumers.append((g, index[(block_class, g.position)], "first"))
    edges: list[EdgeVar] = []
    first_saver: dict[int, int] = {}
    for g, ci, section in consumers:
        seen: set[tuple[int, int]] = set()
        for j, node in enumerate(g.members):
            for k, v in enumerate(node.inputs):
                if v.kind != "activation" or id(v) not in owner or (j, k) in seen:
                    continue
                pg, out_idx = owner[id(v)]
                if pg is g:
                    continue
                pi = var_of(pg)
                if pi is None:
                    continue
                if section == "first" and vars_[pi].section != "pre":
                    continue
                if section == "block" and vars_[pi].section == "pre":
                    continue
                seen.add((j, k))
                edges.append(_edge(pricer, vars_, pi, ci, j, k, out_idx, v, section))
    for i, var in enumerate(vars_):
        for c in var.cands:
            for key, _, _ in c.saved:
                first_saver.setdefault(key, i)
    for i, var in enumerate(vars_):
        var.costs = [_cost(pricer, var, c, first_saver, i) for c in var.cands]
    boundary = 0.0
    if lay.blocks:
        last = facts.by_layer.get(lay.blocks[-1], [])
        outs = [v for g in last for n in g.members for v in n.outputs if v.type.is_float]
        if outs:
            boundary = shapes.nbytes(outs[-1], Layout(), intra) / shape.dp
    micro = gbs // (shape.dp * mb)
    return Problem(facts, shape, mb, micro, pricer, vars_, edges, boundary)


def _edge(pricer: Pricer, vars_: list[GroupVar], pi: int, ci: int, member: int, index: int, out_idx: int,
          value: Value, section: str) -> EdgeVar:
    prod_layouts: list[Layout] = []
    prod_class = []
    for c in vars_[pi].cands:
        lay = c.outputs[out_idx][1] if out_idx < len(c.outputs) else Layout()
        if lay not in prod_layouts:
            prod_layouts.append(lay)
        prod_class.append(prod_layouts.index(lay))
    cons_layouts: list[tuple[Layout, Layout]] = []
    cons_class = []
    for c in vars_[ci].cands:
        req = next(((e.required, e.grad) for e in c.inputs if e.member == member and e.index == index),
                   (Layout(), Layout()))
        if req not in cons_layouts:
            cons_layouts.append(req)
        cons_class.append(cons_layouts.index(req))
    fwd = [[0.0] * len(cons_layouts) for _ in prod_layouts]
    bwd = [[0.0] * len(cons_layouts) for _ in prod_layouts]
    for a, src in enumerate(prod_layouts):
        for b, (req, grad) in enumerate(cons_layouts):
            fwd[a][b], bwd[a][b] = pricer.edge(value, src, req, grad)
    sec = vars_[ci].section if section != "first" else "pre"
    if vars_[pi].section == "block" and vars_[ci].section == "post":
        sec = "post"
    return EdgeVar(pi, ci, sec, value, prod_class, cons_class, fwd, bwd)


def _cost(pricer: Pricer, var: GroupVar, cand: Candidate, first_saver: dict[int, int], i: int) -> CandCost:
    priced = pricer.candidate(var.group, cand)
    saved = sum(b for k, b, _ in priced.saved if first_saver.get(k) == i)
    core_ids = {id(n) for n in var.group.members if id(n) in pricer.core}
    saved_core = saved if core_ids and var.group.anchor is not None and id(var.group.anchor) in core_ids else 0.0
    layer_input = sum(pricer.shapes.nbytes(e.value, e.required, pricer.mesh) for e in cand.inputs
                      if e.value.kind == "activation" and (e.value.producer is None or
                                                           e.value.producer.layer != var.group.layer))
    state = tuple(sum(pricer.state_bytes(n, axes, z) for _, n, axes in priced.params) for z in ZEROS)
    syncs = [[pricer.grad_sync(n, axes, z) for _, n, axes in priced.params] for z in ZEROS]
    return CandCost(priced.fwd + priced.bwd, priced.fwd, priced.fwd_core, priced.bwd, saved, saved_core,
                    layer_input, priced.transient, state, tuple(sum(s for s, _ in row) for row in syncs),
                    tuple(sum(m for _, m in row) for row in syncs))
