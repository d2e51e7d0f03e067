"""`solve{gbs=8,time-limit=30,seed=0,workers=1,memory-limit-gb=0,warm-start="",grid2d=false,dtype=bf16,schedules=true}`:
choose and write a plan into the IR.

Rule: runs the outer search (`shardc.search.outer.search`: grid baseline, then one CP-SAT
model per mesh shape and micro-batch size) on `ctx.cluster` for a global batch of `gbs`
sequences within a per-device memory limit (`memory-limit-gb`, 0: the device's usable memory,
its capacity less its headroom, `DeviceSpec.usable_memory_bytes`), then
writes the best plan into the graph (`annotate_graph`: mesh, partitions, layouts,
stage/recompute/ZeRO per layer). `warm-start` names a plan file from an earlier run (`shardc
plan -o`) whose assignment hints the solver; `grid2d` adds PrimePar's tp x tq meshes; `dtype`
is the training precision the plan is priced (and written) for (fp32: what CPU processes run);
`schedules=false` leaves torch's zero-bubble schedules out (Megatron's 1F1B and interleaved 1F1B
only); `wall-stop` is the multiple of the time limit after which an overloaded machine stops solving
(`inf`: never, so that the plan depends on the seed and worker count only). The
search result is left in `ctx.options["search"]`. Fails with a ShardcError when no plan fits.

Candidates an `enumerate-candidates` pass enumerated earlier in the pipeline (its table in
`ctx.options["candidates"]`, for this graph) are the solver's: it enumerates only the shapes and
micro-batches that table lacks, and leaves the completed table there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shardc.hardware import Cluster, with_overrides
from shardc.ir import Graph
from shardc.ir.diagnostics import ShardcError
from shardc.passmanager import Pass, PassContext, register_pass
from shardc.plan.file import PlanFile
from shardc.search.evaluate import Assignment
from shardc.search.outer import WALL_STOP, search
from shardc.search.planfile import annotate_graph, assignment_from_plan
from shardc.search.problem import GraphFacts, MeshShape, build_problem, graph_facts
from shardc.search.report import no_fit_error


def warm_hint(path: str, facts: GraphFacts, cluster: Cluster, gbs: int,
              dtype: str = "bf16") -> tuple[MeshShape, int, Assignment]:
    """The plan file at `path` mapped onto this graph: (mesh shape, micro-batch size, assignment)."""
    file = PlanFile.load(path)
    shape, mb = MeshShape.of(file.plan, file.tq), file.plan.mb
    return shape, mb, assignment_from_plan(file, build_problem(facts, cluster, shape, mb, gbs, dtype))


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
    warm_start: str = ""
    grid2d: bool = False
    dtype: str = "bf16"
    wall_stop: float = WALL_STOP
    schedules: bool = True

    def __post_init__(self) -> None:
        if self.time_limit <= 0:
            raise ShardcError(f"--time-limit must be positive, got {self.time_limit}", hint="e.g. --time-limit 30")
        if self.gbs < 1:
            raise ShardcError(f"--gbs must be a positive number of sequences, got {self.gbs}")

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        cluster = ctx.the_cluster(self.name)
        if self.memory_limit_gb:  # replaces the device's headroom, for the plans' estimates too
            cluster = with_overrides(cluster, memory_limit_bytes=int(self.memory_limit_gb * 2**30))
        limit = float(cluster.device.usable_memory_bytes)
        facts = graph_facts(graph, cluster, self.dtype, candidates=ctx.options.get("candidates"))
        ctx.options["candidates"] = facts.candidates
        warm = warm_hint(self.warm_start, facts, cluster, self.gbs, self.dtype) if self.warm_start else None
        result = search(facts, cluster, self.gbs, limit, self.time_limit, self.seed, self.workers, warm,
                        dtype=self.dtype, grid2d=self.grid2d, wall_stop=self.wall_stop, schedules=self.schedules)
        ctx.options["search"] = result
        ctx.options["memory_limit"] = limit
        if result.best is None:
            raise no_fit_error(result, limit)
        return annotate_graph(graph, result.best.problem, result.best.assignment)
