"""Microbenchmarks of this machine, measured once and cached: the `local` cluster profile.

What is measured (CPU, fp32, one intra-op thread per process, as the gloo tests run):
- matmul throughput of square matmuls by size, fitted to `time = flops / A + h / A`, i.e.
  `rate(flops) = A * flops / (flops + h)`: the asymptote A is the device's fp32 peak (a CPU's
  achievable peak is what large matmuls reach, so `matmul_efficiency` is 1) and h is
  `matmul_half_flops`; bf16 and fp16 are measured at one size as a ratio to fp32;
- memory bandwidth of a large copy, and the fixed cost of one tiny op in eager training (kernel
  latency: a chain of tiny modules run forward under autograd, per module);
- eager costs per op class, forward and backward, and of the AdamW step (`calibrate_ops`: what
  the cost model charges a CPU with, in place of the roofline);
- with N processes started at once (N in `nprocs`, `calibrate_gloo`): the per-process matmul rate
  and copy bandwidth while all N run together, gloo all_reduce, all_gather, reduce_scatter,
  broadcast and send/recv times by message size, each fitted to `alpha + beta * bytes`, and
  AdamW's step on FSDP2's sharded DTensor parameters.

Every figure is taken at one reference speed (`shardc.calibration.speed`): this machine's cores flip
between speeds (1.45x apart here) within seconds, so each measurement is timed beside a probe
workload and scaled to the probe's time at the calibration's start. The study predicts a plan
on `at_speed(profile, factor)`, the factor read by the same probe beside the plan's steps.

The sharing model for `local_cluster(n)`: n processes share the cores, so a process computes
at `per_process(n)` = measured concurrent rate when n was measured, else
`single * min(n, cores) * scaling / n` with `scaling` the mean measured ratio of aggregate to
ideal. Everything a process does (matmul rate, bandwidth, op latency, eager op costs) slows by
the same factor; for the eager costs, measured alone, that factor is the 256 x 256 matmul rate
alone over the concurrent rate at that size (`eager_slowdown`), like against like. The single-
process figures are CPU time (`time.thread_time`), so they hold on a busy machine; the
concurrent ones are work over wall time, so they say how much of a core a process gets.
The link is chosen so that the cost model's ring formula for all_reduce,
`2(n-1) * latency + 2(n-1)/n * bytes / bandwidth`, reproduces the measured all_reduce fit.

The profile is a JSON file (default `$SHARDC_CACHE_DIR/local-profile.json`, else
`~/.cache/shardc/local-profile.json`), written atomically (temporary file, then rename).
Version 1 profiles (before eager costs) still load, with `eager=None`: the model then falls
back to the roofline, and `shardc calibrate` (or the study) measures them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shardc.calibration.gloo import COLLECTIVES, _run_workers
from shardc.calibration.ops import (
    _copy_bandwidth,
    _kernel_latency,
    _matmul_rate,
    eager_from_json,
    measure_eager,
)
from shardc.calibration.speed import SpeedIndex
from shardc.hardware import Cluster, DeviceSpec, EagerCosts, LinkSpec, format_bytes
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import torch_dtype
from shardc.ops.collectives import ring_traffic

PROFILE_VERSION = 4  # 4: figures at the probe's reference speed; 3: wrapper_overhead; 1-3 still load
CONCURRENT_MATMUL_N = 256  # the concurrent benchmark's matmul size


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """`time(bytes) = alpha + beta * bytes` (s, s/byte)."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


@dataclass(frozen=True, slots=True)
class CollectiveFit:
    """One collective at one process count: measured (bytes, seconds) points and their fit."""

    op: str
    nprocs: int
    points: tuple[tuple[int, float], ...]
    fit: AlphaBeta

    def link(self) -> LinkSpec | None:
        """The ring link (per-step latency, per-direction bandwidth) that reproduces this fit."""
        if self.op == "broadcast" or not self.points:  # gloo broadcasts along a tree: no ring reproduces it
            return None
        traffic = ring_traffic(self.op, self.nprocs)
        steps, volume = traffic.steps, traffic.fraction
        # A flat fit (noise hid the size dependence) gets the bandwidth the largest message
        # shows when all of its time is counted as transfer: a lower bound.
        biggest, seconds = max(self.points)
        bandwidth = volume / self.fit.beta if self.fit.beta > 0 else volume * biggest / seconds
        return LinkSpec(f"gloo-{self.op}", bandwidth, self.fit.alpha / steps)


