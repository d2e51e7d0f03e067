"""Launching local process groups: `spawn` for functions (tests, benchmarks), torchrun for `shardc run`.

Failure rule: when one rank fails, every other rank is stopped within a bounded time and the
caller gets one error naming the rank and its exception, never a hang. `spawn` watches its
children and kills the rest as soon as one reports an error or dies; `torchrun` does the same
with its elastic agent (no restarts), and process groups carry a timeout as a second guard.
"""

from __future__ import annotations

import io
import json
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

PG_TIMEOUT_S = 60.0


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


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
           queue: Any, timeout_s: float, device: str | None = None) -> None:
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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, nproc, port, args, queue, pg_timeout_s, device), daemon=True)
             for r in range(nproc)]
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


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file then rename), so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


# ---- the `shardc run` worker ----------------------------------------------------------------

class PeakMemory:
    """Peak bytes of live tensor storage on this process during a block (CPU), or CUDA's own counter.

    On CPU a TorchDispatchMode sees every op's outputs; each new storage is counted once (by data
    pointer) until it is freed (a weakref finalizer on the storage). `baseline` counts what lived
    before the block (parameters, gradients, optimizer state). On CUDA it is
    `torch.cuda.max_memory_allocated` after a reset.
    """

    def __init__(self, baseline: int, device: Any = None) -> None:
        self.baseline = baseline
        self.peak = baseline
        self.device = device  # a CUDA device: its allocator's peak; anything else: the storage counter
        self._mode: Any = None

    def _cuda(self) -> bool:
        import torch

        return self.device is not None and torch.device(self.device).type == "cuda"

    def __enter__(self) -> PeakMemory:
        import torch

        if self._cuda():
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self._mode = _StorageCounter(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self._mode is not None:
            self._mode.__exit__(*exc)
        elif self._cuda():
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))


