"""`shardc plan`: load a model, search, print the chosen plan against the best grid plan.

`run_plan(...)` is the whole command: it traces the model on the meta device, runs the outer
search, prints the chosen plan, its predicted step time and memory with breakdowns, the best
grid plan and the ratio, lists ops kept replicated for want of a rule, and writes the plan file
and its partitioned IR.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from shardc.hardware import Cluster, parse_cluster
from shardc.ir import RECOMPUTE_CHOICES, Graph
from shardc.ir.diagnostics import ShardcError
from shardc.ops.registry import has_op
from shardc.search.outer import Found, SearchResult, search
from shardc.search.planfile import (
    annotate_graph,
    assignment_from_plan,
    load_plan,
    plan_dict,
    plan_shape,
    save_plan,
)
from shardc.search.problem import build_problem, graph_facts


def load_graph(model_spec: str, batch: int | None = None) -> Graph:
    """The model traced on the meta device (at batch 2 unless the spec or `batch` says otherwise)."""
    if batch is not None:
        model_spec += ("&" if "?" in model_spec else "?") + f"batch={batch}"
    from shardc.frontend import trace
    from shardc.frontend.spec import load_model
    from shardc.passes.group_layers import group_layers

    if ".py:" in model_spec and "batch=" not in model_spec:
        # Trace at batch 2: the registry binds a batch of one as a broadcast dim that no mesh
        # axis can split; the planner rescales the batch to the micro-batch anyway.
        try:
            loaded = load_model(model_spec + ("&" if "?" in model_spec else "?") + "batch=2", device="meta")
        except ShardcError:
            loaded = load_model(model_spec, device="meta")
    else:
        loaded = load_model(model_spec, device="meta")
    graph = trace(loaded.model, loaded.example_inputs, name=loaded.name, input_names=loaded.input_names)
    return group_layers(graph)


def describe(found: Found) -> str:
    s, a = found.problem.shape, found.assignment
    stages = " | ".join("+".join(f"{k}{r[0]}" for k, r in zip(row, RECOMPUTE_CHOICES) if k) or "0" for row in a.stages)
    text = f"{s}, mb={found.problem.mb}, m={found.problem.micro_batches}, zero={a.zero}, blocks per stage [{stages}]"
    if a.stage_choice:
        differ = sum(1 for g, v in enumerate(found.problem.groups) if v.section == "block"
                     and len({a.at(st)[g] for st in range(len(a.stages))}) > 1)
        text += f", block partitions per stage ({differ} groups differ)"
    return text


def no_fit_error(result: SearchResult, limit: float) -> ShardcError:
    c = result.closest
    if c is None:
        return ShardcError("no plan fits and no plan could be scored")
    parts = max(c.evaluation.memory_parts, key=lambda p: sum(p.values()))
    category = max(parts, key=lambda k: parts[k])
    return ShardcError(
        f"no plan fits in {limit / 2**30:.1f} GiB per device: the smallest per-device memory any plan reached is "
        f"{c.evaluation.memory_per_device_bytes / 2**30:.1f} GiB ({describe(c)}); the category that overflows "
        f"is {category} ({parts[category] / 2**30:.1f} GiB)",
        hint="raise --memory-limit, use more devices, or a smaller --gbs")


def run_plan(model_spec: str, cluster: str | Cluster, gbs: int, memory_limit_gb: float | None = None,
             time_limit: float = 30.0, seed: int = 0, out: str | None = None, json_out: bool = False,
             console: Any = None, workers: int = 1, warm_start: str | None = None,
             graph: Graph | None = None, grid2d: bool = False) -> int:
    """The `shardc plan` command; returns the exit code (ShardcError propagates to the CLI).
    `grid2d` adds the tp x tq mesh shapes PrimePar's 2-D grids need (`mesh_shapes`)."""
    if time_limit <= 0:
        raise ShardcError(f"--time-limit must be positive, got {time_limit}", hint="e.g. --time-limit 30")
    if gbs < 1:
        raise ShardcError(f"--gbs must be a positive number of sequences, got {gbs}")
    started = time.perf_counter()
    cl = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    limit = memory_limit_gb * 2**30 if memory_limit_gb else float(cl.device.memory_bytes)
    graph = graph if graph is not None else load_graph(model_spec)
    facts = graph_facts(graph, cl)
    warm = None
    if warm_start:
        data = load_plan(warm_start)
        shape, mb = plan_shape(data)
        warm = (shape, mb, assignment_from_plan(data, build_problem(facts, cl, shape, mb, gbs)))
    result = search(facts, cl, gbs, limit, time_limit, seed, workers, warm, grid2d=grid2d)
    if result.best is None:
        raise no_fit_error(result, limit)
    best, grid = result.best, result.grid
    unruled = sorted({n.op for n in graph.nodes if not has_op(n.op)})
    annotate_graph(graph, best.problem, best.assignment)
    est = best.estimate
    assert est is not None
    if out:
        save_plan(out, best.problem, best.assignment, est, gbs)
        Path(str(out) + ".ir").write_text(str(plan_ir(model_spec, graph, best, cl, gbs)))
    payload = plan_dict(best.problem, best.assignment, est, gbs)
    summary = {
        "step_time_s": est.step_time_s,
        "memory_per_device_bytes": est.memory_per_device_bytes,
        "mfu": est.mfu,
        "source": best.source,
        "grid_best_step_time_s": grid.step_time_s if grid else None,
        "grid_best_memory_per_device_bytes": grid.memory_per_device_bytes if grid else None,
        "grid_best_plan": grid.grid_point.plan_string(gbs) if grid and grid.grid_point else None,
        "speedup_over_grid": grid.step_time_s / est.step_time_s if grid else None,
        "solver_evaluation_step_time_s": best.evaluation.step_time_s,
        "solve_time_s": result.solve_time_s,
        "total_time_s": time.perf_counter() - started,
        "optimality_gap": result.gap,
        "shapes_solved": result.shapes_solved,
        "shapes_pruned": result.shapes_pruned,
        "time_breakdown": est.time_breakdown(),
        "memory_breakdown": est.memory_breakdown,
        "replicated_ops": unruled,
        "plan": payload,
    }
    if json_out:
        print(json.dumps(summary, indent=1))
        return 0
    _print(console, best, grid, summary, graph, gbs)
    return 0


