"""Plan quality measured: the solver's plan and the best grid plan trained for real on `local4`.

Rule. Each case is a small example model, a global batch and a per-device memory limit on
`local4` (this machine's calibrated profile: 4 gloo processes sharing its cores) chosen so that
the best grid plan must recompute or pipeline. The case is solved as `shardc plan` solves it
(fp32, as CPU processes train; fixed seed, one worker, `wall-stop=inf`: the plans depend on the
seed, not on the load); the solver's plan and the best grid plan are written as plan files
(`shardc.search.planfile.plan_file`: the grid point as a plan file too), so that both run
through the one path `shardc run --plan FILE.plan` takes. Both are predicted as `shardc run`
predicts them (`shardc.run.predict`, the graph the file partitions, on `local4`) and trained in
one torchrun (`shardc.run.launch_all`): one discarded warm-up run of each, then `repeats` of
each, alternating solver, grid, grid, solver, solver, grid..., so that drift in the machine's
load hits both alike. Per run, the measured step time is the slowest rank's median over the
timed steps (the first step is a warm-up) and the peak memory the largest rank's; per plan, the
figures are medians over the repeats, with their spread (min..max). A case whose best plan is
the grid point runs it twice: its ratio is the noise floor.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardc import driver
from shardc.hardware import Cluster, GiB, with_overrides
from shardc.ir import RECOMPUTE_CHOICES
from shardc.plan.file import PlanFile
from shardc.run import launch_all, predict, summarize
from shardc.search.outer import Found
from shardc.search.planfile import plan_file

NPROC = 4
CLUSTER = f"local{NPROC}"
SEED = 0


@dataclass(frozen=True, slots=True)
class MeasureCase:
    """A model spec (its batch is the global batch), the global batch, the per-device memory
    limit in GiB (the memory each process has: plans are made for its usable part, `case_cluster`),
    and why the limit is tight (what the grid must do under it)."""

    name: str
    spec: str
    gbs: int
    limit_gib: float
    why: str


MEASURE_CASES = [
    # Limits found by trying (`shardc plan --cluster local4 --memory-limit ...`, session 6-7): the best
    # grid plan pipelines and fully recomputes every block. Since session 8 plans are made for 95% of
    # the limit (`case_cluster`); the `why` texts give the plans on run e's calibration.
    MeasureCase("gpt-4l", "examples/gpt.py:tiny?batch=8&seq=128&n_layer=4", 8, 0.0035,
                "the grid pipelines over four stages and fully recomputes every block (pp=2 x dp=2 no longer fits "
                "95%); the solver pipelines over four and recomputes per stage as its micro-batches in flight need"),
    MeasureCase("gpt-4l-zero", "examples/gpt.py:tiny?batch=8&seq=128&n_layer=4", 8, 0.003,
                "tighter: the grid pipelines over four and fully recomputes every block; the solver recomputes "
                "the first two stages in full and the third selectively (its [1f|1f|1n|1n] plan of run e, "
                "3.03 MiB predicted and 3.09 measured against 3.07, no longer fits 95%)"),
    MeasureCase("llama-2l", "examples/llama.py:tiny?batch=4&seq=128", 4, 0.002,
                "the grid runs pp=2 x tp=2 (2 micro-batches of 2) recomputing both blocks in full (pp=2 x dp=2, "
                "run e's plan of both, no longer fits 95%); the solver the same shape recomputing the first "
                "stage's block only"),
    MeasureCase("gpt-4l-tie", "examples/gpt.py:tiny?batch=8&seq=128&n_layer=4", 8, 0.0045,
                "roomier: the grid pipelines over four (micro-batches of 2) recomputing every block in full; the "
                "solver the same, recomputing two stages in full and one selectively"),
    # Structural: a vocabulary of 8192 at hidden 64. The embedding, head and logits fit only split
    # over the vocabulary, so every grid point that fits is tp=4 (Megatron's tensor parallelism
    # splits the blocks too: two all-reduces per block per pass, 255 ms of 327 predicted); the
    # solver splits only the embedding and head over tp and runs the tiny blocks replicated,
    # recomputing their attention core (tp_comm 78 ms, compute +19 ms): 1.88x predicted.
    MeasureCase("gpt-vocab", "examples/gpt.py:tiny?batch=8&seq=128&vocab_size=8192&tie=false", 8, 0.012,
                "a large vocabulary forces the vocabulary split: the grid runs tp=4 over every block (mb 2, "
                "4 micro-batches); the solver splits only the embedding and head over tp=4, the blocks "
                "replicated and fully recomputed"),
]


@dataclass(frozen=True, slots=True)
class PlanRun:
    """One plan of a case: its label, plan file, a short description and `shardc run`'s prediction."""

    label: str
    file: PlanFile
    short: str
    predicted_step_s: float
    predicted_peak_bytes: int


