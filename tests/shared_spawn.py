"""Several tests' multi-process jobs in one spawned process group, to keep the suite fast.

A test file whose tests each spawn `world` processes builds their jobs in one module fixture and
runs them in one group: the processes start, import torch and join gloo once (seconds per process
on a small machine) instead of once per test; each test then asserts on its own job's results.
A job is `(fn, args)`, run as `shardc.backends.torch.launch.spawn` runs a function:
`fn(rank, world, *args)` on every rank, in the order given, each on fresh models.

Failures still land on their test: a job whose arguments cannot be built (a plan that does not
compile) keeps that error and is left out of the launch; when the shared launch fails, every job
runs again alone, so that the failing job's test reports its own error and the others pass.

`map_apart` is the other saving: deterministic single-threaded setup work (solves with a fixed
seed, traces) spread over two processes of their own, since the suite runs one test at a time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from shardc.backends.torch.launch import FORKSERVER_PRELOAD, spawn
from shardc.ir.diagnostics import ShardcError

Job = tuple[Callable[..., Any], tuple[Any, ...]]


def run_jobs(rank: int, world: int, jobs: Sequence[Job]) -> list[Any]:
    """On every rank: each job's function in turn; this rank's results, one per job."""
    return [fn(rank, world, *args) for fn, args in jobs]


class SharedRuns:
    """Per job, every rank's result (rank-ordered), or the error that stopped it: `runs[i]`
    returns job i's per-rank results or raises its error."""

    def __init__(self, outcomes: list[list[Any] | BaseException]) -> None:
        self.outcomes = outcomes

    def __getitem__(self, index: int) -> list[Any]:
        got = self.outcomes[index]
        if isinstance(got, BaseException):
            raise got
        return got


def spawn_jobs(world: int, builders: Sequence[Callable[[], Job]], *, timeout_s: float) -> SharedRuns:
    """Build every job (`builders[i]()`), run those built in one group of `world` processes; on a
    failed launch, each alone (each with `timeout_s`)."""
    outcomes: list[list[Any] | BaseException] = []
    jobs: list[Job] = []
    for build in builders:
        try:
            jobs.append(build())
            outcomes.append([])
        except Exception as err:  # e.g. a plan that does not compile: that job's test fails with it
            outcomes.append(err)
    built = [i for i, got in enumerate(outcomes) if not isinstance(got, BaseException)]
    if not built:
        return SharedRuns(outcomes)
    try:
        per_rank = spawn(run_jobs, world, jobs, timeout_s=timeout_s)
        for k, i in enumerate(built):
            outcomes[i] = [results[k] for results in per_rank]
    except ShardcError as shared:
        if len(built) == 1:
            outcomes[built[0]] = shared
        else:
            for k, i in enumerate(built):
                try:
                    outcomes[i] = [results[0] for results in spawn(run_jobs, world, [jobs[k]], timeout_s=timeout_s)]
                except ShardcError as err:
                    outcomes[i] = err
    return SharedRuns(outcomes)


def apart_context() -> Any:
    """multiprocessing's forkserver context, its server preloaded as `launch.spawn`'s (one server
    per process, whichever starts it), or spawn where there is none."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def _adopt_environment(env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)


def map_apart(fn: Callable[[Any], Any], items: Iterable[Any], *, processes: int = 2) -> list[Any]:
    """`[fn(item) for item in items]`, computed on up to `processes` processes of their own (forked
    from multiprocessing's forkserver, each with this process's environment and working directory),
    results in order; an error raised by `fn` is raised here. For deterministic single-threaded work
    (a solve with a fixed seed, one worker and no wall-clock stop): the suite runs one test at a
    time, so a second core is otherwise idle. `fn` and each item and result must be picklable."""
    items = list(items)
    if len(items) <= 1 or processes <= 1:
        return [fn(item) for item in items]
    with ProcessPoolExecutor(min(processes, len(items)), mp_context=apart_context(), initializer=_adopt_environment,
                             initargs=(dict(os.environ),)) as pool:
        return list(pool.map(fn, items))
