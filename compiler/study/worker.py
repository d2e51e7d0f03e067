"""What every rank runs: a list of study jobs in one process group, each result written as it ends.

A job is a plan or the all_reduce-by-size benchmark. A plan runs as `shardc run` trains it
(`runtime="shardc"`): compiled by the parent for the global batch, `plan.parallelize(model)`
here and `module.step(*batch)` per step (pipelines for pp > 1, gradient accumulation over
micro-batches for pp = 1, any mix of dp/tp/pp/zero/recompute; a study plan's `split=3+1` is
written into the layers' stages before the parent lowers it, so unbalanced pipelines run the
same way). The study-only key `bucket_mb` keeps an older path (plain DDP with its bucket size
set, micro-batches accumulated here under `no_sync`). For a plan: warm-up steps, then
`steps` timed steps (each started together after a barrier), one step under torch.profiler
and one step under the memory tracker (`shardc.study.measure`). Each rank writes its result
to `<work>/<job id>.rank<r>.json` atomically; a rank that fails writes its error there and
re-raises, so `launch.spawn` stops the whole group and the parent records the error and goes
on with the next job in a fresh group.

The training step is forward and backward (`module.step`, or the older paths' own loop),
AdamW `step()`, `zero_grad(set_to_none=False)` (gradients stay allocated between steps, as
Megatron's gradient buffers do, so the peak holds them); timing and the memory tracker wrap
that whole step the same way on every path.

On CUDA (`job["device"] == "cuda"`, an NCCL group from `launch.spawn(device="cuda")`): rank r
runs on `cuda:r` (model shards, inputs, targets, all_reduce buffers); every timed interval is
closed by `torch.cuda.synchronize()` (host timers then measure the GPU's work), and CUDA events
give each step's GPU time beside it; the profiled step records CUDA activities (kernels are the
compute, NCCL kernels the communication); the memory-tracked step resets the caching
allocator's peak first, so the measured peak is `torch.cuda.max_memory_allocated` and the
tensor accounting splits it by category.
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

from shardc.calibration.speed import SpeedIndex
from shardc.ir.diagnostics import ShardcError
from shardc.study.measure import ddp_bucket_bytes, profile_events, track_memory

MARKER = "shardc.study.step"


def write_atomic(path: Path, data: Any) -> None:
    """JSON written to a temporary sibling, then renamed: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def job_device(rank: int, jobs: list[dict[str, Any]]) -> torch.device:
    """`cuda:<rank>` when the jobs say `device="cuda"` (the group must be NCCL), else the CPU."""
    if not any(job.get("device") == "cuda" for job in jobs):
        return torch.device("cpu")
    if dist.get_backend() != "nccl":
        raise ShardcError(f"--device cuda: rank {rank} joined a {dist.get_backend()} group, not NCCL",
                          hint="launch the study's group with launch.spawn(..., device='cuda')")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_jobs(rank: int, world: int, jobs: list[dict[str, Any]], work: str) -> int:
    """Entry point for `launch.spawn`: run `jobs` in order; returns how many finished."""
    torch.set_num_threads(1)
    device = job_device(rank, jobs)
    done = 0
    for job in jobs:
        path = Path(work) / f"{job['id']}.rank{rank}.json"
        try:
            if job["kind"] == "allreduce_sizes":
                result = allreduce_sizes(rank, world, job, device)
            else:
                result = run_plan(rank, world, job, device)
        except BaseException as err:
            write_atomic(path, {"rank": rank, "error": f"{type(err).__name__}: {err}",
                                "traceback": traceback.format_exc()[-4000:]})
            raise
        write_atomic(path, {"rank": rank, **result})
        done += 1
        dist.barrier()
    return done


# ---- the all_reduce benchmark -----------------------------------------------------------------

