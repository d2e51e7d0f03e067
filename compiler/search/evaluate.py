"""Scores one point of the search space with the analytical model: `shardc.cost.compose` over
layer costs built from the chosen candidates' terms.

A point (`Assignment`) is a candidate per group, per pipeline stage (per virtual stage, pp*vpp
of them, with interleaved stages: virtual stage s runs on device s % pp) how many blocks it holds
under each recomputation (none, selective, full), and one ZeRO stage. Its layers are the
prefix, every block copy and the suffix, each with a `LayerCost` from `finish_layer` (the
cost model's recomputation rules) over the sum of its groups' `LayerTerms` and its edges: an
edge's forward redistribution belongs to the consumer's layer, the gradient to the
producer's (once per produced value, the consumers' contributions summed, as `estimate`
does), so the first block has the prefix's edges instead of a previous copy's and the last
block the suffix's. With per-stage partitions every block copy is priced at its stage's
candidates, the edge into a stage's first block across the two stages' partitions (its saved
input at the layout the previous stage sent), the gradient out of a stage's last block likewise.
The pipeline sends are the values one block passes to the next, at the sending stage's layout. Then the
same `compose` as `estimate`: the schedule simulated, bucketed gradient sync, optimizer,
memory per device in flight. The CP-SAT objective is its linearisation (`shardc.search.linear`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from shardc.analysis.stages import stage_sizes
from shardc.cost.compose import EstimateOptions, LayerWork, Links, compose
from shardc.cost.estimate import StageEstimate
from shardc.cost.layer import LayerCost, LayerTerms, finish_layer
from shardc.cost.timeline import LayerMemory
from shardc.ir import RECOMPUTE_CHOICES, LayerAnnotation
from shardc.plan.parallel import ParallelPlan
from shardc.search.problem import Problem, compile_key
from shardc.search.timelines import Timelines, output_bytes


@dataclass(frozen=True, slots=True)
class Assignment:
    """A candidate index per group, per stage block counts by recomputation, and the ZeRO stage.

    `stage_choice`, when not empty, holds per pipeline stage a full candidate vector whose block
    groups' entries are that stage's (the prefix's and suffix's entries equal `choice`'s): the
    blocks of different stages may be partitioned differently. Empty: every stage runs `choice`.
    Build per-stage assignments with `per_stage`, which keeps them canonical."""

    choice: tuple[int, ...]
    stages: tuple[tuple[int, int, int], ...]
    zero: int
    stage_choice: tuple[tuple[int, ...], ...] = ()

    def at(self, stage: int) -> tuple[int, ...]:
        """The candidate vector stage `stage` runs."""
        return self.stage_choice[stage] if self.stage_choice else self.choice

    @property
    def uniform(self) -> bool:
        return not self.stage_choice

    def blocks(self) -> list[tuple[int, str]]:
        """Every block copy's (stage, recomputation), in order. Rule: within a stage, fully
        recomputed blocks first, then selective, then none (the first are held longest)."""
        return [(s, RECOMPUTE_CHOICES[r]) for s, row in enumerate(self.stages) for r in (2, 1, 0)
                for _ in range(row[r])]


def executed_zero(problem: Problem, a: Assignment) -> Assignment:
    """`a` as it runs: ZeRO shards over the data group (dp, cp and ep: the axes a replicated
    parameter's gradient is averaged over), so on a shape without one it wraps nothing at run time
    and is priced as nothing; the plan then says ZeRO 0, so that a plan never claims a ZeRO stage it
    does not execute (the same figures: `tests/test_closed_loop.py` counts ZeRO only where it runs)."""
    s = problem.shape
    return a if a.zero == 0 or s.dp * s.cp * s.ep > 1 else replace(a, zero=0)


def per_stage(problem: Problem, choice: tuple[int, ...], blocks: list[tuple[int, ...]],
              stages: tuple[tuple[int, int, int], ...], zero: int) -> Assignment:
    """The canonical assignment whose stage s runs `blocks[s]`'s block-group entries (the other
    entries from `choice`). A stage without blocks takes its neighbour's vector (it runs no block,
    and the boundary it would otherwise create does not exist); `choice`'s block entries become the
    first stage's; equal vectors on every stage give a uniform assignment."""
    p = len(stages)
    is_block = [v.section == "block" for v in problem.groups]
    vecs = [tuple(b if blk else c for b, c, blk in zip(blocks[s], choice, is_block)) for s in range(p)]
    if p > 1 and sum(stages[0]) == 0:
        vecs[0] = vecs[1]
    if p > 1 and sum(stages[-1]) == 0:
        vecs[-1] = vecs[-2]
    if all(v == vecs[0] for v in vecs):
        return Assignment(vecs[0], stages, zero)
    return Assignment(vecs[0], stages, zero, tuple(vecs))


