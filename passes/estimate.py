"""`estimate{bucket-mb=25,algorithm=auto}`: predict step time and memory of the partitioned graph.

Rule: `shardc.cost.model.estimate` on the graph as it stands (partitioned by apply-plan or the
solver; a graph without a mesh is one device) on the context's cluster, under the context's
plan (`ParallelPlan.of`: its text, a plan, a partitioned graph), or, without one, the plan the
graph records (`plan_of`). The `Estimate` goes to `ctx.options["estimate"]`; the graph is not
changed. Options are the model's knobs that are not part of the plan: DDP's bucket size (MiB;
0 keeps DDP's default), the collective algorithm, and the routing skew of expert-parallel MoE
layers (`shardc.cost.moe`; 1.0 balanced; the graph's own `routing_skew` attribute otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardc.cost.compose import EstimateOptions
from shardc.cost.model import estimate
from shardc.ir import Graph
from shardc.passmanager import Pass, PassContext, register_pass
from shardc.plan.parallel import ParallelPlan


@register_pass
@dataclass(frozen=True)
class Estimate(Pass):
    """`estimate`: see the module docstring."""

    name: ClassVar[str] = "estimate"
    bucket_mb: float = 0.0
    algorithm: str = "auto"
    routing_skew: float = 0.0  # 0: the graph's attribute, else the measured default per ep degree

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        cluster = ctx.the_cluster(self.name)
        plan = None if ctx.plan is None else ParallelPlan.of(ctx.plan)
        options = EstimateOptions(algorithm=self.algorithm)
        if self.bucket_mb:
            options = EstimateOptions(bucket_bytes=self.bucket_mb * 2**20, algorithm=self.algorithm)
        before = graph.attrs.get("routing_skew")
        if self.routing_skew:
            graph.attrs["routing_skew"] = float(self.routing_skew)
        try:
            ctx.options["estimate"] = estimate(graph, cluster, plan, options=options)
        finally:
            if self.routing_skew:
                graph.attrs.pop("routing_skew")
                if before is not None:
                    graph.attrs["routing_skew"] = before
        return graph