def allreduce_sizes(rank: int, world: int, job: dict[str, Any], device: torch.device | None = None
                    ) -> dict[str, Any]:
    """Seconds per fp32 all_reduce of each size (median of 3 trials, slowest rank per trial)."""
    device = device or torch.device("cpu")
    points = []
    for nbytes in job["sizes"]:
        x = torch.ones(max(1, nbytes // 4), device=device)
        dist.all_reduce(x)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        _sync(device)
        probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        reps = int(max(2, min(40, job.get("budget_s", 0.1) / max(probe.item(), 1e-6))))
        trials = torch.zeros(3, dtype=torch.float64, device=device)
        for i in range(3):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(x)
            _sync(device)
            trials[i] = (time.perf_counter() - t0) / reps
        dist.all_reduce(trials, op=dist.ReduceOp.MAX)
        points.append((x.numel() * 4, float(trials.median())))
    return {"points": points}


# ---- a plan -----------------------------------------------------------------------------------

def _loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    if isinstance(output, tuple | list):
        output = output[0]
    return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def _build(job: dict[str, Any], world: int, device: torch.device | None = None
           ) -> tuple[Any, list[torch.nn.Module], Any, tuple[torch.Tensor, ...]]:
    """(trainable, its modules for memory roles, a step function taking inputs, the inputs);
    the model is built on the CPU with the job's seed, its shards and the inputs live on `device`."""
    from shardc.frontend.spec import load_model

    device = device or torch.device("cpu")
    torch.manual_seed(job.get("seed", 0))
    loaded = load_model(job["model"], device="cpu")
    model, inputs = loaded.model, tuple(x.to(device) for x in loaded.example_inputs)
    runtime = job.get("runtime", "shardc")
    compiled = job["compiled"]
    if runtime == "shardc":
        return _shardc_runtime(compiled, model, inputs)
    module = _ddp_with_bucket(compiled, model, float(job["bucket_mb"]), device)
    per = job["traced_batch"]
    micro = [tuple(x[i:i + per] for x in inputs) for i in range(0, inputs[0].shape[0], per)]
    sync_ctx = getattr(module, "no_sync", None)

    def forward_backward() -> torch.Tensor:
        total = torch.zeros((), device=device)
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


def _ddp_with_bucket(compiled: Any, model: torch.nn.Module, bucket_mb: float,
                     device: torch.device | None = None) -> torch.nn.Module:
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
    from shardc.backends.torch.parallelize import with_constants

    device = device or torch.device("cpu")
    tensors = local_tensors(graph, with_constants(model, compiled.constants), rank, device=device)
    module = generate(graph, rank, tensors, mesh_groups(graph.mesh, dm, rank), device=str(device))
    return DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None,
                                   process_group=dm[axes[0]].get_group(), bucket_cap_mb=bucket_mb)


PROBE_CALLS = 2  # probe calls beside each measured step (3-5 ms each here)


def run_plan(rank: int, world: int, job: dict[str, Any], device: torch.device | None = None) -> dict[str, Any]:
    """Warm-up, timed steps, a profiled step and a memory-tracked step (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from shardc.study.measure import allocator_memory

    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    trainable, modules, forward_backward, _ = _build(job, world, device)
    optimizer = torch.optim.AdamW(trainable.parameters(), lr=1e-4, foreach=False)

    def step(tracker: Any = None) -> float:
        loss = forward_backward()
        if tracker is not None:
            tracker.phase = "optimizer"
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return float(loss)

    losses = [step() for _ in range(job["warmup"])]
    # The CPU's speed beside every step (`shardc.calibration.speed`); the reference is the profile's.
    speed = SpeedIndex(job.get("speed_reference")) if not cuda else None
    times, gpu_times, cpu_times = [], [], []
    probes = [speed.seconds(PROBE_CALLS)] if speed is not None else []  # before the first step, after each
    for _ in range(job["steps"]):
        dist.barrier()
        _sync(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        c0 = time.thread_time()  # this rank's main-thread CPU time: the step's work without the load
        t0 = time.perf_counter()
        if events:
            events[0].record()
        losses.append(step())
        if events:
            events[1].record()
        _sync(device)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.thread_time() - c0)
        if events:
            gpu_times.append(events[0].elapsed_time(events[1]) / 1e3)
        if speed is not None:
            probes.append(speed.seconds(PROBE_CALLS))
    reference = speed.reference if speed is not None else None
    speed = None  # its probe tensors and 32 MiB eviction buffer must not count in the tracked memory
    dist.barrier()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities, record_shapes=True) as prof:
        with record_function(MARKER):
            step()
            _sync(device)
    events_data = profile_events(prof, MARKER, device.type)
    dist.barrier()
    wrappers = [stage.submod for stage in getattr(trainable, "stages", [])] or [trainable]  # a pipeline: DDP per stage
    extra = {"buffers": float(sum(ddp_bucket_bytes(m) for m in wrappers))}
    if cuda:
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    with track_memory(modules, optimizer, extra) as tracker:
        step(tracker)
    memory = tracker.result()
    if cuda:  # the allocator's peak is the measurement; the accounting splits it by category
        _sync(device)
        allocator = allocator_memory(device)
        memory["tracked_peak_bytes"] = memory["peak_bytes"]
        memory["peak_bytes"] = allocator["peak_allocated_bytes"]
        memory["allocator"] = allocator
        memory["peak_breakdown"] = {**memory["peak_breakdown"], "allocator_extra": max(
            0.0, allocator["peak_allocated_bytes"] - memory["tracked_peak_bytes"])}
    collectives = memory.pop("collectives")
    return {"step_times_s": times, "median_step_s": statistics.median(times), "losses": losses,
            "cpu_step_times_s": cpu_times, "speed_probe_s": probes,
            "speed_reference_s": reference,
            "profile": events_data, "memory": memory, "collectives": collectives, "device": str(device),
            **({"gpu_step_times_s": gpu_times} if cuda else {})}
