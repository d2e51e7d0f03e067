"""The outer search: mesh shapes and micro-batch sizes around the per-shape CP-SAT model.

Rules:
- Shapes are the factorisations pp*dp*cp*tp of the device count with tp and cp inside one
  node (the innermost mesh axes, so the fastest links carry the per-layer traffic), dp
  dividing the global batch, pp at most the number of blocks, and cp > 1 only for sequences
  of 8192 tokens or more. Micro-batch sizes are the powers of two up to 8 that divide the
  per-replica batch.
- The grid baseline is scored first; its best point is the incumbent and the warm start.
- Shapes are visited in order of a lower bound (every group at its cheapest candidate, every
  edge free, a perfectly balanced pipeline: (1 + (m-1)/p) * per-micro-batch time); a shape
  whose bound cannot beat the incumbent is pruned without solving.
- The time limit is shared: each solve gets a slice of what is left, and the best plan found
  when it runs out is returned with its proven gap (the largest over the shapes not proven).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shardc.diagnostics import ShardcError
from shardc.hardware import Cluster
from shardc.search.cpsat import solve
from shardc.search.evaluate import Assignment, Evaluation, evaluate
from shardc.search.grid import GridPoint, grid_assignments
from shardc.search.problem import GraphFacts, MeshShape, Problem, build_problem

LONG_SEQUENCE = 8192
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass
class Found:
    problem: Problem
    assignment: Assignment
    evaluation: Evaluation
    source: str  # "solver" or "grid"
    status: str = ""
    gap: float = 0.0
    grid_point: GridPoint | None = None


@dataclass
class SearchResult:
    best: Found | None
    grid: Found | None
    closest: Found | None  # the lowest-memory plan seen when nothing fits
    solve_time_s: float
    gap: float
    shapes_solved: int
    shapes_pruned: int
    log: list[str] = field(default_factory=list)


def mesh_shapes(devices: int, per_node: int, layers: int, gbs: int, seq: int) -> list[MeshShape]:
    """Every admissible (pp, dp, cp, tp) for `devices` (see the module rule)."""
    if devices < 1:
        raise ShardcError(f"cannot factor {devices} devices into a mesh; the cluster needs at least one device")
    out = []
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    for tp in divisors:
        for cp in divisors:
            if tp * cp > per_node and tp * cp > 1 and (tp > per_node or cp > 1):
                continue
            if cp > 1 and seq < LONG_SEQUENCE:
                continue
            rest = devices // (tp * cp) if devices % (tp * cp) == 0 else 0
            if not rest:
                continue
            for pp in divisors:
                if rest % pp or pp > max(layers, 1):
                    continue
                dp = rest // pp
                if gbs % dp:
                    continue
                out.append(MeshShape(pp, dp, cp, tp))
    if not out:
        raise ShardcError(
            f"no mesh shape pp x dp x cp x tp fits {devices} devices with {layers} blocks and global batch {gbs}: "
            f"dp must divide the batch and pp be at most the number of blocks",
            hint=f"use a global batch that is a multiple of {devices} or a device count dividing it")
    return out


def micro_batch_sizes(gbs: int, dp: int) -> list[int]:
    per = gbs // dp
    return [mb for mb in MICRO_BATCHES if per % mb == 0]


def lower_bound(problem: Problem) -> float:
    """Every group at its cheapest, edges free, stages perfectly balanced."""
    per_mb = sum(min(c.time for c in v.costs) * (problem.layers if v.section == "block" else 1)
                 for v in problem.groups)
    p, m = problem.shape.pp, problem.micro_batches
    return per_mb * (1 + (m - 1) / p)


def search(facts: GraphFacts, cluster: Cluster, gbs: int, limit: float, time_limit: float, seed: int = 0,
           workers: int = 1, warm: tuple[MeshShape, int, Assignment] | None = None, dtype: str = "bf16",
           shapes: list[MeshShape] | None = None, mbs: tuple[int, ...] | None = None) -> SearchResult:
    """Grid baseline, then CP-SAT over shapes by lower bound, within `time_limit` seconds."""
    if time_limit <= 0:
        raise ShardcError(f"time limit must be positive, got {time_limit} s", hint="pass --time-limit 30")
    start = time.perf_counter()
    seq = max((v.type.shape[1] for v in facts.graph.inputs if v.type.rank >= 2), default=1)
    shapes = shapes or mesh_shapes(cluster.num_devices, cluster.devices_per_node, facts.layering.count, gbs, seq)
    if not facts.layering.blocks:
        shapes = [s for s in shapes if s.pp == 1] or shapes
    problems: list[Problem] = []
    for shape in shapes:
        for mb in (mbs or micro_batch_sizes(gbs, shape.dp)):
            if (gbs // shape.dp) % mb == 0:
                problems.append(build_problem(facts, cluster, shape, mb, gbs, dtype))
    grid: Found | None = None
    closest: Found | None = None
    hints: dict[int, Assignment] = {}
    for i, problem in enumerate(problems):
        for point, a in grid_assignments(problem):
            ev = evaluate(problem, a, limit)
            if ev.fits:
                if grid is None or ev.step_time_s < grid.evaluation.step_time_s:
                    grid = Found(problem, a, ev, "grid", "grid", 0.0, point)
                prev = hints.get(i)
                if prev is None or ev.step_time_s < evaluate(problem, prev, limit).step_time_s:
                    hints[i] = a
            if closest is None or ev.memory_per_device_bytes < closest.evaluation.memory_per_device_bytes:
                closest = Found(problem, a, ev, "grid", grid_point=point)
    if warm is not None:
        for i, problem in enumerate(problems):
            if problem.shape == warm[0] and problem.mb == warm[1] and len(warm[2].choice) == len(problem.groups):
                hints[i] = warm[2]
    best = grid
    order = sorted(range(len(problems)), key=lambda i: (i not in hints or warm is None, lower_bound(problems[i]), i))
    solved = pruned = 0
    gap = 0.0
    log = []
    for n_left, i in enumerate(order):
        problem = problems[i]
        bound = lower_bound(problem)
        if best is not None and bound >= best.evaluation.step_time_s:
            pruned += 1
            continue
        remaining = time_limit - (time.perf_counter() - start)
        if remaining <= 0:
            gap = max(gap, 1.0 - bound / best.evaluation.step_time_s if best else 1.0)
            pruned += 1
            continue
        budget = max(0.05, min(remaining / 2, remaining / max(1, (len(order) - n_left) / 4), 10.0))
        result = solve(problem, limit, budget, seed, workers, hints.get(i))
        solved += 1
        log.append(f"{problem.shape} mb={problem.mb}: {result.status} {result.objective_s:.4g}s "
                   f"bound {result.bound_s:.4g}s in {result.wall_s:.2f}s")
        if result.assignment is None:
            continue
        ev = evaluate(problem, result.assignment, limit)
        if not ev.fits:
            continue
        if result.status != "OPTIMAL":
            gap = max(gap, result.gap)
        if best is None or ev.step_time_s < best.evaluation.step_time_s - 1e-12:
            best = Found(problem, result.assignment, ev, "solver", result.status, result.gap)
    if best is not None and best.source == "solver" and best.status != "OPTIMAL":
        gap = max(gap, best.gap)
    return SearchResult(best, grid, closest, time.perf_counter() - start, gap, solved, pruned, log)