def plan_ir(model_spec: str, graph: Graph, best: Found, cluster: Cluster, gbs: int) -> Graph:
    """The partitioned IR written beside a plan file. The planner traces at a small batch; when
    the data-parallel degree does not divide it, the model is loaded again at one micro-batch of
    every replica (mb x dp sequences) and the plan file mapped onto it, so that every dim the
    mesh splits divides evenly and the IR verifies."""
    shape, mb = best.problem.shape, best.problem.mb
    if best.problem.facts.batch % shape.dp == 0 or not model_spec:
        return graph
    again = load_graph(model_spec, batch=mb * shape.dp)
    problem = build_problem(graph_facts(again, cluster), cluster, shape, mb, gbs)
    data = plan_dict(best.problem, best.assignment, best.estimate, gbs)
    return annotate_graph(again, problem, assignment_from_plan(data, problem))


def _print(console: Any, best: Found, grid: Found | None, summary: dict[str, Any], graph: Graph, gbs: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from shardc.cost.report import tables

    console = console or Console(highlight=False)
    est = best.estimate
    assert est is not None
    console.print(f"[bold]plan for @{graph.name}[/bold] ({best.source}): {describe(best)}")
    console.print(f"predicted step time {est.step_time_s:.4g} s, memory per device "
                  f"{est.memory_per_device_bytes / 2**30:.2f} GiB (shardc.cost.estimate on the partitioned IR)")
    for table in tables(est):
        console.print(table)
    p = Table(title="partitions of the node groups")
    p.add_column("group")
    p.add_column("partition")
    a = best.assignment
    for g, (v, c) in enumerate(zip(best.problem.groups, a.choice)):
        labels = [v.cands[a.at(st)[g]].label for st in range(len(a.stages))]
        if v.section == "block" and len(set(labels)) > 1:
            c_text = "; ".join(f"stage {st}: {label}" for st, label in enumerate(labels))
        else:
            c_text = v.cands[c].label
        p.add_row(f"{v.key[0]}#{v.key[1]} {v.group.name}", c_text)
    console.print(p)
    if grid is not None:
        console.print(f"best grid plan: {grid.grid_point.plan_string(gbs) if grid.grid_point else ''} -> "
                      f"{grid.step_time_s:.4g} s, {grid.memory_per_device_bytes / 2**30:.2f} GiB; "
                      f"solver / grid speedup {grid.step_time_s / est.step_time_s:.3f}x (both by estimate)")
    else:
        console.print("no grid plan fits in memory")
    console.print(f"solve time {summary['solve_time_s']:.2f} s, optimality gap {summary['optimality_gap']:.2%} "
                  f"(linearised objective), {summary['shapes_solved']} shapes solved, "
                  f"{summary['shapes_pruned']} pruned")
    if summary["replicated_ops"]:
        console.print("kept replicated (no rule): " + ", ".join(summary["replicated_ops"]))
