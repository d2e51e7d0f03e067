"""What every rank runs: a list of study jobs in one process group, each result written as it ends.

A job is a plan or the all_reduce-by-size benchmark. A plan runs as `shardc run` trains it
(`runtime="shardc"`): compiled by the parent for the global batch, `plan.parallelize(model)`
here and `module.step(*batch)` per step (pipelines for pp > 1, gradient accumulation over
micro-batches for pp = 1, any mix of dp/tp/pp/zero/recompute). Two study-only keys keep the
older paths: `split=3+1` (unbalanced stages, cut here by `backends/torch/pipeline.PipelineRunner`,
pp with dp only) and `bucket_mb` (plain DDP with its bucket size set, micro-batches accumulated
here under `no_sync`). For a plan: warm-up steps, then
`steps` timed steps (each started together after a barrier), one step under torch.profiler
and one step under the memory tracker (`shardc.study.measure`). Each rank writes its result
to `<work>/<job id>.rank<r>.json` atomically; a rank that fails writes its error there and
re-raises, so `launch.spawn` stops the whole group and the parent records the error and goes
on with the next job in a fresh group.

The training step is forward and backward (`module.step`, or the older paths' own loop),
AdamW `step()`, `zero_grad(set_to_none=False)` (gradients stay allocated between steps, as
Megatron's gradient buffers do, so the peak holds them); timing and the memory tracker wrap
that whole step the same way on every path.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardc.diagnostics import ShardcError
from shardc.study.measure import ddp_bucket_bytes, profile_events, track_memory

MARKER = "shardc.study.step"


def write_atomic(path: Path, data: Any) -> None:
    """JSON written to a temporary sibling, then renamed: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def run_jobs(rank: int, world: int, jobs: list[dict[str, Any]], work: str) -> int:
    """Entry point for `launch.spawn`: run `jobs` in order; returns how many finished."""
    torch.set_num_threads(1)
    done = 0
    for job in jobs:
        path = Path(work) / f"{job['id']}.rank{rank}.json"
        try:
            if job["kind"] == "allreduce_sizes":
                result = allreduce_sizes(rank, world, job)
            else:
                result = run_plan(rank, world, job)
        except BaseException as err:
            write_atomic(path, {"rank": rank, "error": f"{type(err).__name__}: {err}",
                                "traceback": traceback.format_exc()[-4000:]})
            raise
        write_atomic(path, {"rank": rank, **result})
        done += 1
        dist.barrier()
    return done


# ---- the all_reduce benchmark -----------------------------------------------------------------

