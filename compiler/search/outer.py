"""The outer search: mesh shapes and micro-batch sizes around the per-shape CP-SAT model.

Rules:
- Shapes are the factorisations pp*dp*cp*tp of the device count with tp and cp inside one
  node (the innermost mesh axes, so the fastest links carry the per-layer traffic), dp
  dividing the global batch, pp at most the number of blocks, and cp > 1 only for sequences
  of 8192 tokens or more; with `grid2d`, a tp that is a square q*q is also offered as tp=q x
  tq=q, the two equal model axes PrimePar's 2-D grids run on (`shardc.search.candidates`;
  opt-in: more shapes to price and solve in the same time limit); every shape with pp > 1 is
  also offered interleaved, vpp = v model chunks per device wherever the blocks divide into
  pp*v equal chunks (Megatron's rule, `shardc.search.grid.interleavings`: up to one block per
  chunk, v = layers/pp, as Megatron users may set; only the divisors of layers/pp, so a few
  shapes more, searched in the interleaved share of the time limit). Micro-batch
  sizes are the powers of two up to 8 that divide the per-replica batch and leave at least pp
  micro-batches (torch's 1F1B refuses fewer micro-batches than stages).
- An MoE model (`experts` ops, `shardc.ops.moe`) also gets shapes with an expert axis ep > 1
  inside dp (pp*dp*ep*cp*tp), ep dividing its experts and dp*ep the global batch; ep splits
  each micro-batch, so its micro-batch sizes are ep times the above. Whether an `experts` op
  splits its experts over ep (dispatch and combine by all-to-all, priced by `shardc.cost.moe`)
  or its tokens (ep then a data axis for it too) is the candidates' choice, as any partition.
  Pipelines with ep get every schedule (interleaved and the zero-bubble ones: their
  expert-parallel numerics are tested, `tests/test_moe_matrix.py`); tp x tq grids do not
  (`grid2d`: no expert-parallel numerics on a grid; `tests/test_moe_offers.py`).
- Shapes that share a `pricing_key` (same cp, tp, micro-batch; dp > 1 or not) share one
  enumeration and pricing of their candidates. An MoE model prices at most as many keys as its
  time limit allows (`shardc.search.budget`: one sequence per ep rank first), the rest logged.
- Every problem gets two lower bounds (`shardc.search.bounds`): `grid_bound` (every group at
  its cheapest candidate, every edge free, a perfectly balanced pipeline: (1 + (m-1)/p) *
  per-micro-batch time), by which the grid baseline is scanned exactly as before, and the
  tighter `lower_bound` (whole blocks per stage, the prefix and suffix on their stages, pipeline sends, the optimizer and
  the last gradient bucket, infinite when the model states cannot fit), by which shapes are
  ordered, pruned and the gap proven. The grid baseline is scored first, problems by
  `grid_bound`; once it is `GRID_MARGIN` above the best grid point, no later problem's grid
  points can be among the best. The best grid point is the incumbent, and
  each problem's best grid point its warm start (else the grid point best by the linearised
  objective, or a plan file's).
- Interleaved shapes are priced as their shape without interleaving (the same pricing key) and
  searched by `shardc.search.interleave` (the grid's layouts and the solver's vectors of the
  shape without interleaving, the recomputation per device), after the CP-SAT solves, in
  order of bound and while the wall clock allows; their `lower_bound` is the interleaved
  schedule's ideal time on the cheapest blocks (no memory term), and it stays their floor in
  the gap (the enumeration proves nothing).
- After the CP-SAT solves, the fastest pipelined plans with Megatron's schedule and one chunk
  per device (the grid's and the solver's) get a local search over their per-stage block counts and
  recomputation by `evaluate` (`shardc.search.refine`: a later 1F1B stage holds fewer
  micro-batches in flight, so it can recompute less), in `refine.EVALUATIONS_PER_SECOND`
  evaluations per second of the time limit (deterministic).
- Every pipelined shape is also offered under torch's zero-bubble schedules (`zbv`,
  `dualpipev` with vpp = 2, `interleaved-zb` with vpp = 1..`MAX_VPP` and Megatron's depths
  above it; `schedules=False` leaves
  them out), priced as their shape, searched by `shardc.search.schedules` after the interleaved
  shapes (the same vectors, stage boundaries and per-stage recomputation by a local search on
  `evaluate`) in `SCHEDULE_SHARE` of the time limit on the wall clock; the best interleaved plan
  gets the same boundary search. Their `lower_bound` is m times an even share of the cheapest
  per-micro-batch work (no bubble, no memory term). The grid baseline holds none of them
  (Megatron's schedules only), and `SearchResult.families` keeps the best plan of each family
  (Megatron's 1F1B/interleaved, zero bubble), scored by the estimate, for comparison.
- Shapes are solved in order of their bound; a shape whose bound cannot beat the incumbent is
  pruned without solving, and the others are solved cut off at the incumbent (CP-SAT looks
  only for better plans; proving there is none bounds the shape by the incumbent). The solves
  share `SOLVE_SHARE` of the time limit (each gets a slice of what is left), counted in CP-SAT's
  deterministic seconds and, by default, in wall seconds too: each solve is stopped at its
  slice on either clock and charged the larger, so that `--time-limit` is a promise on the
  clock a user reads (CP-SAT's deterministic second took about two wall seconds on the 2-core
  development machine: the Mixtral search's solves ran 19 s for a 9 s share). The wall clock
  (started after the grid baseline, whose scan is its own cost) also stops the solves past
  `WALL_STOP` times the limit (a machine too loaded to keep any promise). `wall_stop=inf`
  counts the deterministic seconds alone, so that a fixed seed and worker count give the same
  CP-SAT plans on a busy machine too (what the tests and benchmarks that compare plans use). The best plan found is returned with its proven gap: 1 - (the smallest lower
  bound over all shapes: the larger of CP-SAT's bound on the linearised objective and
  `lower_bound` where solved, `lower_bound` elsewhere) / the best plan's evaluation. A
  solved plan that overflows by evaluation (the linearised memory is an approximation) is
  solved once more with the limit lowered by its overshoot.
- Every grid point and every solver plan is evaluated with `shardc.search.evaluate` (the cost
  model's composition); the best few of each are then scored by `shardc.cost.estimate` on the
  graph annotated with the plan, the very function `shardc estimate` runs, and those are the
  numbers compared and reported. The grid's best plan is among the solver's candidates, so the
  plan returned is never worse than it by the estimate.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from shardc.cost.estimate import Estimate
from shardc.cost.model import estimate
from shardc.hardware import Cluster
from shardc.ir import Graph
from shardc.ir.diagnostics import ShardcError
from shardc.search.bounds import grid_bound, lower_bound
from shardc.search.budget import within_budget
from shardc.search.cpsat import SolveResult, solve
from shardc.search.evaluate import Assignment, Evaluation, evaluate, executed_zero
from shardc.search.grid import GridPoint, grid_assignments, grid_points, interleavings
from shardc.search.interleave import search_interleaved
from shardc.search.objective import objective
from shardc.search.planfile import annotate_graph
from shardc.search.problem import GraphFacts, MeshShape, PricingCache, Problem, build_problem, pricing_key
from shardc.search.refine import EVALUATIONS_PER_SECOND, refine
from shardc.search.schedules import rebalance, schedule_shapes, search_schedules

LONG_SEQUENCE = 8192
MAX_VPP = 4  # interleaved zero bubble's depths offered whether or not the blocks divide (beside Megatron's)
MICRO_BATCHES = (1, 2, 4, 8)
RESCORED = 3  # plans per source (grid, solver) re-scored by `estimate` at the end
GRID_MARGIN = 0.02  # grid problems whose bound is this far above the best grid point are skipped
SOLVE_SHARE = 0.3  # of the time limit, in CP-SAT deterministic seconds, shared by the solves
WALL_STOP = 1.5  # an overloaded machine stops solving at this multiple of the limit (not deterministic)
RETRY_MARGIN = 1e-3  # a solve whose plan overflows by evaluation is retried this far below the overshoot
INTERLEAVE_SHARE = 0.3  # of the time limit, on the wall clock, for the interleaved shapes' search
SCHEDULE_SHARE = 0.3  # of the time limit, on the wall clock, for the zero-bubble shapes and the boundaries
FAMILIES = ("1f1b/interleaved", "zero-bubble")  # `SearchResult.families`' keys


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
    # Seconds of `solve_time_s` spent pricing the problems and scanning the grid baseline, which
    # `time_limit` does not bound (their cost grows with the model and the device count).
    baseline_s: float = 0.0
    # Per schedule family (`FAMILIES`), the best plan found that fits, by the estimate.
    families: dict[str, Found] = field(default_factory=dict)


def score(found: Found, cluster: Cluster) -> Found:
    """Annotate the graph with the plan and run `shardc.cost.estimate` on it (in place)."""
    graph = annotate_graph(found.problem.facts.graph, found.problem, found.assignment)
    found.estimate = estimate(graph, cluster)
    return found


def _rescore(founds: list[Found], cluster: Cluster, limit: float, keep: int) -> Found | None:
    """The fastest of the `keep` best plans by evaluation, by the estimate, among those that fit."""
    best = None
    for found in sorted(founds, key=lambda f: f.evaluation.step_time_s)[:keep]:
        if found.estimate is None:
            score(found, cluster)
        assert found.estimate is not None
        if found.estimate.memory_per_device_bytes <= limit and (best is None or found.step_time_s < best.step_time_s):
            best = found
    return best


def expert_count(graph: Graph) -> int:
    """The experts every MoE layer of `graph` holds in common (the gcd of its `experts` ops'
    expert counts; `shardc.ops.moe`), 0 for a model without experts."""
    return math.gcd(*[n.inputs[3].type.shape[0] for n in graph.nodes if n.op == "experts"] or [0])


def mesh_shapes(devices: int, per_node: int, layers: int, gbs: int, seq: int, grid2d: bool = False,
                experts: int = 0) -> list[MeshShape]:
    """Every admissible (pp, dp, ep, cp, tp) for `devices` (see the module rule); with `grid2d`
    also tp=q x tq=q for a square tp; ep > 1 only for an MoE model (`experts` > 0), dividing its
    experts."""
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
            for pp, ep in itertools.product(divisors, [e for e in divisors if e == 1 or (experts and experts % e == 0)]):
                if rest % (pp * ep) or pp > max(layers, 1):
                    continue
                dp = rest // (pp * ep)
                if gbs % (dp * ep):
                    continue
                out.append(MeshShape(pp, dp, cp, tp, ep=ep))
                out += [MeshShape(pp, dp, cp, tp, 1, v, ep=ep) for v in interleavings(layers, pp)]
                q = math.isqrt(tp)
                if grid2d and q > 1 and q * q == tp and ep == 1:  # tp as a q x q grid (tp x tq) for P(q x q)
                    out.append(MeshShape(pp, dp, cp, q, q))
    if not out:
        raise ShardcError(
            f"no mesh shape pp x dp x cp x tp fits {devices} devices with {layers} blocks and global batch {gbs}: "
            f"dp must divide the batch and pp be at most the number of blocks",
            hint=f"use a global batch that is a multiple of {devices} or a device count dividing it")
    return out


def micro_batch_sizes(gbs: int, dp: int, pp: int = 1, ep: int = 1) -> list[int]:
    """The micro-batch sizes a shape may use: those dividing the per-replica batch that leave at
    least `pp` micro-batches (the solver's plans run 1F1B, which torch refuses with fewer); with
    ep > 1, `ep` times those (ep splits each micro-batch: every ep rank gets 1, 2, 4 or 8 sequences)."""
    per = gbs // dp
    return [mb * ep for mb in MICRO_BATCHES if per % (mb * ep) == 0 and per // (mb * ep) >= pp]


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
        for point, a, ev in grid_points(problems[i], limit):
            found = Found(problems[i], a, ev, "grid", "grid", 0.0, point)
            if ev.fits and problems[i].shape.tq == 1:  # tp x tq points are only warm starts
                grids.append(found)
                best = min(best, ev.step_time_s)
            if ev.fits and problems[i].shape.vpp == 1:
                if i not in hints or ev.step_time_s < hints[i][1]:
                    hints[i] = (a, ev.step_time_s)
            if closest is None or ev.memory_per_device_bytes < closest.evaluation.memory_per_device_bytes:
                closest = found
    return grids, closest, hints


def _solve_wall(budget: float, left: float, clocked: bool) -> float:
    """A solve's wall-clock limit: what is left before `wall_stop` (at least 0.5 s), and with
    `clocked` at most its budget too."""
    return max(min(left, budget) if clocked else left, 0.5)


def _spent(result: SolveResult, clocked: bool) -> float:
    """What a solve took from the solves' share: CP-SAT's deterministic seconds, or with
    `clocked` the larger of those and its wall seconds (a machine slower than CP-SAT's unit)."""
    return max(result.deterministic_s, result.wall_s if clocked else 0.0, 0.01)


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
           grid2d: bool = False, wall_stop: float = WALL_STOP, schedules: bool = True) -> SearchResult:
    """Grid baseline, then CP-SAT over shapes by lower bound, then the interleaved shapes, then
    (with `schedules`) the zero-bubble shapes and the best interleaved plan's boundaries.
    `time_limit` bounds the search after the baseline: the CP-SAT solves share `SOLVE_SHARE` of
    it in deterministic seconds, the interleaved shapes `INTERLEAVE_SHARE` and the zero-bubble
    shapes `SCHEDULE_SHARE` on the wall clock,
    and solving stops past `wall_stop` times it on the wall clock (infinity: never, so that the
    plan depends on the seed and worker count only). Pricing the problems, scanning the grid
    baseline and the final re-scoring come on top (`SearchResult.baseline_s` holds the first
    two): the baseline is what the plan is guaranteed to match, so it is never cut short."""
    if time_limit <= 0:
        raise ShardcError(f"time limit must be positive, got {time_limit} s", hint="pass --time-limit 30")
    began = time.perf_counter()
    seq = max((v.type.shape[1] for v in facts.graph.inputs if v.type.rank >= 2), default=1)
    shapes = shapes or mesh_shapes(cluster.num_devices, cluster.devices_per_node, facts.layering.count, gbs, seq,
                                   grid2d, expert_count(facts.graph))
    if not facts.layering.blocks:
        shapes = [s for s in shapes if s.pp == 1] or shapes
    if schedules:
        shapes = shapes + [s for s in schedule_shapes(shapes, facts.layering.count, MAX_VPP) if s not in shapes]
    problems: list[Problem] = []
    cache: PricingCache = {}
    pairs = [(shape, mb) for shape in shapes for mb in (mbs or micro_batch_sizes(gbs, shape.dp, shape.pp, shape.ep))
             if (gbs // shape.dp) % mb == 0 and gbs // (shape.dp * mb) >= shape.pp and mb % shape.ep == 0]
    # An MoE model's ep x tp x micro-batch pricings within the time limit (`shardc.search.budget`)
    pairs, unpriced = within_budget(pairs, lambda s, mb: pricing_key(facts, s, mb, dtype, True, True), time_limit,
                                    expert_count(facts.graph))
    for shape, mb in pairs:
        problems.append(build_problem(facts, cluster, shape, mb, gbs, dtype, cache=cache))
    if not problems:
        raise ShardcError(f"no mesh shape and micro-batch size give the 1F1B schedule at least as many "
                          f"micro-batches as pipeline stages with global batch {gbs}",
                          hint=f"use a global batch of at least {cluster.num_devices} sequences")
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
    order = sorted((i for i in by_bound if problems[i].shape.vpp == 1 and not problems[i].shape.schedule),
                   key=lambda i: (i not in hints or warm is None, bounds[i], i))
    solved = pruned = 0
    floor = dict(enumerate(bounds))  # per problem, the best proven lower bound
    log = [f"pricing budget: {len(unpriced)} (shape, micro-batch) problems not priced, e.g. "
           f"{', '.join(f'{s} mb={mb}' for s, mb in unpriced[:4])}"] if unpriced else []
    founds: list[Found] = []
    budget_left = SOLVE_SHARE * time_limit
    clocked = math.isfinite(wall_stop)  # the solves' share is spent on the wall clock too (module rules)
    start = time.perf_counter()  # the solves' wall clock starts after the baseline (its own cost)
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
                       wall_limit=_solve_wall(budget, wall_stop * time_limit - (time.perf_counter() - start), clocked),
                       cutoff=incumbent if incumbent < float("inf") else None)
        budget_left -= _spent(result, clocked)
        solved += 1
        log.append(f"{problem.shape} mb={problem.mb}: {result.status} {result.objective_s:.4g}s "
                   f"bound {result.bound_s:.4g}s in {result.wall_s:.2f}s")
        floor[i] = max(floor[i], result.bound_s)
        if result.assignment is None:
            continue
        a = result.assignment
        ev = evaluate(problem, a, limit)
        if not ev.fits and budget_left > 0:
            # The linearised memory fell short of the evaluated one: once more with the limit
            # lowered by the overshoot (the first solve's bound stands: the retry's is not one).
            lin = objective(problem, a.choice, a.stages, a.zero, a.stage_choice)
            over = max(e - l for e, l in zip(ev.memory_bytes, lin.memory_bytes))
            retry = solve(problem, limit - max(over, RETRY_MARGIN * limit), budget / 2,
                          seed, workers, hint[0] if hint else None,
                          wall_limit=_solve_wall(budget / 2, wall_stop * time_limit - (time.perf_counter() - start),
                                                 clocked),
                          cutoff=incumbent if incumbent < float("inf") else None)
            budget_left -= _spent(retry, clocked)
            log.append(f"  retried below the evaluated memory: {retry.status} {retry.objective_s:.4g}s")
            if retry.assignment is not None:
                result, a = retry, retry.assignment
                ev = evaluate(problem, a, limit)
        if ev.fits:
            founds.append(Found(problem, a, ev, "solver", result.status, result.gap))
            incumbent = min(incumbent, ev.step_time_s)
    flat = [(f.problem, f.assignment, f.evaluation) for f in founds + grids
            if f.problem.shape.pp > 1 and f.problem.shape.vpp == 1 and not f.problem.shape.schedule]
    for problem, a, ev in refine(flat, limit, int(EVALUATIONS_PER_SECOND * time_limit), start + wall_stop * time_limit):
        founds.append(Found(problem, a, ev, "solver", "FEASIBLE", 0.0))
        log.append(f"{problem.shape} mb={problem.mb}: {ev.step_time_s:.4g}s by the stage refinement")
        incumbent = min(incumbent, ev.step_time_s)
    deadline = min(start + wall_stop * time_limit, time.perf_counter() + INTERLEAVE_SHARE * time_limit)
    solved_plans = [(f.problem, f.assignment, f.evaluation.step_time_s) for f in founds]
    for i, a, ev in search_interleaved(problems, by_bound, bounds, solved_plans, incumbent, limit, deadline):
        founds.append(Found(problems[i], a, ev, "solver", "FEASIBLE", 0.0))
        incumbent = min(incumbent, ev.step_time_s)
    deadline = min(start + wall_stop * time_limit, time.perf_counter() + SCHEDULE_SHARE * time_limit)
    interleaved = [f for f in founds if f.problem.shape.vpp > 1]
    if interleaved:  # the best interleaved plan's boundaries, as the zero-bubble plans get theirs
        f = min(interleaved, key=lambda f: f.evaluation.step_time_s)
        a, ev = rebalance(f.problem, f.assignment, limit, deadline)
        if ev.fits and ev.step_time_s < f.evaluation.step_time_s:
            founds.append(Found(f.problem, a, ev, "solver", "FEASIBLE", 0.0))
            incumbent = min(incumbent, ev.step_time_s)
    seen = solved_plans + [(f.problem, f.assignment, f.evaluation.step_time_s) for f in grids]
    for i, a, ev in search_schedules(problems, by_bound, bounds, seen, incumbent, limit, deadline):
        founds.append(Found(problems[i], a, ev, "solver", "FEASIBLE", 0.0))
        log.append(f"{problems[i].shape} mb={problems[i].mb}: {ev.step_time_s:.4g}s by the schedule search")
        incumbent = min(incumbent, ev.step_time_s)
    proven = min(floor.values(), default=float("inf"))
    gap = max(0.0, 1.0 - proven / incumbent) if incumbent < float("inf") else 1.0
    # The reported numbers are `estimate`'s, on the graph annotated with each plan.
    grid = _rescore(grids, cluster, limit, RESCORED)
    best = _rescore(founds + ([grid] if grid is not None else []), cluster, limit, RESCORED + 1)
    if grid is not None and (best is None or grid.step_time_s <= best.step_time_s):
        best = grid
    families: dict[str, Found] = {}
    if schedules:
        for name, zb in zip(FAMILIES, (False, True)):
            mine = [f for f in founds + grids if bool(f.problem.shape.schedule) == zb]
            got = _rescore(mine, cluster, limit, RESCORED)
            if got is not None:
                families[name] = got
    for f in {id(f): f for f in (best, grid, *families.values()) if f is not None}.values():
        f.assignment = executed_zero(f.problem, f.assignment)  # ZeRO without a data group runs nothing
    if best is not None:
        annotate_graph(facts.graph, best.problem, best.assignment)
    return SearchResult(best, grid, closest, time.perf_counter() - began, gap, solved, pruned, log, start - began,
                        families)