@dataclass(frozen=True, slots=True)
class LocalProfile:
    """This machine, measured. Rates per process; `concurrent` is keyed by process count."""

    version: int
    created: str
    machine: str
    cores: int
    memory_bytes: int
    torch_version: str
    quick: bool
    matmul_points: tuple[tuple[int, float], ...]      # (square size n, FLOP/s), 1 process
    peak_fp32: float                                  # fitted asymptote A (FLOP/s)
    matmul_half_flops: float                          # fitted h (FLOPs)
    dtype_ratio: tuple[tuple[str, float], ...]        # bf16/fp16 matmul rate relative to fp32
    memory_bandwidth: float                           # bytes/s, 1 process
    kernel_latency: float                             # s per tiny op, 1 process
    concurrent: tuple[tuple[int, float, float], ...]  # (nprocs, FLOP/s, bytes/s) per process
    collectives: tuple[CollectiveFit, ...]
    eager: EagerCosts | None = None                   # eager op and optimizer costs, 1 process
    concurrent_matmul_n: int = 0                      # size of the concurrent matmul benchmark
    probe_alone_rate: float = 0.0                     # 1 / the reference speed's probe seconds (`shardc.calibration.speed`)
    wrapper_overhead: tuple[tuple[int, float], ...] = ()  # (nprocs, s per collective wrapper call)

    def call_overhead(self, nproc: int) -> float:
        """Seconds a shardc collective wrapper adds per call over `nproc` processes, from the
        nearest measured count (0 for profiles without the measurement)."""
        if not self.wrapper_overhead or nproc <= 1:
            return 0.0
        return min(self.wrapper_overhead, key=lambda c: (abs(c[0] - nproc), -c[0]))[1]

    def eager_slowdown(self, nproc: int) -> float:
        """How much slower one of `nproc` concurrent processes runs than alone, measured like
        against like: the lone rate of the concurrent benchmark's matmul size over its rate now."""
        alone = dict(self.matmul_points).get(self.concurrent_matmul_n, self.peak_fp32)
        return alone / self.per_process_flops(nproc) if nproc > 1 else 1.0

    def slowdown(self, nproc: int) -> float:
        """How much slower one of `nproc` concurrent processes runs than a process alone."""
        return self.peak_fp32 / self.per_process_flops(nproc)

    def per_process_flops(self, nproc: int) -> float:
        """Large-matmul fp32 FLOP/s of one process when `nproc` run at once (see module doc)."""
        if nproc <= 1:
            return self.peak_fp32
        for n, flops, _ in self.concurrent:
            if n == nproc:
                return flops
        ratios = [n * f / (self.peak_fp32 * min(n, self.cores)) for n, f, _ in self.concurrent]
        scaling = min(1.5, max(0.05, statistics.mean(ratios))) if ratios else 1.0
        return self.peak_fp32 * min(nproc, self.cores) * scaling / nproc

    def link(self, nproc: int) -> LinkSpec:
        """The gloo link for `nproc` processes, from the all_reduce fit of the nearest count."""
        fits = [c for c in self.collectives if c.op == "all_reduce" and c.link() is not None]
        if not fits:
            raise ShardcError("the local profile has no all_reduce measurement; rerun `shardc calibrate`")
        best = min(fits, key=lambda c: (abs(c.nprocs - nproc), -c.nprocs))
        link = best.link()
        assert link is not None
        sends = [c for c in self.collectives if c.op == "send_recv" and c.points]
        p2p = None
        if sends:  # a pipeline's send is far cheaper than an all_reduce's ring step on gloo
            near = min(sends, key=lambda c: (abs(c.nprocs - nproc), -c.nprocs)).fit
            bandwidth = 1.0 / near.beta if near.beta > 0 else link.bandwidth
            p2p = (near.alpha, bandwidth)
        # Every collective as measured, at each group size measured with no more processes than
        # these (a group of 2 among 4 processes: the 2-process fit; the others' load is the probe's).
        measured = tuple((c.op, c.nprocs, c.fit.alpha, c.fit.beta) for c in self.collectives
                         if c.op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast") and c.points
                         and c.nprocs <= max(nproc, 2))
        return LinkSpec(f"gloo-{best.nprocs}proc", link.bandwidth, link.latency,
                        call_overhead=self.call_overhead(nproc), p2p=p2p, measured=measured)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LocalProfile:
        if data.get("version") not in (1, 2, 3, PROFILE_VERSION):
            raise ValueError(f"profile version {data.get('version')!r}, expected {PROFILE_VERSION}")
        fits = tuple(CollectiveFit(c["op"], int(c["nprocs"]), tuple((int(b), float(t)) for b, t in c["points"]),
                                   AlphaBeta(**c["fit"])) for c in data["collectives"])
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k not in ("collectives", "eager")}
        for k in ("matmul_points", "dtype_ratio", "concurrent"):
            kwargs[k] = tuple(tuple(x) for x in data[k])
        kwargs["wrapper_overhead"] = tuple((int(n), float(t)) for n, t in data.get("wrapper_overhead", ()))
        return cls(**kwargs, collectives=fits, eager=eager_from_json(data.get("eager")))


