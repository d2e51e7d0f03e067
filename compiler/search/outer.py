"""The outer search: mesh shapes and micro-batch sizes around the per-shape CP-SAT model.

Rules:
- Shapes are the factorisations pp*dp*cp*tp of the device count with tp and cp inside one
  node (the innermost mesh axes, so the fastest links carry the per-layer traffic), dp
  dividing the global batch, pp at most the number of blocks, and cp > 1 only for sequences
  of 8192 tokens or more; with `grid2d`, a tp that is a square q*q is also offered as tp=q x
  tq=q, the two equal model axes PrimePar's 2-D grids run on (`shardc.search.candidates`;
  opt-in: more shapes to price and solve in the same time limit). Micro-batch
  sizes are the powers of two up to 8 that divide the per-replica batch.
- Shapes that share a `pricing_key` (same cp, tp, micro-batch; dp > 1 or not) share one
  enumeration and pricing of their candidates.
- Every problem gets two lower bounds: `grid_bound` (every group at its cheapest candidate,
  every edge free, a perfectly balanced pipeline: (1 + (m-1)/p) * per-micro-batch time), by
  which the grid baseline is scanned exactly as before, and the tighter `lower_bound` (whole
  blocks per stage, the prefix and suffix on their stages, pipeline sends, the optimizer and
  the last gradient bucket, infinite when the model states cannot fit), by which shapes are
  ordered, pruned and the gap proven. The grid baseline is scored first, problems by
  `grid_bound`; once it is `GRID_MARGIN` above the best grid point, no later problem's grid
  points can be among the best. The best grid point is the incumbent, and
  each problem's best grid point its warm start (else the grid point best by the linearised
  objective, or a plan file's).
- Shapes are solved in order of their bound; a shape whose bound cannot beat the incumbent is
  pruned without solving. The solves share `SOLVE_SHARE` of the time limit in CP-SAT's
  deterministic seconds (each gets a slice of what is left), so a fixed seed and worker count
  give the same plan on a busy machine too; the wall clock stops the solves only past
  `WALL_STOP` times the limit (a machine too loaded to keep any promise; `wall_stop=inf`
  turns it off). The best plan found is returned with its proven gap: 1 - (the smallest lower
  bound over all shapes: the larger of CP-SAT's bound on the linearised objective and
  `lower_bound` where solved, `lower_bound` elsewhere) / the best plan's evaluation.
- Every grid point and every solver plan is evaluated with `shardc.search.evaluate` (the cost
  model's composition); the best few of each are then scored by `shardc.cost.estimate` on the
  graph annotated with the plan, the very function `shardc estimate` runs, and those are the
  numbers compared and reported. The grid's best plan is among the solver's candidates, so the
  plan returned is never worse than it by the estimate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from shardc.cost.estimate import Estimate
from shardc.cost.model import estimate
from shardc.diagnostics import ShardcError
from shardc.hardware import Cluster
from shardc.search.cpsat import solve
from shardc.search.evaluate import Assignment, Evaluation, evaluate
from shardc.search.grid import GridPoint, grid_assignments
from shardc.search.linear import coefficients, objective
from shardc.search.planfile import annotate_graph
from shardc.search.problem import ZEROS, GraphFacts, MeshShape, PricingCache, Problem, build_problem

LONG_SEQUENCE = 8192
MICRO_BATCHES = (1, 2, 4, 8)
RESCORED = 3  # plans per source (grid, solver) re-scored by `estimate` at the end
GRID_MARGIN = 0.02  # grid problems whose bound is this far above the best grid point are skipped
SOLVE_SHARE = 0.3  # of the time limit, in CP-SAT deterministic seconds, shared by the solves
WALL_STOP = 1.5  # an overloaded machine stops solving at this multiple of the limit (not deterministic)


@dataclass
class Found:
    problem: Problem
    assignment: Assignment
    evaluation: Evaluation
    source: str  # "solver" or "grid"
    status: str = ""
    gap: float = 0.0
    grid_point: GridPoint | None = None
    estimate: Estimate | None = None  # `shardc.cost.estimate` on the graph annotated with this plan

    @property
    def step_time_s(self) -> float:
        """The analytical model's step time: the estimate's when scored, else the evaluation's."""
        return self.estimate.step_time_s if self.estimate is not None else self.evaluation.step_time_s

    @property
    def memory_per_device_bytes(self) -> float:
        return (self.estimate.memory_per_device_bytes if self.estimate is not None
                else self.evaluation.memory_per_device_bytes)


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


