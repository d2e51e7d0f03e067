"""Steps 3 and 4 of the driver: a pipeline string run over the registered passes (`run`, with
each command's default in `PIPELINES`), and the commands' roads through it: `partition`,
`estimate`, `solve`, and a plan file written into the graph (`plan_file_graph`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from shardc.driver.batch import solver_batch, trace_for
from shardc.driver.source import Source, open_model
from shardc.hardware import Cluster, parse_cluster
from shardc.ir import Graph
from shardc.ir.diagnostics import ShardcError
from shardc.passmanager import Pass, PassContext, parse_pipeline, run_pipeline

if TYPE_CHECKING:  # both load torch (the registry); `shardc --help` should not wait for it
    from shardc.frontend import TraceResult
    from shardc.plan.file import PlanFile
    from shardc.plan.parallel import ParallelPlan


PIPELINES: dict[str, str] = {
    "inspect": "group-layers,annotate-cost",
    "partition": "group-layers,validate-plan,apply-plan",
    "estimate": "group-layers,validate-plan,apply-plan,estimate",
    "compile": "group-layers,validate-plan,apply-plan,lower",
    # what comes before `estimate` partitions the graph that is both predicted and run
    "study": "group-layers,validate-plan,apply-plan,estimate",
}


@dataclass(frozen=True, slots=True)
class Flags:
    """How a pipeline runs: `pipeline` replaces the command's default; the IR is printed after
    every pass and each pass timed on `out` (stdout when None)."""

    pipeline: str | None = None
    print_after_all: bool = False
    time_passes: bool = False
    out: TextIO | None = None


def run(graph: Graph, pipeline: str | list[Pass], ctx: PassContext, flags: Flags = Flags(), *,
        allow_uneven: bool = True) -> Graph:
    """Run `pipeline` over `graph` (verifying after every pass), as `flags` ask. Shards split
    unevenly are allowed (apply-plan pads the vocabulary on tp, and the cost model prices the
    padded shard) unless `allow_uneven` is False, as compiling for the backend asks."""
    return run_pipeline(graph, pipeline, ctx, print_after_all=flags.print_after_all,
                        time_passes=flags.time_passes, out=flags.out, allow_uneven=allow_uneven)


def load(spec: str, *, batch: int | None = None, pipeline: str = "group-layers", device: str = "meta",
         flags: Flags = Flags()) -> Graph:
    """The model `spec` names traced at `batch` (None: its example batch) after `pipeline`."""
    return run(open_model(spec, device=device).trace(batch).graph, pipeline, PassContext(), flags)


def as_cluster(cluster: str | Cluster | None) -> Cluster | None:
    """A cluster from its text (`8xA100-80GB`, `local2`); None stays None. A `local` cluster on
    a machine never calibrated is measured once first (`shardc calibrate` redoes it), so every
    command predicts for this machine out of the box."""
    if not isinstance(cluster, str):
        return cluster
    from shardc.calibration.local import load_profile  # the cached profile, measured when there is none

    return parse_cluster(cluster, local_profile=load_profile)


def as_plan(plan: str | ParallelPlan | None) -> ParallelPlan | None:
    """`ParallelPlan.of(plan)`; None stays None."""
    from shardc.plan.parallel import ParallelPlan

    return None if plan is None else ParallelPlan.of(plan)


PLAN_FILE_SUFFIXES = (".plan", ".json")


def plan_file_of(plan: Any) -> PlanFile | None:
    """The plan file `plan` names, loaded: a `PlanFile`, a `Path`, or text that is a file's path
    (it ends in .plan or .json, or names an existing file; plan text is `key=value` pairs and
    names no file). None for any other plan. A named file that is missing is a ShardcError."""
    from shardc.plan.file import PlanFile

    if isinstance(plan, PlanFile):
        return plan
    if isinstance(plan, os.PathLike) or (isinstance(plan, str) and (
            plan.endswith(PLAN_FILE_SUFFIXES) or ("=" not in plan and Path(plan).is_file()))):
        return PlanFile.load(plan)
    return None


def plan_file_graph(source: Source, cluster: str | Cluster | None, file: PlanFile, *,
                    flags: Flags = Flags()) -> tuple[TraceResult, Graph]:
    """(the trace, the partitioned graph) of plan file `file` on `source`: traced at the batch
    the solver traced at, layers grouped, and partitioned as the file says
    (`shardc.search.planfile.partitioned_graph`). The partitions are labels on the file's own
    mesh: `cluster` (else the one the file records) only prices the solver's problem, and must
    have the plan's device count. A file of another model is a ShardcError naming the file."""
    from shardc.search.planfile import partitioned_graph

    resolved = as_cluster(cluster if cluster is not None else file.cluster)
    if resolved is None:
        raise ShardcError(f"plan file {file.path} records no cluster", hint="give --cluster (the one it was planned on)")
    if resolved.num_devices != file.plan.devices:
        raise ShardcError(f"plan file {file.path} is a plan for {file.plan.devices} devices ({file.plan}), but cluster "
                          f"{resolved} has {resolved.num_devices}",
                          hint=f"use a cluster (or --nproc) of {file.plan.devices} devices, or plan again for this one")
    batch = solver_batch(int(file.plan.global_batch()))
    traced = source.trace(batch if source.resizable and batch != source.batch else None)
    graph = run(traced.graph, "group-layers", PassContext(cluster=resolved), flags)
    return traced, partitioned_graph(graph, resolved, file)


