"""`solve{gbs=8,time-limit=30,seed=0,workers=1}`: choose and write a plan into the IR.

Rule: runs the outer search (`shardc.search.outer.search`: grid baseline, then one CP-SAT
model per mesh shape and micro-batch size) on `ctx.cluster`, then writes the best plan into
the graph (`annotate_graph`: mesh, partitions, layouts, stage/recompute/ZeRO per layer). The
search result is left in `ctx.options["search"]`. Fails with a ShardcError when no plan fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardc.hardware import parse_cluster
from shardc.ir import Graph
from shardc.ir.diagnostics import ShardcError
from shardc.passmanager import Pass, PassContext, register_pass
from shardc.search.outer import search
from shardc.search.planfile import annotate_graph
from shardc.search.problem import graph_facts
from shardc.search.report import no_fit_error


@register_pass
@dataclass(frozen=True)
class Solve(Pass):
    """`solve`: see the module docstring."""

    name: ClassVar[str] = "solve"
    gbs: int = 8
    time_limit: float = 30.0
    seed: int = 0
    workers: int = 1
    memory_limit_gb: float = 0.0

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        if ctx.cluster is None:
            raise ShardcError("the solve pass needs a cluster", hint="set PassContext(cluster=parse_cluster('8xH100'))")
        cluster = parse_cluster(ctx.cluster) if isinstance(ctx.cluster, str) else ctx.cluster
        limit = self.memory_limit_gb * 2**30 if self.memory_limit_gb else float(cluster.device.memory_bytes)
        result = search(graph_facts(graph, cluster), cluster, self.gbs, limit, self.time_limit, self.seed, self.workers)
        ctx.options["search"] = result
        if result.best is None:
            raise no_fit_error(result, limit)
        return annotate_graph(graph, result.best.problem, result.best.assignment)
