"""Measuring this machine: the `shardc calibrate` driver, which writes the local profile.

The profile's contents, its sharing model and its file are `shardc.calibration.profile`'s; the
measurements are the modules below this one: the speed probe every figure is taken beside
(`speed`), matmul rate, copy bandwidth and op latency on one core (`timing`), eager op and
optimizer costs (`ops`), and N processes at once under gloo (`gloo`): their matmul rate and copy
bandwidth while all run, gloo all_reduce, all_gather, reduce_scatter, broadcast and send/recv by
message size, the same collectives with every process computing between calls (`busy`: what a
blocking collective waits inside a step), shardc's collective-wrapper overhead and AdamW on
FSDP2's sharded parameters. Each
timing series is fitted here (`fit.fit_affine`): matmul time to `flops / A + h / A` (A the fp32
peak, h the half-rate FLOPs), collective time to `alpha + beta * bytes`.

Every figure is taken at one reference speed (`shardc.calibration.speed`): this machine's cores
flip between speeds (1.45x apart here) within seconds, so each measurement is timed beside a
probe workload and scaled to the probe's time at the calibration's start. The single-process
figures are CPU time (`time.thread_time`), so they hold on a busy machine; the concurrent ones
are work over wall time, so they say how much of a core a process gets.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from shardc.calibration import conditions
from shardc.calibration.fit import fit_affine
from shardc.calibration.gloo import COLLECTIVES, run_workers
from shardc.calibration.ops import measure_eager
from shardc.calibration.pipeline_steps import REFILL_REPS, split_refill
from shardc.calibration.profile import (
    PROFILE_VERSION,
    CollectiveFit,
    EagerCosts,
    LoadedCollective,
    LocalProfile,
    at_speed,
    default_profile_path,
    median_profile,
    read_profile,
    write_profile,
)
from shardc.calibration.speed import SpeedIndex
from shardc.calibration.timing import copy_bandwidth, kernel_latency, matmul_rate
from shardc.hardware import format_bytes
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import torch_dtype

CONCURRENT_MATMUL_N = 256  # the concurrent benchmark's matmul size


def _machine_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _settings(quick: bool) -> dict[str, Any]:
    """Sizes, budgets and repetitions of one calibration (`quick`: fewer, shorter); the gloo
    workers get the same dictionary."""
    return {"quick": quick, "sizes": (64, 128, 256, 512) if quick else (64, 128, 256, 512, 768, 1024),
            "budget": 0.05 if quick else 0.25, "matmul_n": CONCURRENT_MATMUL_N, "copy_numel": 1 << 22,
            "window": 0.2 if quick else 0.5,
            "numels": (16, 1024, 16384, 262144, 1 << 20) if quick else (16, 1024, 8192, 65536, 262144, 1 << 20, 1 << 22),
            "max_reps": 20 if quick else 50, "point_budget": 0.03 if quick else 0.08,
            "loaded_numels": (16, 16384) if quick else (16, 16384, 262144), "loaded_trials": 3 if quick else 5}


def _measure_alone(cfg: dict[str, Any], say: Callable[[str], None], step: Callable[[], None]) -> dict[str, Any]:
    """The single-process figures, at one intra-op thread, each at the reference speed of a
    `SpeedIndex` made first (its reference goes into `cfg` for the gloo workers): the fields of
    `LocalProfile` they fill, by name. `say` names the step running, `step` marks one done."""
    import torch

    quick, budget = cfg["quick"], cfg["budget"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        say("speed reference")
        speed = SpeedIndex()  # every figure below is taken to this speed (`shardc.calibration.speed`)
        cfg["speed_reference"] = speed.reference
        say("matmul fp32 by size")
        points = tuple((n, matmul_rate(n, torch.float32, budget, speed)) for n in cfg["sizes"])
        fit = fit_affine([2.0 * n ** 3 for n, _ in points], [2.0 * n ** 3 / r for n, r in points])
        peak = 1.0 / fit.beta if fit.beta > 0 else max(r for _, r in points)
        step()
        say("matmul bf16/fp16")
        ref = dict(points)[256]
        ratios = tuple((name, matmul_rate(256, torch_dtype(name), budget, speed) / ref) for name in ("bf16", "fp16"))
        step()
        say("memory bandwidth")
        bandwidth = copy_bandwidth(cfg["copy_numel"] * (1 if quick else 4), budget, speed)
        step()
        say("op latency")
        latency = kernel_latency(budget, speed=speed)
        step()
        eager = measure_eager(quick, say, speed)
        say("split backward's refill")  # about a second: the measurement, then the probe beside it
        refill = split_refill(REFILL_REPS // 2 if quick else REFILL_REPS)
        eager = replace(eager, split_backward_per_byte=refill * speed.scale([speed.seconds(3)]))
        step()
    finally:
        torch.set_num_threads(threads)
    return {"matmul_points": points, "peak_fp32": peak, "matmul_half_flops": fit.alpha * peak, "dtype_ratio": ratios,
            "memory_bandwidth": bandwidth, "kernel_latency": latency, "eager": eager,
            "probe_alone_rate": 1.0 / speed.reference, "typical_probe_s": speed.typical()}


def action_fit(eager: EagerCosts, small: float, large: float, small_bytes: float, large_bytes: float) -> EagerCosts:
    """`eager` with its action terms from `pipeline_steps.action_by_size`: the line through the two
    stages (s per action at no bytes, s per byte), flat past the larger stage's bytes; a larger
    stage that read cheaper (noise) gives no per-byte term, the cost the mean of the two."""
    slope = (large - small) / (large_bytes - small_bytes) if large_bytes > small_bytes else 0.0
    if slope <= 0:
        return replace(eager, pipeline_action=max(0.0, (small + large) / 2), pipeline_action_per_byte=0.0,
                       pipeline_action_bytes=0.0)
    return replace(eager, pipeline_action=max(0.0, small - slope * small_bytes), pipeline_action_per_byte=slope,
                   pipeline_action_bytes=large_bytes)


def _measure_together(nprocs: int, cfg: dict[str, Any], eager: EagerCosts) -> dict[str, Any]:
    """`nprocs` processes at once (`gloo._worker`): their `concurrent` row, collective fits and
    wrapper overhead, and `eager` with FSDP2's optimizer and per-micro-batch costs filled in
    where it has none yet (CPU time per op: the first count's will do)."""
    res = run_workers(nprocs, cfg)
    fits = []
    for op in COLLECTIVES:
        pts = tuple((int(b), float(t)) for b, t in res[op])
        fits.append(CollectiveFit(op, nprocs, pts, fit_affine([b for b, _ in pts], [t for _, t in pts])))
    if not eager.sharded_optimizer_per_tensor:
        eager = replace(eager, sharded_optimizer_per_tensor=res["sharded_optimizer"][0],
                        sharded_optimizer_per_param=res["sharded_optimizer"][1],
                        fsdp_per_tensor=res["fsdp_overhead"][0], fsdp_per_param=res["fsdp_overhead"][1])
    if not eager.pipeline_action and res.get("pipeline_overhead"):  # CPU per action: the first count's will do
        eager = replace(eager, pipeline_action=float(res["pipeline_overhead"][0]),
                        split_backward_per_tensor=float(res["pipeline_overhead"][1]))
    if res.get("action_by_size"):  # an action by its stage's size: each count replaces the last (the largest wins)
        eager = action_fit(eager, *(float(x) for x in res["action_by_size"]))
    steps = tuple((str(w), nprocs, int(g), float(c), float(a), float(b)) for w, g, c, a, b in res.get("sync_steps", ()))
    loaded = tuple(LoadedCollective(str(r["op"]), int(r["running"]), int(r["group"]),
                                    tuple((int(b), float(t), float(i), float(s)) for b, t, i, s in r["points"]))
                   for r in res.get("loaded_collectives", ()))
    # the probe under a training load (`calibration.loaded`); workers before it: among the measurements
    probe = res.get("loaded_probe_s", res["probe_s"])
    return {"concurrent": (nprocs, res["flops"], res["bandwidth"]), "collectives": fits, "probe_s": probe,
            "wrapper_overhead": (nprocs, float(res["wrapper_overhead"])), "eager": eager, "sync_steps": steps,
            "loaded_collectives": loaded}


BUSY_CHOICES = ("refuse", "record")
_WARNED: dict[str, str] = {}  # profile path -> the `created` of the busy profile already reported


def run_calibration(path: str | Path | None = None, *, quick: bool = False, nprocs: Sequence[int] = (2, 4),
                    console: Any = None, show: bool = True, summary: bool = False, busy: str = "refuse",
                    wait_s: float = 60.0, draws: int | None = None) -> LocalProfile:
    """Measure this machine (see the module doc) and write the profile to `path` atomically.

    Takes about 40 s per draw on an idle 2-core machine (`quick=True`: about 15 s per process count, fewer
    sizes and repetitions). `draws` (default 3, 1 with `quick`): the whole measurement is taken that
    many times, one after the other (single-process, then each process count, then again), and every
    figure is the median of its draws (`profile.median_profile`). One draw is one moment of a shared
    machine: two quiet calibrations hours apart read eager per-call costs 2.7x apart and a 2-process
    in-step wait of 10 against 208 us, and every plan's prediction moved with them. `console` is a
    rich Console (default: stderr) for the progress bar (`show`) and, with `summary=True`, the
    `profile_tables` once done (else call `print_profile`).

    Quiet first (`shardc.calibration.conditions`): it waits up to `wait_s` seconds for other
    processes to go quiet, and looks again after measuring; a machine that became busy meanwhile
    is measured once more. `busy="refuse"`: a busy machine (before, or after both attempts) is a
    ShardcError and nothing is written; `"record"`: the profile is measured anyway and records
    how busy the machine was (`LocalProfile.conditions`), which every command using it reports.
    """
    if busy not in BUSY_CHOICES:
        raise ValueError(f"busy={busy!r}: expected one of {BUSY_CHOICES}")
    from rich.console import Console
    from rich.progress import Progress

    draws = (1 if quick else 3) if draws is None else draws
    if draws < 1:
        raise ShardcError(f"--draws {draws}: a calibration takes at least one draw", hint="pass --draws 1 or more")
    console = console or Console(stderr=True)
    target = Path(path) if path is not None else default_profile_path()
    for attempt in (1, 2):
        with Progress(console=console, transient=True, disable=not show) as progress:
            task = progress.add_task("calibrating", total=(5 + len(nprocs)) * draws)
            say = partial(_describe, progress, task)
            before = conditions.wait_for_quiet(wait_s, say)
            if before[0] > conditions.BUSY_CORES and busy == "refuse":
                raise _busy_error(before, f"for {wait_s:.0f} s")
            taken = [_measure(quick, nprocs, partial(_in_draw, say, d, draws), partial(progress.advance, task))
                     for d in range(draws)]
            profile = median_profile(taken)
        after = conditions.look()
        seen = conditions.conditions(before, after, attempt)
        profile = replace(profile, conditions=seen)
        if not seen.busy or busy == "record":
            break
        if attempt == 2:
            raise _busy_error(after, "while it was measured, twice")
        console.print(f"the machine became busy while it was measured ({seen.describe()}); measuring again")
    write_profile(profile, target)
    for name, low, high in draws_disagree(taken):
        console.print(f"[yellow]note:[/] the {len(taken)} draws disagree on {name}: {low:.3g} to {high:.3g} "
                      f"({high / low:.2f}x); the profile keeps their median, and a plan priced on this machine "
                      "is as uncertain (`shardc calibrate --draws 5` takes more)")
    if seen.busy:
        console.print(f"[yellow]warning:[/] this profile was measured on a busy machine: {seen.describe()}; "
                      "rerun `shardc calibrate` when the machine is quiet")
    if summary:
        print_profile(profile, console, path=target)
    return profile


DRAW_SPREAD = 1.25  # draws further apart than this on a headline figure are reported (`draws_disagree`)


def draws_disagree(draws: Sequence[LocalProfile], spread: float = DRAW_SPREAD) -> list[tuple[str, float, float]]:
    """The headline figures on which the draws of one calibration lie more than `spread` apart, as
    (name, lowest, highest): the compute rate alone and among the most processes measured, the copy
    bandwidth, the eager matmul's per-call cost and the collective wrapper's per-call overhead. The
    in-step waits are left out: they scatter 0-200 us between quiet draws (that is why there are draws)."""
    if len(draws) < 2:
        return []
    most = max((n for n, _, _ in draws[0].concurrent), default=1)
    figures: dict[str, Callable[[LocalProfile], float]] = {
        "the fp32 matmul rate (GFLOP/s)": lambda p: p.peak_fp32 / 1e9,
        f"the matmul rate among {most} processes (GFLOP/s)": lambda p: p.per_process_flops(most) / 1e9,
        "the copy bandwidth (GB/s)": lambda p: p.memory_bandwidth / 1e9,
        "an eager matmul's call (us)": lambda p: p.eager.fit("matmul").fwd_call * 1e6 if p.eager else 0.0,
        f"the collective wrapper's call among {most} processes (us)": lambda p: p.call_overhead(most) * 1e6,
    }
    out = []
    for name, read in figures.items():
        values = [read(p) for p in draws]
        low, high = min(values), max(values)
        if low > 0 and high / low > spread:
            out.append((name, low, high))
    return out


def _describe(progress: Any, task: Any, what: str) -> None:
    progress.update(task, description=what)


def _in_draw(say: Callable[[str], None], draw: int, draws: int, what: str) -> None:
    say(f"draw {draw + 1}/{draws}: {what}" if draws > 1 else what)


def _busy_error(seen: tuple[float, float], when: str) -> ShardcError:
    return ShardcError(f"this machine is busy: other processes used {seen[0]:.1f} cores ({when}; load average "
                       f"{seen[1]:.1f}), and a profile measured now would price every plan for a slower machine",
                       hint="stop what else runs and rerun `shardc calibrate`, or pass --allow-busy to measure "
                            "anyway (the profile records it and every command using it says so)")


def _measure(quick: bool, nprocs: Sequence[int], say: Callable[[str], None], step: Callable[[], None]
             ) -> LocalProfile:
    """One measurement of everything (module doc), `say` naming the step running."""
    import torch

    cfg = _settings(quick)
    alone = _measure_alone(cfg, say, step)
    eager: EagerCosts = alone.pop("eager")
    typical = alone.pop("typical_probe_s")
    concurrent, fits, overhead, sync_steps, contention, loaded = [], [], [], [], [], []
    for n in nprocs:
        say(f"{n} processes: matmul, copy, gloo collectives")
        together = _measure_together(n, cfg, eager)
        concurrent.append(together["concurrent"])
        fits += together["collectives"]
        overhead.append(together["wrapper_overhead"])
        sync_steps += together["sync_steps"]
        loaded += together["loaded_collectives"]
        contention.append((n, together["probe_s"] / typical))
        eager = together["eager"]
        step()
    profile = LocalProfile(
        PROFILE_VERSION, datetime.now(UTC).isoformat(timespec="seconds"), _cpu_name(), os.cpu_count() or 1,
        _machine_memory(), torch.__version__, quick, concurrent=tuple(concurrent), collectives=tuple(fits),
        eager=eager, concurrent_matmul_n=CONCURRENT_MATMUL_N, wrapper_overhead=tuple(overhead),
        sync_steps=tuple(sync_steps), contention=tuple(contention), loaded_collectives=tuple(loaded), **alone)
    return at_typical_speed(profile, typical)


def at_typical_speed(profile: LocalProfile, typical_probe_s: float) -> LocalProfile:
    """`profile` re-expressed at the speed the machine mostly ran at while it was measured.

    Every figure was first taken to the probe's time at the calibration's start, which is
    whichever of the cores' modes (1.45x apart) they happened to be in; a plan predicted before
    it runs (`shardc study`, `shardc plan` for `local`) meets the usual mode, so the reference is
    moved to the median of all the probe's readings through the calibration."""
    start = 1.0 / profile.probe_alone_rate if profile.probe_alone_rate > 0 else 0.0
    if start <= 0 or typical_probe_s <= 0:
        return profile
    return replace(at_speed(profile, typical_probe_s / start), probe_alone_rate=1.0 / typical_probe_s)


def load_profile(path: str | Path | None = None, *, calibrate_if_missing: bool = True) -> LocalProfile:
    """The cached profile (`profile.read_profile`); measured (and cached) when it is missing or
    from another version, unless `calibrate_if_missing=False` (then the ShardcError stands).

    A profile measured on a busy machine is not used silently: when the machine is quiet now it
    is measured again (and cached), else a warning names how busy it was. Measuring here waits
    less for quiet than `shardc calibrate`, takes one draw (a first command should not wait minutes;
    `shardc calibrate` takes the median of three) and records a busy machine rather than refusing."""
    from rich.console import Console

    console = Console(stderr=True)
    try:
        profile = read_profile(path)
    except ShardcError as err:
        if not calibrate_if_missing:
            raise
        console.print(f"{err.message}; measuring this machine once (`shardc calibrate` redoes it)")
        return run_calibration(path, console=console, busy="record", wait_s=20.0, draws=1)
    if not profile.busy or profile.conditions is None or _WARNED.get(str(path)) == profile.created:
        return profile
    _WARNED[str(path)] = profile.created  # look and warn once per process and profile, not per command step
    if calibrate_if_missing and conditions.look()[0] <= conditions.BUSY_CORES:
        console.print(f"the local profile was measured on a busy machine ({profile.conditions.describe()}); "
                      "the machine is quiet now, measuring it again")
        return run_calibration(path, console=console, busy="record", wait_s=0.0, draws=1)
    console.print(f"[yellow]warning:[/] the local profile was measured on a busy machine "
                  f"({profile.conditions.describe()}); predictions for `local` clusters are off by as much; "
                  "rerun `shardc calibrate` when the machine is quiet")
    return profile


def profile_tables(profile: LocalProfile) -> list[Any]:
    """The profile as rich tables: compute and memory per process count, then collectives."""
    from rich.table import Table

    compute = Table(title=f"local profile: {profile.machine}, {profile.cores} cores, "
                          f"{format_bytes(profile.memory_bytes)}, torch {profile.torch_version}")
    for col in ("processes", "fp32 matmul GFLOP/s", "half-rate size (MFLOP)", "copy GB/s", "op latency (us)"):
        compute.add_column(col, justify="right")
    for n in (1,) + tuple(n for n, _, _ in profile.concurrent):
        slow = profile.slowdown(n)
        bw = next((b for m, _, b in profile.concurrent if m == n), profile.memory_bandwidth)
        compute.add_row(str(n), f"{profile.per_process_flops(n) / 1e9:.2f}",
                        f"{profile.matmul_half_flops / slow / 1e6:.2f}", f"{bw / 1e9:.2f}",
                        f"{profile.kernel_latency * slow * 1e6:.2f}")
    comm = Table(title="gloo collectives: time = alpha + bytes / bandwidth")
    for col in ("collective", "processes", "alpha (us)", "bandwidth (GB/s)", "ring link: latency (us)", "GB/s"):
        comm.add_column(col, justify="right")
    for c in profile.collectives:
        ring = c.ring()
        comm.add_row(c.op, str(c.nprocs), f"{c.fit.alpha * 1e6:.1f}",
                     f"{1 / c.fit.beta / 1e9:.2f}" if c.fit.beta > 0 else "-",
                     f"{ring[1] * 1e6:.1f}" if ring else "-", f"{ring[0] / 1e9:.2f}" if ring else "-")
    for n, t in profile.wrapper_overhead:
        comm.add_row("shardc wrapper (extra per call)", str(n), f"{t * 1e6:.1f}", "-", "-", "-")
    for running, group in sorted({(c.running, c.group) for c in profile.loaded_collectives}):
        spread = statistics.median(p[3] for c in profile.loaded_collectives if (c.running, c.group) == (running, group)
                                   for p in c.points)
        comm.add_row(f"in-step wait, group of {group} (spread {spread:.2f})", str(running),
                     f"{profile.step_wait(running, group) * 1e6:.1f}", "-", "-", "-")
    tables = [compute, comm]
    if profile.sync_steps:
        sync = Table(title="a synchronising step beyond the same step without data parallelism (wall time, "
                           "cores shared)")
        for col in ("wrapper", "processes", "group", "per step (us)", "per tensor (us)", "per element (ns)"):
            sync.add_column(col, justify="right")
        for wrapper, count, group, step, tensor, element in profile.sync_steps:
            sync.add_row(wrapper, str(count), str(group), f"{step * 1e6:.1f}", f"{tensor * 1e6:.1f}",
                         f"{element * 1e9:.2f}")
        tables.append(sync)
    if profile.eager is not None:
        eager = Table(title="eager ops, 1 process: call (us) + per unit (ns per byte; per 1000 FLOPs for matmul)")
        for col in ("class", "forward call", "forward per unit", "backward call", "backward per unit"):
            eager.add_column(col, justify="right")
        for kind, f in profile.eager.kinds:
            unit = 1e12 if kind == "matmul" else 1e9
            eager.add_row(kind, f"{f.fwd_call * 1e6:.1f}", f"{f.fwd_per_unit * unit:.3f}", f"{f.bwd_call * 1e6:.1f}",
                          f"{f.bwd_per_unit * unit:.3f}")
        eager.add_row("optimizer", f"{profile.eager.optimizer_per_tensor * 1e6:.1f} per tensor",
                      f"{profile.eager.optimizer_per_param * 1e9:.2f} per element", "", "")
        eager.add_row("optimizer (FSDP2)", f"{profile.eager.sharded_optimizer_per_tensor * 1e6:.1f} per tensor",
                      f"{profile.eager.sharded_optimizer_per_param * 1e9:.2f} per element", "", "")
        eager.add_row("FSDP2 per micro-batch", f"{profile.eager.fsdp_per_tensor * 1e6:.1f} per tensor",
                      f"{profile.eager.fsdp_per_param * 1e9:.2f} per element", "", "")
        tables.append(eager)
    return tables


def print_profile(profile: LocalProfile, console: Any = None, *, path: Path | None = None) -> None:
    """Print `profile_tables` (and where the profile was written)."""
    from rich.console import Console

    console = console or Console()
    for table in profile_tables(profile):
        console.print(table)
    if path is not None:
        console.print(f"written to {path}")
