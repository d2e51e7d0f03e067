"""The study's side of the analytical model: the cluster, and one plan's predicted figures.

Predictions are the cost model's own, through the driver as `shardc estimate` makes them: the
`partition` pipeline (group-layers, validate-plan, apply-plan), the study plan's stage split
written into the layer annotations when it gives one, then the `estimate` pass (DDP's bucket
size as its `bucket-mb` option); nothing is fitted per plan.

The cluster: `local_cluster(n)`, the calibrated `local` profile for n processes on this
machine (`shardc calibrate`), or on GPUs `NxPRESET` for the detected device.
"""

from __future__ import annotations

from typing import Any

from shardc.ir.diagnostics import ShardcError
from shardc.study.plans import StudyPlan


def study_cluster(nproc: int, device: str = "cpu", *, profile: Any = None, memory_limit_bytes: int | None = None):
    """The cluster predictions are made for (see the module doc)."""
    from shardc.hardware import with_overrides

    if device == "cuda":
        cluster = gpu_cluster(nproc)
    else:
        from shardc.hardware import local_cluster

        cluster = local_cluster(nproc, profile)
    if memory_limit_bytes is not None:
        cluster = with_overrides(cluster, memory_bytes=int(memory_limit_bytes))
    return cluster


def gpu_cluster(nproc: int):
    """`{nproc}x<preset>` for the local GPU model (H100, H200, A100, V100 by name)."""
    import torch

    from shardc.hardware import make_cluster

    if not torch.cuda.is_available():
        raise ShardcError("--device cuda: no CUDA device is visible", hint="use --device cpu")
    name = torch.cuda.get_device_name(0).upper()
    for key, preset in (("H200", "H200"), ("H100", "H100-SXM"), ("A100", "A100-80GB"), ("V100", "V100-32GB")):
        if key in name:
            return make_cluster(preset, 1, nproc)
    raise ShardcError(f"no preset for GPU {name!r}; known: H200, H100, A100, V100")


def stage_split(graph: Any, split: tuple[int, ...] | None, stages: int) -> dict[str, int]:
    """Module path of each repeated block -> stage. With `split`, blocks are dealt out by it
    (`shardc.analysis.stages.layer_stages`) and the graph's layer annotations rewritten to match;
    without, the stages apply-plan chose."""
    from dataclasses import replace

    from shardc.analysis.stages import layer_stages, layering

    if split is not None:
        for name, stage in layer_stages(graph, stages, split).items():
            if name in graph.layers:
                graph.layers[name].annotation = replace(graph.layers[name].annotation, stage=stage)
    return {n: graph.layers[n].annotation.stage or 0 for n in layering(graph).block_names}


def predict(model_spec: str, sp: StudyPlan, cluster: Any) -> tuple[Any, dict[str, Any]]:
    """(the Estimate, a JSON-ready dict of the predicted figures per rank) for one study plan."""
    from shardc import driver

    plan = sp.plan
    graph, ctx = driver.partition(model_spec, cluster, plan)
    stage_of = stage_split(graph, sp.split, plan.stages)
    driver.run(graph, "estimate" if sp.bucket_mb is None else f"estimate{{bucket-mb={sp.bucket_mb}}}", ctx)
    est = ctx.options["estimate"]
    mesh = graph.mesh
    ranks = []
    for r in range(plan.devices):
        coords = mesh.coordinates(r) if mesh is not None else {}
        stage = est.stages[coords.get("pp", 0) % len(est.stages)]
        ranks.append({"rank": r, "stage": stage.stage, "peak_memory_bytes": stage.memory_bytes,
                      "memory": dict(stage.memory), "time": dict(stage.time)})
    data = {"step_time_s": est.step_time_s, "fits": est.fits, "overflow": est.overflow,
            "micro_batches": est.micro_batches, "bubble_fraction": est.bubble_fraction,
            "memory_capacity_bytes": est.memory_capacity_bytes, "ranks": ranks,
            "time_breakdown": est.time_breakdown(), "stage_of": stage_of,
            "mesh_axes": list(mesh.axes) if mesh is not None else [],
            "stages": [{"stage": s.stage, "layers": list(s.layers), "memory_bytes": s.memory_bytes,
                        "memory": dict(s.memory), "in_flight": s.in_flight} for s in est.stages]}
    return est, data
