"""The calibration's multi-process benchmarks: N fresh processes on this machine at once.

Each of `nprocs` processes (one intra-op thread) measures its matmul rate and copy bandwidth
while all run together (`_window_rate`: work done over wall time, so the time a process waits
for a core counts), then gloo all_reduce, all_gather, reduce_scatter, broadcast and send/recv
by message size (the slowest rank's time per call, median of 3 trials), the same collectives with
every process computing between calls (`busy`: what a blocking collective waits inside a step,
median of 5 trials with their spread; groups of 2 among more processes too), the per-call overhead of
shardc's autograd-aware collective wrapper (`_wrapper_overhead`), AdamW on DTensor
parameters sharded over all of them (FSDP2's optimizer step), FSDP2's own work per
micro-batch (`wrapper_steps.fsdp_overhead`), the pipeline runtime's CPU per schedule action and
split backward (`pipeline_steps`), a whole synchronising FSDP2 and DDP step per
data-parallel group size (`wrapper_steps.sync_steps`), and last the speed probe while every
process trains (`loaded`: the contention among them). `shardc.calibration.local` fits and caches the results.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardc.calibration.busy import loaded_collectives
from shardc.calibration.loaded import probe_under_load
from shardc.calibration.pipeline_steps import STEPS, action_by_size, pipeline_overhead
from shardc.calibration.wrapper_steps import fsdp_overhead, sharded_optimizer, sync_steps
from shardc.ir import Axis
from shardc.ir.diagnostics import ShardcError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
OVERHEAD_NUMEL = 256  # the small tensor the wrapper overhead is measured on (1 KiB)
OVERHEAD_CHAIN = 8  # wrapped calls per forward + backward in that measurement
OVERHEAD_TRIALS = 7
OVERHEAD_BUDGET = 0.5  # seconds for that measurement (about; quick or not, as noise needs it)


def _window_rate(fn: Callable[[], object], work: float, window: float) -> float:
    """`work` per call x calls completed in `window` seconds of wall time / the time taken: a rate
    that counts the time this process waited for a core (unlike a median of call times)."""
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < window:
        fn()
        calls += 1
    return work * calls / elapsed


def _init(rank: int, nprocs: int, workdir: str) -> None:
    """One intra-op thread, then join the gloo group of `nprocs` through a file store in `workdir`."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if platform.system() == "Linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=nprocs,
                            timeout=timedelta(seconds=120))


def _leave() -> None:
    """End this worker process once every rank is done, without the interpreter's finalization.
    `destroy_process_group()` does not stop gloo's threads while anything holds a group, and
    after FSDP2 something always does: DTensor's sharding cache keeps the specs of the sharded
    parameters, their device mesh and its groups (world and sub-groups) alive. Those groups were
    then torn down inside the interpreter's finalization, racing their own threads; there a
    thread that takes the GIL is ended by `pthread_exit`, whose unwinding through noexcept C++
    code aborts the process: the likely source of "terminate called without an active
    exception", exit -6, seen after `sync_steps` on the rank that reached its exit first (not
    reproduced at will). So: a barrier (every rank's collectives are over and rank 0's
    result is written), the groups destroyed, then `os._exit(0)`, as multiprocessing's child
    processes end."""
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _one_worker(rank: int, nprocs: int, workdir: str, cfg: dict[str, Any]) -> None:
    """One of `nprocs` processes measuring only `cfg["measure"]` (a name, or a list of them run in
    turn): "wrapper_overhead" (`_wrapper_overhead`), "fsdp_overhead" (`wrapper_steps.fsdp_overhead`),
    "sync_steps" (`wrapper_steps.sync_steps`), "pipeline_overhead" and "action_by_size" (`pipeline_steps`) or
    "loaded_probe_s" (`loaded`, over `cfg["window"]` seconds); `cfg["steps"]`: the pipeline's steps per
    schedule; rank 0 writes each under its name."""
    import torch.distributed as dist

    from shardc.calibration.speed import SpeedIndex

    what = cfg["measure"]
    measures = {"wrapper_overhead": lambda: _wrapper_overhead(nprocs, rank),
                "fsdp_overhead": lambda: fsdp_overhead(nprocs), "sync_steps": lambda: sync_steps(nprocs),
                "pipeline_overhead": lambda: pipeline_overhead(nprocs, cfg.get("steps", 7)),
                "action_by_size": lambda: action_by_size(nprocs, cfg.get("steps", 7)),
                "loaded_probe_s": lambda: probe_under_load(SpeedIndex(calls=2), cfg.get("window", 0.2)),
                "loaded_collectives": lambda: _loaded(nprocs, cfg, None)}
    _init(rank, nprocs, workdir)
    try:
        results = {name: measures[name]() for name in ([what] if isinstance(what, str) else what)}
        if rank == 0:
            Path(workdir, "result.json").write_text(json.dumps(results))
    except BaseException:
        dist.destroy_process_group()  # no barrier: a peer may be gone
        raise
    _leave()


