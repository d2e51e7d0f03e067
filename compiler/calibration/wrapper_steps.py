"""What data parallelism's wrappers cost per step on this machine, measured inside the
calibration's gloo workers (`shardc.calibration.gloo`): AdamW on DTensor parameters sharded
over all processes (FSDP2's optimizer step, `sharded_optimizer`), FSDP2's own work per
micro-batch (`fsdp_overhead`) and a whole synchronising FSDP2 and DDP step per data-parallel
group size (`sync_steps`). Each runs in every worker at once; the caller scales the figures to
the profile's reference speed.
"""

from __future__ import annotations

import time
from typing import Any

from shardc.calibration.fit import fit_two_terms
from shardc.calibration.timing import COLD_BYTES, evict, timed


def sharded_optimizer(nprocs: int, budget: float, speed: Any = None) -> tuple[float, float]:
    """(seconds per tensor, per local element) of AdamW's step and zero_grad on parameters that
    are DTensors sharded over all processes, as FSDP2 leaves them: each op goes through DTensor's
    dispatch. In this thread's CPU time, as the single-process eager costs are."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from shardc.calibration.ops import OPTIMIZER_CASES

    mesh = init_device_mesh("cpu", (nprocs,))
    shard = lambda n: DTensor.from_local(torch.randn(n), mesh, [Shard(0)], run_check=False)  # noqa: E731
    samples = []
    for count, numel in OPTIMIZER_CASES:
        params = [torch.nn.Parameter(shard(numel)) for _ in range(count)]
        for p in params:
            p.grad = shard(numel)
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
        buffer = torch.zeros(COLD_BYTES // 4)

        def step(opt: Any = opt, buffer: Any = buffer) -> tuple[float, float]:
            evict(buffer)  # cold caches, as the single-process optimizer is timed
            t0 = time.thread_time()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return time.thread_time() - t0, 0.0

        samples.append((count, count * numel, timed(step, budget / len(OPTIMIZER_CASES), speed)[0]))
    return fit_two_terms(samples)


def _release() -> None:
    """Free the wrappers just measured now (DDP and FSDP2 modules sit in reference cycles), not
    whenever the collector runs inside a later case's timing."""
    import gc

    gc.collect()


FSDP_CASES = ((48, 512), (12, 16384), (3, 131072))  # (parameter tensors, elements each)
FSDP_REPS = 9  # micro-batches timed per case and per variant (a fixed count: every rank gathers as often)


def _unit(count: int, numel: int) -> Any:
    """The module FSDP2's costs are measured on: `count` parameters of `numel` elements, each used
    in one elementwise op, so its own forward and backward are short beside what wraps it."""
    import torch

    class Unit(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(numel)) for _ in range(count))

        def forward(self, x: Any) -> Any:
            return sum((p * x).sum() for p in self.ps)

    return Unit()


def fsdp_overhead(nprocs: int) -> tuple[float, float]:
    """(seconds per parameter tensor, per element) that FSDP2 adds to one micro-batch's forward
    and backward of a unit sharded over all processes, as the torch backend runs ZeRO-1/2
    (`fully_shard(reshard_after_forward=False)`, gradient sync off but for the last micro-batch:
    torch 2.13 still reshards after each backward, so every forward gathers again): its hooks,
    the copies into and out of the flat all-gather buffer, and accumulating the unsharded
    gradients. The unit is a module using each parameter in one elementwise op; the same module
    unsharded is timed alike and subtracted. In this thread's CPU time, cold caches, as the eager
    costs are (the gather's own wait is the all_gather collective's, priced by the link)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (nprocs,))
    buffer = torch.zeros(COLD_BYTES // 4)
    x = torch.ones(())
    samples = []
    for count, numel in FSDP_CASES:
        times = []
        for sharded in (False, True):
            unit = _unit(count, numel)
            if sharded:
                fully_shard(unit, mesh=mesh, reshard_after_forward=False)
                unit.set_requires_gradient_sync(False)  # type: ignore[operator]
            spent = []
            for _ in range(FSDP_REPS + 2):
                evict(buffer)
                t0 = time.thread_time()
                unit(x).backward()
                spent.append(time.thread_time() - t0)
            times.append(sorted(spent[2:])[FSDP_REPS // 2])
            del unit
            _release()
        samples.append((count, count * numel, max(times[1] - times[0], 1e-7)))
    return fit_two_terms(samples)


SYNC_STEP_CASES = ((2, 256), (48, 512), (12, 16384), (3, 131072))  # (parameter tensors, elements each)
SYNC_STEP_TRIALS = 9  # steps timed per case and variant, the variants taken in turn
SYNC_WRAPPERS = ("fsdp2", "ddp")


def sync_steps(nprocs: int) -> list[tuple[str, int, float, float, float]]:
    """(wrapper, group size, seconds per step, per parameter tensor, per element) that one
    synchronising step adds to the same step without data parallelism, for FSDP2 as the torch
    backend runs ZeRO (`fully_shard(reshard_after_forward=False)`) and DDP as it runs ZeRO-0, for
    every data-parallel group size g dividing `nprocs` (g >= 2), all `nprocs` processes running at
    once in `nprocs / g` groups as a plan's mesh runs them. FSDP2: the forward's all-gather with
    its copies, its hooks, the backward's reduce-scatter (on gloo an all_reduce of the whole
    buffer) with its copies; DDP: its hooks, bucketing and all-reduces; for both every rank
    waiting for the slowest. That is a pipeline stage's whole step, and a flat step's with one
    micro-batch. Wall time, the slowest rank's, median of `SYNC_STEP_TRIALS` steps of each variant
    taken in turn (so that load drifting hits all alike), over `SYNC_STEP_CASES` of a unit using
    each parameter in one elementwise op (so backward is short: the sync is all exposed, as it is
    when the processes fill the cores); fitted by `fit.fit_three_terms`. On this kind of machine
    the whole is several times what its collectives cost alone (a process waiting on a peer that
    waits for a core), so it is measured whole."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from shardc.calibration.fit import fit_three_terms

    x = torch.ones(())
    out = []
    for group in (g for g in range(2, nprocs + 1) if nprocs % g == 0):
        mesh = init_device_mesh("cpu", (nprocs // group, group), mesh_dim_names=("other", "dp"))["dp"]
        samples: dict[str, list[tuple[float, float, float]]] = {w: [] for w in SYNC_WRAPPERS}
        for count, numel in SYNC_STEP_CASES:
            sharded = _unit(count, numel)
            fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
            ddp = DistributedDataParallel(_unit(count, numel), process_group=mesh.get_group(), init_sync=False,
                                          broadcast_buffers=False)
            units = (_unit(count, numel), sharded, ddp)
            trials = torch.zeros(len(units), SYNC_STEP_TRIALS + 2, dtype=torch.float64)
            for i in range(SYNC_STEP_TRIALS + 2):
                for j, unit in enumerate(units):
                    dist.barrier()
                    t0 = time.perf_counter()
                    unit(x).backward()
                    trials[j, i] = time.perf_counter() - t0
            del units, unit, sharded, ddp
            _release()
            dist.all_reduce(trials, op=dist.ReduceOp.MAX)
            medians = trials[:, 2:].median(dim=1).values
            for j, wrapper in enumerate(SYNC_WRAPPERS, start=1):
                samples[wrapper].append((count, count * numel, max(float(medians[j] - medians[0]), 1e-7)))
        out += [(w, group, *fit_three_terms(samples[w])) for w in SYNC_WRAPPERS]
    return out
