"""Op coverage: which calls the registry has no entry of its own for, how often and where.

Printed before any solving, so a user sees at once which ops run as torch's aten ops with
torch's own sharding rules (`aten` fallback nodes, `shardc.ops.fallback`), which of those torch
cannot shard (they stay replicated), and which calls were kept opaque (`allow_opaque`:
replicated, and free in the cost model).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.ir import Graph
from shardc.ops.registry import get_op


@dataclass(frozen=True, slots=True)
class OpaqueOp:
    """One torch target without a registry entry: how many nodes and in which modules; for aten
    fallback nodes, whether torch's strategies split any of them (`sharded`)."""

    target: str
    count: int
    module_paths: tuple[str, ...]
    sharded: bool = False


def _paths(op: OpaqueOp) -> str:
    paths = ", ".join(p or "<root>" for p in op.module_paths[:5])
    return paths + (f" and {len(op.module_paths) - 5} more" if len(op.module_paths) > 5 else "")


@dataclass(frozen=True, slots=True)
class CoverageReport:
    graph: str
    nodes: int
    opaque: tuple[OpaqueOp, ...]
    fallback: tuple[OpaqueOp, ...] = ()

    @property
    def opaque_count(self) -> int:
        return sum(op.count for op in self.opaque)

    @property
    def replicated(self) -> tuple[OpaqueOp, ...]:
        """Fallback ops torch's sharding propagation cannot split: they stay replicated."""
        return tuple(op for op in self.fallback if not op.sharded)

    @property
    def complete(self) -> bool:
        """Every node is a registry op of its own (no fallback, nothing opaque)."""
        return not self.opaque and not self.fallback

    def __str__(self) -> str:
        if self.complete:
            return f"op coverage of @{self.graph}: all {self.nodes} nodes are registry ops"
        lines = []
        if self.fallback:
            count = sum(op.count for op in self.fallback)
            lines.append(f"op coverage of @{self.graph}: {count} of {self.nodes} nodes run as aten ops with "
                         "torch's DTensor sharding rules (no registry entry of their own)")
            lines += [f"  {op.target} x{op.count} in {_paths(op)}" for op in self.fallback if op.sharded]
            if self.replicated:
                lines.append("  torch cannot shard these; they stay replicated:")
                lines += [f"    {op.target} x{op.count} in {_paths(op)}" for op in self.replicated]
        if self.opaque:
            lines.append(f"op coverage of @{self.graph}: {self.opaque_count} of {self.nodes} nodes are opaque "
                         "(no registry rule; they stay replicated and cost nothing in the model)")
            lines += [f"  {op.target} x{op.count} in {_paths(op)}" for op in self.opaque]
        return "\n".join(lines)


def coverage(graph: Graph) -> CoverageReport:
    """The opaque and aten fallback nodes of a graph grouped by torch target, in first-appearance
    order; a fallback target is `sharded` when torch's strategies split some node of it."""
    found: dict[tuple[str, str], list[str]] = {}
    sharded: set[str] = set()
    for node in graph.nodes:
        if node.op not in ("opaque", "aten"):
            continue
        target = str(node.attrs.get("target", "?"))
        found.setdefault((node.op, target), []).append(node.location.module_path)
        if node.op == "aten" and target not in sharded:
            space = get_op("aten").iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs],
                                                   node.attrs)
            if space.splittable():
                sharded.add(target)
    rows = {kind: tuple(OpaqueOp(t, len(paths), tuple(dict.fromkeys(paths)), t in sharded)
                        for (k, t), paths in found.items() if k == kind) for kind in ("opaque", "aten")}
    return CoverageReport(graph.name, len(graph.nodes), rows["opaque"], rows["aten"])
