"""Plans as files, and plans written into the IR.

A plan file is JSON: the mesh shape, micro-batch size, global batch, ZeRO stage, per stage the
block counts under each recomputation, and per node group its chosen partition (by group key
and candidate label, so a file stays readable and loads back onto a freshly traced graph);
when stages partition their blocks differently, `stage_groups` lists per stage the block
groups' partitions (`groups` then holds the first stage's).
`annotate_graph` writes a plan into the IR: `graph.mesh`, every node's `Partition`, every
value's `Layout`, and per layer its stage, recomputation and ZeRO stage, so the printed IR
(`shardc inspect plan.ir`) shows `partition<...>` on every node.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardc.ir import RECOMPUTE_CHOICES, Graph, LayerAnnotation, Layout, Partial, Placement, Value
from shardc.ir.diagnostics import ShardcError
from shardc.search.evaluate import Assignment, per_stage
from shardc.search.problem import MeshShape, Problem

FORMAT = "shardc-plan/1"


def plan_dict(problem: Problem, a: Assignment, ev: Any, gbs: int) -> dict[str, Any]:
    """The plan file's content; `ev` is the plan's `Estimate` (or `Evaluation`)."""
    s = problem.shape
    return {
        "format": FORMAT,
        "model": problem.facts.graph.name,
        "mesh": {"pp": s.pp, "dp": s.dp, "cp": s.cp, "tp": s.tp, **({"tq": s.tq} if s.tq > 1 else {})},
        "mb": problem.mb, "gbs": gbs, "micro_batches": problem.micro_batches, "zero": a.zero,
        "stages": [dict(zip(RECOMPUTE_CHOICES, row)) for row in a.stages],
        "groups": [{"layer": v.key[0], "position": v.key[1], "anchor": v.group.name, "partition": v.cands[c].label}
                   for v, c in zip(problem.groups, a.choice)],
        **({"stage_groups": [[{"layer": v.key[0], "position": v.key[1], "partition": v.cands[c].label}
                              for v, c in zip(problem.groups, a.at(s)) if v.section == "block"]
                             for s in range(len(a.stages))]} if a.stage_choice else {}),
        "step_time_s": ev.step_time_s,
        "memory_per_device_bytes": ev.memory_per_device_bytes,
    }


def save_plan(path: str | Path, problem: Problem, a: Assignment, ev: Any, gbs: int) -> None:
    Path(path).write_text(json.dumps(plan_dict(problem, a, ev, gbs), indent=1) + "\n")


def load_plan(path: str | Path) -> dict[str, Any]:
    """Read a plan file written by `save_plan` (checked for its format tag)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ShardcError(f"cannot read plan file {path}: {e}", hint="pass a file written by `shardc plan -o`") from e
    if data.get("format") != FORMAT:
        raise ShardcError(f"{path} is not a shardc plan file (format {data.get('format')!r}, expected {FORMAT})")
    return data


def plan_shape(data: dict[str, Any]) -> tuple[MeshShape, int]:
    m = data["mesh"]
    return MeshShape(m["pp"], m["dp"], m["cp"], m["tp"], m.get("tq", 1)), int(data["mb"])


def assignment_from_plan(data: dict[str, Any], problem: Problem) -> Assignment:
    """Map a plan file back onto `problem` (same model, shape and micro-batch size)."""
    stages = tuple(tuple(int(row[r]) for r in RECOMPUTE_CHOICES) for row in data["stages"])

    def vector(groups: list[dict[str, Any]], base: dict[tuple[str, int], str]) -> tuple[int, ...]:
        by_key = base | {(g["layer"], g["position"]): g["partition"] for g in groups}
        choice = []
        for v in problem.groups:
            label = by_key.get(v.key)
            labels = [c.label for c in v.cands]
            if label not in labels:
                raise ShardcError(f"plan file names partition {label!r} for group {v.group.name}, which is not a "
                                  f"candidate on {problem.shape}", hint="re-plan without --warm-start")
            choice.append(labels.index(label))
        return tuple(choice)

    base = {(g["layer"], g["position"]): g["partition"] for g in data["groups"]}
    choice = vector([], base)
    if "stage_groups" not in data:
        return Assignment(choice, stages, int(data["zero"]))  # type: ignore[arg-type]
    vecs = [vector(groups, base) for groups in data["stage_groups"]]
    return per_stage(problem, choice, vecs, stages, int(data["zero"]))  # type: ignore[arg-type]