def _worker(rank: int, nprocs: int, workdir: str, cfg: dict[str, Any]) -> None:
    """One of `nprocs` processes: concurrent matmul and copy rates, then gloo collectives."""
    import torch
    import torch.distributed as dist

    from shardc.calibration.speed import SpeedIndex, speed_factor

    _init(rank, nprocs, workdir)
    try:
        speed = SpeedIndex(cfg.get("speed_reference"))  # the parent's reference: its figures' units
        n = cfg["matmul_n"]
        a, b = torch.randn(n, n), torch.randn(n, n)
        src, dst = torch.randn(cfg["copy_numel"]), torch.empty(cfg["copy_numel"])
        dist.barrier()
        before = speed.seconds(3)  # all ranks at once: the mode of the core and our own contention
        flops = _window_rate(lambda: torch.mm(a, b), 2.0 * n ** 3, cfg["window"])
        dist.barrier()
        bandwidth = _window_rate(lambda: dst.copy_(src), 2.0 * src.nbytes, cfg["window"])
        slow = speed_factor([before, speed.seconds(3)], speed.reference)  # rates at the reference speed: x slow
        rates = torch.tensor([flops * slow, bandwidth * slow], dtype=torch.float64)
        dist.all_reduce(rates)
        results: dict[str, Any] = {"flops": rates[0].item() / nprocs, "bandwidth": rates[1].item() / nprocs}
        for op in COLLECTIVES:
            results[op] = [(4 * numel, _time_collective(op, numel, nprocs, rank, cfg, speed)) for numel in cfg["numels"]]
        results["wrapper_overhead"] = _wrapper_overhead(nprocs, rank) * _scale_now(speed)
        results["sharded_optimizer"] = sharded_optimizer(nprocs, cfg["window"], speed)
        results["fsdp_overhead"] = tuple(x * _scale_now(speed) for x in fsdp_overhead(nprocs))
        runtime = pipeline_overhead(nprocs, 3) if cfg["quick"] else pipeline_overhead(nprocs)
        results["pipeline_overhead"] = tuple(x * _scale_now(speed) for x in runtime)
        small, large, b0, b1 = action_by_size(nprocs, 3 if cfg["quick"] else STEPS)
        results["action_by_size"] = (small * _scale_now(speed), large * _scale_now(speed), b0, b1)
        results["loaded_collectives"] = _loaded(nprocs, cfg, speed)
        scale = _scale_now(speed)
        results["sync_steps"] = [(w, g, *(x * scale for x in fit)) for w, g, *fit in sync_steps(nprocs)]
        probe = torch.tensor([speed.typical()], dtype=torch.float64)  # the median over this worker's run
        dist.all_reduce(probe)
        results["probe_s"] = probe.item() / nprocs
        results["loaded_probe_s"] = probe_under_load(speed, 4 * cfg["window"])  # the contention (`loaded`)
        if rank == 0:
            Path(workdir, "result.json").write_text(json.dumps(results))
    except BaseException:
        dist.destroy_process_group()  # no barrier: a peer may be gone
        raise
    _leave()


def _scale_now(speed: Any) -> float:
    """The factor to the reference speed now: every rank times the probe, the slowest counts
    (the ranks of a collective measurement wait for each other)."""
    import torch
    import torch.distributed as dist

    probe = torch.tensor([speed.seconds(2)], dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    return float(speed.scale([probe.item()]))


def _loaded(nprocs: int, cfg: dict[str, Any], speed: Any) -> list[dict[str, Any]]:
    """The collectives under a training load (`busy`): the whole world's group, and groups of 2
    among more processes (a tp or cp axis of 2 beside other axes)."""
    groups = (nprocs, 2) if nprocs > 2 else (nprocs,)
    scale = (lambda: _scale_now(speed)) if speed is not None else (lambda: 1.0)
    return loaded_collectives(nprocs, groups, tuple(cfg["loaded_numels"]), cfg["loaded_trials"], scale)


def _collective(op: str, numel: int, nprocs: int, rank: int) -> Callable[[], None]:
    import torch
    import torch.distributed as dist

    n = max(numel // nprocs, 1)
    x, part, out = torch.ones(numel), torch.ones(n), torch.empty(n * nprocs)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x)
    if op == "all_gather":  # numel = the gathered size, as the ring factors assume
        return lambda: dist.all_gather_single(out, part)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, out)
    if op == "broadcast":
        return lambda: dist.broadcast(x, 0)

    def send_recv() -> None:  # ranks 0 and 1 pass the buffer there and back: two messages
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
    return send_recv


