"""The machine's speed right now: a fixed eager workload timed beside every measurement.

Why: this machine is a virtual one on a shared host, and the speed of its cores flips between
modes (a neighbour on the sibling hyperthread, the shared 300 MiB L3): the same training step
takes 41 ms for a few seconds, then 62 ms, then 41 again, in CPU time as in wall time. A cost
profile measured in one mode and a plan run in the other differ by 1.45x whatever the model.
So every timing that goes into the local profile is taken beside the probe workload (a small
MLP block's forward and backward, `probe_workload`) and expressed at the profile's reference
speed: `seconds * reference / probe_seconds_now`. The study times the probe beside each
measured step and predicts on the profile at that speed (`shardc.calibration.profile.at_speed`).

The probe is timed in this thread's CPU time, always from cold caches, (`time.thread_time`), so a process waiting for a
core (4 processes on 2 cores) does not read as a slow core; that share is the concurrent
benchmarks' business. All of this holds no state beyond one `SpeedIndex` object.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def probe_workload() -> Callable[[], None]:
    """One call: forward and backward of a small MLP block in eager mode (linear 128 -> 512, gelu,
    linear back, layer_norm) on a (8, 64, 128) batch: a few MiB of weights and activations, more
    than a core's L2, matmuls and vector ops in about a training step's proportions (3-5 ms)."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(8, 64, 128)
    w1, w2 = torch.randn(512, 128, requires_grad=True), torch.randn(128, 512, requires_grad=True)
    norm = torch.ones(128, requires_grad=True)

    def run() -> None:
        y = F.layer_norm(F.linear(F.gelu(F.linear(x, w1)), w2), (128,), norm)
        torch.autograd.grad(y.sum(), [w1, w2, norm])

    return run


WARMUP_CALLS = 8
EVICT_BYTES = 32 << 20  # many times a core's L2 (2 MiB): what a probe or an op finds after a step's others


class SpeedIndex:
    """CPU seconds per call of `probe_workload` now, against a reference (see the module doc).

    `reference` is the probe's time that the profile's figures are expressed at: measured once
    when this object is made (a calibration's start: any mode will do, everything after is
    relative to it), or given (a worker process normalising to its parent's reference)."""

    def __init__(self, reference: float | None = None, calls: int = 24) -> None:
        import torch

        self._run = probe_workload()
        self._buffer = torch.zeros(EVICT_BYTES // 4)
        self.readings: list[float] = []  # every `seconds` read, for `typical`
        for _ in range(WARMUP_CALLS):  # a fresh process's first calls fault their pages in
            self._run()
        self.reference = reference if reference is not None else self.seconds(calls)

    def seconds(self, calls: int = 1) -> float:
        """Median CPU seconds per probe call over `calls` calls, timed now."""
        samples = []
        for _ in range(max(1, calls)):
            # Always from cold caches: beside a training step or an op sample the probe finds its
            # data evicted, and a hot loop would read 1.3-1.5x faster than those.
            self._buffer.add_(1.0)
            t0 = time.thread_time()
            self._run()
            samples.append(time.thread_time() - t0)
        self.readings.append(statistics.median(samples))
        return self.readings[-1]

    def typical(self) -> float:
        """The median of every reading so far: the speed the machine mostly ran at, where the
        first reading (`reference`, when measured here) is whichever mode the cores were in."""
        return statistics.median(self.readings) if self.readings else self.reference

    def scale(self, probes: Sequence[float]) -> float:
        """The factor that takes a time measured beside `probes` (seconds per probe call) to the
        reference speed: `reference / median(probes)` (1 without probes)."""
        return self.reference / statistics.median(probes) if probes else 1.0


def speed_factor(probe_seconds: Sequence[float], reference: float) -> float:
    """How much slower than the reference the machine ran while `probe_seconds` were timed:
    `median(probe_seconds) / reference` (1 when either is missing)."""
    return statistics.median(probe_seconds) / reference if probe_seconds and reference > 0 else 1.0
