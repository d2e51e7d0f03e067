"""The study's side of the analytical model: the cluster, and one plan's partitioned graph and figures.

A study plan goes through the driver as `shardc estimate` takes a plan: traced at the batch the
plan needs, then the study pipeline (`driver.PIPELINES["study"]`, or `--pipeline`) cut before
its `estimate` pass. The passes before it partition the graph (group-layers, validate-plan,
apply-plan); the study plan's stage split is written into the layer annotations; that one
graph is what the cost model scores (the `estimate` pass onward, DDP's bucket size as its
`bucket-mb` option) and what the sweep lowers and runs. Nothing is fitted per plan.

The cluster: `local_cluster(n)`, the calibrated `local` profile for n processes on this
machine (`shardc calibrate`); on GPUs the sweep takes `calibration.gpu.gpu_study_cluster`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shardc import driver
from shardc.driver import Flags, Source
from shardc.ir import Axis, Graph
from shardc.passes.estimate import Estimate
from shardc.passmanager import Pass, PassContext
from shardc.study.plans import StudyPlan


def study_cluster(nproc: int, *, profile: Any = None, memory_limit_bytes: int | None = None) -> Any:
    """This machine's `local` cluster for `nproc` processes (`profile`: a LocalProfile in place
    of the cached one), its memory per process replaced by `memory_limit_bytes` when given."""
    from shardc.hardware import local_cluster, with_overrides

    cluster = local_cluster(nproc, profile)
    if memory_limit_bytes is not None:
        cluster = with_overrides(cluster, memory_bytes=int(memory_limit_bytes))
    return cluster


def study_pipeline(flags: Flags | None) -> tuple[list[Pass], list[Pass]]:
    """The study's pipeline (`flags.pipeline`, else `PIPELINES["study"]`) cut before its last
    `estimate` pass: (the passes that partition, the passes that score). A ShardcError when it
    does not parse or has no estimate pass."""
    pipeline = flags.pipeline if flags is not None else None
    return driver.split_before(pipeline or driver.PIPELINES["study"], "estimate", "study")


def stage_split(graph: Any, split: tuple[int, ...] | None, stages: int) -> dict[str, int]:
    """Module path of each repeated block -> stage. With `split`, blocks are dealt out by it
    (`shardc.analysis.stages.layer_stages`) and the graph's layer annotations rewritten to match;
    without, the stages apply-plan chose."""
    from shardc.analysis.stages import layer_stages

    if split is not None:
        for name, stage in layer_stages(graph, stages, split).items():
            if name in graph.layers:
                graph.layers[name].annotation = replace(graph.layers[name].annotation, stage=stage)
    return block_stages(graph)


def block_stages(graph: Graph) -> dict[str, int]:
    """Module path of each repeated block -> the stage its layer annotation names."""
    from shardc.analysis.stages import layering

    return {n: graph.layers[n].annotation.stage or 0 for n in layering(graph).block_names}


def partition(source: Source, sp: StudyPlan, cluster: Any, flags: Flags | None = None) -> tuple[Graph, PassContext]:
    """`source` traced at the batch `sp` needs and partitioned by the study pipeline's passes
    before `estimate`, with `sp.split` dealt into the stages: the graph predicted and run. A
    plan file's plan (`sp.file`) is written into the graph as the file says instead
    (`driver.plan_file_graph`, as `shardc run --plan FILE` does)."""
    if sp.file is not None:
        from shardc.plan.file import PlanFile

        ctx = PassContext(cluster=driver.as_cluster(cluster))
        return driver.plan_file_graph(source, ctx.cluster, PlanFile.load(sp.file), flags=flags or Flags())[1], ctx
    passes, _ = study_pipeline(flags)
    ctx = PassContext(cluster=driver.as_cluster(cluster), plan=sp.plan)
    graph = driver.run(driver.trace_for(source, sp.plan).graph, passes, ctx, flags or Flags())
    stage_split(graph, sp.split, sp.plan.stages)
    return graph, ctx


def score(graph: Graph, sp: StudyPlan, cluster: Any, flags: Flags | None = None) -> tuple[Any, dict[str, Any]]:
    """(the Estimate, a JSON-ready dict of the predicted figures per rank) of the partitioned
    `graph` on `cluster`: the study pipeline from its `estimate` pass (which leaves the graph as
    it is), with `sp.bucket_mb` as the pass's bucket size."""
    _, passes = study_pipeline(flags)
    if sp.bucket_mb is not None:
        passes = [replace(p, bucket_mb=sp.bucket_mb) if isinstance(p, Estimate) else p for p in passes]
    ctx = PassContext(cluster=driver.as_cluster(cluster), plan=None if sp.file else sp.plan)
    driver.run(graph, passes, ctx, flags or Flags())
    return ctx.options["estimate"], figures(ctx.options["estimate"], graph, sp)