@dataclass(frozen=True, slots=True)
class Evaluation:
    step_time_s: float
    stages: tuple[StageEstimate, ...]
    fits: bool
    limit: float

    @property
    def memory_bytes(self) -> tuple[float, ...]:
        return tuple(s.memory_bytes for s in self.stages)

    @property
    def memory_per_device_bytes(self) -> float:
        return max(self.memory_bytes)

    @property
    def memory_parts(self) -> tuple[dict[str, float], ...]:
        return tuple(dict(s.memory) for s in self.stages)

    @property
    def time_parts(self) -> dict[str, float]:
        """Seconds by category on the busiest stage (the one with the least bubble)."""
        return dict(min(self.stages, key=lambda s: s.time.get("bubble", 0.0)).time)


def plan_for(problem: Problem, zero: int = 0) -> ParallelPlan:
    """The uniform plan `problem` prices: its mesh shape's degrees, micro-batch, batch, `zero`."""
    return problem.shape.plan(problem.mb, problem.gbs, zero, problem.dtype, compile_key(problem.facts))


def _add(into: dict[str, float], part: dict[str, float]) -> None:
    for key, val in part.items():
        into[key] = into.get(key, 0.0) + val


def _merge(parts: list[LayerTerms], problem: Problem | None = None, choice: tuple[int, ...] = ()) -> LayerTerms:
    """The sum of `parts`; with `problem`, storages saved by one group and made by another are
    counted at their producer's chosen layout."""
    out = LayerTerms()
    for t in parts:
        _add(out.fwd, t.fwd)
        _add(out.bwd, t.bwd)
        _add(out.core_fwd, t.core_fwd)
        out.fwd_flops += t.fwd_flops
        out.bwd_flops += t.bwd_flops
        out.core_flops += t.core_flops
        out.matmul_flops += t.matmul_flops
        out.core_matmul_flops += t.core_matmul_flops
        out.transient = max(out.transient, t.transient)
        for key, val in t.saved_entries.items():
            out.saved_entries.setdefault(key, val)
        for key, b in t.input_entries.items():
            out.input_entries.setdefault(key, b)
        out.roots |= t.roots
    for root in out.roots if problem is not None else ():
        assert problem is not None
        if root in problem.owner:
            var, k = problem.owner[root]
            nbytes = problem.pricer.local_bytes(root, problem.groups[var].costs[choice[var]].produced[k][0])
            if root in out.saved_entries:
                out.saved_entries[root] = (nbytes, out.saved_entries[root][1])
            if root in out.input_entries:
                out.input_entries[root] = nbytes
    out.saved = sum(b for b, _ in out.saved_entries.values())
    out.core_saved = sum(b for b, c in out.saved_entries.values() if c)
    out.inputs = sum(out.input_entries.values())
    return out


def _edges_into(problem: Problem, t: LayerTerms, fwd_kinds: tuple[str, ...], grad_kinds: tuple[str, ...],
                prod: tuple[int, ...], cons: tuple[int, ...]) -> None:
    """Add to `t` the forward redistributions (and backward re-gathers) of the edges of `fwd_kinds`
    and the gradients of the shares of `grad_kinds`, producers at `prod`'s candidates, consumers
    at `cons`'s."""
    for e in problem.edges:
        if e.kind in fwd_kinds:
            pa, cb = e.prod_class[prod[e.producer]], e.cons_class[cons[e.consumer]]
            _add(t.fwd, e.fwd[pa][cb])
            _add(t.bwd, e.regather[pa][cb])
            if e.core:
                _add(t.core_fwd, e.fwd[pa][cb])
    for ids in problem.shares:
        e = problem.edges[ids[0]]
        if e.kind in grad_kinds:
            info = e.prod_info[e.prod_class[prod[e.producer]]]
            grads = [problem.edges[i].cons_grad[problem.edges[i].cons_class[cons[problem.edges[i].consumer]]]
                     for i in ids]
            _add(t.bwd, problem.prices.edge_backward(e.value, info, grads))


