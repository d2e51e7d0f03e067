"""The local profile: this machine as measured by `shardc calibrate`, its data and its file.

It is data, like a hardware preset, so it sits below `shardc.hardware` (tests/test_layering.py):
`hardware.local_cluster` turns it into the `local` cluster, and measuring it is the business of
the modules above (`shardc.calibration.local` drives them). What it holds (CPU, fp32, one
intra-op thread per process, as the gloo tests run):
- matmul throughput of square matmuls by size, fitted to `rate(flops) = A * flops / (flops + h)`
  (A the fp32 peak, h `matmul_half_flops`); bf16 and fp16 at one size as a ratio to fp32;
- memory bandwidth of a large copy, and the fixed cost of one tiny op in eager training;
- eager costs per op class, forward and backward, and of the AdamW step (`EagerCosts`: what the
  cost model charges a CPU with, in place of the roofline);
- per process count N measured: the per-process matmul rate and copy bandwidth while N run
  together, gloo collective times by message size with their `alpha + beta * bytes` fits, the
  extra cost of shardc's collective wrapper per call, and what a whole synchronising step adds
  under FSDP2 and under DDP per data-parallel group size among the N (`sync_steps`: wall time,
  sharing included), and the collectives again with every process computing between calls
  (`loaded_collectives`: what a blocking collective waits inside a step, `step_wait`).

Every figure is at one reference speed (`shardc.calibration.speed`); `at_speed` gives the profile
on the machine running some factor slower.

The sharing model: n processes share the cores, so a process computes at `per_process_flops(n)`
= the measured concurrent rate when n was measured, else `single * min(n, cores) * scaling / n`
with `scaling` the mean measured ratio of aggregate to ideal. Everything a process does slows by
the same factor; for the eager costs, measured alone, that factor is the lone rate of the
concurrent benchmark's matmul size over the concurrent rate (`eager_slowdown`), like against like.

The file: JSON (default `$SHARDC_CACHE_DIR/local-profile.json`, else
`~/.cache/shardc/local-profile.json`), written atomically (temporary file, then rename). Versions
1-4 still load: version 1 without eager costs (`eager=None`: the model falls back to the roofline),
before 3 without the wrapper overhead, before 4 not at a reference speed, before 5 without the
collectives timed under a training load (`LoadedCollective`, `step_wait`: 0).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shardc.ir.diagnostics import ShardcError
from shardc.ir.files import write_json_atomic
from shardc.ops.collectives import ring_traffic

PROFILE_VERSION = 5  # 5: loaded_collectives; 4: figures at the probe's reference speed; 3: wrapper_overhead


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

    def ring(self) -> tuple[float, float] | None:
        """(per-direction bandwidth bytes/s, per-step latency s) of the ring that reproduces this
        fit under the cost model's ring formula; None for a collective without a ring form."""
        if self.op == "broadcast" or not self.points:  # gloo broadcasts along a tree: no ring reproduces it
            return None
        traffic = ring_traffic(self.op, self.nprocs)
        steps, volume = traffic.steps, traffic.fraction
        # A flat fit (noise hid the size dependence) gets the bandwidth the largest message
        # shows when all of its time is counted as transfer: a lower bound.
        biggest, seconds = max(self.points)
        bandwidth = volume / self.fit.beta if self.fit.beta > 0 else volume * biggest / seconds
        return bandwidth, self.fit.alpha / steps