@dataclass
class Measured:
    """A plan's figures over the repeats: per repeat the slowest rank's median step time and the
    largest rank's peak memory."""

    plan: PlanRun
    step_s: list[float]
    peak_bytes: list[int]

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def median_peak_bytes(self) -> float:
        return statistics.median(self.peak_bytes)


def short_plan(file: PlanFile) -> str:
    """The plan in a few words: degrees, micro-batch, ZeRO, blocks per stage by recomputation
    (`2n` two blocks not recomputed, `1s+1f` one selective one full), per-stage partitions."""
    p = file.plan
    degrees = " ".join(f"{k}{v}" for k, v in (("pp", p.pp), ("dp", p.dp), ("tp", p.tp), ("cp", p.cp),
                                                ("vpp", p.vpp)) if v > 1) or "single"
    stages = "|".join("+".join(f"{n}{r[0]}" for n, r in zip(row, RECOMPUTE_CHOICES) if n) or "0"
                      for row in file.stages)
    groups = file.groups + tuple(g for stage in file.stage_groups for g in stage)
    temporal = len({g.key for g in groups if "; time " in g.partition})  # rotating matmuls, rings, chunks
    extra = (", per-stage partitions" if file.stage_groups else "") + (f", {temporal} temporal" if temporal else "")
    return f"{degrees} mb{p.mb} z{p.zero} [{stages}]{extra}"


def solve_case(case: MeasureCase, out: Path, time_limit: float) -> tuple[PlanRun, PlanRun]:
    """Solve the case; write the solver's plan and the best grid plan as plan files under `out`
    and predict each as `shardc run` does."""
    _, ctx = driver.solve(case.spec, case_cluster(case), case.gbs, time_limit=time_limit, seed=0, workers=1,
                          dtype="fp32", wall_stop=float("inf"))
    result = ctx.options["search"]
    if result.grid is None:
        raise SystemExit(f"case {case.name}: no grid plan fits {case.limit_gib} GiB; choose a looser limit")
    runs = []
    for label, found in (("solver", result.best), ("grid", result.grid)):
        runs.append(_plan_run(case, label, found, out / f"{case.name}-{label}.plan"))
    return runs[0], runs[1]


def case_cluster(case: MeasureCase) -> Cluster:
    """`local4` whose processes have `case.limit_gib` each: the limit is the memory a run must fit
    in, and the plans fit the usable part of it, less the local headroom (the memory model's
    measured error, `shardc.hardware.LOCAL_HEADROOM`), so that a plan predicted to fit fits when run.
    (`--memory-limit` would set the usable figure itself, with no room for the model's error.)"""
    cluster = driver.as_cluster(CLUSTER)
    assert cluster is not None
    return with_overrides(cluster, memory_bytes=int(case.limit_gib * GiB))


def _plan_run(case: MeasureCase, label: str, found: Found, path: Path) -> PlanRun:
    assert found.estimate is not None
    plan_file(found.problem, found.assignment, found.estimate, case.gbs).save(path)
    file = PlanFile.load(path)
    est, note = predict(case.spec, file, CLUSTER, NPROC)
    if est is None:
        raise SystemExit(f"case {case.name}: the {label} plan has no prediction ({note})")
    peak = max(int(s.memory_bytes) for s in est.stages)
    short = short_plan(file) + (" (= grid)" if label == "solver" and found.source == "grid" else "")
    return PlanRun(label, file, short, float(est.step_time_s), peak)


def measure(case: MeasureCase, plans: tuple[PlanRun, PlanRun], steps: int, repeats: int,
            timeout_s: float) -> list[Measured]:
    """Train the two plans alternately `repeats` times each in one torchrun; their figures. The
    launch opens with one discarded run of each plan (the workers' first run pays their own
    warm-up: thread pools, gloo's first connections), and the order alternates solver-grid,
    grid-solver, ... so that a trend in the load over the launch falls on both alike."""
    order = [0, 1] + [i if r % 2 == 0 else 1 - i for r in range(repeats) for i in (0, 1)]
    runs = [(case.spec, plans[i].file) for i in order]
    results = launch_all(runs, nproc=NPROC, steps=steps, seed=SEED, timeout_s=timeout_s, cluster=CLUSTER)
    out = [Measured(p, [], []) for p in plans]
    for i, reports in list(zip(order, results))[2:]:
        summary = summarize(case.spec, plans[i].file, reports, None, "")
        out[i].step_s.append(float(summary["measured_step_time_s"]))
        out[i].peak_bytes.append(max(int(r["peak_memory_bytes"]) for r in summary["ranks"]))
    return out


