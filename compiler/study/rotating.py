"""The study's rotating partition: a plan file of tensor parallelism whose row-parallel linears rotate.

Rule. On `tp = n` (one micro-batch of the whole batch, fp32, nothing recomputed, no ZeRO) every
node group takes the candidate the grid's Megatron plan takes (`search.grid.megatron_choice`),
except the groups whose Megatron candidate splits the contraction dim k over tp (the
row-parallel linears: attention's output projection, the MLP's down projection), which take
PrimePar's rotating partition of the same group, `partition<tp:n; time k/n rotate tp>`: the
output columns split over tp, the contraction in n steps, each step's input shard passed on
around the tp ring, so no partial sum is left to all-reduce. The choice is written as the
solver writes its plans (`search.planfile.plan_file`: group keys and candidate labels), so the
study runs it from the file (`plan_file=PATH`) as it runs the solver's, partitioned, predicted
and lowered by the same functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardc.ir import Axis
from shardc.ir.diagnostics import ShardcError


def rotating_choice(problem: Any) -> tuple[int, ...]:
    """Per group of `problem` (a tp-only shape), the Megatron candidate, or for a group whose
    Megatron candidate splits k over tp, its `tp:n; time k/T rotate tp` candidate. A
    ShardcError when no group has one (nothing to rotate on this model)."""
    from shardc.search.grid import megatron_choice

    choice = list(megatron_choice(problem))
    rotated = 0
    for g, var in enumerate(problem.groups):
        anchor = var.cands[choice[g]].partitions[0] if var.cands[choice[g]].partitions else None
        if anchor is None or (Axis.TP, "k") not in anchor.spatial:
            continue
        for c, cand in enumerate(var.cands):
            part = cand.partitions[0] if cand.partitions else None
            if part is not None and part.spatial == ((Axis.TP, "n"),) and len(part.temporal) == 1 \
                    and part.temporal[0].dim == "k" and part.temporal[0].rotate == Axis.TP:
                choice[g] = c
                rotated += 1
                break
    if not rotated:
        raise ShardcError(f"no row-parallel linear of @{problem.facts.graph.name} has a rotating partition on "
                          f"{problem.shape}: the study's rotating plan needs one",
                          hint="leave the rotating plan out (--plans FILE), or use a model with linear layers")
    return tuple(choice)


def rotating_plan_file(source: Any, cluster: Any, n: int, gbs: int, path: str | Path) -> str:
    """The rotating plan (see the module doc) of `source` on `cluster` (n processes) at global
    batch `gbs`, written to `path` (a plan file, and its partitioned IR at `path.ir`); returns
    the study plan text `plan_file=PATH` that runs it."""
    from shardc import driver
    from shardc.driver import Flags
    from shardc.ir.files import write_text_atomic
    from shardc.passmanager import PassContext
    from shardc.search.evaluate import Assignment, evaluate
    from shardc.search.planfile import annotate_graph, plan_file
    from shardc.search.problem import MeshShape, build_problem, graph_facts

    resolved = driver.as_cluster(cluster)
    if resolved is None:
        raise ShardcError("the study's rotating plan needs a cluster to plan on: pass the local cluster")
    graph = source.trace(driver.solver_batch(gbs) if source.resizable else None).graph
    graph = driver.run(graph, "group-layers", PassContext(cluster=resolved), Flags())
    facts = graph_facts(graph, resolved, "fp32")
    problem = build_problem(facts, resolved, MeshShape(tp=n), gbs, gbs, "fp32")
    a = Assignment(rotating_choice(problem), ((problem.layers, 0, 0),), 0)
    evaluation = evaluate(problem, a, float("inf"))
    plan_file(problem, a, evaluation, gbs).save(path)
    write_text_atomic(str(path) + ".ir", str(annotate_graph(graph, problem, a)))
    return f"plan_file={path}"