def score(found: Found, cluster: Cluster) -> Found:
    """Annotate the graph with the plan and run `shardc.cost.estimate` on it (in place)."""
    graph = annotate_graph(found.problem.facts.graph, found.problem, found.assignment)
    found.estimate = estimate(graph, cluster)
    return found


def _rescore(founds: list[Found], cluster: Cluster, limit: float, keep: int) -> Found | None:
    """The fastest of the `keep` best plans by evaluation, by the estimate, among those that fit."""
    best = None
    for found in sorted(founds, key=lambda f: f.evaluation.step_time_s)[:keep]:
        score(found, cluster)
        assert found.estimate is not None
        if found.estimate.memory_per_device_bytes <= limit and (best is None or found.step_time_s < best.step_time_s):
            best = found
    return best


def mesh_shapes(devices: int, per_node: int, layers: int, gbs: int, seq: int, grid2d: bool = False
                ) -> list[MeshShape]:
    """Every admissible (pp, dp, cp, tp) for `devices` (see the module rule); with `grid2d`
    also tp=q x tq=q for a square tp."""
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
                q = math.isqrt(tp)
                if grid2d and q > 1 and q * q == tp:  # tp as a q x q grid (tp x tq) for PrimePar's P(q x q)
                    out.append(MeshShape(pp, dp, cp, q, q))
    if not out:
        raise ShardcError(
            f"no mesh shape pp x dp x cp x tp fits {devices} devices with {layers} blocks and global batch {gbs}: "
            f"dp must divide the batch and pp be at most the number of blocks",
            hint=f"use a global batch that is a multiple of {devices} or a device count dividing it")
    return out


def micro_batch_sizes(gbs: int, dp: int) -> list[int]:
    per = gbs // dp
    return [mb for mb in MICRO_BATCHES if per % mb == 0]


def lower_bound(problem: Problem, limit: float = float("inf")) -> float:
    """A lower bound of the problem's linearised objective (`shardc.search.linear.objective`):
    every group at its cheapest, edges free, each pipeline send at its cheapest; the slowest
    stage at least the smallest makespan of whole blocks over the stages (the prefix on the
    first, the suffix on the last, sends on every boundary), the pipeline at least
    sum + (m-1) x slowest; plus, for the best ZeRO stage, the optimizer on an even share of the
    parameters and the last gradient bucket. Infinite when even an even share of the smallest
    model states (the ZeRO stage that shards most) overflows `limit` on every device."""
    co = coefficients(problem)
    L, p, m = problem.layers, problem.shape.pp, problem.micro_batches
    low = {s: 0.0 for s in ("pre", "block", "post")}
    numel = {s: 0.0 for s in ("pre", "block", "post")}
    send = 0.0
    for rows, v, sends in zip(co.cand, problem.groups, co.send):
        low[v.section] += min(r["time"] for r in rows)
        numel[v.section] += min(r["numel"] for r in rows)
        send += min(sends)
    send = send if p > 1 else 0.0
    extra = [low["pre"] * (s == 0) + low["post"] * (s == p - 1) + send * ((s > 0) + (s < p - 1)) for s in range(p)]
    total = L * low["block"] + sum(extra)
    slowest = max(total / p, _makespan(L, low["block"], extra))
    params = L * numel["block"] + numel["pre"] + numel["post"]
    states = min(co.state[z] for z in ZEROS) * params / p
    if states > limit:
        return float("inf")
    tail = min(co.optimizer[z] * params / p + co.gather[z][0] + co.gather[z][1] * co.w_elem * params / p + co.tail[z]
               for z in ZEROS)
    return total + (m - 1) * slowest + tail