def _wrapper_overhead(nprocs: int, rank: int) -> float:
    """Seconds one call of shardc's autograd-aware `all_reduce` wrapper adds to a raw gloo
    all_reduce of the same small tensor, forward and backward together: the copy, the autograd
    node and the Python around the collective, which tensor-parallel plans pay at every wrapped
    collective. A chain of `OVERHEAD_CHAIN` wrapped calls run forward then backward once (as in
    a model, one backward pass for many nodes) against as many raw calls, per call, in this
    thread's CPU time: a small gloo call's wall time here varies by milliseconds with the
    scheduler, its CPU time by microseconds. The two alternate in `OVERHEAD_TRIALS` trials (the
    slowest rank's each), the median difference is taken and scaled by how many processes share
    each core (`nprocs / cores`, at least 1): the wall time that CPU work takes while all run."""
    import torch
    import torch.distributed as dist

    from shardc.backends.torch.collectives import MeshGroups, all_reduce

    mesh = MeshGroups({Axis.TP: nprocs}, {Axis.TP: rank}, {Axis.TP: dist.group.WORLD})
    x, grad = torch.ones(OVERHEAD_NUMEL, requires_grad=True), torch.ones(OVERHEAD_NUMEL)
    buf = torch.ones(OVERHEAD_NUMEL)

    def wrapped() -> None:
        y = x
        for _ in range(OVERHEAD_CHAIN):
            y = all_reduce(y, mesh, Axis.TP)
        y.backward(grad)
        x.grad = None

    def raw() -> None:
        for _ in range(OVERHEAD_CHAIN):
            dist.all_reduce(buf)

    for _ in range(3):
        wrapped()
        raw()
    t0 = time.perf_counter()
    wrapped()
    probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    reps = int(max(2, min(200, OVERHEAD_BUDGET / (2 * OVERHEAD_TRIALS) / max(probe.item(), 1e-7))))
    trials = torch.zeros(2, OVERHEAD_TRIALS, dtype=torch.float64)
    for i in range(OVERHEAD_TRIALS):
        for j, run in enumerate((wrapped, raw)):
            dist.barrier()
            t0 = time.thread_time()
            for _ in range(reps):
                run()
            trials[j, i] = (time.thread_time() - t0) / reps
    dist.all_reduce(trials, op=dist.ReduceOp.MAX)
    cpu = max(0.0, float((trials[0] - trials[1]).median().item()) / OVERHEAD_CHAIN)
    return cpu * max(1.0, nprocs / (os.cpu_count() or 1))


def _time_collective(op: str, numel: int, nprocs: int, rank: int, cfg: dict[str, Any], speed: Any = None) -> float:
    """Seconds per call of collective `op` on `numel` elements (per `_time_calls`; send/recv
    counts one message, half its round trip), at `speed`'s reference speed when given (a copy and
    a TCP stack are CPU work: the core's mode moves them too)."""
    scale = _scale_now(speed) if speed is not None else 1.0
    return _time_calls(_collective(op, numel, nprocs, rank), cfg) / (2 if op == "send_recv" else 1) * scale


def _time_calls(run: Callable[[], None], cfg: dict[str, Any]) -> float:
    """Seconds per call of `run` (collective on every rank): the slowest rank's mean over each of
    3 trials, median of the trials. The repetition count comes from one timed call, agreed on by
    all ranks."""
    import torch
    import torch.distributed as dist

    run()
    t0 = time.perf_counter()
    run()
    probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    reps = int(max(1, min(cfg["max_reps"], cfg["point_budget"] / 3 / max(probe.item(), 1e-7))))
    trials = torch.zeros(3, dtype=torch.float64)
    for i in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        trials[i] = (time.perf_counter() - t0) / reps
    dist.all_reduce(trials, op=dist.ReduceOp.MAX)
    return float(trials.median().item())


def run_workers(nprocs: int, cfg: dict[str, Any], timeout: float = 300.0, entry: str = "_worker") -> dict[str, Any]:
    """Start `nprocs` fresh interpreters running `entry` (`_worker`, or `_one_worker` for one
    measurement) and return rank 0's results.

    Plain subprocesses rather than multiprocessing: they do not re-import the caller's
    `__main__` (which fails from stdin or a notebook), and a file store in a temporary
    folder avoids racing for a free port. Gloo itself talks over localhost TCP.
    """
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix="shardc-calibrate-") as workdir:
        code = f"import json, sys; from shardc.calibration.gloo import {entry}; {entry}(*json.loads(sys.argv[1]))"
        procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps([rank, nprocs, workdir, cfg])],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for rank in range(nprocs)]
        errors = []
        try:
            for rank, proc in enumerate(procs):
                _, err = proc.communicate(timeout=timeout)
                if proc.returncode:
                    errors.append(f"rank {rank} exited with {proc.returncode}: {err.strip()[-800:]}")
        except subprocess.TimeoutExpired:
            errors.append(f"timed out after {timeout:.0f} s")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        result = Path(workdir, "result.json")
        if errors or not result.exists():
            raise ShardcError(f"calibration with {nprocs} gloo processes failed: " + ("; ".join(errors) or "no result"),
                              hint="check that localhost TCP works (GLOO_SOCKET_IFNAME) and rerun `shardc calibrate`")
        return json.loads(result.read_text())
