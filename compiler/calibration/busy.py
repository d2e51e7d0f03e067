"""Collectives as a training step meets them: every rank computes between calls.

Why: the calibration's other collective timings (`gloo._time_calls`) run call after call with
every peer waiting inside the collective, so a peer is always on a core when a message arrives.
Inside a step a collective follows compute, and on this machine the processes share the cores
(4 on 2): when a rank enters a collective its peer may still be computing, or be descheduled
while another process runs, and gloo's own threads take a core from compute. Priced by the idle
figures, the communication-heavy plans of the study ran 13-49% slower than predicted (session 6,
study D: tp=2,sp=1 measured 60.6 ms of communication where 33.3 were priced; a tp=2 group
among 4 processes was priced by the 2-process fit, measured with the other 2 idle).

Rule: every one of the `running` processes joins groups of `group` ranks (consecutive ranks,
as a mesh's innermost axis) and alternates a fixed piece of compute (`WORK_N` square matmuls,
about a layer's op) with one collective on its group; the same loop without the collective is
timed beside it, and the collective alone called back to back (the idle figure), in the same
trial. A call's in-step cost is the slowest rank's time per iteration with the collective less
its time per iteration without: the latency, the waits for a peer that is not on a core, and the
CPU gloo's threads take from compute, together. Each point is the median of `trials` trials,
with the spread of the in-step cost ((max - min) / median over the trials); the idle figure
measured beside it lets the pricing (`LocalProfile.step_wait`) take a difference of two timings
made under the same conditions, whatever else the machine was doing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

LOADED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
WORK_N = 160  # the compute between calls: a (160 x 160) matmul, ~8 MFLOP, a fraction of a ms
WORK_CALLS = 2
REPS = 6  # iterations per trial


def _groups(running: int, group: int) -> tuple[Any, list[int]]:
    """This rank's group of `group` consecutive ranks among `running` (every rank creates every
    group, as torch.distributed requires) and its members."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine, members = None, []
    for start in range(0, running, group):
        ranks = list(range(start, start + group))
        handle = dist.group.WORLD if group == running else dist.new_group(ranks)
        if rank in ranks:
            mine, members = handle, ranks
    return mine, members


def _call(op: str, numel: int, group: Any, members: list[int]) -> Callable[[], None]:
    """One collective of `numel` fp32 elements on `group` (all_gather: the gathered size; send_recv:
    the group's first two ranks pass the buffer there and back, counted as two messages)."""
    import torch
    import torch.distributed as dist

    size = len(members)
    n = max(numel // size, 1)
    x, part, out = torch.ones(numel), torch.ones(n), torch.empty(n * size)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, part, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, out, group=group)
    if op != "send_recv":
        raise ValueError(f"no loaded measurement for collective {op!r}; known: {', '.join(LOADED_OPS)}")
    me, first, second = dist.get_rank(), members[0], members[1]

    def send_recv() -> None:
        if me == first:
            dist.send(x, second)
            dist.recv(x, second)
        elif me == second:
            dist.recv(x, first)
            dist.send(x, first)
    return send_recv


def _trial(work: Callable[[], None], call: Callable[[], None], reps: int) -> tuple[float, float, float]:
    """(s per iteration of compute then the collective, s per iteration of the compute alone, s per
    collective called back to back with the peers waiting in it), this rank's wall time, side by side."""
    import torch.distributed as dist

    out = []
    for body in ((work, call), (work,), (call,)):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            for fn in body:
                fn()
        out.append((time.perf_counter() - t0) / reps)
    return out[0], out[1], out[2]


def summarize(extra: list[float]) -> tuple[float, float]:
    """(median, spread) of one point's trials, each the seconds a call added to an iteration
    (negative readings, noise on a call cheaper than the noise, count as 0): the median is the
    figure, the spread `(max - min) / median` says how far the trials disagreed."""
    if not extra:
        raise ValueError("summarize needs at least one trial")
    values = [max(0.0, x) for x in extra]
    middle = statistics.median(values)
    return middle, (max(values) - min(values)) / middle if middle > 0 else 0.0


def loaded_collectives(running: int, groups: tuple[int, ...], numels: tuple[int, ...], trials: int,
                       scale: Callable[[], float]) -> list[dict[str, Any]]:
    """Per group size in `groups`, op in `LOADED_OPS` and message size in `numels` (fp32
    elements): the cost per call under a training load (module rule), `scale()` taking each op's
    figures to the profile's reference speed. Every rank calls it and gets the same rows:
    {"op", "running", "group", "points": [(bytes, in-step s, idle s, spread)]}."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(WORK_N, WORK_N), torch.randn(WORK_N, WORK_N)

    def work() -> None:
        for _ in range(WORK_CALLS):
            torch.mm(a, b)

    rows = []
    for group in groups:
        handle, members = _groups(running, group)
        for op in LOADED_OPS:
            calls = [_call(op, numel, handle, members) for numel in numels]
            for call in calls:  # connections set up and buffers touched before any timing
                call()
            samples = torch.zeros(len(numels), trials, 3, dtype=torch.float64)
            for t in range(trials):
                for i, call in enumerate(calls):
                    samples[i, t] = torch.tensor(_trial(work, call, REPS), dtype=torch.float64)
            dist.all_reduce(samples, op=dist.ReduceOp.MAX)  # the slowest rank's, each
            factor = scale()
            points = []
            per = 2 if op == "send_recv" else 1  # send_recv: one message, half the round trip
            for i, numel in enumerate(numels):
                trial = samples[i].tolist()
                in_step, spread = summarize([w - alone for w, alone, _ in trial])
                idle = statistics.median(x for _, _, x in trial)
                points.append((4 * numel, in_step / per * factor, idle / per * factor, spread))
            rows.append({"op": op, "running": running, "group": group, "points": points})
    return rows