def section_terms(problem: Problem, section: str, vec: tuple[int, ...]) -> LayerTerms:
    """The prefix's (`pre`) or suffix's (`post`) terms with every group at `vec`: its own groups,
    the edges whose forward it runs (`last`, `skip` into the suffix) and the gradients it
    produces (`first`, `skip` out of the prefix). The prefix is given the vector of the stage
    that holds the first block, the suffix that of the stage holding the last."""
    fwd, grad = {"pre": (("pre",), ("pre", "first", "skip")), "post": (("post", "last", "skip"), ("post",))}[section]
    t = LayerTerms()
    _edges_into(problem, t, fwd, grad, vec, vec)
    own = [var.costs[c].terms for var, c in zip(problem.groups, vec) if var.section == section]
    return _merge(own + [t], problem, vec)


def block_terms(problem: Problem, prev: tuple[int, ...] | None, cur: tuple[int, ...],
                nxt: tuple[int, ...] | None) -> LayerTerms:
    """One block copy's terms, its groups at `cur`: its own groups and internal edges, the
    forward of what it reads from the block before it (at `prev`; None: the first block, which
    reads the prefix) and the gradient of what it passes to the block after it (at `nxt`; None:
    the last block, which feeds the suffix)."""
    t = LayerTerms()
    _edges_into(problem, t, ("block",), ("block",), cur, cur)
    if prev is None:
        _edges_into(problem, t, ("first",), (), cur, cur)
    else:
        _edges_into(problem, t, ("chain",), (), prev, cur)
    if nxt is None:
        _edges_into(problem, t, (), ("last",), cur, cur)
    else:
        _edges_into(problem, t, (), ("chain",), cur, nxt)
    own = [var.costs[c].terms for var, c in zip(problem.groups, cur) if var.section == "block"]
    out = _merge(own + [t], problem, cur)
    if prev is None:
        _rebase_first(problem, cur, out)
    elif prev != cur:
        _rebase_chain(problem, prev, out)
    return out


def _refresh(t: LayerTerms) -> None:
    t.saved = sum(b for b, _ in t.saved_entries.values())
    t.core_saved = sum(b for b, c in t.saved_entries.values() if c)
    t.inputs = sum(t.input_entries.values())


def _rebase_first(problem: Problem, choice: tuple[int, ...], first: LayerTerms) -> None:
    """The first block reads the prefix's output where the others read the previous copy's: its
    saved input and kept layer input are that value, at the prefix's layout."""
    chain = {(e.consumer, e.member, e.index): e for e in problem.edges if e.kind == "chain"}
    for e in problem.edges:
        old = chain.get((e.consumer, e.member, e.index)) if e.kind == "first" else None
        if old is None:
            continue
        layout = e.prod_info[e.prod_class[choice[e.producer]]][0]
        nbytes = problem.pricer.local_bytes(e.value, layout)
        if old.value in first.input_entries:
            del first.input_entries[old.value]
            first.input_entries[e.value] = nbytes
        if old.value in first.saved_entries:
            flag = first.saved_entries.pop(old.value)[1]
            first.saved_entries[e.value] = (nbytes, flag)
    _refresh(first)


def _rebase_chain(problem: Problem, prev: tuple[int, ...], t: LayerTerms) -> None:
    """A stage's first block reads the previous stage's last block: what it saves and keeps of
    that input is at the layout the previous stage produced (and sent) it in."""
    for e in problem.edges:
        if e.kind != "chain":
            continue
        nbytes = problem.pricer.local_bytes(e.value, e.prod_info[e.prod_class[prev[e.producer]]][0])
        if e.value in t.input_entries:
            t.input_entries[e.value] = nbytes
        if e.value in t.saved_entries:
            t.saved_entries[e.value] = (nbytes, t.saved_entries[e.value][1])
    _refresh(t)


