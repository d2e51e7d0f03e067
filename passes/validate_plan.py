"""`validate-plan`: check the context's `ParallelPlan` against the model and the cluster.

Rule: the plan's degrees multiply to the cluster's device count (the plan's own count when the
context has no cluster); tp divides heads, kv heads and hidden; pp*vpp is at most the number
of layers (the larger of the attention layers and the blocks group-layers found); the global
batch (gbs, else the traced batch) divides by dp*mb, into a micro-batch count the plan's
torch pipeline schedule accepts (1F1B: at least pp; interleaved 1F1B: divisible by
max(1, m // pp); GPipe: any); cp, and tp*cp with sp, divide the sequence (`shardc.plan.parallel.validate_plan` states each with the nearest valid values).
Every broken constraint is reported at once, in one ShardcError. The graph is not changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardc.analysis.dims import model_dims
from shardc.analysis.stages import layering
from shardc.ir import Graph
from shardc.ir.diagnostics import ShardcError
from shardc.passmanager import Pass, PassContext, register_pass
from shardc.plan.parallel import ParallelPlan, validate_plan


def check_plan(graph: Graph, plan: ParallelPlan, devices: int | None = None) -> None:
    """Raise a ShardcError naming every constraint `plan` breaks on `graph` and `devices`
    (default: the plan's own device count); see the module docstring."""
    dims = model_dims(graph)
    kwargs = {k: v for k, v in dims.as_kwargs().items() if k != "layers"}
    if graph.inputs and dims.batch is None and graph.inputs[0].type.rank:
        kwargs["batch"] = graph.inputs[0].type.shape[0]
    layers = max(dims.layers, layering(graph).count, 1 if plan.stages == 1 else 0)
    validate_plan(plan, devices=plan.devices if devices is None else devices, layers=layers, **kwargs)


def context_plan(ctx: PassContext, who: str) -> ParallelPlan:
    """The context's plan (`ParallelPlan.of`); a ShardcError naming `who` when it has none."""
    if ctx.plan is None:
        raise ShardcError(f"the {who} pass needs a plan in the pass context",
                          hint="give the command a --plan (or PassContext(plan=ParallelPlan.parse('dp=2')))")
    return ParallelPlan.of(ctx.plan)


@register_pass
@dataclass(frozen=True)
class ValidatePlan(Pass):
    """`validate-plan`: see the module docstring."""

    name: ClassVar[str] = "validate-plan"

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        devices = getattr(ctx.cluster, "num_devices", None)
        check_plan(graph, context_plan(ctx, self.name), devices)
        return graph