# ---- fitting ---------------------------------------------------------------------------------

def fit_affine(xs: Sequence[float], ts: Sequence[float], scale: Sequence[float] | None = None) -> AlphaBeta:
    """Least squares of `t = alpha + beta * x` in relative error (points span decades), with
    alpha, beta >= 0 (a negative intercept is refitted through the origin, and vice versa).
    The error is relative to `scale` when given (e.g. the raw measurement a difference came from)."""
    if len(xs) != len(ts) or not xs or (scale is not None and len(scale) != len(ts)):
        raise ValueError("fit_affine needs matching, non-empty samples")
    w = [1.0 / (t * t) for t in (scale if scale is not None else ts)]
    sw, sx, st = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * t for wi, t in zip(w, ts))
    sxx, sxt = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    det = sw * sxx - sx * sx
    if det > 0:
        alpha, beta = (sxx * st - sx * sxt) / det, (sw * sxt - sx * st) / det
        if alpha >= 0 and beta >= 0:
            return AlphaBeta(alpha, beta)
    through_origin = AlphaBeta(0.0, max(sxt / sxx, 0.0)) if sxx > 0 else AlphaBeta(0.0, 0.0)
    constant = AlphaBeta(st / sw, 0.0)
    err = lambda f: sum(wi * (f.time(x) - t) ** 2 for wi, x, t in zip(w, xs, ts))  # noqa: E731
    return min((through_origin, constant), key=err)


# ---- the driver, the cache and the local cluster ---------------------------------------------

def default_profile_path() -> Path:
    """`$SHARDC_CACHE_DIR/local-profile.json`, else `~/.cache/shardc/local-profile.json`."""
    base = os.environ.get("SHARDC_CACHE_DIR")
    return Path(base) / "local-profile.json" if base else Path.home() / ".cache" / "shardc" / "local-profile.json"


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