def layer_works(problem: Problem, a: Assignment, options: EstimateOptions | None = None) -> list[LayerWork]:
    """The plan's layers in order, with stages, recomputation, costs, parameters and memory timelines."""
    build = _Layers(problem, a, options or EstimateOptions())
    blocks = a.blocks()
    where = [s for s, _ in blocks]
    lay = problem.facts.layering
    out = []
    if lay.pre:  # the prefix runs on the stage of the first block
        out.append(build.section("pre", lay.pre[0], 0, a.at(where[0]) if where else a.choice))
    for i, (s, recompute) in enumerate(blocks):  # the order `annotate_graph` writes them in
        out.append(build.block(i, s, recompute, where))
    if lay.post:  # the suffix, on the last stage, runs that of the last block
        last = len(a.stages) - 1
        out.append(build.section("post", lay.post[0], last, a.at(where[-1]) if where else a.at(last)))
    return out


def _params(problem: Problem, vec: tuple[int, ...], section: str) -> dict[str, tuple[float, frozenset[str]]]:
    """The parameters `section`'s groups read at `vec`: name -> (local elements, gradient-sum axes)."""
    out: dict[str, tuple[float, frozenset[str]]] = {}
    for var, c in zip(problem.groups, vec):
        if var.section == section:
            for name, numel, axes in var.costs[c].params:
                prev = out.get(name)
                out[name] = (numel, axes | (prev[1] if prev else frozenset()))
    return out


class _Layers:
    """Builds one assignment's `LayerWork`s in order. Layers at equal stage vectors share their
    terms, costs and timelines; parameters are tied per pipeline device as `estimate` ties them
    (a layer reading a parameter an earlier layer on its device read holds its gradient)."""

    def __init__(self, problem: Problem, a: Assignment, options: EstimateOptions) -> None:
        self.problem, self.a, self.options = problem, a, options
        self.terms: dict[tuple[object, ...], LayerTerms] = {}
        self.costs: dict[tuple[object, ...], LayerCost] = {}
        self.timelines: dict[tuple[object, ...], Timelines] = {}
        self.block_params: dict[tuple[int, ...], dict[str, tuple[float, frozenset[str]]]] = {}
        self.earlier: dict[int, set[str]] = {}  # parameter names per device

    def section(self, section: str, name: str, stage: int, vec: tuple[int, ...]) -> LayerWork:
        """The prefix (`pre`) or the suffix (`post`), its groups and edges at `vec`."""
        key = (section, vec)
        t = self._terms(key, lambda: section_terms(self.problem, section, vec))
        params = _params(self.problem, self.a.choice, section)
        return LayerWork(name, section, LayerAnnotation(stage, "none", self.a.zero), self._nodes(name), stage=stage,
                         cost=self._cost(key, t, "none"), params=params,
                         memory=self._memory(self._timeline(None, vec), section, t, "none", stage, params))

    def block(self, i: int, s: int, recompute: str, where: list[int]) -> LayerWork:
        """Block copy `i` on stage `s` under `recompute` (`where`: every copy's stage)."""
        a, last = self.a, self.problem.layers - 1
        cur = a.at(s)
        prev = a.at(where[i - 1]) if i > 0 else None
        nxt = a.at(where[i + 1]) if i < last else None
        kind = "first" if i == 0 else "last" if i == last else "block"
        key = ("block", prev, cur, nxt)
        terms = self._terms(key, lambda: block_terms(self.problem, prev, cur, nxt))
        if cur not in self.block_params:
            self.block_params[cur] = _params(self.problem, cur, "block")
        name = self.problem.facts.layering.blocks[i]
        own = {f"{name}/{k}": v for k, v in self.block_params[cur].items()}
        return LayerWork(name, "block", LayerAnnotation(s, recompute, a.zero), self._nodes(name), stage=s,
                         cost=self._cost(key, terms, recompute), params=own,
                         memory=self._memory(self._timeline(prev, cur), kind, terms, recompute, s, own))

    def _terms(self, key: tuple[object, ...], build: Callable[[], LayerTerms]) -> LayerTerms:
        """The terms under `key`, made by `build` once: they depend on the vectors only, so the
        problems of one pricing keep them for every assignment they evaluate (`Problem.memo`)."""
        if key not in self.terms:
            shared = self.problem.memo.setdefault(("terms", self.problem.layer_shape), {})
            if key not in shared:
                shared[key] = build()
            self.terms[key] = shared[key]
        return self.terms[key]

    def _nodes(self, layer: str) -> list:
        """The layer's nodes (what a zero-bubble schedule's weight-gradient share is read from)."""
        facts = self.problem.facts
        by_layer = facts.__dict__.get("_nodes_by_layer")
        if by_layer is None:
            by_layer = facts.__dict__["_nodes_by_layer"] = {}
            for node in facts.graph.nodes:
                by_layer.setdefault(node.layer, []).append(node)
        return by_layer.get(layer, [])

    def _timeline(self, prev: tuple[int, ...] | None, cur: tuple[int, ...]) -> Timelines:
        across = prev if prev is not None and prev != cur else None  # only a stage boundary changes the layouts
        key = (across, cur)
        if key not in self.timelines:
            # A timeline depends on the layouts only, so the problems of one pricing keep them
            # for every assignment they evaluate (the grid's points share their vector, the
            # shapes that differ only in pp their layers).
            shared = self.problem.memo.setdefault(("timelines", self.problem.layer_shape), {})
            if (key, self.options) not in shared:
                shared[(key, self.options)] = Timelines(self.problem, cur, {}, self.options, across)
            self.timelines[key] = shared[(key, self.options)]
        return self.timelines[key]

    def _cost(self, key: tuple[object, ...], t: LayerTerms, recompute: str) -> LayerCost:
        if (key, recompute) not in self.costs:
            self.costs[(key, recompute)] = finish_layer(t, recompute)
        return self.costs[(key, recompute)]

    def _memory(self, tl: Timelines, kind: str, t: LayerTerms, recompute: str, stage: int,
                names: dict[str, tuple[float, frozenset[str]]]) -> LayerMemory:
        mine = self.earlier.setdefault(stage % self.problem.shape.pp, set())  # per device, as `estimate` ties
        tied = frozenset(n for n in names if n in mine)
        mine.update(names)
        return tl.get(kind, recompute, self.a.zero, tied, t)


