"""The plans a study runs: the default sweep, `--sweep KEYS`, or a `--plans FILE`.

A study plan is a `ParallelPlan` (the `--plan` syntax) plus keys only the study knows:
`split=3+1` (repeated blocks per pipeline stage, for deliberately unbalanced partitions),
`bucket_mb=1` (DDP's gradient bucket size, for the block-size experiment), and
`plan_file=PATH` alone (a plan file `shardc plan -o` wrote: the solver's plan, run from it).
The default sweep (`default_sweep`) is a list of candidates for the model's batch and layers
that the study filters through the `validate-plan` pass. The torch backend
trains in the model's own dtype, so study plans default to `dtype=fp32`; `mb` defaults to the
whole per-replica batch when there is no pipeline (no gradient accumulation) and to a
quarter of it with a pipeline (4 micro-batches), unless written.

`--sweep pipeline` runs the pipeline study (`pipeline_sweep`: pp vs dp, stage splits,
schedules, point-to-point block size), filtered by `validate-plan` like the default sweep.
`--sweep dp,tp,pp,zero,recompute,mb` varies the named keys one at a time around a base plan
for every factorisation of the process count into the named degrees (dp, tp, pp) that the
model allows: zero over 0/1/3 where dp > 1, recompute over none/selective/full, mb over
the per-replica batch and its half (micro-batching or accumulation).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan

STUDY_KEYS = ("split", "bucket_mb", "plan_file")
SWEEP_KEYS = ("dp", "tp", "pp", "zero", "recompute", "mb")
PIPELINE_SWEEP = "pipeline"  # `--sweep pipeline`: `pipeline_sweep`, not keys varied one at a time

# Measured steps per plan and round. 8, not 10: re-taking rounds 1 and 3 of session 7's studies
# A-D (README command, 3 rounds) at their first 8 steps moves the headline median error by at
# most 0.8 points (C: 8.4 -> 9.2%; A, B, D within 0.2) and Spearman by at most 0.007, a plan's
# median over rounds by a median 0-0.4%, against a median round-to-round spread of 17-26%.
STUDY_STEPS = 8

DEFAULT_MODEL = "examples/gpt.py:gpt?n_layer=4&n_embd=128&n_head=4&vocab_size=512&seq=64&batch=8"


# The study's defaults that a label leaves out: the plan's, in the study's dtype (mb is always shown).
_LABEL_DEFAULTS = dict(ParallelPlan(dtype="fp32").items())


@dataclass(frozen=True, slots=True)
class StudyPlan:
    """One plan of the study: the parallel plan, an optional stage split (repeated blocks per
    pipeline stage, one positive count per stage) and DDP bucket size (MiB). Its text is the
    plan's text form followed by `split=3+1` and `bucket_mb=1` when set."""

    plan: ParallelPlan
    split: tuple[int, ...] | None = None
    bucket_mb: float | None = None
    file: str | None = None  # a plan file (`shardc plan -o`): the graph is partitioned as it says

    def __post_init__(self) -> None:
        if self.split is not None and (len(self.split) != self.plan.stages or min(self.split) < 1):
            raise ShardcError(f"study plan {self.plan}: split={'+'.join(map(str, self.split))} names "
                              f"{len(self.split)} stages but the plan has pp*vpp = {self.plan.stages}; give one "
                              "positive count per stage")

    def items(self) -> list[tuple[str, str]]:
        """The plan's keys and values (`ParallelPlan.items`), then the study's own."""
        return self.plan.items() + ([("split", "+".join(map(str, self.split)))] if self.split else []) + \
            ([("bucket_mb", f"{self.bucket_mb:g}")] if self.bucket_mb is not None else [])

    @property
    def text(self) -> str:
        """The canonical text: every plan key, then split and bucket_mb when set; a plan file's
        plan is `plan_file=PATH` (the file says the rest)."""
        if self.file is not None:
            return f"plan_file={self.file}"
        return ",".join(f"{k}={v}" for k, v in self.items())

    @property
    def label(self) -> str:
        """The keys that differ from the study's defaults, and mb: `dp=2,mb=4,zero=1`; a plan
        file's prefixed by what wrote it: `rotate:` for the sweep's rotating plan
        (`rotate-N.plan`), `solver:` otherwise."""
        text = ",".join(f"{k}={v}" for k, v in self.items() if k == "mb" or _LABEL_DEFAULTS.get(k) != v)
        if self.file is None:
            return text
        return f"{'rotate' if Path(self.file).name.startswith('rotate-') else 'solver'}:{text}"

    @property
    def id(self) -> str:
        """A stable file-name-safe id: the plan's keys, then a short hash of the full text."""
        short = re.sub(r"[^A-Za-z0-9=._+-]", "_", self.label)[:60]
        digest = hashlib.sha1(self.text.encode())
        if self.file is not None:  # the same path may hold another plan on another study
            digest.update(Path(self.file).read_bytes() if Path(self.file).is_file() else b"")
        return f"{short}-{digest.hexdigest()[:6]}"

    @property
    def devices(self) -> int:
        return self.plan.devices


