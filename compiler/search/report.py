"""`shardc plan`'s report: the chosen plan against the best grid plan, and the files it writes.

The driver (`shardc.driver.solve`) loads the model and runs the `solve` pass; this module only
shows the result: `plan_summary` (the JSON), `print_plan` (the chosen plan, its predicted step
time and memory with breakdowns, the best grid plan and the ratio, ops kept replicated for
want of a rule), `write_plan` (the plan file and its partitioned IR), `no_fit_error`.
"""

from __future__ import annotations

from typing import Any

from shardc.analysis.stages import stage_device, stage_sizes
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


def stage_rows(found: Found) -> list[dict[str, Any]]:
    """Per virtual stage of the plan's pipeline: its device, blocks by recomputation, the
    prefix (embedding) or suffix (head, loss) it holds, one micro-batch's forward and backward
    seconds (sends included; W, the weight-gradient part, when the schedule splits it), and its
    device's memory and micro-batches in flight (by the estimate)."""
    est, a = found.estimate, found.assignment
    if est is None or est.pipeline is None:
        return []
    shape, lay = found.problem.shape, found.problem.facts.layering
    S = len(a.stages)
    rows = []
    for st, row in enumerate(a.stages):
        d = stage_device(st, shape.pp, shape.plan(found.problem.mb, found.problem.gbs).schedule)
        holds = (["the embedding"] if st == 0 and lay.pre else []) + (["the head and loss"] if st == S - 1 and lay.post
                                                                      else [])
        rows.append({"stage": st, "device": d, "blocks": sum(row), "recompute": dict(zip(RECOMPUTE_CHOICES, row)),
                     "holds": holds, "fwd_s": est.pipeline.fwd[st], "bwd_s": est.pipeline.bwd[st],
                     "wgrad_s": est.pipeline.wgrad[st], "memory_bytes": est.stages[d].memory_bytes,
                     "in_flight": est.stages[d].in_flight})
    return rows


def boundary_reasons(found: Found) -> list[str]:
    """Why the stage boundaries fell where they did: per stage whose block count differs from the
    even split (`stage_sizes`), what it holds besides blocks or what bounds it (its device's
    memory near the limit, the micro-batches in flight), and per stage that recomputes, why."""
    rows = stage_rows(found)
    if len(rows) <= 1:
        return []
    even = stage_sizes(found.problem.layers, len(rows))
    limit = found.evaluation.limit
    mean = sum(r["fwd_s"] + r["bwd_s"] for r in rows) / len(rows)
    out = []
    for r, n in zip(rows, even):
        what = f"stage {r['stage']} (device {r['device']})"
        t = r["fwd_s"] + r["bwd_s"]
        if r["blocks"] < n:
            cause = (f"holds {' and '.join(r['holds'])}" if r["holds"] else
                     f"its device holds {r['in_flight']} micro-batches in flight "
                     f"({r['memory_bytes'] / 2**30:.3g} of {limit / 2**30:.3g} GiB)"
                     if r["memory_bytes"] >= 0.9 * limit else "gives a block to a slower neighbour")
            out.append(f"{what} {cause}: {r['blocks']} blocks vs {n} (even split); {t * 1e3:.4g} ms per "
                       f"micro-batch vs {mean * 1e3:.4g} ms mean")
        elif r["blocks"] > n:
            out.append(f"{what} takes the blocks others gave up: {r['blocks']} vs {n} (even split); "
                       f"{t * 1e3:.4g} ms per micro-batch vs {mean * 1e3:.4g} ms mean")
        redone = {k: v for k, v in r["recompute"].items() if k != "none" and v}
        if redone:
            out.append(f"{what} recomputes {', '.join(f'{v} blocks {k}' for k, v in redone.items())}: its device "
                       f"holds {r['in_flight']} micro-batches in flight ({r['memory_bytes'] / 2**30:.3g} of "
                       f"{limit / 2**30:.3g} GiB)")
    return out or ["the even split (no stage gains by giving or taking a block)"]


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


def best_by_family(summary: dict[str, Any]) -> dict[str, str]:
    """One line per schedule family: its best plan, predicted step time and memory."""
    return {name: f"{f['plan']} -> {f['step_time_s']:.4g} s, {f['memory_per_device_bytes'] / 2**30:.2f} GiB"
            for name, f in summary.get("families", {}).items()}


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
        "pipeline_stages": stage_rows(best),
        "stage_boundaries": boundary_reasons(best),
        "families": {name: {"plan": describe(f), "step_time_s": f.step_time_s,
                            "memory_per_device_bytes": f.memory_per_device_bytes}
                     for name, f in result.families.items()},
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
    rows = stage_rows(best)
    if len(rows) > 1:
        st = Table(title=f"pipeline stages ({best.problem.shape.plan(best.problem.mb, gbs).schedule})")
        for col in ("stage", "device", "blocks", "holds", "F ms/mb", "B ms/mb (W)", "device memory", "in flight"):
            st.add_column(col, justify="left" if col == "holds" else "right")
        for r in rows:
            recompute = "+".join(f"{v}{k[0]}" for k, v in r["recompute"].items() if v)
            st.add_row(str(r["stage"]), str(r["device"]), recompute, ", ".join(r["holds"]), f"{r['fwd_s'] * 1e3:.4g}",
                       f"{r['bwd_s'] * 1e3:.4g}" + (f" ({r['wgrad_s'] * 1e3:.3g})" if r["wgrad_s"] else ""),
                       f"{r['memory_bytes'] / 2**30:.3g} GiB", str(r["in_flight"]))
        console.print(st)
        for line in summary["stage_boundaries"]:
            console.print(f"  boundaries: {line}")
    for name, f in best_by_family(summary).items():
        console.print(f"best {name} plan: {f}")
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
