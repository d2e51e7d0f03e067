"""Timing on a core of one's own, and the profile's single-process benchmarks built on it.

Single-process figures are this thread's CPU time (`time.thread_time`): what a call costs on a
core of its own, however busy the machine is (how much of a core a process gets is what the
concurrent benchmarks of `shardc.calibration.gloo` measure). With a `SpeedIndex`, every figure is
taken to the probe's reference speed (`shardc.calibration.speed`): the core's own speed flips
between modes 1.45x apart within seconds on this machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from shardc.calibration.speed import EVICT_BYTES, SpeedIndex

COLD_BYTES = EVICT_BYTES  # what an op finds in its caches after the others of a step (`shardc.calibration.speed`)


def evict(buffer: Any) -> None:
    """Overwrite `buffer` (`COLD_BYTES`) so that the next call finds its data and code out of the
    core's caches, as each op of a training step does after the others ran (a hot loop would not)."""
    buffer.add_(1.0)


def timed(run: Callable[[], tuple[float, float]], budget: float, speed: SpeedIndex | None = None
          ) -> tuple[float, float]:
    """Median forward and backward seconds over repeated runs (>= 5, until `budget` is spent);
    with `speed`, one probe call follows each run and the medians are taken to its reference
    speed (`shardc.calibration.speed`: the machine's speed flips between modes within seconds)."""
    run()
    fwd: list[float] = []
    bwd: list[float] = []
    probes: list[float] = []
    start = time.perf_counter()
    while len(fwd) < 5 or (time.perf_counter() - start < budget and len(fwd) < 200):
        f, b = run()
        fwd.append(f)
        bwd.append(b)
        if speed is not None:
            probes.append(speed.seconds())
    scale = speed.scale(probes) if speed is not None else 1.0
    return statistics.median(fwd) * scale, statistics.median(bwd) * scale


def cpu_seconds(fn: Callable[[], object], budget: float, inner: int = 1, speed: SpeedIndex | None = None) -> float:
    """Median seconds per call of `fn` over repeated batches of `inner` calls, >= 3 batches, in
    this thread's CPU time (`time.thread_time`): what a call costs on a core of its own, however
    busy the machine is (sharing is what the concurrent benchmarks measure)."""
    fn()
    samples: list[float] = []
    # Probed before and after, not between samples: these loops run hot, and a probe would evict.
    probes = [speed.seconds(3)] if speed is not None else []
    start = time.perf_counter()
    while len(samples) < 3 or (time.perf_counter() - start < budget and len(samples) < 50):
        t0 = time.thread_time()
        for _ in range(inner):
            fn()
        samples.append((time.thread_time() - t0) / inner)
    if speed is not None:
        probes.append(speed.seconds(3))
    return statistics.median(samples) * (speed.scale(probes) if speed is not None else 1.0)


# ---- the profile's single-process benchmarks -----------------------------------------------------

def matmul_rate(n: int, dtype: Any, budget: float, speed: SpeedIndex | None = None) -> float:
    """FLOP/s of an (n x n) @ (n x n) matmul in `dtype` (a torch dtype)."""
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2.0 * n ** 3 / cpu_seconds(lambda: torch.mm(a, b), budget, speed=speed)


def copy_bandwidth(numel: int, budget: float, speed: SpeedIndex | None = None) -> float:
    """Bytes/s of copying `numel` fp32 elements, reads and writes counted."""
    import torch

    src, dst = torch.randn(numel), torch.empty(numel)
    return 2.0 * src.nbytes / cpu_seconds(lambda: dst.copy_(src), budget, speed=speed)


def kernel_latency(budget: float, chain: int = 32, speed: SpeedIndex | None = None) -> float:
    """The fixed cost of one op in eager training: a chain of tiny modules run forward with
    autograd recording (dispatch, autograd node, module call), per module. Backward costs about
    the same per op and input gradient, which is how the model charges it."""
    import torch

    mods = [torch.nn.GELU() for _ in range(chain)]
    x = torch.ones(2, 4, requires_grad=True)

    def forward() -> None:
        y = x
        for m in mods:
            y = m(y)

    return cpu_seconds(forward, budget, inner=4, speed=speed) / chain
