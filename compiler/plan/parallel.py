"""The parallel plan users write by hand: `dp=8,tp=8,pp=16,vpp=3,mb=1,gbs=1536,...`.

One parser (`ParallelPlan.parse`) serves every command that takes `--plan`; `str(plan)` prints
the same syntax back, every key in `PLAN_KEYS` order (those in `OPTIONAL_KEYS` only when set),
so `parse(str(p)) == p`.
`ParallelPlan.of` is the one coercion from what callers hold (the text, a plan, a partitioned
graph: `plan_of`) to a plan; `plan.mesh()` is the device mesh it partitions over.
`validate_plan` checks a plan against a cluster size and a model's dimensions (`model_dims`
reads those off an IR graph) and names the nearest valid values when a constraint fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

from shardc.ir import RECOMPUTE_CHOICES, ZERO_STAGES, Axis, Graph, Mesh, dtypes
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import PLAN_DTYPES

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "interleaved-zb", "dualpipev")
# The zero-bubble schedules (backward split into input- and weight-gradient passes), and those of
# them that place two virtual stages per device in a V (`shardc.analysis.stages.stage_device`).
ZB_SCHEDULES = ("zbv", "interleaved-zb", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")
CP_LAYOUTS = ("contiguous", "zigzag")
_ZEROS = ", ".join(map(str, ZERO_STAGES))
# The mesh's axes, outermost first: tp innermost, on the fastest links.
MESH_AXES = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)

# key -> (type, default, meaning); the order here is the printed order.
# Keys printed only away from their default, so plans that do not use them print as before.
OPTIONAL_KEYS: tuple[str, ...] = ("recompute_layers", "compile", "ep")
PLAN_KEYS: Mapping[str, tuple[str, str, str]] = MappingProxyType({
    Axis.DP: ("int", "1", "data-parallel degree (DDP, or FSDP when zero>0)"),
    Axis.TP: ("int", "1", "tensor-parallel degree (Megatron column/row parallel linears, heads split)"),
    Axis.PP: ("int", "1", "pipeline-parallel degree (number of stages)"),
    "vpp": ("int", "1", "virtual stages per device; >1 means the interleaved 1F1B schedule (or, with "
            "schedule=interleaved-zb, interleaved zero bubble; zbv and dualpipev need vpp=2)"),
    Axis.CP: ("int[:zigzag]", "1", "context-parallel degree (ring attention over the sequence); cp=N:zigzag "
           "balances causal attention (2N chunks, rank i holds i and 2N-1-i)"),
    "sp": ("0|1", "0", "sequence parallel: shard norms/dropout over the sequence across tp ranks"),
    "mb": ("int", "1", "micro-batch size (sequences per micro-batch per data-parallel rank)"),
    "gbs": ("int|auto", "auto", "global batch (sequences per optimizer step); auto: the model's batch"),
    "schedule": ("|".join(SCHEDULES), "1f1b", "pipeline schedule; zbv, interleaved-zb and dualpipev are "
                 "torch's zero-bubble schedules (backward split into input- and weight-gradient passes; zbv "
                 "and dualpipev place stages r and 2pp-1-r on pp rank r, with vpp=2)"),
    "recompute": ("|".join(RECOMPUTE_CHOICES), "none", "activation recomputation of the transformer blocks "
                  "(full: the whole block; selective: its attention core; the embedding and head never)"),
    "recompute_layers": ("int|all", "all", "with recompute=full|selective, only the first N blocks of each "
                         "pipeline model chunk recompute, the rest none (Megatron's --recompute-num-layers, "
                         "block method); printed only when not all"),
    "zero": (f"{ZERO_STAGES[0]}-{ZERO_STAGES[-1]}", "0", "ZeRO stage: 1 shards optimizer states, 2 also grads, 3 also weights"),
    "dtype": ("|".join(PLAN_DTYPES), "bf16", "compute dtype; bf16/fp16 keep fp32 master weights and Adam states"),
    "compile": ("auto|0|1", "auto", "run each rank's module through torch.compile (inductor) and price its fused "
                "kernels; auto: on for CUDA devices, off for CPU processes; printed only when not auto"),
    Axis.EP: ("int", "1", "expert-parallel degree: an MoE layer's experts split over ep ranks, tokens dispatched "
              "and combined by all-to-all; every other op splits each micro-batch over them (mb must be a "
              "multiple of ep); its mesh axis sits inside dp; printed only when not 1"),
})


def _bool(key: str, text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "on", "yes"):
        return True
    if t in ("0", "false", "off", "no"):
        return False
    raise ShardcError(f"plan key {key}={text!r}: expected 0 or 1 (also true/false, on/off)")


def _compile_flag(raw: str) -> bool:
    try:
        return _bool("compile", raw)
    except ShardcError:
        raise ShardcError(f"plan key compile={raw!r}: expected auto, 0 or 1 (auto: torch.compile on CUDA "
                          "devices, eager on CPU processes)") from None


def _no_offload(raw: str, text: str) -> None:
    """`offload=0` reads as nothing (plans printed before the key was removed carry it);
    `offload=1` is refused: no backend moves optimizer states to host memory, so a plan
    asking for it would be priced and run as something it is not."""
    if not _bool("offload", raw):
        return
    raise ShardcError(f"plan key offload={raw} in {text!r}: optimizer-state offload to host memory is not "
                      "supported (no backend executes it, so shardc neither prices nor plans it)",
                      hint="drop the offload key from the plan; to save device memory use zero=1..3 "
                           "or recompute=full")


def _int(key: str, text: str, low: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise ShardcError(f"plan key {key}={text!r}: expected an integer >= {low}")
    return value


def _choice(key: str, text: str, choices: tuple[str, ...], spelling: Callable[[str], str] | None = None) -> str:
    """`text` as one of `choices`, after `spelling` maps its aliases to the canonical name."""
    t = text.strip().lower()
    t = spelling(t) if spelling else t
    if t not in choices:
        raise ShardcError(f"plan key {key}={text!r}: valid values are {', '.join(choices)}")
    return t


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    """A uniform Megatron-style plan. Degrees multiply to the device count: dp*tp*pp*cp.

    Keys and defaults (see `PLAN_KEYS`): dp=1, tp=1, pp=1, vpp=1, cp=1, sp=0, mb=1, gbs=auto
    (the model's example batch), schedule=1f1b, recompute=none, recompute_layers=all, zero=0,
    dtype=bf16, compile=auto, ep=1 (expert parallelism: an MoE layer's experts over ep ranks,
    each micro-batch of the other ops split over them; devices = dp*tp*pp*cp*ep).
    mb is the micro-batch size; gbs the global batch (sequences per optimizer step); the
    number of micro-batches per pipeline is gbs / (dp * mb) (gradient accumulation when pp=1).
    vpp>1 makes the schedule `interleaved` (`schedule=1f1b` with vpp>1 is read as interleaved
    1F1B, as Megatron does); `gpipe` with vpp>1 is an error, and so is writing
    `schedule=interleaved` with vpp=1 (a dataclass `replace` to vpp=1 falls back to 1f1b).
    The zero-bubble schedules (`ZB_SCHEDULES`, torch's) keep their name whatever vpp:
    `interleaved-zb` (torch's ScheduleInterleavedZeroBubble, the round-robin placement, any vpp),
    `zbv` and `dualpipev` (two virtual stages per device in a V: vpp must be 2); all need pp > 1
    (`_check_zero_bubble`); with ZeRO each stage is an FSDP2 unit that torch's runtime
    reduce-scatters after its last weight-gradient pass.
    `cp=N:zigzag` sets `cp_layout`: the sequence is cut into 2N chunks and cp rank i holds chunks
    i and 2N-1-i, so causal ring attention costs every rank the same (contiguous, the last rank
    computes all N key shards and sets the pace). Opt-in: the default keeps the contiguous
    split, whose inputs, printed IR and checkpoints read as before.
    `recompute_layers=N` (None: all) recomputes only the first N blocks of every pipeline model
    chunk (stage, or virtual stage with vpp>1) and none of the rest; it needs recompute=full or
    selective, and at most the blocks of a chunk (`check_recompute_layers`, with the model).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    sp: bool = False
    mb: int = 1
    gbs: int | None = None
    schedule: str = "1f1b"
    recompute: str = "none"
    zero: int = 0
    dtype: str = "bf16"
    # The sequence layout over cp, written as a suffix of cp (`cp=4:zigzag`) and printed only
    # when not contiguous, so plans without it print as they always have.
    cp_layout: str = "contiguous"
    recompute_layers: int | None = None
    # torch.compile of the rank modules: None (auto) follows the device (`compiled_on`).
    compile: bool | None = None
    ep: int = 1

    def __post_init__(self) -> None:
        for key in ("dp", "tp", "pp", "vpp", "cp", "mb", "ep"):  # the integer fields
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ShardcError(f"plan key {key}={v!r}: expected an integer >= 1")
        if self.gbs is not None and self.gbs < 1:
            raise ShardcError(f"plan key gbs={self.gbs}: expected an integer >= 1 or auto")
        object.__setattr__(self, "dtype", _choice("dtype", self.dtype, PLAN_DTYPES, dtypes.precision))
        object.__setattr__(self, "recompute", _choice("recompute", self.recompute, RECOMPUTE_CHOICES))
        if self.recompute_layers is not None:
            n = self.recompute_layers
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ShardcError(f"plan key recompute_layers={n!r}: expected an integer >= 0 or all")
            if self.recompute == "none":
                raise ShardcError(f"plan key recompute_layers={n} has no effect with recompute=none",
                                  hint="set recompute=full or recompute=selective, or leave recompute_layers out")
        object.__setattr__(self, "sp", bool(self.sp))
        if self.compile is not None:
            object.__setattr__(self, "compile", bool(self.compile))
        if self.zero not in ZERO_STAGES:
            raise ShardcError(f"plan key zero={self.zero!r}: valid values are {_ZEROS}")
        object.__setattr__(self, "cp_layout", _choice("cp layout", self.cp_layout, CP_LAYOUTS))
        schedule = _choice("schedule", self.schedule, SCHEDULES, lambda t: t.replace("_", "-"))
        if schedule in ZB_SCHEDULES:
            _check_zero_bubble(schedule, self.pp, self.vpp, self.zero)
        elif self.vpp > 1:
            if schedule == "gpipe":
                raise ShardcError(f"plan has vpp={self.vpp} with schedule=gpipe; virtual stages need "
                                  "schedule=interleaved (or 1f1b, read as interleaved 1F1B), or vpp=1")
            if self.pp == 1:
                raise ShardcError(f"plan has vpp={self.vpp} with pp=1; virtual stages interleave a "
                                  "pipeline: set pp>1 or vpp=1")
            schedule = "interleaved"
        elif schedule == "interleaved":
            schedule = "1f1b"  # so that replace(plan, vpp=1) works; parse rejects it as written
        object.__setattr__(self, "schedule", schedule)

    @classmethod
    def parse(cls, text: str) -> ParallelPlan:
        """Read `key=value,key=value,...`; keys left out take their defaults (see `PLAN_KEYS`)."""
        values: dict[str, Any] = {}
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            key, eq, raw = item.partition("=")
            key, raw = key.strip().lower(), raw.strip()
            if key == "offload":
                _no_offload(raw, text)
                continue
            if key not in PLAN_KEYS:
                raise ShardcError(f"unknown plan key {key!r} in {text!r}; known keys: {', '.join(PLAN_KEYS)}",
                                  hint="write the plan as e.g. dp=8,tp=8,pp=4,mb=1,gbs=512,recompute=full")
            if not eq or not raw:
                raise ShardcError(f"plan key {key!r} has no value in {text!r}; write {key}=VALUE "
                                  f"({PLAN_KEYS[key][0]})")
            if key in values:
                raise ShardcError(f"plan key {key!r} given twice in {text!r}")
            if key == "sp":
                values[key] = _bool(key, raw)
            elif key == "compile":
                values[key] = None if raw.lower() == "auto" else _compile_flag(raw)
            elif key == "gbs":
                values[key] = None if raw.lower() == "auto" else _int(key, raw)
            elif key == "recompute_layers":
                if raw.lower() != "all" and not (raw.isdigit() and raw.isascii()):
                    raise ShardcError(f"plan key recompute_layers={raw!r}: expected an integer >= 0 or all")
                values[key] = None if raw.lower() == "all" else int(raw)
            elif key == "zero":
                values[key] = _int(key, raw, 0)
                if values[key] not in ZERO_STAGES:
                    raise ShardcError(f"plan key zero={raw!r}: valid values are {_ZEROS}")
            elif key in ("schedule", "recompute", "dtype"):
                values[key] = raw
            elif key == Axis.CP and ":" in raw:
                degree, _, layout = raw.partition(":")
                values[key], values["cp_layout"] = _int(key, degree), _choice("cp", layout, CP_LAYOUTS)
            else:
                values[key] = _int(key, raw)
        if str(values.get("schedule", "")).lower() == "interleaved" and values.get("vpp", 1) == 1:
            raise ShardcError("plan has schedule=interleaved with vpp=1; set vpp>=2 (virtual stages per "
                              "device) or schedule=1f1b")
        return cls(**values)

    @classmethod
    def of(cls, plan: str | ParallelPlan | Graph) -> ParallelPlan:
        """The plan `plan` stands for: its text parsed, a plan as it is, a partitioned graph's
        recorded plan (`plan_of`). Anything else is a ShardcError naming what was given."""
        if isinstance(plan, ParallelPlan):
            return plan
        if isinstance(plan, str):
            return cls.parse(plan)
        if isinstance(plan, Graph):
            return plan_of(plan)
        raise ShardcError(f"a plan is a ParallelPlan, its text ('dp=2,tp=2') or a partitioned Graph, "
                          f"not {type(plan).__name__}")

    def mesh(self) -> Mesh:
        """The device mesh of the plan: pp, dp, cp, tp in that order (`MESH_AXES`), with ep after
        dp when ep > 1 (a plan without experts keeps the four axes it always had)."""
        axes = [(axis, getattr(self, axis)) for axis in MESH_AXES]
        if self.ep > 1:
            axes.insert(axes.index((Axis.DP, self.dp)) + 1, (Axis.EP, self.ep))
        return Mesh(tuple(axes))

    def items(self) -> list[tuple[str, str]]:
        """Every key with its value as `parse` reads it, in `PLAN_KEYS` order: the text form
        (`OPTIONAL_KEYS` only when not at their default)."""
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("cp_layout", "recompute_layers") or (f.name == "compile" and v is None) or \
                    (f.name == Axis.EP and v == 1):
                continue
            text = "auto" if v is None else str(int(v)) if isinstance(v, bool) else str(v)
            if f.name == Axis.CP and self.cp_layout != "contiguous":
                text += f":{self.cp_layout}"
            parts.append((f.name, text))
            if f.name == "recompute" and self.recompute_layers is not None:
                parts.append(("recompute_layers", str(self.recompute_layers)))
        return parts

    def __str__(self) -> str:
        return ",".join(f"{key}={text}" for key, text in self.items())

    def compiled_on(self, gpu: bool) -> bool:
        """Whether the rank modules run through torch.compile on a device of that kind:
        `compile=1|0` as written; auto (unset) on GPUs, not on CPU processes."""
        return gpu if self.compile is None else self.compile

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def stages(self) -> int:
        """Model chunks along the pipeline: pp * vpp."""
        return self.pp * self.vpp

    @property
    def ir_dtype(self) -> str:
        """The compute dtype in the IR's spelling (`f32`, `bf16`, `f16`)."""
        return dtypes.ir_dtype(self.dtype)

    def global_batch(self, batch: int | None = None) -> int:
        """`gbs`, or `batch` (the model's example batch) when gbs=auto."""
        gbs = self.gbs if self.gbs is not None else batch
        if gbs is None:
            raise ShardcError("plan has gbs=auto and no model batch was given; set gbs=N in the plan")
        return gbs

    def micro_batches(self, global_batch: int | None = None) -> int:
        """Micro-batches per pipeline per step: global batch / (dp * mb), which must be whole."""
        gbs = self.global_batch(global_batch)
        per = self.dp * self.mb
        if gbs % per:
            raise ShardcError(f"plan {self}: the global batch {gbs} is not divisible by dp*mb = "
                              f"{self.dp}*{self.mb} = {per}; " + _batch_suggestions(gbs, self.dp, self.mb))
        return gbs // per

    def notes(self, *, layers: int | None = None, global_batch: int | None = None) -> list[str]:
        """Remarks on choices that are legal but probably not what was meant."""
        out = []
        if self.sp and self.tp == 1:
            out.append("sp=1 has no effect with tp=1 (sequence parallelism shards across tp ranks)")
        if self.zero and self.dp * self.cp == 1:
            out.append(f"zero={self.zero} has no effect with dp=1 (nothing to shard optimizer states over)")
        if layers is not None and layers % self.stages:
            out.append(f"{layers} layers do not divide evenly into {self.stages} stages; stages get "
                       f"{layers // self.stages} or {layers // self.stages + 1} layers (unbalanced)")
        if self.pp > 1 and (global_batch or self.gbs):
            m = (global_batch or self.gbs or 0) // (self.dp * self.mb)
            if 0 < m < self.pp:
                out.append(f"{m} micro-batches for {self.pp} stages: the pipeline never fills; use >= {self.pp}")
            elif self.schedule == "interleaved" and m % self.pp:
                out.append(f"interleaved 1F1B wants the micro-batch count ({m}) to be a multiple of pp={self.pp}")
        return out


def _check_zero_bubble(schedule: str, pp: int, vpp: int, zero: int) -> None:
    """The combinations torch's zero-bubble schedules run (their constructors' rules, and what
    the torch backend executes): pp > 1; zbv and dualpipev exactly two virtual stages per device
    (vpp=2, the V)."""
    if pp == 1:
        raise ShardcError(f"plan key schedule={schedule} with pp=1; a zero-bubble schedule splits a pipeline's "
                          "backward: set pp>1 or leave schedule out")
    if schedule in V_SCHEDULES and vpp != 2:
        raise ShardcError(f"plan key schedule={schedule} with vpp={vpp}; {schedule} places exactly two virtual "
                          "stages on each device in a V (pp rank r holds stages r and 2pp-1-r)",
                          hint="set vpp=2, or use schedule=interleaved-zb (any vpp)")


def plan_of(graph: Graph) -> ParallelPlan:
    """The plan a partitioned graph was written with: `graph.attrs["plan"]` (apply-plan and the
    solver record it); recomputation, ZeRO and stages per layer come from the layers."""
    text = graph.attrs.get("plan")
    if not text:
        raise ShardcError(f"graph @{graph.name} records no plan (graph.attrs['plan']); pass the plan, or "
                          "partition the graph with apply-plan or the solver first")
    return ParallelPlan.parse(str(text))


def check_recompute_layers(plan: ParallelPlan, chunk_blocks: list[int]) -> None:
    """`recompute_layers=N` must not exceed the blocks of the largest pipeline model chunk
    (`chunk_blocks`: blocks per stage, virtual stages included): beyond it, N means all."""
    n = plan.recompute_layers
    if n is not None and chunk_blocks and n > max(chunk_blocks):
        raise ShardcError(f"plan key recompute_layers={n} but the pipeline model chunks hold at most "
                          f"{max(chunk_blocks)} blocks ({'+'.join(map(str, chunk_blocks))} over pp*vpp = "
                          f"{plan.stages} chunks)", hint=f"use recompute_layers <= {max(chunk_blocks)}, or "
                          "recompute_layers=all")


def plan_keys_help() -> str:
    """`PLAN_KEYS` as help text, one key a line: `  dp=int (default 1)  data-parallel degree ...`."""
    rows = [(f"{k}={t}", f"(default {d})", m) for k, (t, d, m) in PLAN_KEYS.items()]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    return "\n".join(f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _nearest(values: list[int], target: int, k: int = 4) -> list[int]:
    return sorted(sorted(values, key=lambda v: (abs(v - target), v))[:k])


def _batch_suggestions(gbs: int, dp: int, mb: int) -> str:
    per = dp * mb
    lo, hi = gbs // per * per, -(-gbs // per) * per
    near = " and ".join(str(v) for v in (lo, hi) if v > 0)
    text = f"nearest valid gbs: {near}"
    if gbs % dp == 0:
        text += f"; with gbs={gbs}, valid mb: {', '.join(map(str, _nearest(_divisors(gbs // dp), mb, 6)))}"
    return text


def validate_plan(plan: ParallelPlan, *, devices: int, layers: int, heads: int | None, hidden: int | None,
                  kv_heads: int | None = None, batch: int | None = None, seq: int | None = None,
                  vocab: int | None = None) -> None:
    """Check `plan` against `devices` and the model's dimensions; raise one ShardcError naming
    every broken constraint with the nearest valid values. Dims given as None are not checked.

    Rules: dp*tp*pp*cp == devices; tp divides heads, kv_heads and hidden; pp*vpp <= layers;
    the global batch (gbs, else `batch`) divisible by dp*mb, and the micro-batch count it gives
    one torch's pipeline schedule accepts (`microbatch_problem`); cp divides the sequence; with
    sp=1, tp*cp divides the sequence; recompute_layers at most the layers of a model chunk.
    `vocab` is not constrained: a vocab-parallel embedding
    pads it to a multiple of tp.
    """
    problems: list[str] = []
    if plan.devices != devices:
        problems.append(_degree_problem(plan, devices))
    if plan.tp > 1:
        dims = {"heads": heads, "kv_heads": kv_heads, "hidden": hidden}
        bad = [f"{k}={v}" for k, v in dims.items() if v is not None and v % plan.tp]
        if bad:
            common = math.gcd(*[v for v in dims.values() if v is not None])
            valid = [d for d in _divisors(common) if d <= devices]
            problems.append(f"tp={plan.tp} does not divide {' and '.join(bad)}; valid tp: "
                            + ", ".join(map(str, valid)))
    if plan.stages > layers:
        low = 2 if plan.vpp > 1 else 1
        valid_pp = [p for p in _divisors(layers) if low <= p and p * plan.vpp <= layers and p <= devices]
        what = f"pp*vpp = {plan.pp}*{plan.vpp} = {plan.stages} stages" if plan.vpp > 1 else f"pp={plan.pp} stages"
        text = (f"{what} for {layers} layers: each stage needs at least one layer, so pp <= "
                f"{layers // plan.vpp}; pp dividing the layers evenly: ")
        text += ", ".join(map(str, _nearest(valid_pp, plan.pp, 6))) or "none"
        if plan.vpp > 1:
            text += f"; with pp={plan.pp}, vpp <= {max(1, layers // plan.pp)}"
        problems.append(text)
    most = -(-layers // plan.stages) if plan.stages <= layers else 1
    if plan.recompute_layers is not None and plan.recompute_layers > most:
        problems.append(f"recompute_layers={plan.recompute_layers} but a pipeline model chunk holds at most {most} "
                        f"of the {layers} layers over pp*vpp = {plan.stages} chunks; use recompute_layers <= "
                        f"{most} or all")
    gbs = plan.gbs if plan.gbs is not None else batch
    if gbs is not None and gbs % (plan.dp * plan.mb):
        problems.append(f"global batch {gbs} not divisible by dp*mb = {plan.dp}*{plan.mb} = "
                        f"{plan.dp * plan.mb} (micro-batch count must be whole); "
                        + _batch_suggestions(gbs, plan.dp, plan.mb))
    elif gbs is not None:
        short = microbatch_problem(plan, gbs // (plan.dp * plan.mb))
        if short:
            problems.append(short + "; " + _pipeline_suggestions(plan, gbs))
    if seq is not None and plan.cp > 1 and seq % plan.cp:
        valid = [c for c in _divisors(seq) if c <= devices]
        problems.append(f"cp={plan.cp} does not divide the sequence length {seq}; valid cp: "
                        + ", ".join(map(str, _nearest(valid, plan.cp, 6))))
    if seq is not None and plan.cp > 1 and plan.cp_layout == "zigzag" and seq % plan.cp == 0 and seq % (2 * plan.cp):
        problems.append(f"cp={plan.cp}:zigzag cuts the sequence {seq} into 2*cp = {2 * plan.cp} chunks, which do "
                        "not divide it; use a contiguous cp or a cp dividing " + str(seq // 2 if seq % 2 == 0 else 1))
    if seq is not None and plan.sp and plan.tp > 1 and seq % (plan.tp * plan.cp):
        problems.append(f"sp=1 splits the sequence {seq} over tp*cp = {plan.tp * plan.cp} ranks, which "
                        f"does not divide it; use sp=0 or a tp dividing {seq // math.gcd(seq, plan.cp)}")
    if plan.ep > 1 and plan.mb % plan.ep:
        problems.append(f"ep={plan.ep} splits each micro-batch of mb={plan.mb} sequences over its ranks, which "
                        f"does not divide it; use mb a multiple of {plan.ep}")
    if problems:
        raise ShardcError(f"plan {plan} is not valid for {devices} devices:\n  - " + "\n  - ".join(problems))


def microbatch_problem(plan: ParallelPlan, m: int) -> str | None:
    """Why torch's schedule for `plan` refuses `m` micro-batches per step, or None when it runs
    them. The rules are torch.distributed.pipelining's own constructor checks: Schedule1F1B
    needs m >= pp (its stage count); ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble run
    in max(1, m // pp) rounds and need m divisible by that (so m < pp is allowed); ScheduleGPipe
    and ScheduleZBVZeroBubble take any m >= 1; ScheduleDualPipeV needs m >= its 2*pp stages."""
    if plan.pp == 1 or plan.schedule in ("gpipe", "zbv"):
        return None
    if plan.schedule == "dualpipev" and m < 2 * plan.pp:
        return (f"{m} micro-batch{'es' if m != 1 else ''} per step for pp={plan.pp}: DualPipeV needs at least as "
                f"many micro-batches as its 2*pp = {2 * plan.pp} virtual stages (m = gbs/(dp*mb) >= {2 * plan.pp})")
    if plan.schedule == "1f1b" and m < plan.pp:
        return (f"{m} micro-batch{'es' if m != 1 else ''} per step for pp={plan.pp} stages: the 1F1B "
                f"schedule needs at least as many micro-batches as stages (m = gbs/(dp*mb) >= {plan.pp})")
    rounds = max(1, m // plan.pp)
    if plan.schedule in ("interleaved", "interleaved-zb") and m % rounds:
        what = "interleaved 1F1B" if plan.schedule == "interleaved" else "interleaved zero bubble"
        return (f"{m} micro-batches per step for pp={plan.pp}: {what} runs them in "
                f"max(1, m // pp) = {rounds} rounds and needs m divisible by that (m < pp, or m a "
                f"multiple of m // pp, e.g. a multiple of pp)")
    return None


def _pipeline_suggestions(plan: ParallelPlan, gbs: int) -> str:
    """Valid values of gbs, mb and dp near the plan's, for the micro-batch count's sake."""
    per = plan.dp * plan.mb
    ok_m = [m for m in range(1, 4 * plan.pp + 1) if microbatch_problem(plan, m) is None]
    near_gbs = [m * per for m in _nearest(ok_m, gbs // per, 3)]
    text = f"valid gbs with dp={plan.dp}, mb={plan.mb}: {', '.join(map(str, near_gbs))}"
    if gbs % plan.dp == 0:
        mbs = [mb for mb in _divisors(gbs // plan.dp) if microbatch_problem(plan, gbs // (plan.dp * mb)) is None]
        text += f"; valid mb with gbs={gbs}: {', '.join(map(str, mbs[:6])) or 'none'}"
    dps = [d for d in _divisors(gbs) if d < plan.dp and gbs % (d * plan.mb) == 0
           and microbatch_problem(plan, gbs // (d * plan.mb)) is None]
    if dps:
        text += f"; or a smaller dp (more devices on tp/pp/cp): {', '.join(map(str, dps[-3:]))}"
    if plan.schedule in ("1f1b", "interleaved") and plan.vpp == 1:
        text += "; or schedule=gpipe, which runs fewer micro-batches than stages"
    return text


def _degree_problem(plan: ParallelPlan, devices: int) -> str:
    degrees = {Axis.DP: plan.dp, Axis.TP: plan.tp, Axis.PP: plan.pp, Axis.CP: plan.cp}
    text = (f"dp*tp*pp*cp = {plan.dp}*{plan.tp}*{plan.pp}*{plan.cp} = {plan.devices} but the cluster has "
            f"{devices} devices")
    if plan.ep > 1:
        text = (f"dp*tp*pp*cp*ep = {plan.dp}*{plan.tp}*{plan.pp}*{plan.cp}*{plan.ep} = {plan.devices} but the "
                f"cluster has {devices} devices")
    fixes = []
    for key, value in degrees.items():
        rest = plan.devices // value
        if devices % rest == 0:
            fixes.append(f"{key}={devices // rest}")
    if fixes:
        return text + "; to fit, change one degree: " + " or ".join(fixes)
    return text + f"; the degrees must multiply to {devices} (e.g. dp={devices} alone)"
