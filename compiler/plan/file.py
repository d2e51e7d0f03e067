"""The plan file: the one file form of a plan, JSON tagged `shardc-plan/1` (`shardc plan -o`).

A plan file holds the uniform plan (`ParallelPlan`: degrees, micro-batch size, global batch,
ZeRO stage, dtype; written as `mesh`, `mb`, `gbs`, `zero`, `dtype`, with `tq` in the mesh when
tensor parallelism is split over a second axis, `ep` when experts are split (expert parallelism), `vpp` when stages interleave, and `schedule`
when it is a zero-bubble one), per pipeline
stage (per model chunk, pp*vpp of them, when interleaved) the block counts under
each recomputation, and per node group its chosen partition by group key (layer, position)
and candidate label, so that it loads back onto a freshly traced graph of the same model
(`shardc.search.planfile.partitioned_graph`). When stages partition their blocks
differently, `stage_groups` lists per stage the block groups' partitions (`groups` then holds
the first stage's). The predicted step time and memory are kept for reference, with the
cluster they were predicted on. `inputs` (each graph input's shape at the batch the solver
traced, the global batch) and `params` (the parameter count) fingerprint the model, so that a
file loaded onto another model's graph is refused by name rather than misread. `save` writes
atomically (`shardc.ir.files`): a reader never sees half a plan.

This module reads and writes the JSON; turning it into a partitioned graph needs the solver's
candidates and lives in `shardc.search.planfile`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardc.ir import RECOMPUTE_CHOICES, Axis, Graph
from shardc.ir.diagnostics import ShardcError
from shardc.ir.files import write_text_atomic
from shardc.plan.parallel import ZB_SCHEDULES, ParallelPlan

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
    cluster: str | None = None
    inputs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    params: int | None = None
    # where it was read from, for error messages (not part of the plan)
    path: str = field(default="plan file", compare=False)

    def __post_init__(self) -> None:
        if self.plan.gbs is None:
            raise ShardcError(f"a plan file's plan gives its global batch (gbs=N), not {self.plan}")
        if self.tq < 1 or self.plan.tp % self.tq:
            raise ShardcError(f"plan file: tq={self.tq} does not divide tp={self.plan.tp}")

    def to_json(self) -> dict[str, Any]:
        p = self.plan
        mesh = {Axis.PP: p.pp, Axis.DP: p.dp, Axis.CP: p.cp, Axis.TP: p.tp // self.tq} | (
            {Axis.EP: p.ep} if p.ep > 1 else {})
        return {
            "format": FORMAT,
            "model": self.model,
            "mesh": {str(k): v for k, v in mesh.items()} | ({"tq": self.tq} if self.tq > 1 else {}),
            **({"vpp": p.vpp} if p.vpp > 1 else {}),  # interleaved: `stages` lists the pp*vpp model chunks
            **({"schedule": p.schedule} if p.schedule in ZB_SCHEDULES else {}),  # a zero-bubble schedule
            "mb": p.mb, "gbs": p.gbs, "micro_batches": self.micro_batches, "zero": p.zero, "dtype": p.dtype,
            "stages": [dict(zip(RECOMPUTE_CHOICES, row)) for row in self.stages],
            "groups": [g.to_json() for g in self.groups],
            **({"stage_groups": [[g.to_json() for g in row] for row in self.stage_groups]}
               if self.stage_groups else {}),
            "step_time_s": self.step_time_s,
            "memory_per_device_bytes": self.memory_per_device_bytes,
            **({"cluster": self.cluster} if self.cluster is not None else {}),
            **({"inputs": {name: list(shape) for name, shape in self.inputs}} if self.inputs else {}),
            **({"params": self.params} if self.params is not None else {}),
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
                                vpp=int(data.get("vpp", 1)), schedule=str(data.get("schedule", "1f1b")),
                                mb=int(data["mb"]), gbs=int(data["gbs"]), zero=int(data["zero"]),
                                dtype=str(data.get("dtype", "bf16")), ep=int(m.get("ep", 1)))
            return cls(str(data["model"]), plan, int(data["micro_batches"]),
                       tuple(tuple(int(row[r]) for r in RECOMPUTE_CHOICES) for row in data["stages"]),
                       tuple(GroupChoice.from_json(g) for g in data["groups"]),
                       tuple(tuple(GroupChoice.from_json(g) for g in row) for row in data.get("stage_groups", ())),
                       tq, float(data.get("step_time_s", 0.0)), float(data.get("memory_per_device_bytes", 0.0)),
                       None if data.get("cluster") is None else str(data["cluster"]),
                       tuple((str(k), tuple(int(d) for d in v)) for k, v in data.get("inputs", {}).items()),
                       None if data.get("params") is None else int(data["params"]), source)
        except (KeyError, TypeError, ValueError) as e:
            raise ShardcError(f"{source} is a damaged plan file: {type(e).__name__} {e}",
                              hint="write it again with `shardc plan -o`") from e

    @staticmethod
    def fingerprint(graph: Graph) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], int]:
        """(each input's name and shape, the parameter count) of `graph`: what `check` compares."""
        return tuple((v.name, tuple(int(d) for d in v.type.shape)) for v in graph.inputs), graph.param_count()

    def check(self, graph: Graph) -> None:
        """A ShardcError naming the file unless `graph` is the model it was planned for: the same
        name, and (when the file records them) the same input shapes and parameter count."""
        hint = (f"run it with the model spec it was planned for (`shardc plan` traced it at --gbs {self.plan.gbs}), "
                "or plan this model again with `shardc plan -o`")
        if graph.name != self.model:
            raise ShardcError(f"plan file {self.path} was planned for model @{self.model}, not @{graph.name}", hint=hint)
        inputs, params = self.fingerprint(graph)
        if self.inputs and dict(self.inputs) != dict(inputs):
            want = ", ".join(f"{k}={list(v)}" for k, v in self.inputs)
            got = ", ".join(f"{k}={list(v)}" for k, v in inputs)
            raise ShardcError(f"plan file {self.path} was planned for inputs {want}; model @{graph.name} traced "
                              f"at the plan's global batch has {got}", hint=hint)
        if self.params is not None and self.params != params:
            raise ShardcError(f"plan file {self.path} was planned for a model @{self.model} with {self.params:,} "
                              f"parameters; this one has {params:,}", hint=hint)

    def save(self, path: str | Path) -> None:
        """Write the file atomically (a temporary sibling renamed over `path`)."""
        write_text_atomic(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PlanFile:
        """Read a plan file written by `save`."""
        if not Path(path).is_file():
            raise ShardcError(f"cannot read plan file {path}: it does not exist",
                              hint="write it with `shardc plan MODEL --cluster C --gbs N -o FILE.plan`")
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ShardcError(f"cannot read plan file {path}: {e}", hint="pass a file written by `shardc plan -o`") from e
        return cls.from_json(data, str(path))
