"""The uniform plan (`ParallelPlan`): Megatron-style degrees, batch, schedule, recomputation,
ZeRO stage and dtype, the same for every layer.

`ParallelPlan.parse` reads the text form (`shardc.plan.keys.read_values`); `str(plan)` prints
it back, every key in `PLAN_KEYS` order (those in `OPTIONAL_KEYS` only when set), so
`parse(str(p)) == p`. `ParallelPlan.of` is the one coercion from what callers hold (the text, a
plan, a partitioned graph: `plan_of`) to a plan; `plan.mesh()` is the device mesh it
partitions over. Import these names from `shardc.plan.parallel`, the plan's front module.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from shardc.ir import RECOMPUTE_CHOICES, ZERO_STAGES, Axis, Graph, Mesh, dtypes
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import PLAN_DTYPES
from shardc.plan.keys import (
    CP_LAYOUTS,
    SCHEDULES,
    V_SCHEDULES,
    ZB_SCHEDULES,
    ZERO_TEXT,
    read_choice,
    read_values,
)
from shardc.plan.nearest import batch_suggestions

# The mesh's axes, outermost first: tp innermost, on the fastest links.
MESH_AXES = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)


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
        object.__setattr__(self, "dtype", read_choice("dtype", self.dtype, PLAN_DTYPES, dtypes.precision))
        object.__setattr__(self, "recompute", read_choice("recompute", self.recompute, RECOMPUTE_CHOICES))
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
            raise ShardcError(f"plan key zero={self.zero!r}: valid values are {ZERO_TEXT}")
        object.__setattr__(self, "cp_layout", read_choice("cp layout", self.cp_layout, CP_LAYOUTS))
        schedule = read_choice("schedule", self.schedule, SCHEDULES, lambda t: t.replace("_", "-"))
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
        return cls(**read_values(text))

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
                              f"{self.dp}*{self.mb} = {per}; " + batch_suggestions(gbs, self.dp, self.mb))
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

