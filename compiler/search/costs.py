"""Prices candidates and edges with the analytical model itself (`shardc.cost`), node by node.

A candidate of a node group is priced by costing the group's nodes with `layer_terms` on a
`CostContext` overlaid with the candidate's partitions and layouts (`internal_only`: what
crosses the group's boundary is the edges'). An edge is priced with `input_steps` (the
forward redistribution, plus the backward re-gather of a saved input) and `gradient_steps`
(the gradient back). These are the very functions `estimate` runs on a partitioned graph, so
a plan's coefficients add up to what `estimate` predicts for it; the solver only combines
them (linearly in CP-SAT, with `shardc.cost.compose` in `shardc.search.evaluate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.analysis.groups import NodeGroup
from shardc.cost.comm import collective_time, neighbour_link
from shardc.cost.compute import node_compute_time, repeated, rotation_steps
from shardc.cost.context import CostContext
from shardc.cost.edges import (
    feeds_only_parameters,
    gradient_contribution,
    gradient_layout,
    gradient_steps,
    input_steps,
    layer_params,
    steps_time,
)
from shardc.cost.layer import LayerTerms, layer_terms, regather_exposed
from shardc.hardware import Cluster
from shardc.ir import Axis, Layout, Mesh, Node, Value
from shardc.search.candidates import Candidate


@dataclass(frozen=True, slots=True)
class ExternalGrad:
    """What a candidate needs of one external input: the layout required, the gradient it sends
    back, and, when it saves the input for backward, (op kind, its backward seconds) for the
    re-gather rule."""

    member: int
    index: int
    value: Value
    required: Layout
    contribution: Layout
    regather: tuple[str, float] | None


@dataclass(frozen=True, slots=True)
class CandCost:
    """A candidate's own terms (one micro-batch, one device), its parameters and external inputs."""

    terms: LayerTerms
    params: tuple[tuple[str, float, frozenset[str]], ...]  # (name, local elements, gradient-sum axes)
    ext: tuple[ExternalGrad, ...]
    # per output: (layout, passthrough, split axes, layout its gradient is needed in)
    produced: tuple[tuple[Layout, bool, frozenset[str], Layout], ...]

    @property
    def time(self) -> float:
        return sum(self.terms.fwd.values()) + sum(self.terms.bwd.values())


@dataclass
class Pricer:
    """Prices on one cluster for one full mesh (pp, dp, cp, tp) and one micro-batch size."""

    cluster: Cluster
    mesh: Mesh
    dtype: str
    ctx: CostContext  # the graph's dataflow facts on `mesh`, batch-scaled to the micro-batch
    core: frozenset[Node] = frozenset()  # the nodes in attention cores (selective recomputation)

    def candidate(self, group: NodeGroup, cand: Candidate) -> CandCost:
        partitions = {n: cand.partitions[j] if j < len(cand.partitions) else None
                      for j, n in enumerate(group.members)}
        layouts = {e.value: e.required for e in cand.inputs}
        layouts.update({v: lay for v, lay in cand.outputs})
        ctx = self.ctx.with_overlay(partitions, layouts)
        terms = layer_terms(ctx, group.members, internal_only=True, core=self.core)
        params = tuple((name, numel, axes) for name, (_, numel, axes) in layer_params(ctx, group.members).items())
        ext = []
        for e in cand.inputs:
            if e.value.kind != "activation":
                continue
            node = group.members[e.member]
            local = ctx.local(node)
            saves = any(k == "in" and i == e.index for k, i in local.op.saved_for_backward(
                local.in_types, local.out_types, node.attrs))
            regather = None
            if saves:
                cost = node_compute_time(local.op, local.in_types, local.out_types, node.attrs, ctx.device, ctx.dtype,
                                         needs_grad=[v in ctx.needs_grad for v in node.inputs],
                                         scale=ctx.batch_scale, scaled_in=[v in ctx.batched for v in node.inputs],
                                         scaled_out=[v in ctx.batched for v in node.outputs])
                cost = repeated(cost, rotation_steps(partitions[node]))
                regather = (local.op.kind, cost.bwd_s)
            ext.append(ExternalGrad(e.member, e.index, e.value, e.required,
                                    gradient_contribution(ctx, node, e.index), regather))
        produced = []
        for node in group.members:
            part = partitions[node]
            split = frozenset(a for a, _ in part.spatial) if part else frozenset()
            through = feeds_only_parameters(node, ctx.needs_grad)
            made = ctx.local(node).out_layouts
            for k, v in enumerate(node.outputs):
                held = layouts.get(v, Layout())
                grad = gradient_layout(made[k], held) if part is not None and k < len(made) else held
                produced.append((held, through, split, grad))
        return CandCost(terms, params, tuple(ext), tuple(produced))

    def edge_forward(self, value: Value, have: Layout, ext: ExternalGrad) -> tuple[dict[str, float], dict[str, float]]:
        """Seconds by category of the forward redistribution, and of the backward re-gather of
        an input saved sharded but used gathered."""
        steps = input_steps(self.ctx, value, have, ext.required)
        regather: dict[str, float] = {}
        if ext.regather is not None:
            for step in steps:
                if step.kind == "all_gather":
                    for key, val in steps_time(self.ctx, [step]).items():
                        regather[key] = regather.get(key, 0.0) + regather_exposed(val, *ext.regather)
        return steps_time(self.ctx, steps), regather

    def edge_backward(self, value: Value, produced: tuple[Layout, bool, frozenset[str], Layout],
                      contributions: list[Layout]) -> dict[str, float]:
        """Seconds by category of bringing the consumers' gradients back to the producer."""
        _, through, split, layout = produced
        return steps_time(self.ctx, gradient_steps(self.ctx, value, contributions, layout, through, split))

    def p2p(self, nbytes: float) -> float:
        """One pipeline send of `nbytes` between neighbouring stages."""
        if self.mesh.axis_size(Axis.PP) <= 1 or nbytes <= 0:
            return 0.0
        return collective_time("send_recv", nbytes, ((neighbour_link(self.mesh, Axis.PP, self.cluster), 2),))

    def local_bytes(self, value: Value, layout: Layout) -> float:
        return self.ctx.local_bytes(value, layout)
