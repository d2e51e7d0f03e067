"""Contention under a training load: the speed probe timed while every process trains.

Why: a process among N on this machine does the same work in more CPU time than alone (shared
caches, the cores' sibling threads, the scheduler's switches evicting what it had cached). The
calibration used to read that from the probe at moments when all N ran the probe or waited in
collectives between measurements: 1.05x with 2 processes, 1.11x with 4 (the calibration of
`benchmarks/study-report/`). The study times the same probe beside every step of a plan, and
there it read 1.15-1.38x its reference during the 4-process plans (median 1.23) against
1.03-1.14x (median 1.07) during the 2-process ones; in four studies the 4-process median was
1.06-1.16x the 2-process one (1.11-1.16x in the last three), where the calibrations' two
figures differ by 1.05-1.07x: with four training processes on two cores a process loses about
10% more than the calibration said, and the 4-process plans ran 12-37% slower than predicted.

Rule: every one of the N processes trains a small MLP (the probe's shapes: 128 -> 512 -> 128 on
an (8, 64, 128) batch; forward, backward, its gradients all-reduced over all N as data
parallelism does, an SGD step) for a window of wall time, and after each step times the probe
(`SpeedIndex.seconds`, `PROBE_CALLS` calls from cold caches), as the study's worker times it
beside a plan's steps. The figure is the median of each process's readings, averaged over the
processes: CPU seconds per probe call under load, which over the probe's time alone is the
contention factor among N (`LocalProfile.contention`), a calibrated constant per process count.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

PROBE_CALLS = 2  # as the study's worker (`shardc.study.worker.PROBE_CALLS`)
MIN_STEPS = 4


def probe_under_load(speed: Any, window: float) -> float:
    """CPU seconds per probe call while every rank of the default group trains (module rule);
    every rank calls it, every rank gets the same figure."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(8, 64, 128)
    weights = [torch.randn(512, 128, requires_grad=True), torch.randn(128, 512, requires_grad=True)]
    size = sum(w.numel() for w in weights)
    flat = torch.zeros(size + 1)  # the gradients, and whether this rank wants another step

    def train_step(more: bool) -> bool:
        """One step; whether any rank wants another (all ranks get the same answer, so they stop
        together: a rank that stopped on its own clock alone left the others in an all_reduce)."""
        y = F.layer_norm(F.linear(F.gelu(F.linear(x, weights[0])), weights[1]), (128,))
        grads = torch.autograd.grad(y.square().mean(), weights)
        torch.cat([g.reshape(-1) for g in grads], out=flat[:size])
        flat[size] = 1.0 if more else 0.0
        dist.all_reduce(flat)  # the data-parallel sync: the ranks meet every step, as in a plan
        with torch.no_grad():
            offset = 0
            for w in weights:
                w.sub_(flat[offset:offset + w.numel()].view_as(w), alpha=1e-6)
                offset += w.numel()
        return bool(flat[size] > 0)

    dist.barrier()
    readings: list[float] = []
    start = time.perf_counter()
    more = True
    while more:
        wants = len(readings) + 1 < MIN_STEPS or time.perf_counter() - start < window
        more = train_step(wants)
        readings.append(speed.seconds(PROBE_CALLS))
    dist.barrier()
    mine = torch.tensor([statistics.median(readings)], dtype=torch.float64)
    dist.all_reduce(mine)
    return mine.item() / dist.get_world_size()
