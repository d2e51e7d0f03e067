"""Zero bubble against 1F1B, measured: the schedules of one pipeline-bound case run in alternation.

The target (issue 16): on a pipeline-bound 4-stage case the measured step-time ratio of each
zero-bubble schedule to 1F1B matches the predicted ratio within `RATIO_TOLERANCE`, and every
pp rank's peak memory is within 5% of its prediction.

Rules.
- The case (`measure_model`, `measure_plans`): a GPT of equal blocks, one per virtual stage
  at vpp=2 (the embedding and a 256-word head are small beside a block), untied, with as few
  micro-batches as every schedule accepts (m = 2pp, DualPipeV's least), so 1F1B's bubble
  (p-1)/(m+p-1) is 27% of its step at pp=4 (20% at pp=2). The plans: 1F1B, and with vpp=2
  interleaved 1F1B, ZB-V, interleaved zero bubble and DualPipeV, all at micro-batch 1.
- One process per stage. Where the processes outnumber the cores (pp=4 on a 2-core machine) a
  rank idle in a bubble lends its core to the busy ones, so 1F1B's bubble mostly vanishes from
  the measurement; the prediction of the `local` cluster prices that (`cost.pipeline_shared`:
  processor sharing), so there the predicted gain of zero bubble is what the cores leave of it.
- They run through the study (`shardc.study.run_study`, one front door: partitioned and
  predicted before any runs, lowered from that graph, trained by `shardc.train`): `repeats`
  rounds, each round every plan once in one process group, in an order shuffled per round, so
  drift of a shared machine lands on every schedule alike.
- Figures (`schedule_rows`): predicted step (before the run), measured step (the median of
  the rounds' medians, and their range), the ratio to 1F1B predicted and measured; the
  measured ratio pairs each round's step with 1F1B's in the same round, then takes the median
  over rounds. Within tolerance: |measured ratio / predicted ratio - 1| <= `RATIO_TOLERANCE`.
  Memory (`memory_rows`): each pp rank's peak as measured by the study's tracker against its
  prediction (the first round's run; memory does not drift).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardc.analysis.stages import device_stages
from shardc.ir.diagnostics import ShardcError
from shardc.study.plans import parse_study_plan

RATIO_TOLERANCE = 0.10
MEMORY_TOLERANCE = 0.05
MEASURE_MODEL = ("examples/gpt.py:gpt?n_layer={layers}&n_embd=256&n_head=4&vocab_size=256&seq=128"
                 "&batch={batch}&tie=false")
BASELINE = "1f1b"
SCHEDULES = ("1f1b", "interleaved", "zbv", "interleaved-zb", "dualpipev")


def measure_model(pp: int = 4) -> str:
    """The measured case's model for `pp` stages: a block per virtual stage at vpp=2 (2pp blocks)
    and 2pp sequences, so micro-batches of 1 make m = 2pp, the fewest DualPipeV runs."""
    return MEASURE_MODEL.format(layers=2 * pp, batch=2 * pp)


def measure_plans(pp: int = 4, mb: int = 1) -> list[str]:
    """The plans of the measured case: 1F1B, then each other schedule of `SCHEDULES` with two
    virtual stages per device, at pp and micro-batch size `mb` (study plans: fp32)."""
    return [f"pp={pp},mb={mb}" + ("" if s == BASELINE else f",vpp=2,schedule={s}") for s in SCHEDULES]


def schedule_name(text: str) -> str:
    plan = parse_study_plan(text).plan
    return plan.schedule + (f" vpp={plan.vpp}" if plan.vpp > 1 else "")


@dataclass(frozen=True, slots=True)
class ScheduleRow:
    """One schedule's step time, predicted and measured, and its ratio to 1F1B's."""

    schedule: str
    plan: str
    predicted_s: float
    measured_s: float
    measured_min_s: float
    measured_max_s: float
    rounds: int
    predicted_ratio: float
    measured_ratio: float

    @property
    def ratio_error(self) -> float:
        """(measured ratio / predicted ratio) - 1: +5% means the schedule gained 5% less than predicted."""
        return self.measured_ratio / self.predicted_ratio - 1

    @property
    def within(self) -> bool:
        return abs(self.ratio_error) <= RATIO_TOLERANCE


@dataclass(frozen=True, slots=True)
class MemoryRow:
    schedule: str
    rank: int
    stages: str
    measured_bytes: float
    predicted_bytes: float

    @property
    def error(self) -> float:
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    @property
    def within(self) -> bool:
        return abs(self.error) <= MEMORY_TOLERANCE


def _ran(data: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(1F1B's entry, every plan's entry that ran, 1F1B first) of a study's results."""
    ran = [p for p in data["plans"] if p.get("status") == "ok" and not p["plan"].startswith("plan_file=")]
    base = [p for p in ran if parse_study_plan(p["plan"]).plan.schedule == BASELINE
            and parse_study_plan(p["plan"]).plan.vpp == 1]
    if not base:
        failed = {p["plan"]: p.get("error", p.get("status")) for p in data["plans"] if p.get("status") != "ok"}
        raise ShardcError("the measured schedules have no 1F1B run to compare with"
                          + (f" (failed: {failed})" if failed else ""),
                          hint="rerun the measurement; results.json lists why each plan did not run")
    return base[0], [base[0]] + [p for p in ran if p is not base[0]]


