"""The candidates of one graph's node groups, enumerated once per graph and key.

Rule: a group's candidates depend on its members, the intra-stage mesh, the micro-batch the
traced batch stands for (`shardc.analysis.dims.batch_scale`: batch dims are scaled before
divisibility is checked) and the rotate/chunk switches; nothing else (no cluster, no prices).
So whoever needs them first enumerates them and everyone after reads them: the
`enumerate-candidates` pass fills a table and leaves it in `ctx.options["candidates"]`, the
`solve` pass hands that table to the solver (`GraphFacts.candidates`), whose `build_problem`
enumerates only the keys the table lacks. A table belongs to one graph as it was when the table
was made; a graph rewritten since (other nodes) gets a fresh one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.analysis.dims import batch_scale
from shardc.analysis.groups import NodeGroup
from shardc.analysis.roles import Roles, dim_roles
from shardc.ir import Graph, Mesh, Node
from shardc.search.candidates import Shapes, enumerate_group
from shardc.search.follow import Candidate

Key = tuple[tuple[Node, ...], Mesh, float, bool, bool]


@dataclass
class CandidateTable:
    """Candidates by (group members, intra-stage mesh, batch scale, rotate, chunk) for `graph`;
    `batch` is the traced batch (dim 0 of the graph inputs whose dim 0 is the batch; 1 if none)."""

    graph: Graph
    roles: Roles
    batch: int
    nodes: tuple[Node, ...]
    found: dict[Key, list[Candidate]] = field(default_factory=dict)

    @classmethod
    def of(cls, graph: Graph, roles: Roles | None = None) -> CandidateTable:
        """An empty table for `graph` (its dim roles, `dim_roles`, unless given)."""
        roles = dim_roles(graph) if roles is None else roles
        batch = next((v.type.shape[0] for v in graph.inputs if roles.get(v, (None,))[0] == "batch"), 1)
        return cls(graph, roles, batch, tuple(graph.nodes))

    def fits(self, graph: Graph) -> bool:
        """Whether the table was made for `graph` as it is now (the same nodes)."""
        return self.graph is graph and self.nodes == tuple(graph.nodes)

    def candidates(self, group: NodeGroup, mesh: Mesh, replicas: int, mb: int, rotate: bool = True,
                   chunk: bool = True) -> list[Candidate]:
        """The candidates of `group` on the intra-stage `mesh`, its `replicas` data-parallel
        replicas holding `mb` sequences each (`enumerate_group`), enumerated on first request."""
        scale = batch_scale(self.batch, mb, replicas).global_factor
        key = (tuple(group.members), mesh, scale, rotate, chunk)
        found = self.found.get(key)
        if found is None:
            found = self.found[key] = enumerate_group(group, mesh, Shapes(self.roles, scale), rotate, chunk)
        return found
