"""Whether this machine is quiet enough to measure: what other processes use of its cores.

Why: a profile measured while something else runs (another test run, a build) prices every plan
for a slower machine, and nothing downstream can tell: the README's study command missed by a
median 62% on such a profile and by 13% after a quiet recalibration. So `shardc calibrate`
looks before and after it measures.

Rule. Over a short window (`WINDOW_S`), the CPU time the whole machine spent busy (user, nice,
system, interrupts and steal: time a neighbour on the host took from this VM counts too, from
`/proc/stat`) less what this process and its children spent (`os.times`), in cores. Above
`BUSY_CORES` the machine is busy. Where `/proc/stat` does not exist the one-minute load average
less this process's own share stands in. `shardc calibrate` waits for quiet (up to a limit),
measures, looks again and measures once more when the machine became busy meanwhile; then it
refuses, unless told to record a busy profile (`LocalProfile.conditions` keeps what was seen,
and every command using the profile says so).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from shardc.calibration.profile import Conditions

WINDOW_S = 1.0  # long enough to see a test run or build; short beside a calibration (~1 min)
BUSY_CORES = 0.3  # other processes' CPU, in cores, above which a measurement would be skewed


def _busy_seconds() -> float | None:
    """CPU seconds the machine has spent busy since boot, all cores (None without /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:]]
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
    busy = sum(ticks[:3]) + sum(ticks[5:8])
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def others_busy(window: float = WINDOW_S, sleep: Callable[[float], None] = time.sleep) -> float:
    """Cores' worth of CPU that other processes used over the next `window` seconds (module rule)."""
    busy0, own0, t0 = _busy_seconds(), _own_seconds(), time.perf_counter()
    sleep(window)
    busy1, own1, elapsed = _busy_seconds(), _own_seconds(), time.perf_counter() - t0
    if busy0 is None or busy1 is None:
        return max(0.0, os.getloadavg()[0] - (own1 - own0) / max(elapsed, 1e-9))
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / max(elapsed, 1e-9)


def look(window: float = WINDOW_S) -> tuple[float, float]:
    """(other processes' cores over `window`, one-minute load average) now."""
    return others_busy(window), os.getloadavg()[0]


def wait_for_quiet(limit_s: float, say: Callable[[str], None] = lambda _: None,
                   window: float = WINDOW_S) -> tuple[float, float]:
    """`look` until the machine is quiet (other processes below `BUSY_CORES`) or `limit_s` seconds
    have passed; the last look. `say` hears what it waits for."""
    start = time.perf_counter()
    seen = look(window)
    while seen[0] > BUSY_CORES and time.perf_counter() - start < limit_s:
        say(f"waiting for quiet: other processes use {seen[0]:.1f} cores")
        seen = look(window)
    return seen


def conditions(before: tuple[float, float], after: tuple[float, float], attempts: int) -> Conditions:
    """What `shardc calibrate` saw (see `profile.Conditions`)."""
    return Conditions(others_before=round(before[0], 3), others_after=round(after[0], 3),
                      load_before=round(before[1], 2), load_after=round(after[1], 2),
                      cores=os.cpu_count() or 1, threshold=BUSY_CORES, attempts=attempts)