@dataclass(frozen=True, slots=True)
class LoadedCollective:
    """One collective timed inside a training-like loop (`shardc.calibration.busy`): `running`
    processes all computing between calls, in groups of `group` ranks; per message size the
    median over the trials of the seconds a call added to an iteration (in step), of the same
    call made back to back beside it (idle), and the in-step trials' spread ((max - min) / median)."""

    op: str
    running: int
    group: int
    points: tuple[tuple[int, float, float, float], ...]  # (bytes, in-step s, idle s, spread)

    def __post_init__(self) -> None:
        if self.group < 2 or self.running < self.group or any(min(p[1:]) < 0 for p in self.points):
            raise ValueError(f"loaded {self.op}: needs 2 <= group <= running and times, spreads >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class KernelFit:
    """Measured eager cost of one class of ops: forward `fwd_call + units * fwd_per_unit`, backward
    `bwd_call + units * bwd_per_unit` (s). A unit is a FLOP for matmuls and a byte of the forward's
    reads and writes for everything else; `*_call` is the per-call cost (dispatch, Python, autograd node)."""

    fwd_call: float
    fwd_per_unit: float
    bwd_call: float
    bwd_per_unit: float

    def __post_init__(self) -> None:
        if min(self.fwd_call, self.fwd_per_unit, self.bwd_call, self.bwd_per_unit) < 0:
            raise ValueError(f"kernel fit {self}: costs must be >= 0")

    def scaled(self, factor: float) -> KernelFit:
        return KernelFit(self.fwd_call * factor, self.fwd_per_unit * factor, self.bwd_call * factor,
                         self.bwd_per_unit * factor)


@dataclass(frozen=True, slots=True)
class EagerCosts:
    """Measured costs of eager-mode training on a CPU, per op class (`shardc.cost.compute.op_class`:
    matmul, elementwise, transcendental, norm, softmax, reduction, index, loss, dropout, view) or
    per op where one differs from its class (`linear`, `attention_matmul`, `masked_fill`, ...), and
    of the optimizer step with `zero_grad` (`optimizer_per_tensor` s per parameter tensor plus
    `optimizer_per_param` s per fp32 parameter element). A device with these is costed by them
    instead of the roofline (`kernel_latency`, `memory_bandwidth`, `matmul_efficiency`)."""

    kinds: tuple[tuple[str, KernelFit], ...]
    optimizer_per_tensor: float
    optimizer_per_param: float
    # The same step on parameters FSDP2 keeps as sharded DTensors (0: not measured, as plain)
    sharded_optimizer_per_tensor: float = 0.0
    sharded_optimizer_per_param: float = 0.0
    # FSDP2's own work per micro-batch of one unit (its hooks, the copies into and out of the
    # flat gather buffer, unsharded gradient accumulation), beyond the same forward and backward
    # unsharded, s per parameter tensor and per element of the unit (0: not measured)
    fsdp_per_tensor: float = 0.0
    fsdp_per_param: float = 0.0
    # A whole synchronising step beyond the same step without data parallelism, under FSDP2 (gather,
    # hooks, reduce, copies, waits) or DDP (hooks, buckets, all-reduce, waits), measured in wall time
    # with the processes sharing the cores as the cluster runs them: (wrapper "fsdp2" or "ddp", group
    # size, s per step, s per parameter tensor, s per element); () when not measured.
    # `hardware.local_cluster` fills it for its process count; it is not scaled by the sharing factor.
    sync_step: tuple[tuple[str, int, float, float, float], ...] = ()
    # torch.distributed.pipelining's own CPU per schedule action (a stage's forward, backward, input- or
    # weight-gradient call with its sends and receives) and, in a split backward, per parameter tensor of
    # the stage (its autograd graph walked per parameter): `calibration.pipeline_steps` (0: not measured)
    pipeline_action: float = 0.0
    split_backward_per_tensor: float = 0.0
    # A split backward keeps the stage's autograd graph (and the gradients captured for the weight pass)
    # while it runs, so what it allocates lands on memory the allocator had returned to the system:
    # CPU s per byte the stage saved for backward (`calibration.pipeline_steps.split_refill`; 0: not measured)
    split_backward_per_byte: float = 0.0
    # An action costs more on a bigger stage (its data cold after another process ran on the core):
    # CPU s per byte of the stage's weights and saved activations per micro-batch, beside
    # `pipeline_action`, up to `pipeline_action_bytes` (the largest stage measured; 0: not measured)
    pipeline_action_per_byte: float = 0.0
    pipeline_action_bytes: float = 0.0

    def action(self, stage_bytes: float) -> float:
        """CPU s of one schedule action on a stage holding `stage_bytes` (weights and saved
        activations per micro-batch)."""
        return self.pipeline_action + self.pipeline_action_per_byte * min(stage_bytes, self.pipeline_action_bytes)

    def fit(self, *keys: str) -> KernelFit:
        """The first measured fit among `keys` (an op name, then its class); else `elementwise`'s."""
        found = dict(self.kinds)
        return next((found[k] for k in keys if k in found), None) or found["elementwise"]

    def scaled(self, factor: float) -> EagerCosts:
        """Every cost times `factor` (a process sharing its core runs everything slower alike)."""
        return EagerCosts(tuple((k, f.scaled(factor)) for k, f in self.kinds), self.optimizer_per_tensor * factor,
                          self.optimizer_per_param * factor, self.sharded_optimizer_per_tensor * factor,
                          self.sharded_optimizer_per_param * factor, self.fsdp_per_tensor * factor,
                          self.fsdp_per_param * factor,
                          tuple((w, g, c * factor, a * factor, b * factor) for w, g, c, a, b in self.sync_step),
                          self.pipeline_action * factor, self.split_backward_per_tensor * factor,
                          self.split_backward_per_byte * factor, self.pipeline_action_per_byte * factor,
                          self.pipeline_action_bytes)

    def sync_step_time(self, wrapper: str, group: int, tensors: float, elements: float) -> float | None:
        """Seconds a whole synchronising step under `wrapper` ("fsdp2" or "ddp") adds for a unit of
        `tensors` parameter tensors and `elements` elements over `group` processes (the measured
        group size nearest, ties to the larger), or None when not measured."""
        fits = [f for f in self.sync_step if f[0] == wrapper]
        if not fits:
            return None
        _, _, c, a, b = min(fits, key=lambda f: (abs(f[1] - group), -f[1]))
        return c + a * tensors + b * elements

    def fsdp_measured(self) -> bool:
        """Whether FSDP2's per-micro-batch work was measured (profiles before it: no)."""
        return self.fsdp_per_tensor > 0 or self.fsdp_per_param > 0

    def optimizer(self, sharded: bool) -> tuple[float, float]:
        """(s per tensor, s per element) of the optimizer step on plain or FSDP2-sharded parameters."""
        if sharded and self.sharded_optimizer_per_tensor > 0:
            return self.sharded_optimizer_per_tensor, self.sharded_optimizer_per_param
        return self.optimizer_per_tensor, self.optimizer_per_param


def eager_from_json(data: dict[str, Any] | None) -> EagerCosts | None:
    """`EagerCosts` from its `dataclasses.asdict` form (None stays None; fields added later default to 0)."""
    if data is None:
        return None
    kinds = tuple((str(k), KernelFit(**f)) for k, f in data["kinds"])
    return EagerCosts(kinds, float(data["optimizer_per_tensor"]), float(data["optimizer_per_param"]),
                      float(data.get("sharded_optimizer_per_tensor", 0.0)),
                      float(data.get("sharded_optimizer_per_param", 0.0)),
                      float(data.get("fsdp_per_tensor", 0.0)), float(data.get("fsdp_per_param", 0.0)),
                      tuple((str(w), int(g), float(c), float(a), float(b))
                            for w, g, c, a, b in data.get("sync_step", ())),
                      float(data.get("pipeline_action", 0.0)), float(data.get("split_backward_per_tensor", 0.0)),
                      float(data.get("split_backward_per_byte", 0.0)),
                      float(data.get("pipeline_action_per_byte", 0.0)), float(data.get("pipeline_action_bytes", 0.0)))


@dataclass(frozen=True, slots=True)
class Conditions:
    """What the machine was doing while it was measured (`shardc.calibration.conditions`): other
    processes' CPU in cores before and after the measurements, the one-minute load average then,
    the core count, the busy threshold and how many times it was measured."""

    others_before: float
    others_after: float
    load_before: float
    load_after: float
    cores: int
    threshold: float
    attempts: int = 1

    @property
    def busy(self) -> bool:
        return max(self.others_before, self.others_after) > self.threshold

    def describe(self) -> str:
        """One line: how busy the machine was while measured."""
        return (f"other processes used {self.others_before:.1f} of {self.cores} cores before and "
                f"{self.others_after:.1f} after (load average {self.load_before:.1f} -> {self.load_after:.1f})")


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
    # (wrapper, nprocs running, group size, s per step, s per tensor, s per element): `EagerCosts.sync_step`
    sync_steps: tuple[tuple[str, int, int, float, float, float], ...] = ()
    conditions: Conditions | None = None  # how busy the machine was while measured (None: not recorded)
    # (nprocs, the probe's CPU time with nprocs running over its time alone): `contention_factor`
    contention: tuple[tuple[int, float], ...] = ()
    loaded_collectives: tuple[LoadedCollective, ...] = ()  # `step_wait`; () before version 5

    @property
    def busy(self) -> bool:
        """Whether it was measured on a busy machine (`Conditions.busy`; unrecorded: no)."""
        return self.conditions is not None and self.conditions.busy

    def sync_step_fits(self, nproc: int) -> tuple[tuple[str, int, float, float, float], ...]:
        """The synchronising-step fits measured with `nproc` processes running (else with the
        nearest count measured, ties to the larger), per wrapper and group size; () for profiles
        without them."""
        counts = {n for _, n, *_ in self.sync_steps}
        if not counts:
            return ()
        near = min(counts, key=lambda n: (abs(n - nproc), -n))
        return tuple((w, g, c, a, b) for w, n, g, c, a, b in self.sync_steps if n == near)

    def call_overhead(self, nproc: int) -> float:
        """Seconds a shardc collective wrapper adds per call over `nproc` processes, from the
        nearest measured count (0 for profiles without the measurement)."""
        if not self.wrapper_overhead or nproc <= 1:
            return 0.0
        return min(self.wrapper_overhead, key=lambda c: (abs(c[0] - nproc), -c[0]))[1]

    def step_wait(self, running: int, group: int) -> float:
        """Seconds a blocking collective over `group` ranks waits inside a training step with
        `running` processes beyond what the cost model prices it at otherwise (`LoadedCollective`):
        the median, over every op and message size measured with this group size and the nearest
        running count (ties to the larger), of the in-step time less the idle one. The idle one is
        the call made back to back beside it when the group is every process; for a smaller group
        it is the fit the model prices that group by (`nearest(op, group)`, measured with `group`
        processes running: the others' load belongs to the wait). Never below 0, nor below the
        wait with fewer processes running: a busier peer never prices a call cheaper. 0 when not
        measured (profiles before version 5)."""
        rows = [r for r in self.loaded_collectives if r.group == group]
        if not rows or group < 2:
            return 0.0
        near = min({r.running for r in rows}, key=lambda n: (abs(n - running), -n))
        waits = []
        for row in (r for r in rows if r.running == near):
            fit = self.nearest(row.op, group) if group < row.running else None
            waits += [step - (fit.fit.time(b) if fit is not None else idle) for b, step, idle, _ in row.points]
        fewer = [n for n in {r.running for r in rows} if n < near]
        below = self.step_wait(max(fewer), group) if fewer else 0.0
        return max(0.0, statistics.median(waits), below)

    def contention_factor(self, nproc: int) -> float:
        """How much more CPU time the same work takes in one of `nproc` processes running at once
        than alone (shared caches, memory and the cores' sibling threads), from the nearest
        measured count (1 alone or unmeasured); measured while every process trains
        (`shardc.calibration.loaded`; older profiles: among the calibration's measurements).
        Every other concurrent figure is taken to the reference speed by the probe timed beside
        it, which divides this factor out; a plan predicted before it runs
        (`hardware.local_cluster`) puts it back."""
        if nproc <= 1 or not self.contention:
            return 1.0
        return max(1.0, min(self.contention, key=lambda c: (abs(c[0] - nproc), -c[0]))[1])

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

    def nearest(self, op: str, nproc: int) -> CollectiveFit | None:
        """The measured fit of collective `op` at the process count nearest `nproc` (ties: the
        larger count), or None when `op` was not measured."""
        fits = [c for c in self.collectives if c.op == op and c.points]
        return min(fits, key=lambda c: (abs(c.nprocs - nproc), -c.nprocs)) if fits else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LocalProfile:
        """The profile from its JSON form, of any version from 1 to `PROFILE_VERSION`."""
        if data.get("version") not in (1, 2, 3, 4, PROFILE_VERSION):
            raise ValueError(f"profile version {data.get('version')!r}, expected {PROFILE_VERSION}")
        fits = tuple(CollectiveFit(c["op"], int(c["nprocs"]), tuple((int(b), float(t)) for b, t in c["points"]),
                                   AlphaBeta(**c["fit"])) for c in data["collectives"])
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k not in ("collectives", "eager")}
        for k in ("matmul_points", "dtype_ratio", "concurrent"):
            kwargs[k] = tuple(tuple(x) for x in data[k])
        kwargs["wrapper_overhead"] = tuple((int(n), float(t)) for n, t in data.get("wrapper_overhead", ()))
        kwargs["sync_steps"] = tuple((str(w), int(n), int(g), float(c), float(a), float(b))
                                     for w, n, g, c, a, b in data.get("sync_steps", ()))
        kwargs["conditions"] = Conditions(**data["conditions"]) if data.get("conditions") else None
        kwargs["contention"] = tuple((int(n), float(f)) for n, f in data.get("contention", ()))
        kwargs["loaded_collectives"] = tuple(
            LoadedCollective(str(c["op"]), int(c["running"]), int(c["group"]),
                             tuple((int(b), float(t), float(i), float(s)) for b, t, i, s in c["points"]))
            for c in data.get("loaded_collectives", ()))
        return cls(**kwargs, collectives=fits, eager=eager_from_json(data.get("eager")))


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
        wrapper_overhead=tuple((n, t * f) for n, t in profile.wrapper_overhead),
        loaded_collectives=tuple(replace(c, points=tuple((b, t * f, i * f, s) for b, t, i, s in c.points))
                                 for c in profile.loaded_collectives),
        sync_steps=tuple((w, n, g, c * f, a * f, b * f) for w, n, g, c, a, b in profile.sync_steps))


