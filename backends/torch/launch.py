"""Launching local process groups: `spawn` for functions (tests, benchmarks, the study), torchrun
for `shardc run` (its workers are `python -m shardc.run`, the training loop `shardc.train`).

Failure rule: when one rank fails, every other rank is stopped within a bounded time and the
caller gets one error naming the rank and its exception, never a hang. `spawn` watches its
children and kills the rest as soon as one reports an error or dies; `torchrun` does the same
with its elastic agent (no restarts), and process groups carry a timeout as a second guard.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from shardc.ir.diagnostics import ShardcError
from shardc.ir.files import write_json_atomic

PG_TIMEOUT_S = 60.0
# `spawn` forks its ranks from a server process that imported these once (multiprocessing's
# forkserver), so that a launch does not import torch again in every rank: on a small machine
# that was seconds per process, per launch (10-25 s for 2-4 ranks on 2 loaded cores, 0.3 s forked).
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.fx", "shardc.api", "shardc.train", "shardc.driver",
                      "shardc.backends.torch.codegen", "shardc.frontend.spec")


def free_port() -> int:
    """A TCP port free on this machine at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def choose_backend(world: int, device: str | None = None, *, fallback: bool = True) -> str:
    """The process-group backend for `world` local processes: `device="cpu"` -> gloo; `"cuda"` ->
    NCCL, one GPU per process, and a ShardcError when there are fewer GPUs than processes; None
    (auto) -> NCCL when there is a GPU for every process, else gloo on CPU, or with
    `fallback=False` (`shardc run`) a ShardcError when there are GPUs but too few (training on
    the CPU next to idle GPUs would mislead). `SHARDC_DEVICE=cpu|cuda` in the environment stands
    for `device` when it is None."""
    import torch

    device = device or os.environ.get("SHARDC_DEVICE") or None
    if device not in (None, "cpu", "cuda"):
        raise ShardcError(f"device {device!r}: use cpu or cuda (SHARDC_DEVICE)")
    if device == "cpu":
        return "gloo"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and gpus >= world:
        return "nccl"
    if device is None and (not gpus or fallback):
        return "gloo"
    raise ShardcError(f"CUDA needs one GPU per process: {world} processes asked for, {gpus} GPUs visible",
                      hint=(f"use --nproc {gpus} or fewer, or " if gpus else "")
                      + "run on CPU processes with gloo (--device cpu; SHARDC_DEVICE=cpu for shardc run)")


def init_process_group(rank: int, world: int, port: int, timeout_s: float = PG_TIMEOUT_S,
                       device: str | None = None) -> str:
    """Join a local process group on `choose_backend(world, device)`; rank r uses GPU r under NCCL.
    Returns the backend."""
    import torch
    import torch.distributed as dist

    backend = choose_backend(world, device)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return backend


def _start_context() -> Any:
    """multiprocessing's forkserver with `FORKSERVER_PRELOAD` imported in its server (started
    once per parent process, on first use), or spawn where there is no forkserver (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
           queue: Any, timeout_s: float, device: str | None = None, env: dict[str, str] | None = None) -> None:
    if env is not None:  # a forked rank has the server's environment, not the caller's at launch
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # What torchrun would set: the runtime picks `cuda:{LOCAL_RANK}` under NCCL.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        init_process_group(rank, world, port, timeout_s, device)
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: tensors must not go through shared-memory pickling
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as err:  # report everything, including SystemExit from the function
        queue.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 180.0,
          pg_timeout_s: float = PG_TIMEOUT_S, device: str | None = None) -> list[Any]:
    """Run `fn(rank, world, *args)` on `nproc` fresh processes in one process group; rank-ordered results.

    `fn` must be importable (module level) and its arguments and result picklable. If a rank
    raises or dies, the others are killed at once and a ShardcError names the first failure;
    after `timeout_s` everything is killed and the error says which ranks had not finished.
    `device` picks the backend as `choose_backend` does (checked here, before any process starts).
    """
    choose_backend(nproc, device)
    ctx = _start_context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_child, args=(fn, r, nproc, port, args, queue, pg_timeout_s, device, env),
                         daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    failure: str | None = None
    try:
        while len(results) < nproc and failure is None:
            try:
                rank, status, payload = queue.get(timeout=0.2)
            except Exception:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and queue.empty():
                    time.sleep(1.0)  # a rank that just exited cleanly has its message in flight
                if dead and queue.empty():
                    failure = f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(nproc)) - set(results))
                    failure = f"timed out after {timeout_s:.0f} s; ranks {missing} had not finished"
                continue
            if status == "error":
                failure = f"rank {rank} failed: {payload}"
                time.sleep(0.5)  # a peer that died is the root cause of a connection error here
                dead = [r for r, p in enumerate(procs) if r != rank and not p.is_alive() and p.exitcode]
                if dead:
                    failure = (f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}; then rank {rank} "
                               f"failed: {payload.splitlines()[0]}")
            else:
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive() and failure is not None:
                p.kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if failure is not None:
        raise ShardcError(f"process group of {nproc} stopped: {failure}")
    return [results[r] for r in range(nproc)]


# ---- torchrun -----------------------------------------------------------------------------

def torchrun(nproc: int, module: str, argv: Sequence[str], *, timeout_s: float, log_dir: Path,
             env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `python -m module argv...` on `nproc` local workers under torchrun; returns (exit code, output).

    No restarts: a failing worker makes torchrun's agent stop the others. The whole run is
    killed after `timeout_s` (exit code -9). Worker output is captured for the error message.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--max-restarts=0", "--monitor-interval=0.2", "-m", module, *argv]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    log = open(log_dir / "torchrun.log", "w+")  # noqa: SIM115 - read back below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = -9
    log.seek(0)
    text = log.read()
    log.close()
    return code, text


def write_json(path: Path, data: Any, indent: int | None = None) -> None:
    """Write JSON atomically (temp file then rename), so a reader never sees half a file."""
    write_json_atomic(path, data, indent)