def _storage_counter_class() -> type:
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Counter(TorchDispatchMode):
        def __init__(self, owner: PeakMemory) -> None:
            super().__init__()
            self.owner = owner
            self.live: dict[int, int] = {}
            self.current = owner.baseline

        def _free(self, key: int) -> None:
            self.current -= self.live.pop(key, 0)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            import torch

            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                    continue
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key == 0 or key in self.live:
                    continue
                self.live[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.owner.peak = max(self.owner.peak, self.current)
                weakref.finalize(storage, self._free, key)
            return out

    return Counter


def _StorageCounter(owner: PeakMemory) -> Any:  # noqa: N802 - a class built on first use
    return _storage_counter_class()(owner)


def synthetic_batch(example_inputs: Sequence[Any], vocab: int, seed: int, step: int) -> list[Any]:
    """Step `step`'s batch: integer inputs uniform in [0, vocab), float inputs normal; fixed by seed and step."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    out: list[Any] = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and not x.is_floating_point():
            out.append(torch.randint(0, vocab, tuple(x.shape), generator=g, dtype=x.dtype))
        elif isinstance(x, torch.Tensor):
            out.append(torch.randn(tuple(x.shape), generator=g, dtype=x.dtype))
        else:
            out.append(x)
    return out


def _vocab_of(model: Any) -> int:
    from torch import nn

    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return int(m.num_embeddings)
    return 2


def _state_bytes(params: Sequence[Any], optimizer: Any) -> int:
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size() * (2 if p.grad is not None else 1)
    for state in optimizer.state.values():
        for v in state.values():
            if hasattr(v, "numel"):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


def _build_trainer(config: dict[str, Any], model: Any, example: Sequence[Any]) -> tuple[Any, Callable[..., Any]]:
    """(module holding this rank's parameters, step(batch) -> loss tensor) for the plan: the
    plan compiled and parallelized by shardc (pipelines included); `step` runs forward and
    backward over the plan's micro-batches."""
    from shardc.api import compile as shardc_compile
    from shardc.plan.parallel import ParallelPlan

    plan = ParallelPlan.parse(config["plan"])
    compiled = shardc_compile(model, tuple(example), plan=plan)
    default = default_loss(compiled.graph)
    if default is None:
        module = compiled.parallelize(model)
        return module, lambda batch: module.step(*batch)
    loss_fn, make_target = default
    module = compiled.parallelize(model, loss_fn=loss_fn)
    return module, lambda batch: module.step(*batch, target=make_target(batch))


def default_loss(graph: Any) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """For a model that returns no loss (an ONNX file ending at its logits): (loss_fn(outputs,
    target), target_of(batch)). Logits over token-id inputs train on next-token cross entropy
    (the target is the ids shifted by one); any other output on its mean square. None when the
    model's output already is a scalar loss."""
    import torch
    import torch.nn.functional as F

    out, first = graph.outputs[0].type, graph.inputs[0].type
    if out.rank == 0:
        return None
    if out.is_float and out.rank >= 2 and not first.is_float and tuple(first.shape) == tuple(out.shape[:-1]):
        def next_token(output: Any, target: Any) -> Any:
            logits = output[0] if isinstance(output, tuple) else output
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

        return next_token, lambda batch: batch[0].roll(-1, dims=-1)

    def mean_square(output: Any, target: Any) -> Any:
        return (output[0] if isinstance(output, tuple) else output).float().square().mean()

    return mean_square, lambda batch: torch.zeros(batch[0].shape[0])


def worker_main(config_path: str) -> int:
    """One rank of `shardc run`: build, parallelize, train `steps` AdamW steps, write `rank<k>.json`."""
    import statistics

    import torch
    import torch.distributed as dist

    config = json.loads(Path(config_path).read_text())
    out_dir = Path(config["out_dir"])
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        backend = choose_backend(int(os.environ["WORLD_SIZE"]), config.get("device"), fallback=False)
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=config.get("pg_timeout_s", PG_TIMEOUT_S)))
        from shardc.frontend.spec import load_model

        torch.manual_seed(config["seed"])
        loaded = load_model(config["model"], device="cpu")
        model, example = loaded.model, list(loaded.example_inputs)
        holder, step_fn = _build_trainer(config, model, example)
        params = [p for p in holder.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.get("lr", 1e-3))
        vocab = _vocab_of(model)
        fail_rank, fail_step = os.environ.get("SHARDC_FAIL_RANK"), int(os.environ.get("SHARDC_FAIL_STEP", "0"))
        losses: list[float] = []
        times: list[float] = []
        peak = 0
        for step in range(config["steps"]):
            if fail_rank is not None and int(fail_rank) == rank and step == fail_step:
                raise RuntimeError(f"injected failure (SHARDC_FAIL_RANK={fail_rank}, step {step})")
            batch = [x.to(device) if isinstance(x, torch.Tensor) else x
                     for x in synthetic_batch(example, vocab, config["seed"], step)]
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            if step == 0:  # memory is measured on the first step (it also creates the optimizer state)
                with PeakMemory(_state_bytes(params, optimizer), device) as mem:
                    loss = step_fn(batch)
                    loss.backward() if loss.requires_grad else None
                    optimizer.step()
                peak = mem.peak
            else:
                loss = step_fn(batch)
                loss.backward() if loss.requires_grad else None
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = loss.detach().reshape(()).to(device=device, dtype=torch.float32, copy=True)  # NCCL: on the GPU
            dist.all_reduce(value)  # tp/pp replicas agree, dp shares are averaged: the global mean
            value /= dist.get_world_size()
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            losses.append(float(value))
        timed = times[1:] or times
        write_json(out_dir / f"rank{rank}.json", {"rank": rank, "losses": losses, "step_times_s": times,
                                                  "median_step_time_s": statistics.median(timed),
                                                  "peak_memory_bytes": int(peak), "backend": backend,
                                                  "device": str(device)})
        dist.destroy_process_group()
        return 0
    except BaseException as err:
        (out_dir / f"rank{rank}.error").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
