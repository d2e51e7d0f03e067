"""Scores one point of the search space with the analytical model: `shardc.cost.compose` over
layer costs built from the chosen candidates' terms.

A point (`Assignment`) is a candidate per group, per pipeline stage how many blocks it holds
under each recomputation (none, selective, full), and one ZeRO stage. Its layers are the
prefix, every block copy and the suffix, each with a `LayerCost` from `finish_layer` (the
cost model's recomputation rules) over the sum of its groups' `LayerTerms` and its edges: an
edge's forward redistribution belongs to the consumer's layer, the gradient to the
producer's (once per produced value, the consumers' contributions summed, as `estimate`
does), so the first block has the prefix's edges instead of a previous copy's and the last
block the suffix's. The pipeline sends are the values one block passes to the next. Then the
same `compose` as `estimate`: the schedule simulated, bucketed gradient sync, optimizer,
memory per device in flight. The CP-SAT objective is its linearisation (`shardc.search.linear`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.cost.compose import EstimateOptions, LayerWork, Links, compose
from shardc.cost.estimate import StageEstimate
from shardc.cost.layer import LayerCost, LayerTerms, finish_layer
from shardc.ir import LayerAnnotation
from shardc.plan import ParallelPlan
from shardc.search.problem import Problem

RECOMPUTES = ("none", "selective", "full")


@dataclass(frozen=True, slots=True)
class Assignment:
    """A candidate index per group, per stage block counts by recomputation, and the ZeRO stage."""

    choice: tuple[int, ...]
    stages: tuple[tuple[int, int, int], ...]
    zero: int


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
    s = problem.shape
    return ParallelPlan(dp=s.dp, tp=s.tp, pp=s.pp, cp=s.cp, mb=problem.mb, gbs=problem.gbs, zero=zero,
                        dtype=problem.dtype)


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
        out.roots.update(t.roots)
    for key, root in out.roots.items() if problem is not None else ():
        assert problem is not None
        if key in problem.owner:
            var, k = problem.owner[key]
            nbytes = problem.pricer.local_bytes(root, problem.groups[var].costs[choice[var]].produced[k][0])
            if key in out.saved_entries:
                out.saved_entries[key] = (nbytes, out.saved_entries[key][1])
            if key in out.input_entries:
                out.input_entries[key] = nbytes
    out.saved = sum(b for b, _ in out.saved_entries.values())
    out.core_saved = sum(b for b, c in out.saved_entries.values() if c)
    out.inputs = sum(out.input_entries.values())
    return out


def layer_parts(problem: Problem, a: Assignment) -> dict[str, LayerTerms]:
    """Terms of the prefix (`pre`), the first, a middle and the last block, and the suffix (`post`)."""
    parts = {k: LayerTerms() for k in ("pre", "block", "post", "chain_fwd", "chain_bwd", "first_fwd", "last_bwd")}
    own: dict[str, list[LayerTerms]] = {"pre": [], "block": [], "post": []}
    for var, c in zip(problem.groups, a.choice):
        own[var.section].append(var.costs[c].terms)
    into_fwd = {"pre": "pre", "block": "block", "post": "post", "chain": "chain_fwd", "first": "first_fwd",
                "last": "post", "skip": "post"}
    into_grad = {"pre": "pre", "block": "block", "post": "post", "chain": "chain_bwd", "first": "pre",
                 "last": "last_bwd", "skip": "pre"}
    for e in problem.edges:
        pa, cb = e.prod_class[a.choice[e.producer]], e.cons_class[a.choice[e.consumer]]
        t = parts[into_fwd[e.kind]]
        _add(t.fwd, e.fwd[pa][cb])
        _add(t.bwd, e.regather[pa][cb])
        if e.core:
            _add(t.core_fwd, e.fwd[pa][cb])
    for ids in problem.shares:
        e = problem.edges[ids[0]]
        info = e.prod_info[e.prod_class[a.choice[e.producer]]]
        grads = [problem.edges[i].cons_grad[problem.edges[i].cons_class[a.choice[problem.edges[i].consumer]]]
                 for i in ids]
        _add(parts[into_grad[e.kind]].bwd, problem.prices.edge_backward(e.value, info, grads))
    for key in ("pre", "block", "post"):
        parts[key] = _merge(own[key] + [parts[key]], problem, a.choice)
    blk = parts["block"]
    middle = _merge([blk, parts["chain_fwd"], parts["chain_bwd"]])
    if problem.layers <= 1:
        first = last = _merge([blk, parts["first_fwd"], parts["last_bwd"]])
    else:
        first = _merge([blk, parts["first_fwd"], parts["chain_bwd"]])
        last = _merge([blk, parts["chain_fwd"], parts["last_bwd"]])
    _rebase_first(problem, a, first)
    return {"pre": parts["pre"], "first": first, "block": middle, "last": last, "post": parts["post"]}


def _rebase_first(problem: Problem, a: Assignment, first: LayerTerms) -> None:
    """The first block reads the prefix's output where the others read the previous copy's: its
    saved input and kept layer input are that value, at the prefix's layout."""
    chain = {(e.consumer, e.member, e.index): e for e in problem.edges if e.kind == "chain"}
    for e in problem.edges:
        old = chain.get((e.consumer, e.member, e.index)) if e.kind == "first" else None
        if old is None:
            continue
        layout = e.prod_info[e.prod_class[a.choice[e.producer]]][0]
        nbytes = problem.pricer.local_bytes(e.value, layout)
        if id(old.value) in first.input_entries:
            del first.input_entries[id(old.value)]
            first.input_entries[id(e.value)] = nbytes
        if id(old.value) in first.saved_entries:
            flag = first.saved_entries.pop(id(old.value))[1]
            first.saved_entries[id(e.value)] = (nbytes, flag)
    first.saved = sum(b for b, _ in first.saved_entries.values())
    first.core_saved = sum(b for b, c in first.saved_entries.values() if c)
    first.inputs = sum(first.input_entries.values())