def median_profile(profiles: Sequence[LocalProfile]) -> LocalProfile:
    """One profile from several measurements of the same machine (`shardc calibrate --draws`):
    every measured figure is the median of its draws, field by field (a fit's alpha and beta, each
    point's time, each eager cost), so one draw taken in an odd moment of a shared machine (its
    per-call costs 2.7x another's, its in-step wait 20x) does not price every plan. The draws must
    have the same shape (the same settings); the identity fields (machine, sizes, counts) are the
    first's, `created` the last's."""
    if not profiles:
        raise ValueError("median_profile needs at least one profile")
    if len(profiles) == 1:
        return profiles[0]
    trees = [p.to_json() for p in profiles]
    merged = _median_tree(trees, "profile")
    merged["created"] = trees[-1]["created"]
    return LocalProfile.from_json(merged)


def _median_tree(values: list[Any], where: str) -> Any:
    """The element-wise median of JSON trees of one shape: floats by median, anything else (ints,
    strings, booleans, None) must agree or is the first's (`where` names a mismatch)."""
    first = values[0]
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
            raise ValueError(f"calibration draws differ in shape at {where}")
        return {k: _median_tree([v[k] for v in values], f"{where}.{k}") for k in first}
    if isinstance(first, (list, tuple)):
        if any(not isinstance(v, (list, tuple)) or len(v) != len(first) for v in values):
            raise ValueError(f"calibration draws differ in shape at {where}")
        return [_median_tree([v[i] for v in values], f"{where}[{i}]") for i in range(len(first))]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if numbers and any(isinstance(v, float) for v in values):
        return float(statistics.median(values))
    return first


# ---- the file ----------------------------------------------------------------------------------

def default_profile_path() -> Path:
    """`$SHARDC_CACHE_DIR/local-profile.json`, else `~/.cache/shardc/local-profile.json`."""
    base = os.environ.get("SHARDC_CACHE_DIR")
    return Path(base) / "local-profile.json" if base else Path.home() / ".cache" / "shardc" / "local-profile.json"


def read_profile(path: str | Path | None = None) -> LocalProfile:
    """The profile cached at `path` (default `default_profile_path()`); a ShardcError saying to run
    `shardc calibrate` when it is missing, unreadable or of an unknown version."""
    target = Path(path) if path is not None else default_profile_path()
    try:
        return LocalProfile.from_json(json.loads(target.read_text()))
    except FileNotFoundError:
        problem = f"no local profile at {target}"
    except (ValueError, KeyError, TypeError) as err:
        problem = f"local profile {target} is unreadable or out of date: {err}"
    raise ShardcError(problem, hint="run `shardc calibrate` to measure this machine")


def write_profile(profile: LocalProfile, path: Path) -> None:
    """Write atomically (`shardc.ir.files`: a temporary file in the same folder, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, profile.to_json(), indent=1)