def grid_bound(problem: Problem) -> float:
    """The grid scan's bound: every group at its cheapest, edges free, stages perfectly balanced."""
    co = coefficients(problem)
    per_mb = sum(min(r["time"] for r in rows) * (problem.layers if v.section == "block" else 1)
                 for rows, v in zip(co.cand, problem.groups))
    p, m = problem.shape.pp, problem.micro_batches
    return per_mb * (1 + (m - 1) / p)


def _makespan(L: int, block: float, extra: list[float]) -> float:
    """The smallest T such that whole blocks of `block` seconds, L of them, fit on stages with
    `extra` seconds already each: sum_s floor((T - extra_s) / block) >= L."""
    if L == 0 or block <= 0:
        return max(extra)

    def fits(t: float) -> bool:
        return sum(max(0, int((t - e) / block + 1e-9)) for e in extra) >= L

    lo, hi = max(min(extra), 0.0), max(extra) + L * block
    for _ in range(60):
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    # The answer is extra_s + k x block for some stage and count: the largest such value <= hi.
    best = hi
    for e in extra:
        k = int((hi - e) / block + 1e-9)
        if k >= 0 and fits(e + k * block):
            best = min(best, e + k * block)
    return best


def _grid(problems: list[Problem], order: list[int], bounds: list[float], limit: float
          ) -> tuple[list[Found], Found | None, dict[int, tuple[Assignment, float]]]:
    """Every grid point that fits, by `evaluate`, visiting problems by lower bound: once a bound is
    `GRID_MARGIN` above the best point found, no later problem has a point among the best. Also
    the lowest-memory point seen (for the no-fit error) and per problem its best point (a hint)."""
    grids: list[Found] = []
    closest: Found | None = None
    hints: dict[int, tuple[Assignment, float]] = {}
    best = float("inf")
    for i in order:
        if bounds[i] > best * (1 + GRID_MARGIN):
            break
        for point, a in grid_assignments(problems[i]):
            ev = evaluate(problems[i], a, limit)
            found = Found(problems[i], a, ev, "grid", "grid", 0.0, point)
            if ev.fits and problems[i].shape.tq == 1:  # tp x tq points are only warm starts
                grids.append(found)
                best = min(best, ev.step_time_s)
            if ev.fits:
                if i not in hints or ev.step_time_s < hints[i][1]:
                    hints[i] = (a, ev.step_time_s)
            if closest is None or ev.memory_per_device_bytes < closest.evaluation.memory_per_device_bytes:
                closest = found
    return grids, closest, hints


def _linear_hint(problem: Problem, limit: float) -> Assignment | None:
    """The grid point best by the linearised objective among those it says fit (a warm start for
    shapes whose grid points were not evaluated)."""
    best: tuple[Assignment, float] | None = None
    for _, a in grid_assignments(problem):
        lin = objective(problem, a.choice, a.stages, a.zero)
        if max(lin.memory_bytes) <= limit and (best is None or lin.step_time_s < best[1]):
            best = (a, lin.step_time_s)
    return best[0] if best else None


