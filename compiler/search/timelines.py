"""A plan's per-layer memory timelines and pipeline buffer sizes, as `estimate` computes them.

`estimate` gives every layer of a partitioned graph its micro-batch memory timeline
(`shardc.cost.timeline.layer_memory`: saved, recomputed and gradient bytes op by op) and the
composition its pipeline buffers (bytes sent between stages, the loss's input). `evaluate`
scores a plan without writing it into the graph, so it builds the same inputs here: one cost
context overlaid with every represented group's chosen partitions and every value's produced
layout (what `annotate_graph` writes), walked over the prefix's, the represented block's and
the suffix's nodes. Block copies share the represented block's timeline; parameters an earlier
layer on the same device also reads (a tied embedding) and FSDP2's held gradients are keyed as
`estimate` keys them.
"""

from __future__ import annotations

import dataclasses

from shardc.cost.compose import EstimateOptions, fsdp2, zero_group
from shardc.cost.context import CostContext
from shardc.cost.layer import LayerTerms
from shardc.cost.saved import SavedKey
from shardc.cost.timeline import LayerMemory, layer_memory
from shardc.ir import Layout, Node, Partial, Partition, Value
from shardc.ops.registry import get_op, has_op
from shardc.search.problem import Problem


class Timelines:
    """Memory timelines of one plan's layers, by (kind, recomputation, tied parameters, held)."""

    def __init__(self, problem: Problem, choice: tuple[int, ...], parts: dict[str, LayerTerms],
                 options: EstimateOptions, prev: tuple[int, ...] | None = None) -> None:
        self.problem, self.parts, self.options = problem, parts, options
        self.ctx = _overlay(problem, choice)
        if prev is not None and prev != choice:
            # A stage's first block reads the previous stage's output as that stage produced it.
            layouts = dict(self.ctx.layouts)
            for e in problem.edges:
                if e.kind == "chain":
                    layouts[e.value] = e.prod_info[e.prod_class[prev[e.producer]]][0]
            self.ctx = self.ctx.with_overlay(self.ctx.partitions, layouts)
        # The first block reads the prefix's output where the represented one reads the
        # previous copy's: its inputs are laid out as the prefix produces them.
        chain = {(e.consumer, e.member, e.index): e for e in problem.edges if e.kind == "chain"}
        first = dict(self.ctx.layouts)
        # The first block's terms name the prefix's value, its nodes the copy's (keyed as the
        # terms' saved entries are; only values are ever rekeyed).
        self.rekey: dict[SavedKey, Value] = {}
        for e in problem.edges:
            old = chain.get((e.consumer, e.member, e.index)) if e.kind == "first" else None
            if old is not None:
                first[old.value] = e.prod_info[e.prod_class[choice[e.producer]]][0]
                self.rekey[e.value] = old.value
        self.first_ctx = self.ctx.with_overlay(self.ctx.partitions, first)
        lay = problem.facts.layering
        rep = next((v.key[0] for v in problem.groups if v.section == "block"), None)
        layer_nodes: dict[str | None, list[Node]] = {}
        for node in problem.facts.graph.nodes:
            layer_nodes.setdefault(node.layer, []).append(node)
        pre = [n for name in lay.pre for n in layer_nodes.get(None if name == "<graph>" else name, [])]
        post = [n for name in lay.post for n in layer_nodes.get(None if name == "<graph>" else name, [])]
        block = layer_nodes.get(rep, []) if rep is not None else []
        self.nodes = {"pre": pre, "post": post, "first": block, "block": block, "last": block}
        self.shard = zero_group(problem.pricer.ctx.mesh)[1]
        self._cache: dict[tuple[str, str, frozenset[str], bool], LayerMemory] = {}

    def get(self, kind: str, recompute: str, zero: int, tied: frozenset[str],
            terms: LayerTerms | None = None) -> LayerMemory:
        """The memory timeline of a layer of `kind` (its terms: `terms`, else `parts[kind]`; a
        layer's memory depends on what it saves and keeps, not on the layer after it)."""
        hold = fsdp2(self.options, zero, self.shard)
        key = (kind, recompute, tied, hold)
        if key not in self._cache:
            ctx, terms = self.ctx, (terms if terms is not None else self.parts[kind])
            if kind == "first":
                ctx, terms = self.first_ctx, dataclasses.replace(
                    terms, saved_entries={self.rekey.get(k, k): v for k, v in terms.saved_entries.items()},
                    input_entries={self.rekey.get(k, k): v for k, v in terms.input_entries.items()})
            self._cache[key] = layer_memory(ctx, self.nodes[kind], terms, recompute, tied, hold)
        return self._cache[key]


def output_bytes(problem: Problem, choice: tuple[int, ...]) -> float:
    """Bytes the last stage returns per micro-batch before the loss (the loss's input)."""
    graph = problem.facts.graph

    def local(value: Value) -> float:
        var, k = problem.owner.get(value, (-1, 0))
        produced = problem.groups[var].costs[choice[var]].produced if var >= 0 else ()
        return problem.pricer.local_bytes(value, produced[k][0] if k < len(produced) else Layout())

    for node in reversed(graph.nodes):
        if has_op(node.op) and get_op(node.op).kind == "loss" and node.inputs:
            return local(node.inputs[0])
    return sum(local(v) for v in graph.outputs)


def _overlay(problem: Problem, choice: tuple[int, ...]) -> CostContext:
    """The pricing context with the plan's partitions and layouts (as `annotate_graph` writes them)."""
    partitions: dict[Node, Partition | None] = {}
    layouts: dict[Value, Layout] = {}
    for var, c in zip(problem.groups, choice):
        cand = var.cands[c]
        for j, node in enumerate(var.group.members):
            partitions[node] = cand.partitions[j] if j < len(cand.partitions) else None
        for e in cand.inputs:
            if e.value.kind in ("input", "parameter", "buffer") and e.value not in layouts:
                layouts[e.value] = Layout(tuple((a, p) for a, p in e.required.placements
                                                    if not isinstance(p, Partial)))
    for value, (var_index, k) in problem.owner.items():
        produced = problem.groups[var_index].costs[choice[var_index]].produced
        if k < len(produced):
            layouts[value] = produced[k][0]
    return problem.pricer.ctx.with_overlay(partitions, layouts)