def pipeline_send(problem: Problem, choice: tuple[int, ...]) -> tuple[float, float]:
    """Seconds and bytes to send what one block passes to the next (one micro-batch), the
    sending block at `choice`."""
    seen: set[tuple[int, int]] = set()
    total = nbytes = 0.0
    for e in problem.edges:
        if e.kind == "chain" and (e.producer, e.out_index) not in seen:
            seen.add((e.producer, e.out_index))
            layout = e.prod_info[e.prod_class[choice[e.producer]]][0]
            b = problem.pricer.local_bytes(e.value, layout)
            total += problem.pricer.p2p(b)
            nbytes += b
    return total, nbytes


def evaluate(problem: Problem, a: Assignment, limit: float, options: EstimateOptions | None = None) -> Evaluation:
    """Predicted step time and per-device memory of `a` (see the module rules)."""
    options = options or EstimateOptions()
    p = len(a.stages)
    per = [pipeline_send(problem, a.at(s)) if p > 1 else (0.0, 0.0) for s in range(p - 1)]
    sends = [t for t, _ in per] + [0.0]
    links = Links(problem.pricer.ctx.mesh, problem.pricer.cluster, problem.pricer.ctx.algorithm)
    links._levels = problem.pricer.ctx._levels
    works = layer_works(problem, a, options)
    output = output_bytes(problem, a.at(p - 1))
    result = compose(works, sends, links, plan_for(problem, a.zero), problem.micro_batches, options,
                     [b for _, b in per] + [0.0], output)
    fits = all(s.memory_bytes <= limit for s in result.stages)
    return Evaluation(result.step_time_s, result.stages, fits, limit)


def balanced_stages(layers: int, pp: int, recompute: str) -> tuple[tuple[int, int, int], ...] | None:
    """Blocks per stage as apply-plan deals them (`shardc.analysis.stages.stage_sizes`), all with
    `recompute` (None when some stage would get no block)."""
    if pp < 1 or (pp > 1 and layers < pp):
        return None
    r = RECOMPUTE_CHOICES.index(recompute)
    return tuple(tuple(n if i == r else 0 for i in range(3)) for n in stage_sizes(layers, pp))  # type: ignore[misc]