def _traced(source: Source | str, cluster: str | Cluster | None,
            plan: str | ParallelPlan | PlanFile | os.PathLike[str] | None, flags: Flags = Flags(),
            ) -> tuple[Graph, PassContext, bool]:
    """`source` traced at the batch `plan` needs, the pass context holding the cluster and the
    plan (None when there is none), and whether the graph is partitioned already (a plan file)."""
    source = open_model(source) if isinstance(source, str) else source
    file = plan_file_of(plan)
    if file is not None:
        graph = plan_file_graph(source, cluster, file, flags=flags)[1]
        return graph, PassContext(cluster=as_cluster(cluster) if cluster is not None else None), True
    parsed = as_plan(plan)  # type: ignore[arg-type]  # a PathLike is a plan file, handled above
    return trace_for(source, parsed).graph, PassContext(cluster=as_cluster(cluster), plan=parsed), False


def partition(source: Source | str, cluster: str | Cluster | None,
              plan: str | ParallelPlan | PlanFile | os.PathLike[str], *,
              flags: Flags = Flags(), pipeline: str | None = None) -> tuple[Graph, PassContext]:
    """Trace at the plan's batch and run `group-layers,validate-plan,apply-plan` (or `pipeline`);
    a plan file is written into the graph instead (`plan_file_graph`) and `pipeline` runs after."""
    graph, ctx, partitioned = _traced(source, cluster, plan, flags)
    if partitioned:
        text = pipeline or flags.pipeline
        return (run(graph, text, ctx, flags) if text else graph), ctx
    return run(graph, pipeline or flags.pipeline or PIPELINES["partition"], ctx, flags), ctx


def estimate(source: Source | str, cluster: str | Cluster,
             plan: str | ParallelPlan | PlanFile | os.PathLike[str] | None, *,
             flags: Flags = Flags(), pipeline: str | None = None) -> tuple[Any, Graph]:
    """(the Estimate, the partitioned graph) of `plan` on `cluster`: the `estimate` pipeline. A
    printed IR that is already partitioned (`shardc plan -o`'s `.ir`) and a plan file's graph
    (`plan_file_graph`) are only estimated."""
    graph, ctx, partitioned = _traced(source, cluster, plan, flags)
    if partitioned and pipeline is None and flags.pipeline is None:
        pipeline = "estimate"
    if pipeline is None and flags.pipeline is None and ctx.plan is None:
        if graph.mesh is None:
            raise ShardcError(f"graph @{graph.name} is not partitioned; give a --plan",
                              hint="e.g. --plan dp=2, or a partitioned IR file written by `shardc plan -o`")
        pipeline = "estimate"
    graph = run(graph, pipeline or flags.pipeline or PIPELINES["estimate"], ctx, flags)
    if "estimate" not in ctx.options:
        raise ShardcError("the pipeline left no estimate; end it with the estimate pass",
                          hint=PIPELINES["estimate"])
    return ctx.options["estimate"], graph


def solve_pipeline(gbs: int, *, time_limit: float = 30.0, seed: int = 0, workers: int = 1,
                   memory_limit_gb: float | None = None, warm_start: str | None = None,
                   grid2d: bool = False, dtype: str = "bf16", wall_stop: float | None = None,
                   schedules: bool = True) -> str:
    """`shardc plan`'s default pipeline: `group-layers,solve{...}` with the command's options
    (`wall_stop`: the solve pass's `wall-stop`, None its default; `schedules=False`: Megatron's
    schedules only)."""
    from shardc.passes.solve import Solve

    more: dict[str, Any] = {} if wall_stop is None else {"wall_stop": wall_stop}
    if not schedules:
        more["schedules"] = False
    solve = Solve(gbs=gbs, time_limit=time_limit, seed=seed, workers=workers,
                  memory_limit_gb=memory_limit_gb or 0.0, warm_start=warm_start or "", grid2d=grid2d, dtype=dtype,
                  **more)
    return f"group-layers,{solve}"


def solve(source: Source | str, cluster: str | Cluster, gbs: int, *, flags: Flags = Flags(),
          pipeline: str | None = None, **options: Any) -> tuple[Graph, PassContext]:
    """Trace at the global batch (`solver_batch`) and run the `solve` pipeline; the search
    result is `ctx.options["search"]`. `options` are `solve_pipeline`'s."""
    if gbs < 1:
        raise ShardcError(f"--gbs must be a positive number of sequences, got {gbs}")
    source = open_model(source) if isinstance(source, str) else source
    ctx = PassContext(cluster=as_cluster(cluster))
    graph = source.trace(solver_batch(gbs) if source.resizable else None).graph
    text = pipeline or flags.pipeline or solve_pipeline(gbs, **options)
    graph = run(graph, text, ctx, flags)
    if "search" not in ctx.options:
        raise ShardcError("the pipeline left no search result; it needs the solve pass", hint=text)
    return graph, ctx


def split_at_lower(pipeline: str) -> tuple[list[Pass], list[Pass]]:
    """The compile pipeline cut before its last `lower` pass (hand-written partitions go between)."""
    return split_before(pipeline, "lower", "compile")


def split_before(pipeline: str, name: str, command: str) -> tuple[list[Pass], list[Pass]]:
    """`pipeline` cut before its last `name` pass; a ShardcError naming `command`'s default
    pipeline when it has none."""
    passes = parse_pipeline(pipeline)
    at = max((i for i, p in enumerate(passes) if p.name == name), default=None)
    if at is None:
        raise ShardcError(f"a {command} pipeline ends with the {name} pass; {pipeline!r} has none",
                          hint=PIPELINES[command])
    return passes[:at], passes[at:]
