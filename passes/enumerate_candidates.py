"""`enumerate-candidates{dp=1,cp=1,tp=1,mb=1}`: annotate every node group with its candidate count.

Rule: nodes are grouped (elementwise and view ops merged into their producers, see
`shardc.analysis.groups`) and each group's partitions on the intra-stage mesh dp x cp x tp are
enumerated by `shardc.search.candidates.enumerate_group`. The pass only annotates: each
anchor gets `ann[candidates=N]`; ops without a rule get `ann[replicated=true]`. The solver
(`solve`) recomputes the candidates itself; this pass is for inspection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardc.analysis.groups import build_groups
from shardc.analysis.roles import dim_roles
from shardc.ir import Graph
from shardc.ops.registry import has_op
from shardc.passmanager import Pass, PassContext, register_pass
from shardc.search.candidates import Shapes, enumerate_group
from shardc.search.problem import MeshShape


def enumerate_candidates(graph: Graph, shape: MeshShape) -> Graph:
    """Annotate anchors with their candidate counts (in place; returns the graph)."""
    roles = dim_roles(graph)
    for group in build_groups(graph):
        cands = enumerate_group(group, shape.intra(), Shapes(roles))
        group.anchor.annotations["candidates"] = len(cands)
        if not has_op(group.anchor.op):
            group.anchor.annotations["replicated"] = True
    return graph


@register_pass
@dataclass(frozen=True)
class EnumerateCandidates(Pass):
    """`enumerate-candidates`: see the module docstring."""

    name: ClassVar[str] = "enumerate-candidates"
    dp: int = 1
    cp: int = 1
    tp: int = 1

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        return enumerate_candidates(graph, MeshShape(1, self.dp, self.cp, self.tp))