def _rounds(entry: dict[str, Any]) -> list[float]:
    return list(entry.get("round_step_times_s") or [entry["measured_step_time_s"]])


def schedule_rows(data: dict[str, Any]) -> list[ScheduleRow]:
    """Per schedule that ran (1F1B first): the figures of the module rule, from results.json."""
    base, entries = _ran(data)
    base_rounds = _rounds(base)
    rows = []
    for p in entries:
        mine = _rounds(p)
        if len(mine) == len(base_rounds):  # paired round by round: the drift of a round cancels
            measured_ratio = statistics.median(a / b for a, b in zip(mine, base_rounds))
        else:
            measured_ratio = statistics.median(mine) / statistics.median(base_rounds)
        rows.append(ScheduleRow(schedule_name(p["plan"]), p["plan"], p["predicted_step_time_s"],
                                statistics.median(mine), min(mine), max(mine), len(mine),
                                p["predicted_step_time_s"] / base["predicted_step_time_s"], measured_ratio))
    return rows


def memory_rows(data: dict[str, Any]) -> list[MemoryRow]:
    """Per schedule that ran and per rank: peak memory measured and predicted, with the virtual
    stages the rank's pipeline device holds."""
    _, entries = _ran(data)
    out = []
    for p in entries:
        plan = parse_study_plan(p["plan"]).plan
        for r in p["ranks"]:
            held = device_stages(int(r["stage"]), plan.pp, plan.vpp, plan.schedule)
            out.append(MemoryRow(schedule_name(p["plan"]), r["rank"], "+".join(map(str, held)),
                                 r["measured_peak_memory_bytes"], r["predicted_peak_memory_bytes"]))
    return out


def format_tables(data: dict[str, Any]) -> str:
    """The two tables of the measurement as text (step times and ratios; memory per rank)."""
    rows = schedule_rows(data)
    lines = [f"{'schedule':20} {'pred s':>8} {'meas s (median [min-max])':>28} {'rounds':>6} "
             f"{'pred/1F1B':>9} {'meas/1F1B':>9} {'ratio err':>9}  within {RATIO_TOLERANCE:.0%}"]
    for r in rows:
        span = f"{r.measured_s:.3f} [{r.measured_min_s:.3f}-{r.measured_max_s:.3f}]"
        lines.append(f"{r.schedule:20} {r.predicted_s:8.3f} {span:>28} {r.rounds:6d} {r.predicted_ratio:9.3f} "
                     f"{r.measured_ratio:9.3f} {r.ratio_error:+9.1%}  {'yes' if r.within else 'NO '}")
    lines += ["", f"{'schedule':20} {'rank':>4} {'stages':>7} {'meas MiB':>9} {'pred MiB':>9} {'error':>7}  "
              f"within {MEMORY_TOLERANCE:.0%}"]
    for m in memory_rows(data):
        lines.append(f"{m.schedule:20} {m.rank:4d} {m.stages:>7} {m.measured_bytes / 2**20:9.2f} "
                     f"{m.predicted_bytes / 2**20:9.2f} {m.error:+7.1%}  {'yes' if m.within else 'NO'}")
    return "\n".join(lines)


def oversubscribed(pp: int) -> str | None:
    """A note when `pp` processes outnumber this machine's cores (see the module rule), else None."""
    import os

    cores = os.cpu_count() or 1
    if pp <= cores:
        return None
    return (f"{pp} processes on {cores} cores: a rank idle in a bubble lends its core to the busy ones; the "
            "prediction prices that (processor sharing, `shardc.cost.pipeline_shared`), so the zero-bubble gain "
            "predicted is what the cores leave of it")


def run_measure(out_dir: str | Path, *, repeats: int = 5, steps: int = 6, warmup: int = 2,
                model: str | None = None, pp: int = 4, mb: int = 1, seed: int = 0,
                fresh_profile: bool = False) -> dict[str, Any]:
    """Run the measured case (see the module rule) into `out_dir` (results.json, the plans) and
    return the study's results. A study already in `out_dir` for the same model is resumed:
    plans that ran `repeats` rounds are not run again."""
    import json

    from shardc.study import run_study

    if repeats < 1 or steps < 1:
        raise ShardcError(f"--repeats {repeats} --steps {steps}: run every schedule at least one round of one "
                          "measured step")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plans = out / "schedules.plans"
    plans.write_text("\n".join(measure_plans(pp, mb)) + "\n")
    run_study(model or measure_model(pp), pp, plans_file=str(plans), out_dir=out, steps=steps, warmup=warmup,
              rounds=repeats, seed=seed, report=False, solver=False, fresh_profile=fresh_profile)
    return json.loads((out / "results.json").read_text())
