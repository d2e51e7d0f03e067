"""A solver's plan as a plan file and as a partitioned graph: the one conversion each way.

`plan_file` writes an `Assignment` as the plan file (`shardc.plan.file.PlanFile`: group keys
and candidate labels), `assignment_from_plan` reads one back onto a `Problem` of the same
model, shape and micro-batch size, and `annotate_graph` writes an assignment into the IR:
`graph.mesh`, every node's `Partition`, every value's `Layout`, and per layer its stage,
recomputation and ZeRO stage, so the printed IR (`shardc inspect plan.ir`) shows
`partition<...>` on every node. `partitioned_graph` is the three together: a plan file on a
freshly traced graph.
"""

from __future__ import annotations

from typing import Any

from shardc.cost.fusion import is_cpu
from shardc.hardware import Cluster
from shardc.ir import Graph, LayerAnnotation, Layout, Partial, Placement, Value
from shardc.ir.diagnostics import ShardcError
from shardc.plan.file import GroupChoice, PlanFile
from shardc.search.evaluate import Assignment, per_stage, plan_for
from shardc.search.problem import MeshShape, Problem, build_problem, compile_key, graph_facts


def plan_file(problem: Problem, a: Assignment, ev: Any, gbs: int) -> PlanFile:
    """The plan file of `a` on `problem`; `ev` is the plan's `Estimate` (or `Evaluation`)."""
    s = problem.shape
    groups = tuple(GroupChoice(v.key[0], v.key[1], v.cands[c].label, v.group.name)
                   for v, c in zip(problem.groups, a.choice))
    stage_groups = tuple(tuple(GroupChoice(v.key[0], v.key[1], v.cands[c].label)
                               for v, c in zip(problem.groups, a.at(st)) if v.section == "block")
                         for st in range(len(a.stages))) if a.stage_choice else ()
    inputs, params = PlanFile.fingerprint(problem.facts.graph)
    return PlanFile(problem.facts.graph.name, s.plan(problem.mb, gbs, a.zero, problem.dtype, compile_key(problem.facts)),
                    problem.micro_batches,
                    a.stages, groups, stage_groups, s.tq, ev.step_time_s, ev.memory_per_device_bytes,
                    str(problem.facts.ctx.cluster), inputs, params)


def assignment_from_plan(file: PlanFile, problem: Problem) -> Assignment:
    """Map a plan file back onto `problem` (same model, shape and micro-batch size)."""
    stages: Any = file.stages

    def vector(groups: tuple[GroupChoice, ...], base: dict[tuple[str, int], str]) -> tuple[int, ...]:
        by_key = base | {g.key: g.partition for g in groups}
        choice = []
        for v in problem.groups:
            label = by_key.get(v.key)
            labels = [c.label for c in v.cands]
            if label is None:
                raise ShardcError(f"plan file {file.path} has no partition for node group {v.group.name} "
                                  f"(layer {v.key[0]}, position {v.key[1]}): it was planned for another model",
                                  hint="plan this model again with `shardc plan -o`")
            if label not in labels:
                raise ShardcError(f"plan file {file.path} names partition {label!r} for group {v.group.name}, which "
                                  f"is not a candidate on {problem.shape}",
                                  hint="plan this model again with `shardc plan -o` (without --warm-start)")
            choice.append(labels.index(label))
        return tuple(choice)

    base = {g.key: g.partition for g in file.groups}
    choice = vector((), base)
    if not file.stage_groups:
        return Assignment(choice, stages, file.plan.zero)
    vecs = [vector(groups, base) for groups in file.stage_groups]
    return per_stage(problem, choice, vecs, stages, file.plan.zero)


def plan_problem(graph: Graph, cluster: Cluster, file: PlanFile) -> Problem:
    """The solver's problem for `file`'s mesh shape and micro-batch size on `graph`."""
    shape = MeshShape.of(file.plan, file.tq)
    compiled = file.plan.compiled_on(not is_cpu(cluster.device))
    return build_problem(graph_facts(graph, cluster, file.plan.dtype, compiled=compiled), cluster, shape, file.plan.mb,
                         file.plan.global_batch(), file.plan.dtype)


def partitioned_graph(graph: Graph, cluster: Cluster, file: PlanFile) -> Graph:
    """`graph` (the model the plan was made for, traced at the batch the solver traced it at,
    its layers grouped) partitioned as `file` says, in place: the graph `shardc plan -o` wrote
    beside the file. A graph of another model is a ShardcError naming the file (`PlanFile.check`)."""
    file.check(graph)
    problem = plan_problem(graph, cluster, file)
    return annotate_graph(graph, problem, assignment_from_plan(file, problem))


def annotate_graph(graph: Graph, problem: Problem, a: Assignment) -> Graph:
    """Write the plan into `graph` in place: mesh, every node's partition, every value's layout
    (graph inputs, parameters and buffers as their readers need them, Partial held replicated;
    replicated on an axis where readers on differently partitioned stages disagree),
    per layer its stage, recomputation and ZeRO stage, and the plan in `graph.attrs` (as
    apply-plan records it), so that `shardc.cost.estimate(graph, cluster)` scores it.

    A candidate whose anchor splits a reduction resolves the Partial(sum) it makes inside its
    group: the anchor's output value holds the resolved layout (Replicate, or the Shard its
    reduce_scatter makes) under the partition that makes it partial. That is the form the cost
    model prices (the reduction charged where the value is made, `cost.edges.resolves`), the
    verifier accepts before lowering (`ops.verifier.resolves_partial`), and `lower` turns into
    the collective right after the node."""
    facts = problem.facts
    graph.mesh = problem.shape.mesh()
    for v in graph.inputs + graph.params + graph.buffers:
        v.layout = None
    index = {v.key: i for i, v in enumerate(problem.groups)}
    rep_block = problem.groups[[v.section for v in problem.groups].index("block")].key[0] \
        if any(v.section == "block" for v in problem.groups) else None
    blocks = set(facts.layering.blocks)
    stage_of: dict[str, tuple[int, str]] = dict(zip(facts.layering.blocks, a.blocks()))
    wanted: dict[Value, tuple[Value, list[tuple[tuple[str, Placement], ...]]]] = {}
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
                    wanted.setdefault(v, (v, []))[1].append(
                        tuple((ax, p) for ax, p in need.placements if not isinstance(p, Partial)))
        for k, v in enumerate(outputs):
            if k < len(cand.outputs):
                v.layout = cand.outputs[k][1]
    for v, read_as in wanted.values():
        # A value every reader needs alike is laid out so; one that stages partitioned apart
        # read differently (a rotary table) is kept whole on the axes they disagree on.
        v.layout = Layout(tuple(pl for pl in read_as[0] if all(pl in other for other in read_as[1:])))
    last = len(a.stages) - 1
    for name in facts.layering.pre:
        stage_of[name] = (0, "none")
    for name in facts.layering.post:
        stage_of[name] = (last, "none")
    for name, graph_layer in graph.layers.items():
        stage, rc = stage_of.get(name, (0, "none"))
        graph_layer.annotation = LayerAnnotation(stage, rc, a.zero)
    for v in graph.params + graph.buffers:
        if v.layout is None:
            v.layout = Layout()
    plan = plan_for(problem, a.zero)
    graph.attrs.update({  # the schedule as apply-plan records it: interleaved when vpp > 1
        "plan": str(plan), "microbatch_size": problem.mb, "microbatches": problem.micro_batches,
        "global_batch": problem.gbs, "traced_batch": facts.batch, "schedule": plan.schedule,
        "virtual_stages": plan.vpp,
        "dtype": problem.pricer.ctx.dtype,
    })
    return graph
