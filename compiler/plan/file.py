"""The plan file: the one file form of a plan, JSON tagged `shardc-plan/1` (`shardc plan -o`).

A plan file holds the uniform plan (`ParallelPlan`: degrees, micro-batch size, global batch,
ZeRO stage, dtype; written as `mesh`, `mb`, `gbs`, `zero`, `dtype`, with `tq` in the mesh when
tensor parallelism is split over a second axis, and `vpp` when stages interleave), per pipeline
stage (per model chunk, pp*vpp of them, when interleaved) the block counts under
each recomputation, and per node group its chosen partition by group key (layer, position)
and candidate label, so that it loads back onto a freshly traced graph of the same model
(`shardc.search.planfile.partitioned_graph`). When stages partition their blocks
differently, `stage_groups` lists per stage the block groups' partitions (`groups` then holds
the first stage's). The predicted step time and memory are kept for reference.

This module reads and writes the JSON; turning it into a partitioned graph needs the solver's
candidates and lives in `shardc.search.planfile`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardc.ir import RECOMPUTE_CHOICES, Axis
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan

FORMAT = "shardc-plan/1"


@dataclass(frozen=True, slots=True)
class GroupChoice:
    """The partition (a candidate label) chosen for the node group at `position` in `layer`;
    `anchor` names the group's anchor node (for the reader; not needed to load)."""

    layer: str
    position: int
    partition: str
    anchor: str | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.layer, self.position)

    def to_json(self) -> dict[str, Any]:
        anchor = {"anchor": self.anchor} if self.anchor is not None else {}
        return {"layer": self.layer, "position": self.position, **anchor, "partition": self.partition}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GroupChoice:
        return cls(str(data["layer"]), int(data["position"]), str(data["partition"]), data.get("anchor"))


@dataclass(frozen=True)
class PlanFile:
    """A plan file's content (see the module docstring). `stages[s]` counts stage s's blocks
    under each of `RECOMPUTE_CHOICES`; `tq` is the part of `plan.tp` on the second tensor axis."""

    model: str
    plan: ParallelPlan
    micro_batches: int
    stages: tuple[tuple[int, ...], ...]
    groups: tuple[GroupChoice, ...]
    stage_groups: tuple[tuple[GroupChoice, ...], ...] = ()
    tq: int = 1
    step_time_s: float = 0.0
    memory_per_device_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.plan.gbs is None:
            raise ShardcError(f"a plan file's plan gives its global batch (gbs=N), not {self.plan}")
        if self.tq < 1 or self.plan.tp % self.tq:
            raise ShardcError(f"plan file: tq={self.tq} does not divide tp={self.plan.tp}")

    def to_json(self) -> dict[str, Any]:
        p = self.plan
        mesh = {Axis.PP: p.pp, Axis.DP: p.dp, Axis.CP: p.cp, Axis.TP: p.tp // self.tq}
        return {
            "format": FORMAT,
            "model": self.model,
            "mesh": {str(k): v for k, v in mesh.items()} | ({"tq": self.tq} if self.tq > 1 else {}),
            **({"vpp": p.vpp} if p.vpp > 1 else {}),  # interleaved: `stages` lists the pp*vpp model chunks
            "mb": p.mb, "gbs": p.gbs, "micro_batches": self.micro_batches, "zero": p.zero, "dtype": p.dtype,
            "stages": [dict(zip(RECOMPUTE_CHOICES, row)) for row in self.stages],
            "groups": [g.to_json() for g in self.groups],
            **({"stage_groups": [[g.to_json() for g in row] for row in self.stage_groups]}
               if self.stage_groups else {}),
            "step_time_s": self.step_time_s,
            "memory_per_device_bytes": self.memory_per_device_bytes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "plan file") -> PlanFile:
        """The plan file `data` holds (checked for its format tag); `source` names it in errors."""
        if data.get("format") != FORMAT:
            raise ShardcError(f"{source} is not a shardc plan file (format {data.get('format')!r}, expected {FORMAT})")
        try:
            m = data["mesh"]
            tq = int(m.get("tq", 1))
            plan = ParallelPlan(dp=int(m["dp"]), tp=int(m["tp"]) * tq, pp=int(m["pp"]), cp=int(m["cp"]),
                                vpp=int(data.get("vpp", 1)),
                                mb=int(data["mb"]), gbs=int(data["gbs"]), zero=int(data["zero"]),
                                dtype=str(data.get("dtype", "bf16")))
            return cls(str(data["model"]), plan, int(data["micro_batches"]),
                       tuple(tuple(int(row[r]) for r in RECOMPUTE_CHOICES) for row in data["stages"]),
                       tuple(GroupChoice.from_json(g) for g in data["groups"]),
                       tuple(tuple(GroupChoice.from_json(g) for g in row) for row in data.get("stage_groups", ())),
                       tq, float(data.get("step_time_s", 0.0)), float(data.get("memory_per_device_bytes", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ShardcError(f"{source} is a damaged plan file: {type(e).__name__} {e}",
                              hint="write it again with `shardc plan -o`") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PlanFile:
        """Read a plan file written by `save`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ShardcError(f"cannot read plan file {path}: {e}", hint="pass a file written by `shardc plan -o`") from e
        return cls.from_json(data, str(path))