def plan_text(problem: Problem, a: Assignment) -> str:
    """The plan's uniform part in `ParallelPlan` syntax (degrees, micro-batch, batch, ZeRO)."""
    from shardc.search.evaluate import plan_for

    return str(plan_for(problem, a.zero))


def annotate_graph(graph: Graph, problem: Problem, a: Assignment) -> Graph:
    """Write the plan into `graph` in place: mesh, every node's partition, every value's layout
    (graph inputs, parameters and buffers as their readers need them, Partial held replicated;
    replicated on an axis where readers on differently partitioned stages disagree),
    per layer its stage, recomputation and ZeRO stage, and the plan in `graph.attrs` (as
    apply-plan records it), so that `shardc.cost.estimate(graph, cluster)` scores it."""
    facts = problem.facts
    graph.mesh = problem.shape.mesh()
    for v in graph.inputs + graph.params + graph.buffers:
        v.layout = None
    index = {v.key: i for i, v in enumerate(problem.groups)}
    rep_block = problem.groups[[v.section for v in problem.groups].index("block")].key[0] \
        if any(v.section == "block" for v in problem.groups) else None
    blocks = set(facts.layering.blocks)
    stage_of: dict[str, tuple[int, str]] = {}
    order = list(facts.layering.blocks)
    i = 0
    for s, row in enumerate(a.stages):
        # Within a stage, fully recomputed blocks first: they are the ones held longest.
        for r in (2, 1, 0):
            for _ in range(row[r]):
                stage_of[order[i]] = (s, RECOMPUTE_CHOICES[r])
                i += 1
    wanted: dict[int, tuple[Value, list[tuple[tuple[str, Placement], ...]]]] = {}
    for g in facts.groups:
        layer = "<graph>" if g.layer is None else g.layer
        key = (rep_block, g.position) if layer in blocks and rep_block is not None else (layer, g.position)
        if key not in index:
            continue
        var = problem.groups[index[key]]
        vec = a.at(stage_of[layer][0]) if layer in blocks and layer in stage_of else a.choice
        cand = var.cands[vec[index[key]]]
        outputs = [v for n in g.members for v in n.outputs]
        for j, node in enumerate(g.members):
            node.partition = cand.partitions[j] if j < len(cand.partitions) else None
            needs = cand.layouts[j][0] if j < len(cand.layouts) else ()
            for v, need in zip(node.inputs, needs):
                if v.kind in ("input", "parameter", "buffer"):
                    wanted.setdefault(id(v), (v, []))[1].append(
                        tuple((ax, p) for ax, p in need.placements if not isinstance(p, Partial)))
        for k, v in enumerate(outputs):
            if k < len(cand.outputs):
                v.layout = cand.outputs[k][1]
    for v, needs in wanted.values():
        # A value every reader needs alike is laid out so; one that stages partitioned apart
        # read differently (a rotary table) is kept whole on the axes they disagree on.
        v.layout = Layout(tuple(pl for pl in needs[0] if all(pl in other for other in needs[1:])))
    last = len(a.stages) - 1
    for name in facts.layering.pre:
        stage_of[name] = (0, "none")
    for name in facts.layering.post:
        stage_of[name] = (last, "none")
    for name, layer in graph.layers.items():
        stage, rc = stage_of.get(name, (0, "none"))
        layer.annotation = LayerAnnotation(stage, rc, a.zero, layer.annotation.offload)
    for v in graph.params + graph.buffers:
        if v.layout is None:
            v.layout = Layout()
    graph.attrs.update({
        "plan": plan_text(problem, a), "microbatch_size": problem.mb, "microbatches": problem.micro_batches,
        "global_batch": problem.gbs, "traced_batch": facts.batch, "schedule": "1f1b", "virtual_stages": 1,
        "dtype": problem.pricer.ctx.dtype,
    })
    return graph