def search(facts: GraphFacts, cluster: Cluster, gbs: int, limit: float, time_limit: float, seed: int = 0,
           workers: int = 1, warm: tuple[MeshShape, int, Assignment] | None = None, dtype: str = "bf16",
           shapes: list[MeshShape] | None = None, mbs: tuple[int, ...] | None = None,
           grid2d: bool = False, wall_stop: float = WALL_STOP) -> SearchResult:
    """Grid baseline, then CP-SAT over shapes by lower bound, within `time_limit` seconds
    (solving stops past `wall_stop` times it on the wall clock; infinity: never, so that the
    plan depends on the seed and worker count only)."""
    if time_limit <= 0:
        raise ShardcError(f"time limit must be positive, got {time_limit} s", hint="pass --time-limit 30")
    start = time.perf_counter()
    seq = max((v.type.shape[1] for v in facts.graph.inputs if v.type.rank >= 2), default=1)
    shapes = shapes or mesh_shapes(cluster.num_devices, cluster.devices_per_node, facts.layering.count, gbs, seq,
                                   grid2d)
    if not facts.layering.blocks:
        shapes = [s for s in shapes if s.pp == 1] or shapes
    problems: list[Problem] = []
    cache: PricingCache = {}
    for shape in shapes:
        for mb in (mbs or micro_batch_sizes(gbs, shape.dp)):
            if (gbs // shape.dp) % mb == 0:
                problems.append(build_problem(facts, cluster, shape, mb, gbs, dtype, cache=cache))
    bounds = [lower_bound(p, limit) for p in problems]
    by_bound = sorted(range(len(problems)), key=lambda i: (bounds[i], i))
    # The grid baseline is scanned by the plain bound (`grid_bound`), so that the tighter
    # solver bound never drops a grid point the baseline would have had.
    plain = [grid_bound(p) for p in problems]
    grids, closest, hints = _grid(problems, sorted(range(len(problems)), key=lambda i: (plain[i], i)), plain, limit)
    if warm is not None:
        for i, problem in enumerate(problems):
            if problem.shape == warm[0] and problem.mb == warm[1] and len(warm[2].choice) == len(problem.groups):
                hints[i] = (warm[2], 0.0)
    incumbent = min((f.evaluation.step_time_s for f in grids), default=float("inf"))
    order = sorted(by_bound, key=lambda i: (i not in hints or warm is None, bounds[i], i))
    solved = pruned = 0
    floor = dict(enumerate(bounds))  # per problem, the best proven lower bound
    log = []
    founds: list[Found] = []
    budget_left = SOLVE_SHARE * time_limit
    for n, i in enumerate(order):
        problem = problems[i]
        if bounds[i] >= incumbent:
            pruned += 1
            continue
        if budget_left <= 0 or time.perf_counter() - start >= wall_stop * time_limit:
            pruned += 1
            continue
        budget = max(0.05, min(budget_left / 2, budget_left / max(1, (len(order) - n) / 4), 10.0))
        hint = hints.get(i)
        result = solve(problem, limit, budget, seed, workers, hint[0] if hint else _linear_hint(problem, limit),
                       wall_limit=max(wall_stop * time_limit - (time.perf_counter() - start), 0.5))
        budget_left -= max(result.deterministic_s, 0.01)
        solved += 1
        log.append(f"{problem.shape} mb={problem.mb}: {result.status} {result.objective_s:.4g}s "
                   f"bound {result.bound_s:.4g}s in {result.wall_s:.2f}s")
        floor[i] = max(floor[i], result.bound_s)
        if result.assignment is None:
            continue
        ev = evaluate(problem, result.assignment, limit)
        if ev.fits:
            founds.append(Found(problem, result.assignment, ev, "solver", result.status, result.gap))
            incumbent = min(incumbent, ev.step_time_s)
    proven = min(floor.values(), default=float("inf"))
    gap = max(0.0, 1.0 - proven / incumbent) if incumbent < float("inf") else 1.0
    # The reported numbers are `estimate`'s, on the graph annotated with each plan.
    grid = _rescore(grids, cluster, limit, RESCORED)
    best = _rescore(founds + ([grid] if grid is not None else []), cluster, limit, RESCORED + 1)
    if grid is not None and (best is None or grid.step_time_s <= best.step_time_s):
        best = grid
    if best is not None:
        annotate_graph(facts.graph, best.problem, best.assignment)
    return SearchResult(best, grid, closest, time.perf_counter() - start, gap, solved, pruned, log)
