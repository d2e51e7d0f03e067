"""What every rank runs: a list of study jobs in one process group, each result written as it ends.

A job is a plan or the all_reduce-by-size benchmark. A plan trains in the one training loop
that `shardc run` uses (`shardc.train.train`): compiled by the parent for the global batch,
`plan.parallelize(model)` here and `module.step(*batch)` per step (pipelines for pp > 1,
gradient accumulation over micro-batches for pp = 1, any mix of dp/tp/pp/zero/recompute; a
study plan's `split=3+1` is written into the layers' stages before the parent lowers it, so
unbalanced pipelines run the same way). The study-only key `bucket_mb` builds the module
another way (plain DDP with its bucket size set, micro-batches accumulated here under
`no_sync`); the loop is the same. The study adds its own around the loop: the speed probe
(`shardc.calibration.speed`, one per process) before the first timed step and after each, and
in a plan's first round (`job["details"]`) one step under torch.profiler before the
memory-tracked step; its later rounds time the steps only (`compare.merge_rounds` keeps the
first round's memory, breakdown and collectives), and skip the memory-tracked step and the
scan of the process's storages before it. A compiled plan (`compile=1`) warms up until a
step compiles nothing: torch.compile's first compile and its recompiles (dynamo's and
inductor's counters) stay out of the timed steps, whose own compiles are recorded (none
expected). Each rank writes its result to
`<work>/<job id>.rank<r>.json` atomically; a rank that fails writes its error there and
re-raises, so `launch.spawn` stops the whole group and the parent records the error and goes
on with the next job in a fresh group.

On CUDA (`job["device"] == "cuda"`, an NCCL group from `launch.spawn(device="cuda")`): rank r
runs on `cuda:r` (model shards, inputs, targets, all_reduce buffers); the loop closes every
timed interval with `torch.cuda.synchronize()` and times each step with CUDA events beside the
host timer; the profiled step records CUDA activities (kernels are the compute, NCCL kernels
the communication); the memory-tracked step's peak is the caching allocator's, split by role
by the tracker.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardc.backends.torch.launch import write_json
from shardc.calibration.speed import SpeedIndex
from shardc.ir.diagnostics import ShardcError
from shardc.study.measure import profile_events, with_sent_bytes
from shardc.train import Hooks, Trainee, TrainOptions, parallelized, synchronize, train

MARKER = "shardc.study.step"
PROBE_CALLS = 2  # probe calls beside each measured step (3-5 ms each here)
PRE_PROBES = 25  # readings of the probe just before a plan's first step, ~0.2 s (their slowest rank's median counts)


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


def run_jobs(rank: int, world: int, jobs: list[dict[str, Any]], work: str) -> int:
    """Entry point for `launch.spawn`: run `jobs` in order; returns how many finished."""
    torch.set_num_threads(1)
    if any(job.get("compiled") is not None and getattr(job["compiled"].plan, "compile", None) for job in jobs):
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        # compile in this process: not a pool of compile worker processes per rank (each
        # importing torch) on the few cores the group's ranks already share
        inductor_config.compile_threads = 1
        # every compiled plan's module is a class of its own behind nn.Module's one `_call_impl`:
        # past dynamo's limit of 8 entries a plan would silently run eager
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 8 * len(jobs))
    device = job_device(rank, jobs)
    probe: list[SpeedIndex] = []  # the speed probe, made once for the process by the first plan
    done = 0
    for job in jobs:
        path = Path(work) / f"{job['id']}.rank{rank}.json"
        try:
            if job["kind"] == "allreduce_sizes":
                result = allreduce_sizes(rank, world, job, device)
            else:
                if not probe and device.type != "cuda":
                    probe.append(SpeedIndex(job.get("speed_reference")))
                result = run_plan(rank, world, job, device, probe[0] if probe else None)
        except BaseException as err:
            write_json(path, {"rank": rank, "error": f"{type(err).__name__}: {err}",
                              "traceback": traceback.format_exc()[-4000:]})
            raise
        write_json(path, {"rank": rank, **result})
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
        synchronize(device)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        synchronize(device)
        probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        reps = int(max(2, min(40, job.get("budget_s", 0.1) / max(probe.item(), 1e-6))))
        trials = torch.zeros(3, dtype=torch.float64, device=device)
        for i in range(3):
            dist.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(x)
            synchronize(device)
            trials[i] = (time.perf_counter() - t0) / reps
        dist.all_reduce(trials, op=dist.ReduceOp.MAX)
        points.append((x.numel() * 4, float(trials.median())))
    return {"points": points}


# ---- a plan -----------------------------------------------------------------------------------

def run_plan(rank: int, world: int, job: dict[str, Any], device: torch.device | None = None,
             speed: SpeedIndex | None = None) -> dict[str, Any]:
    """The plan trained by `shardc.train.train` with the study's probe (`speed`, the process's;
    made here when not given) and, in its first round, the profiler and the memory-tracked step
    (see the module doc)."""
    from shardc.train.memory import storages_now

    device = device or torch.device("cpu")
    details = bool(job.get("details", True))
    if speed is None and device.type != "cuda":
        speed = SpeedIndex(job.get("speed_reference"))
    # What the process holds before this plan (the jobs' compiled plans, the speed probe,
    # leftovers of the plans run before it in this group) is not this plan's memory.
    before = storages_now() if details else None
    # The speed probe just before the plan's first step, every rank at once after a barrier (as
    # beside its steps): what the probed before-run prediction is made at (`Study.probed`).
    pre: list[float] = []
    if speed is not None and device.type != "cuda":
        dist.barrier()
        pre = [speed.seconds(PROBE_CALLS) for _ in range(PRE_PROBES)]
    hooks = _StudyHooks(job, device, speed, details)
    build = parallelized if job.get("runtime", "shardc") == "shardc" else _ddp_with_bucket(job)
    options = TrainOptions(steps=job["steps"], warmup=job["warmup"], lr=1e-4, seed=job.get("seed", 0), memory=details)
    report = train(job["compiled"], job["model"], options, device=device, build=build, hooks=hooks, before=before)
    return {"step_times_s": list(report.step_times_s), "median_step_s": report.median_step_s,
            "losses": list(report.losses), "cpu_step_times_s": list(report.cpu_step_times_s),
            "speed_probe_s": hooks.probes, "pre_probe_s": pre, "speed_reference_s": hooks.reference or
            (speed.reference if speed is not None else None), "profile": hooks.profile,
            "memory": report.memory, "collectives": with_sent_bytes(list(report.collectives)),
            "details": details, "warmup_steps": hooks.warmup_steps, "compiles": hooks.compiles,
            "device": report.device, **({"gpu_step_times_s": list(report.gpu_step_times_s)}
                                        if device.type == "cuda" else {})}


def compile_events() -> int:
    """How much torch.compile has done in this process: the sum of dynamo's and inductor's
    counters (frames traced, graphs, cache lookups, recompiles), which move only while compiling."""
    from torch._dynamo.utils import counters

    return sum(sum(c.values()) for c in counters.values())


class _StudyHooks(Hooks):
    """The speed probe beside the timed steps (CPU only; `speed`), warm-up until torch.compile
    is done, then (`details`) one step under torch.profiler."""

    def __init__(self, job: dict[str, Any], device: torch.device, speed: SpeedIndex | None = None,
                 details: bool = True) -> None:
        self.job, self.device, self.speed, self.details = job, device, speed, details
        self.probes: list[float] = []
        self.reference: float | None = None
        self.profile: dict[str, Any] = {}
        self.warmup_steps = 0
        self.compiles = {"warmup": 0, "timed": 0}  # compile events (`compile_events`) in each phase
        self._mark = compile_events()  # at the start of the current phase's last step

    def before_step(self, index: int, timed: bool) -> None:
        if not timed or index == self.warmup_steps:  # the last warm-up step is over: its compiles
            now = compile_events()
            self.compiles["warmup"] += now - self._mark
            self._mark = now
        if not timed:
            self.warmup_steps = index + 1
            return
        if self.speed is not None and self.device.type != "cuda":
            self.probes.append(self.speed.seconds(PROBE_CALLS))

    def warm_again(self, index: int) -> bool:
        """Another warm-up step while the last one compiled on any rank (a compiled plan's
        recompiles); the ranks agree, as they must run the same steps."""
        plan = getattr(self.job.get("compiled"), "plan", None)
        if not getattr(plan, "compile", None):
            return False
        compiled = torch.tensor([float(compile_events() > self._mark)], device=self.device)
        dist.all_reduce(compiled, op=dist.ReduceOp.MAX)
        return bool(compiled.item())

    def after_steps(self, run_step: Callable[[], None]) -> None:
        from torch.profiler import ProfilerActivity, profile, record_function

        self.compiles["timed"] = compile_events() - self._mark
        if self.speed is not None and self.device.type != "cuda":
            self.probes.append(self.speed.seconds(PROBE_CALLS))
            self.reference = self.speed.reference
        if not self.details:
            return
        dist.barrier()
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities, record_shapes=True) as prof:
            with record_function(MARKER):
                run_step()
        self.profile = profile_events(prof, MARKER, self.device.type)
        dist.barrier()


def _ddp_with_bucket(job: dict[str, Any]) -> Callable[[Any, torch.nn.Module, torch.device], Trainee]:
    """A builder for `train`: plan.parallelize for a DDP plan, with DDP's bucket size set (for the
    block-size study), the job's micro-batches accumulated under `no_sync`."""
    bucket_mb, per = float(job["bucket_mb"]), int(job["traced_batch"])

    def build(compiled: Any, model: torch.nn.Module, device: torch.device) -> Trainee:
        module = _ddp_module(compiled, model, bucket_mb, device)
        sync_ctx = getattr(module, "no_sync", None)

        def forward_backward(batch: Any) -> torch.Tensor:
            micro = [tuple(x[i:i + per] for x in batch) for i in range(0, batch[0].shape[0], per)]
            total = torch.zeros((), device=device)
            for k, part in enumerate(micro):
                ctx = sync_ctx() if sync_ctx is not None and k < len(micro) - 1 else nullcontext()
                with ctx:
                    loss = module(*part) / len(micro)
                    loss.backward()
                total += loss.detach()
            return total

        return Trainee(module, forward_backward)

    return build


def _ddp_module(compiled: Any, model: torch.nn.Module, bucket_mb: float, device: torch.device) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    from shardc.backends.torch.codegen import generate
    from shardc.backends.torch.parallelize import (
        check_model,
        data_parallel_info,
        device_mesh,
        local_tensors,
        mesh_groups,
    )

    graph = compiled.runtime_graph  # one micro-batch of the plan: DDP accumulates them itself
    axes, via, zero = data_parallel_info(graph)
    if zero or via != "ddp" or len(axes) != 1:
        raise ShardcError(f"bucket_mb applies to plain DDP plans (zero=0, one data axis); plan {compiled.plan} "
                          f"syncs {axes} via {via}, zero={zero}")
    dm = device_mesh(graph.mesh)
    rank = dist.get_rank()
    check_model(graph, model)
    from shardc.backends.torch.parallelize import with_constants

    constants = {**compiled.constants, **compiled.micro_constants}
    tensors = local_tensors(graph, with_constants(model, constants), rank, device=device)
    module = generate(graph, rank, tensors, mesh_groups(graph.mesh, dm, rank), device=str(device))
    return DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None,
                                   process_group=dm[axes[0]].get_group(), bucket_cap_mb=bucket_mb)
