"""`enumerate-candidates{dp=1,cp=1,tp=1,tq=1,mb=1}`: enumerate every node group's candidate
partitions for one mesh shape, keep them for the solver, and annotate the counts.

Rule: nodes are grouped (elementwise and view ops merged into their producers, see
`shardc.analysis.groups`) and each group's partitions on the intra-stage mesh dp x cp x tp
(x tq), every data-parallel replica holding `mb` sequences, are enumerated by
`shardc.search.candidates.enumerate_group`, exactly as the solver enumerates that shape: on
its `pricing_shape`, with rotations and chunks. The candidates go into the graph's
`CandidateTable` (`shardc.search.table`), left in `ctx.options["candidates"]` (an earlier
table for the same graph is extended); a `solve` pass later in the pipeline reads them from
there and enumerates only the shapes and micro-batches this pass did not. Each anchor gets
`ann[candidates=N]`; ops without a rule get `ann[replicated=true]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardc.analysis.groups import build_groups
from shardc.ir import Graph
from shardc.ops.registry import has_op
from shardc.passmanager import Pass, PassContext, register_pass
from shardc.search.problem import MeshShape, pricing_shape
from shardc.search.table import CandidateTable


def enumerate_candidates(graph: Graph, shape: MeshShape, mb: int = 1,
                         table: CandidateTable | None = None) -> CandidateTable:
    """Enumerate the candidates of every group of `graph` on `shape` at micro-batch `mb` into
    `table` (a fresh one unless it was made for this graph) and annotate the anchors with
    their counts (in place). Returns the table."""
    if table is None or not table.fits(graph):
        table = CandidateTable.of(graph)
    priced = pricing_shape(table, shape)
    for group in build_groups(graph):
        group.anchor.annotations["candidates"] = len(table.candidates(group, priced.intra(), priced.dp, mb))
        if not has_op(group.anchor.op):
            group.anchor.annotations["replicated"] = True
    return table


@register_pass
@dataclass(frozen=True)
class EnumerateCandidates(Pass):
    """`enumerate-candidates`: see the module docstring."""

    name: ClassVar[str] = "enumerate-candidates"
    dp: int = 1
    cp: int = 1
    tp: int = 1
    tq: int = 1
    mb: int = 1

    def __post_init__(self) -> None:
        if min(self.dp, self.cp, self.tp, self.tq, self.mb) < 1:
            raise ValueError(f"enumerate-candidates needs positive degrees and micro-batch, got {self}")

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        shape = MeshShape(1, self.dp, self.cp, self.tp, self.tq)
        ctx.options["candidates"] = enumerate_candidates(graph, shape, self.mb, ctx.options.get("candidates"))
        return graph
