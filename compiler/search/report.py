"""`shardc plan`'s report: the chosen plan against the best grid plan, and the files it writes.

The driver (`shardc.driver.solve`) loads the model and runs the `solve` pass; this module only
shows the result: `plan_summary` (the JSON), `print_plan` (the chosen plan, its predicted step
time and memory with breakdowns, the best grid plan and the ratio, ops kept replicated for
want of a rule), `write_plan` (the plan file and its partitioned IR), `no_fit_error`.
"""

from __future__ import annotations

from typing import Any

from shardc.ir import RECOMPUTE_CHOICES, Graph
from shardc.ir.diagnostics import ShardcError
from shardc.ir.files import write_text_atomic
from shardc.ops.registry import has_op
from shardc.search.outer import Found, SearchResult
from shardc.search.planfile import plan_file


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


def write_plan(out: str, graph: Graph, best: Found, gbs: int) -> None:
    """The plan file at `out` and, beside it at `out.ir`, the partitioned IR it was scored on."""
    est = best.estimate
    assert est is not None
    plan_file(best.problem, best.assignment, est, gbs).save(out)
    write_text_atomic(str(out) + ".ir", str(graph))


def plan_summary(graph: Graph, result: SearchResult, gbs: int, total_time_s: float) -> dict[str, Any]:
    """What `shardc plan --json` prints: the chosen plan's figures against the best grid plan."""
    best, grid = result.best, result.grid
    assert best is not None and best.estimate is not None
    est = best.estimate
    return {
        "step_time_s": est.step_time_s,
        "memory_per_device_bytes": est.memory_per_device_bytes,
        "mfu": est.mfu,
        "source": best.source,
        "grid_best_step_time_s": grid.step_time_s if grid else None,
        "grid_best_memory_per_device_bytes": grid.memory_per_device_bytes if grid else None,
        "grid_best_plan": grid.grid_point.plan_string(gbs, grid.problem.dtype) if grid and grid.grid_point else None,
        "speedup_over_grid": grid.step_time_s / est.step_time_s if grid else None,
        "solver_evaluation_step_time_s": best.evaluation.step_time_s,
        "solve_time_s": result.solve_time_s,
        "baseline_time_s": result.baseline_s,
        "total_time_s": total_time_s,
        "optimality_gap": result.gap,
        "shapes_solved": result.shapes_solved,
        "shapes_pruned": result.shapes_pruned,
        "time_breakdown": est.time_breakdown(),
        "memory_breakdown": est.memory_breakdown,
        "replicated_ops": sorted({n.op for n in graph.nodes if not has_op(n.op)}),
        "plan": plan_file(best.problem, best.assignment, est, gbs).to_json(),
    }


def print_plan(console: Any, best: Found, grid: Found | None, summary: dict[str, Any], graph: Graph, gbs: int) -> None:
    """The chosen plan, its breakdowns, its partitions and the best grid plan, as rich tables."""
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
        console.print(f"best grid plan: {grid.grid_point.plan_string(gbs, grid.problem.dtype) if grid.grid_point else ''} -> "
                      f"{grid.step_time_s:.4g} s, {grid.memory_per_device_bytes / 2**30:.2f} GiB; "
                      f"solver / grid speedup {grid.step_time_s / est.step_time_s:.3f}x (both by estimate)")
    else:
        console.print("no grid plan fits in memory")
    console.print(f"solve time {summary['solve_time_s']:.2f} s (of which {summary['baseline_time_s']:.2f} s pricing "
                  f"and the grid baseline, outside --time-limit), optimality gap {summary['optimality_gap']:.2%} "
                  f"(linearised objective), {summary['shapes_solved']} shapes solved, "
                  f"{summary['shapes_pruned']} pruned")
    if summary["replicated_ops"]:
        console.print("kept replicated (no rule): " + ", ".join(summary["replicated_ops"]))