def write_profile(profile: LocalProfile, path: Path) -> None:
    """Write atomically: a temporary file in the same folder, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(profile.to_json(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_calibration(path: str | Path | None = None, *, quick: bool = False, nprocs: Sequence[int] = (2, 4),
                    console: Any = None, show: bool = True, summary: bool = False) -> LocalProfile:
    """Measure this machine (see the module doc) and write the profile to `path` atomically.

    Takes about 40 s on an idle 2-core machine (`quick=True`: about 15 s per process count, fewer sizes and
    repetitions). `console` is a rich Console (default: stderr) for the progress bar (`show`)
    and, with `summary=True`, the `profile_tables` once done (else call `print_profile`).
    """
    import torch
    from rich.console import Console
    from rich.progress import Progress

    console = console or Console(stderr=True)
    target = Path(path) if path is not None else default_profile_path()
    sizes = (64, 128, 256, 512) if quick else (64, 128, 256, 512, 768, 1024)
    budget = 0.05 if quick else 0.25
    numels = (16, 1024, 16384, 262144, 1 << 20) if quick else (16, 1024, 8192, 65536, 262144, 1 << 20, 1 << 22)
    cfg: dict[str, Any] = {"matmul_n": CONCURRENT_MATMUL_N, "copy_numel": 1 << 22, "window": 0.2 if quick else 0.5,
           "numels": numels, "max_reps": 20 if quick else 50, "point_budget": 0.03 if quick else 0.08}
    threads = torch.get_num_threads()
    with Progress(console=console, transient=True, disable=not show) as progress:
        task = progress.add_task("calibrating", total=5 + len(nprocs))
        try:
            torch.set_num_threads(1)
            progress.update(task, description="speed reference")
            speed = SpeedIndex()  # every figure below is taken to this speed (`shardc.calibration.speed`)
            cfg["speed_reference"] = speed.reference
            progress.update(task, description="matmul fp32 by size")
            points = tuple((n, _matmul_rate(n, torch.float32, budget, speed)) for n in sizes)
            fit = fit_affine([2.0 * n ** 3 for n, _ in points], [2.0 * n ** 3 / r for n, r in points])
            peak = 1.0 / fit.beta if fit.beta > 0 else max(r for _, r in points)
            progress.advance(task)
            progress.update(task, description="matmul bf16/fp16")
            ref = dict(points)[256]
            ratios = tuple((name, _matmul_rate(256, torch_dtype(name), budget, speed) / ref) for name in ("bf16", "fp16"))
            progress.advance(task)
            progress.update(task, description="memory bandwidth")
            bandwidth = _copy_bandwidth(cfg["copy_numel"] * (1 if quick else 4), budget, speed)
            progress.advance(task)
            progress.update(task, description="op latency")
            latency = _kernel_latency(budget, speed=speed)
            progress.advance(task)
            eager = measure_eager(quick, lambda what: progress.update(task, description=what), speed)
            probe_rate = 1.0 / speed.reference
            progress.advance(task)
        finally:
            torch.set_num_threads(threads)
        concurrent, fits, overhead = [], [], []
        for n in nprocs:
            progress.update(task, description=f"{n} processes: matmul, copy, gloo collectives")
            res = _run_workers(n, cfg)
            concurrent.append((n, res["flops"], res["bandwidth"]))
            overhead.append((n, float(res["wrapper_overhead"])))
            for op in COLLECTIVES:
                pts = tuple((int(b), float(t)) for b, t in res[op])
                fits.append(CollectiveFit(op, n, pts, fit_affine([b for b, _ in pts], [t for _, t in pts])))
            if not eager.sharded_optimizer_per_tensor:  # CPU time per op: the first count's will do
                eager = replace(eager, sharded_optimizer_per_tensor=res["sharded_optimizer"][0],
                                sharded_optimizer_per_param=res["sharded_optimizer"][1],
                                fsdp_per_tensor=res["fsdp_overhead"][0], fsdp_per_param=res["fsdp_overhead"][1])
            progress.advance(task)
    profile = LocalProfile(
        PROFILE_VERSION, datetime.now(UTC).isoformat(timespec="seconds"), _cpu_name(),
        os.cpu_count() or 1, _machine_memory(), torch.__version__, quick, points, peak, fit.alpha * peak,
        ratios, bandwidth, latency, tuple(concurrent), tuple(fits), eager, CONCURRENT_MATMUL_N, probe_rate,
        tuple(overhead))
    write_profile(profile, target)
    if summary:
        print_profile(profile, console, path=target)
    return profile


def load_profile(path: str | Path | None = None, *, calibrate_if_missing: bool = True) -> LocalProfile:
    """Read the cached profile; calibrate (and cache) when it is missing or from another version."""
    target = Path(path) if path is not None else default_profile_path()
    try:
        return LocalProfile.from_json(json.loads(target.read_text()))
    except FileNotFoundError:
        problem = f"no local profile at {target}"
    except (ValueError, KeyError, TypeError) as err:
        problem = f"local profile {target} is unreadable or out of date: {err}"
    if not calibrate_if_missing:
        raise ShardcError(problem, hint="run `shardc calibrate` to measure this machine")
    from rich.console import Console

    console = Console(stderr=True)
    console.print(f"{problem}; measuring this machine once (`shardc calibrate` redoes it)")
    return run_calibration(target, console=console)


def at_speed(profile: LocalProfile, factor: float) -> LocalProfile:
    """`profile` on this machine running `factor` times slower than the profile's reference speed
    (`shardc.calibration.speed`: the probe workload's time now over its reference time): everything a process
    does, computing, copying, launching, collective calls, takes `factor` times as long."""
    if factor <= 0:
        raise ValueError(f"speed factor must be positive, got {factor}")
    f = float(factor)
    fits = tuple(CollectiveFit(c.op, c.nprocs, tuple((b, t * f) for b, t in c.points),
                               AlphaBeta(c.fit.alpha * f, c.fit.beta * f)) for c in profile.collectives)
    return replace(
        profile, matmul_points=tuple((n, r / f) for n, r in profile.matmul_points), peak_fp32=profile.peak_fp32 / f,
        memory_bandwidth=profile.memory_bandwidth / f, kernel_latency=profile.kernel_latency * f,
        concurrent=tuple((n, fl / f, bw / f) for n, fl, bw in profile.concurrent), collectives=fits,
        eager=profile.eager.scaled(f) if profile.eager is not None else None,
        wrapper_overhead=tuple((n, t * f) for n, t in profile.wrapper_overhead))


def local_cluster(nproc: int, profile: LocalProfile | None = None) -> Cluster:
    """This machine as one node of `nproc` CPU processes sharing its cores and memory (gloo links)."""
    if nproc < 1:
        raise ShardcError(f"local cluster needs >= 1 process, got {nproc}")
    prof = profile or load_profile()
    slow = max(1.0, prof.slowdown(nproc))  # sharing never makes a process faster than alone
    flops = prof.per_process_flops(nproc)
    peaks = (("fp32", flops),) + tuple((d, flops * r) for d, r in prof.dtype_ratio)
    bandwidth = next((b for n, _, b in prof.concurrent if n == nproc), prof.memory_bandwidth / slow)
    memory = prof.memory_bytes // nproc
    eager = prof.eager.scaled(max(1.0, prof.eager_slowdown(nproc))) if prof.eager is not None else None
    device = DeviceSpec(f"local-cpu/{nproc}", peaks, memory, bandwidth, 1.0, prof.matmul_half_flops / slow,
                        prof.kernel_latency * slow, bandwidth, memory, eager)
    link = prof.link(nproc)
    return Cluster(device, 1, nproc, link, link, f"local{nproc}")


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
        link = c.link()
        comm.add_row(c.op, str(c.nprocs), f"{c.fit.alpha * 1e6:.1f}",
                     f"{1 / c.fit.beta / 1e9:.2f}" if c.fit.beta > 0 else "-",
                     f"{link.latency * 1e6:.1f}" if link else "-", f"{link.bandwidth / 1e9:.2f}" if link else "-")
    for n, t in profile.wrapper_overhead:
        comm.add_row("shardc wrapper (extra per call)", str(n), f"{t * 1e6:.1f}", "-", "-", "-")
    tables = [compute, comm]
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