def _spread(values: list[float], scale: float, unit: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med * scale:.2f} {unit}"
    return f"{med * scale:.2f} {unit} ({min(values) * scale:.2f}..{max(values) * scale:.2f})"


def rows(case: MeasureCase, measured: list[Measured]) -> list[dict[str, Any]]:
    """The table's rows of one case: the solver's plan, then the grid's, with the ratios."""
    solver, grid = measured
    limit = case.limit_gib * 2**30
    ratios = [g / s for s, g in zip(solver.step_s, grid.step_s)]
    out = []
    for m in measured:
        out.append({
            "case": case.name, "plan": m.plan.label, "short": m.plan.short,
            "predicted_step_s": m.plan.predicted_step_s, "measured_step_s": m.median_step_s,
            "measured_steps_s": m.step_s,
            "predicted_peak_bytes": m.plan.predicted_peak_bytes, "measured_peak_bytes": m.median_peak_bytes,
            "within_limit": max(m.peak_bytes) <= limit, "limit_bytes": limit,
        })
    out[0] |= {"measured_ratio": grid.median_step_s / solver.median_step_s, "paired_ratios": ratios,
               "predicted_ratio": grid.plan.predicted_step_s / solver.plan.predicted_step_s}
    return out


def print_table(table_rows: list[dict[str, Any]], steps: int, repeats: int) -> None:
    """The measured table (rich), one row per plan, the ratios on the solver's row."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(200, int(os.environ.get("COLUMNS", "0") or 0)), highlight=False)
    table = Table(title=f"plan quality measured on {CLUSTER}: {steps} steps (first untimed) x {repeats} repeats, "
                  "medians (min..max over repeats)")
    for col in ("case", "plan", "", "predicted step", "measured step", "measured grid/solver",
                "predicted grid/solver", "predicted peak", "measured peak", "within limit"):
        table.add_column(col, justify="left" if col in ("case", "plan", "") else "right")
    for r in table_rows:
        ratio = r.get("measured_ratio")
        paired = r.get("paired_ratios", [])
        ratio_text = "" if ratio is None else f"{ratio:.3f}" + (
            f" ({min(paired):.2f}..{max(paired):.2f})" if len(paired) > 1 else "")
        table.add_row(
            r["case"], r["plan"], r["short"], f"{r['predicted_step_s'] * 1e3:.2f} ms",
            _spread(r["measured_steps_s"], 1e3, "ms"), ratio_text,
            "" if "predicted_ratio" not in r else f"{r['predicted_ratio']:.3f}",
            f"{r['predicted_peak_bytes'] / 2**20:.2f} MiB", f"{r['measured_peak_bytes'] / 2**20:.2f} MiB",
            f"{'yes' if r['within_limit'] else 'NO'} ({r['limit_bytes'] / 2**20:.2f} MiB)")
    console.print(table)


def select(names: list[str] | None) -> list[MeasureCase]:
    """The cases named (all when none are); an unknown name is an error naming the cases."""
    unknown = set(names or ()) - {c.name for c in MEASURE_CASES}
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}; the cases are {[c.name for c in MEASURE_CASES]}")
    return [c for c in MEASURE_CASES if not names or c.name in names]


def main_measure(cases: list[MeasureCase], steps: int, repeats: int, time_limit: float,
                 timeout_s: float = 1200.0) -> list[dict[str, Any]]:
    """`plan_quality.py --measure`: solve, write, predict and train every case; print the table
    and the load average before and after each case's training; return the table's rows."""
    if steps < 2 or repeats < 1:
        raise SystemExit(f"--steps must be >= 2 (one warm-up) and --repeats >= 1, got {steps} and {repeats}")
    table_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="plan-quality-") as tmp:
        for case in cases:
            t0 = time.perf_counter()
            plans = solve_case(case, Path(tmp), time_limit)
            solved = time.perf_counter() - t0
            load = os.getloadavg()[0]
            measured = measure(case, plans, steps, repeats, timeout_s)
            print(f"{case.name}: solved in {solved:.1f} s, trained in {time.perf_counter() - t0 - solved:.1f} s, "
                  f"load average {load:.2f} -> {os.getloadavg()[0]:.2f}; {case.why}", flush=True)
            table_rows += rows(case, measured)
    print_table(table_rows, steps, repeats)
    return table_rows