def predict(model_spec: str, sp: StudyPlan, cluster: Any, flags: Flags | None = None) -> tuple[Any, dict[str, Any]]:
    """`score` of the graph `partition` makes of `model_spec` (built on the meta device)."""
    graph, _ = partition(driver.open_model(model_spec), sp, cluster, flags)
    return score(graph, sp, cluster, flags)


def figures(est: Any, graph: Graph, sp: StudyPlan) -> dict[str, Any]:
    """The Estimate `est` of `graph` as the study records it: per rank (its stage's memory and
    time) and per stage."""
    mesh = graph.mesh
    ranks = []
    for r in range(sp.plan.devices):
        coords = mesh.coordinates(r) if mesh is not None else {}
        stage = est.stages[coords.get(Axis.PP, 0) % len(est.stages)]
        ranks.append({"rank": r, "stage": stage.stage, "peak_memory_bytes": stage.memory_bytes,
                      "memory": dict(stage.memory), "time": dict(stage.time)})
    return {"step_time_s": est.step_time_s, "fits": est.fits, "overflow": est.overflow,
            "micro_batches": est.micro_batches, "bubble_fraction": est.bubble_fraction,
            "memory_capacity_bytes": est.memory_capacity_bytes, "ranks": ranks,
            "time_breakdown": est.time_breakdown(), "stage_of": block_stages(graph),
            "mesh_axes": list(mesh.axes) if mesh is not None else [],
            "stages": [{"stage": s.stage, "layers": list(s.layers), "memory_bytes": s.memory_bytes,
                        "memory": dict(s.memory), "in_flight": s.in_flight} for s in est.stages]}


def validation_problem(source: Source, sp: StudyPlan, cluster: Any, grouped: dict[int | None, Graph]) -> str | None:
    """Why the `validate-plan` pass refuses `sp` for `source` on `cluster` (its ShardcError's
    message), or None when it accepts it. `grouped` caches the layer-grouped graph per traced
    batch. The rules are the pass's own (`passes.validate_plan.check_plan`), not copied here."""
    from shardc.ir.diagnostics import ShardcError
    from shardc.passes.validate_plan import check_plan

    resolved = driver.as_cluster(cluster)
    key = driver.batch_for(sp.plan, source.batch) if source.resizable else None
    if key not in grouped:
        grouped[key] = driver.run(driver.trace_for(source, sp.plan).graph, "group-layers",
                                  PassContext(cluster=resolved), Flags())
    try:
        check_plan(grouped[key], sp.plan, getattr(resolved, "num_devices", None))
    except ShardcError as err:
        return str(err)
    return None


def model_layers(source: Source) -> int:
    """How many repeated blocks `group-layers` finds in `source`."""
    from shardc.analysis.stages import layering

    return layering(driver.run(source.trace().graph, "group-layers", PassContext(), Flags())).count


def solver_plan_file(source: Source, cluster: Any, gbs: int, path: Any, time_limit: float = 20.0) -> str:
    """`shardc plan` on `cluster` for `source` at global batch `gbs` in fp32 (the study's dtype),
    its plan written to `path` (`search.report.write_plan`); returns the study plan text
    `plan_file=PATH` that runs it."""
    from shardc.search.report import write_plan

    graph, ctx = driver.solve(source, cluster, gbs, time_limit=time_limit, dtype="fp32")
    write_plan(str(path), graph, ctx.options["search"].best, gbs)
    return f"plan_file={path}"