def allreduce_sizes(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Seconds per fp32 all_reduce of each size (median of 3 trials, slowest rank per trial)."""
    points = []
    for nbytes in job["sizes"]:
        x = torch.ones(max(1, nbytes // 4))
        dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        reps = int(max(2, min(40, job.get("budget_s", 0.1) / max(probe.item(), 1e-6))))
        trials = torch.zeros(3, dtype=torch.float64)
        for i in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(x)
            trials[i] = (time.perf_counter() - t0) / reps
        dist.all_reduce(trials, op=dist.ReduceOp.MAX)
        points.append((x.numel() * 4, float(trials.median())))
    return {"points": points}


# ---- a plan -----------------------------------------------------------------------------------

def _loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    if isinstance(output, tuple | list):
        output = output[0]
    return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def _build(job: dict[str, Any], world: int) -> tuple[Any, list[torch.nn.Module], Any, tuple[torch.Tensor, ...]]:
    """(trainable, its modules for memory roles, a step function taking inputs, the inputs)."""
    from shardc.models import load_model

    torch.manual_seed(job.get("seed", 0))
    loaded = load_model(job["model"], device="cpu")
    model, inputs = loaded.model, tuple(loaded.example_inputs)
    runtime = job.get("runtime", "shardc")
    if runtime == "pipeline-runner":
        return _pipeline(job, model, inputs, world)
    compiled = job["compiled"]
    if runtime == "shardc":
        return _shardc_runtime(compiled, model, inputs)
    module = _ddp_with_bucket(compiled, model, float(job["bucket_mb"]))
    per = job["traced_batch"]
    micro = [tuple(x[i:i + per] for x in inputs) for i in range(0, inputs[0].shape[0], per)]
    sync_ctx = getattr(module, "no_sync", None)

    def forward_backward() -> torch.Tensor:
        total = torch.zeros(())
        for k, batch in enumerate(micro):
            ctx = sync_ctx() if sync_ctx is not None and k < len(micro) - 1 else nullcontext()
            with ctx:
                loss = module(*batch) / len(micro)
                loss.backward()
            total += loss.detach()
        return total

    return module, [module], forward_backward, inputs


def _shardc_runtime(compiled: Any, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]):
    """As `shardc run` trains: `plan.parallelize(model)` and `module.step(*global_batch)` (the
    pipeline schedule when pp > 1, gradient accumulation over micro-batches when pp = 1); a model
    that returns logits trains on `launch.default_loss` (next-token cross entropy)."""
    from shardc.backends.torch.launch import default_loss

    default = default_loss(compiled.graph)
    if default is None:
        module = compiled.parallelize(model)

        def forward_backward() -> torch.Tensor:
            return module.step(*inputs)
    else:
        loss_fn, make_target = default
        module = compiled.parallelize(model, loss_fn=loss_fn)
        target = make_target(inputs)

        def forward_backward() -> torch.Tensor:
            return module.step(*inputs, target=target)

    return module, [module], forward_backward, inputs


def _ddp_with_bucket(compiled: Any, model: torch.nn.Module, bucket_mb: float) -> torch.nn.Module:
    """plan.parallelize for a DDP plan, with DDP's bucket size set (for the block-size study)."""
    from torch.nn.parallel import DistributedDataParallel

    from shardc.backends.torch.codegen import generate
    from shardc.backends.torch.parallelize import (
        check_model,
        data_parallel_info,
        device_mesh,
        local_tensors,
        mesh_groups,
    )

    graph = compiled.graph
    axes, via, zero = data_parallel_info(graph)
    if zero or via != "ddp" or len(axes) != 1:
        raise ShardcError(f"bucket_mb applies to plain DDP plans (zero=0, one data axis); plan {compiled.plan} "
                          f"syncs {axes} via {via}, zero={zero}")
    dm = device_mesh(graph.mesh)
    rank = dist.get_rank()
    check_model(graph, model)
    from shardc.api import _with_constants

    tensors = local_tensors(graph, _with_constants(model, compiled.constants), rank)
    module = generate(graph, rank, tensors, mesh_groups(graph.mesh, dm, rank))
    return DistributedDataParallel(module, process_group=dm[axes[0]].get_group(), bucket_cap_mb=bucket_mb)


def _pipeline(job: dict[str, Any], model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], world: int):
    from torch.distributed.device_mesh import init_device_mesh

    from shardc.backends.torch.pipeline import PipelineRunner

    plan = job["plan"]
    if plan.tp > 1 or plan.cp > 1 or plan.zero or plan.recompute != "none":
        raise ShardcError(f"plan {plan}: the pipeline runtime (backends/torch/pipeline.PipelineRunner) runs "
                          "pp with dp only here: tp/cp sharding of a stage, ZeRO and recomputation inside "
                          "a pipeline are not wired to it yet")
    if len(inputs) < 2:
        raise ShardcError("pipelined study plans need example inputs (inputs, targets)")
    axes = job["mesh_axes"]
    mesh = init_device_mesh("cpu", tuple(s for _, s in axes), mesh_dim_names=tuple(a for a, _ in axes))
    # torch.export keeps module paths (nn_module_stack) and specialises shapes (GPT slices its
    # mask by the sequence length), at the micro-batch size the schedule feeds each stage.
    traced = torch.export.export(model, (inputs[0][:plan.mb],), strict=False).module()
    runner = PipelineRunner(model, mesh, _loss_fn, n_microbatches=job["micro_batches"], schedule=plan.schedule,
                            virtual_stages=plan.vpp, stage_of=job.get("stage_of"), traced=traced)
    dp = plan.dp
    coord = mesh["dp"].get_local_rank() if "dp" in (mesh.mesh_dim_names or ()) and dp > 1 else 0
    per = inputs[0].shape[0] // dp
    mine = tuple(x[coord * per:(coord + 1) * per] for x in inputs)

    def forward_backward() -> torch.Tensor:
        return runner.step(mine[0], mine[1])

    return runner, list(runner.modules), forward_backward, inputs


def compute_probe(n: int = 256, window_s: float = 0.15) -> float:
    """This process's fp32 matmul FLOP/s right now, all ranks running it at once (the calibration's
    concurrent benchmark): what the machine's load leaves this plan, measured before its steps."""
    from shardc.calibrate import _window_rate

    a, b = torch.randn(n, n), torch.randn(n, n)
    dist.barrier()
    return _window_rate(lambda: torch.mm(a, b), 2.0 * n ** 3, window_s)


def run_plan(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """Warm-up, timed steps, a profiled step and a memory-tracked step (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    trainable, modules, forward_backward, _ = _build(job, world)
    optimizer = torch.optim.AdamW(trainable.parameters(), lr=1e-4, foreach=False)

    def step(tracker: Any = None) -> float:
        loss = forward_backward()
        if tracker is not None:
            tracker.phase = "optimizer"
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return float(loss)

    losses = [step() for _ in range(job["warmup"])]
    probe = compute_probe()
    times = []
    for _ in range(job["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with record_function(MARKER):
            step()
    events = profile_events(prof, MARKER)
    dist.barrier()
    extra = {"buffers": float(ddp_bucket_bytes(trainable))}
    with track_memory(modules, optimizer, extra) as tracker:
        step(tracker)
    memory = tracker.result()
    collectives = memory.pop("collectives")
    return {"step_times_s": times, "median_step_s": statistics.median(times), "probe_flops": probe, "losses": losses,
            "profile": events, "memory": memory, "collectives": collectives}