def label(plan_text: str) -> str:
    """The label (`StudyPlan.label`) of a study plan's text, as results record it."""
    return parse_study_plan(plan_text).label


def parse_study_plan(text: str, batch: int | None = None) -> StudyPlan:
    """`dp=2,pp=2,split=3+1,bucket_mb=1` -> StudyPlan: the study's keys taken out, the rest read
    by `ParallelPlan.parse`; fills the study's defaults (dtype, mb) where they are not written."""
    keys: dict[str, str] = {}
    rest: list[str] = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        key, _, value = item.partition("=")
        if key.strip().lower() in STUDY_KEYS:
            keys[key.strip().lower()] = value.strip()
        else:
            rest.append(item)
    if "plan_file" in keys:
        return _file_plan(text, keys, rest)
    plan = ParallelPlan.parse(",".join(rest))
    written = {p.partition("=")[0].strip().lower() for p in rest}
    if "dtype" not in written:
        plan = replace(plan, dtype="fp32")
    if "mb" not in written and batch is not None and batch % plan.dp == 0:
        per = batch // plan.dp
        mb = per if plan.pp == 1 else max(1, per // 4)
        plan = replace(plan, mb=mb)
    split = None
    if "split" in keys:
        try:
            split = tuple(int(x) for x in keys["split"].split("+"))
        except ValueError:
            raise ShardcError(f"study plan {text!r}: split={keys['split']!r} is not blocks per stage "
                              "like 3+1") from None
    bucket = None
    if "bucket_mb" in keys:
        try:
            bucket = float(keys["bucket_mb"])
        except ValueError:
            raise ShardcError(f"study plan {text!r}: bucket_mb={keys['bucket_mb']!r} is not a number") from None
    return StudyPlan(plan, split, bucket)


def _file_plan(text: str, keys: dict[str, str], rest: list[str]) -> StudyPlan:
    """`plan_file=PATH`: the plan file's own plan; nothing else may be written beside it."""
    from shardc.plan.file import PlanFile

    if rest or len(keys) > 1:
        raise ShardcError(f"study plan {text!r}: plan_file= stands alone (the file says the whole plan)",
                          hint="write plan_file=PATH on its own line")
    return StudyPlan(PlanFile.load(keys["plan_file"]).plan, file=keys["plan_file"])


def default_sweep(n: int, batch: int, layers: int) -> list[str]:
    """The default sweep's candidates for `n` processes on a model of `batch` sequences and
    `layers` repeated blocks, before validation (`shardc.study.sweep` drops those the
    `validate-plan` pass refuses for the model and cluster). Every factorisation of `n` into
    dp, tp, pp and cp; around pure data parallelism ZeRO 1 and 3, selective and full
    recomputation, bf16, gradient accumulation (half the micro-batch), DDP bucket sizes and
    the rank modules compiled (`compile=1`, inductor); tp with sequence parallelism, and tp=2
    compiled on 2 processes; pp with GPipe and an unbalanced stage split; mb is the per-replica batch, or a
    pipeline's per-replica batch over 2*pp (at least 1). The rotating partition is a plan file
    (`shardc.study.rotating`), added by the sweep beside the solver's."""
    out: list[str] = []
    for combo in _factorisations(n, ("dp", "tp", "pp", "cp")):
        dp, tp, pp, cp = (combo[k] for k in ("dp", "tp", "pp", "cp"))
        per = max(1, batch // dp)
        mb = per if pp == 1 else max(1, per // (2 * pp))
        base = ",".join(f"{k}={v}" for k, v in combo.items() if v > 1) or "dp=1"
        base += f",mb={mb}"
        out.append(base)
        if dp == n:
            out += [f"{base},zero=1", f"{base},zero=3", f"{base},recompute=selective", f"{base},recompute=full",
                    f"{base},dtype=bf16", f"{base},bucket_mb=0.01", f"{base},bucket_mb=1", f"{base},compile=1"]
            if mb > 1:
                out.append(f"dp={dp},mb={mb // 2}")
        if tp > 1 and pp == 1 and cp == 1:
            out += [f"{base},sp=1", f"{base},sp=1,recompute=selective"]
        if tp == n == 2:  # one tp plan compiled: 4-process tp plans are the sweep's slowest, their compile too
            out.append(f"{base},compile=1")
        if pp == n:
            out.append(f"{base},schedule=gpipe")
            if layers > pp:  # all but one block per later stage on the first
                out.append(f"{base},split=" + "+".join(map(str, [layers - pp + 1] + [1] * (pp - 1))))
    return list(dict.fromkeys(out))


def pipeline_sweep(n: int, batch: int, layers: int) -> list[str]:
    """`--sweep pipeline`'s candidates for `n` processes (n > 1), before validation (the study
    drops those the `validate-plan` pass refuses, listing why): the seed's pipeline findings
    measured beside their predictions. pp vs dp at equal devices (`dp=n` and `pp=n`);
    balanced vs unbalanced stage splits (all but one block per later stage on the first, then
    on the last); the schedules at the same micro-batches (1F1B, GPipe, and with two virtual
    stages per device interleaved 1F1B, interleaved zero bubble, ZB-V and DualPipeV); and
    the point-to-point block size: the same pipeline at every micro-batch size dividing the
    batch (each size is one stage-to-stage message; fewer, larger blocks leave less waiting
    per byte but a longer fill and drain). The base micro-batch is the batch over 2*pp."""
    if n < 2:
        return []
    mb = max(1, batch // (2 * n))
    base = f"pp={n},mb={mb}"
    out = ([f"dp={n},mb={batch // n}"] if batch % n == 0 else []) + [base]
    if layers > n:
        heavy = layers - n + 1
        out += [f"{base},split=" + "+".join(map(str, [heavy] + [1] * (n - 1))),
                f"{base},split=" + "+".join(map(str, [1] * (n - 1) + [heavy]))]
    out.append(f"{base},schedule=gpipe")
    out += [f"{base},vpp=2,schedule={s}" for s in ("interleaved", "interleaved-zb", "zbv", "dualpipev")]
    out += [f"pp={n},mb={m}" for m in range(1, batch + 1) if batch % m == 0 and m != mb]
    return list(dict.fromkeys(out))


def read_plans_file(path: str | Path) -> list[str]:
    """One plan a line; blank lines and `#` comments skipped."""
    p = Path(path)
    if not p.is_file():
        raise ShardcError(f"plans file {path} does not exist", hint="write one plan a line, e.g. dp=2,mb=4")
    lines = [line.split("#", 1)[0].strip() for line in p.read_text().splitlines()]
    return [line for line in lines if line]


def _factorisations(n: int, names: Sequence[str]) -> list[dict[str, int]]:
    if not names:
        return [{}] if n == 1 else []
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out += [{names[0]: d, **rest} for rest in _factorisations(n // d, names[1:])]
    return out


def sweep_plans(keys: Iterable[str], nprocs: Sequence[int], batch: int) -> list[str]:
    """Plans varying `keys` one at a time around each degree factorisation (see module doc)."""
    keys = [k.strip().lower() for k in keys if k.strip()]
    unknown = [k for k in keys if k not in SWEEP_KEYS]
    if unknown:
        raise ShardcError(f"--sweep {','.join(keys)}: unknown key(s) {', '.join(unknown)}; sweepable keys: "
                          + ", ".join(SWEEP_KEYS) + f", or --sweep {PIPELINE_SWEEP} alone (the pipeline study)")
    degrees = [k for k in ("dp", "tp", "pp") if k in keys] or ["dp"]
    out: list[str] = []
    for n in nprocs:
        for combo in _factorisations(n, degrees):
            if any(combo.get(k, 1) > 1 and k not in keys for k in ("dp", "tp", "pp")):
                continue
            dp, pp = combo.get("dp", 1), combo.get("pp", 1)
            if batch % dp:
                continue
            per = batch // dp
            mb = per if pp == 1 else max(1, per // 4)
            base = ",".join(f"{k}={v}" for k, v in combo.items()) + f",mb={mb}"
            out.append(base)
            if "zero" in keys and dp > 1:
                out += [f"{base},zero={z}" for z in (1, 3)]
            if "recompute" in keys:
                out += [f"{base},recompute={r}" for r in ("selective", "full")]
            if "mb" in keys and mb > 1:
                out.append(base.replace(f"mb={mb}", f"mb={mb // 2}"))
    return list(dict.fromkeys(out))