def layer_works(problem: Problem, a: Assignment, options: EstimateOptions | None = None) -> list[LayerWork]:
    """The plan's layers in order, with stages, recomputation, costs, parameters and memory timelines."""
    from shardc.search.timelines import Timelines

    parts = layer_parts(problem, a)
    timelines = Timelines(problem, a.choice, parts, options or EstimateOptions())
    cache: dict[tuple[str, str], LayerCost] = {}

    def cost(kind: str, recompute: str) -> LayerCost:
        if (kind, recompute) not in cache:
            cache[(kind, recompute)] = finish_layer(parts[kind], recompute)
        return cache[(kind, recompute)]

    params: dict[str, dict[str, tuple[float, frozenset[str]]]] = {"pre": {}, "block": {}, "post": {}}
    for var, c in zip(problem.groups, a.choice):
        for name, numel, axes in var.costs[c].params:
            prev = params[var.section].get(name)
            params[var.section][name] = (numel, axes | (prev[1] if prev else frozenset()))
    lay = problem.facts.layering
    last_stage = len(a.stages) - 1
    out = []
    earlier: dict[int, set[str]] = {}  # parameter names per device, as `estimate` ties them

    def memory(kind: str, recompute: str, stage: int, names: dict[str, tuple[float, frozenset[str]]]):
        mine = earlier.setdefault(stage, set())
        tied = frozenset(n for n in names if n in mine)
        mine.update(names)
        return timelines.get(kind, recompute, a.zero, tied)

    if lay.pre:
        out.append(LayerWork(lay.pre[0], "pre", LayerAnnotation(0, "none", a.zero), stage=0,
                             cost=cost("pre", "none"), params=params["pre"],
                             memory=memory("pre", "none", 0, params["pre"])))
    i = 0
    for s, row in enumerate(a.stages):
        for r in (2, 1, 0):  # as `annotate_graph` writes them: fully recomputed blocks first
            for _ in range(row[r]):
                kind = "first" if i == 0 else "last" if i == problem.layers - 1 else "block"
                name = lay.blocks[i]
                own = {f"{name}/{k}": v for k, v in params["block"].items()}
                out.append(LayerWork(name, "block", LayerAnnotation(s, RECOMPUTES[r], a.zero), stage=s,
                                     cost=cost(kind, RECOMPUTES[r]), params=own,
                                     memory=memory(kind, RECOMPUTES[r], s, own)))
                i += 1
    if lay.post:
        out.append(LayerWork(lay.post[0], "post", LayerAnnotation(last_stage, "none", a.zero), stage=last_stage,
                             cost=cost("post", "none"), params=params["post"],
                             memory=memory("post", "none", last_stage, params["post"])))
    return out


def pipeline_send(problem: Problem, a: Assignment) -> tuple[float, float]:
    """Seconds and bytes to send what one block passes to the next (one micro-batch)."""
    seen: set[tuple[int, int]] = set()
    total = nbytes = 0.0
    for e in problem.edges:
        if e.kind == "chain" and (e.producer, e.out_index) not in seen:
            seen.add((e.producer, e.out_index))
            layout = e.prod_info[e.prod_class[a.choice[e.producer]]][0]
            b = problem.pricer.local_bytes(e.value, layout)
            total += problem.pricer.p2p(b)
            nbytes += b
    return total, nbytes


def evaluate(problem: Problem, a: Assignment, limit: float, options: EstimateOptions | None = None) -> Evaluation:
    """Predicted step time and per-device memory of `a` (see the module rules)."""
    from shardc.search.timelines import output_bytes

    options = options or EstimateOptions()
    p = len(a.stages)
    send, send_bytes = pipeline_send(problem, a) if p > 1 else (0.0, 0.0)
    sends = [send] * (p - 1) + [0.0]
    links = Links(problem.pricer.ctx.mesh, problem.pricer.cluster, problem.pricer.ctx.algorithm)
    links._levels = problem.pricer.ctx._levels
    works = layer_works(problem, a, options)
    output = output_bytes(problem, a.choice)
    result = compose(works, sends, links, plan_for(problem, a.zero), problem.micro_batches, options,
                     [send_bytes] * (p - 1) + [0.0], output)
    fits = all(s.memory_bytes <= limit for s in result.stages)
    return Evaluation(result.step_time_s, result.stages, fits, limit)


def balanced_stages(layers: int, pp: int, recompute: str) -> tuple[tuple[int, int, int], ...] | None:
    """Megatron's split: layers / pp blocks per stage (None when it does not divide)."""
    if pp < 1 or layers % pp or (pp > 1 and layers == 0):
        return None
    n = layers // pp
    r = RECOMPUTES.index(recompute)
    return tuple(tuple(n if i == r else 0 for i in range(3)) for _ in range(pp))  # type: ignore[misc]
