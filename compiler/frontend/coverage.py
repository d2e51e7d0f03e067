"""Op coverage: which torch calls the frontend kept as opaque nodes, how often and where.

Printed before any solving, so a user sees at once which ops stay replicated because the
registry has no rule for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.ir import Graph


@dataclass(frozen=True, slots=True)
class OpaqueOp:
    """One torch target kept opaque: how many nodes and in which modules."""

    target: str
    count: int
    module_paths: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CoverageReport:
    graph: str
    nodes: int
    opaque: tuple[OpaqueOp, ...]

    @property
    def opaque_count(self) -> int:
        return sum(op.count for op in self.opaque)

    @property
    def complete(self) -> bool:
        return not self.opaque

    def __str__(self) -> str:
        if self.complete:
            return f"op coverage of @{self.graph}: all {self.nodes} nodes are registry ops"
        lines = [f"op coverage of @{self.graph}: {self.opaque_count} of {self.nodes} nodes are opaque "
                 "(no registry rule; they stay replicated and cost nothing in the model)"]
        for op in self.opaque:
            paths = ", ".join(p or "<root>" for p in op.module_paths[:5])
            more = f" and {len(op.module_paths) - 5} more" if len(op.module_paths) > 5 else ""
            lines.append(f"  {op.target} x{op.count} in {paths}{more}")
        return "\n".join(lines)


def coverage(graph: Graph) -> CoverageReport:
    """The opaque nodes of a graph grouped by torch target, in first-appearance order."""
    found: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.op == "opaque":
            found.setdefault(str(node.attrs.get("target", "?")), []).append(node.location.module_path)
    rows = tuple(OpaqueOp(t, len(paths), tuple(dict.fromkeys(paths))) for t, paths in found.items())
    return CoverageReport(graph.name, len(graph.nodes), rows)
