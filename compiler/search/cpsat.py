"""The CP-SAT model of one mesh shape and micro-batch size (OR-Tools).

Variables (`shardc.search.sections`): a boolean per (group, candidate), the block's groups once
per stage class, so that stages partition their blocks differently; per edge, booleans per
layout class pair; per pipeline stage, block counts under each recomputation; one ZeRO stage.
The objective and the memory constraints are `shardc.search.objective.objective`'s formulas (the
linearisation of the analytical model), stage boundaries between classes priced across the
two partitions. Products of block counts and per-block quantities use multiplication
constraints, which the LP relaxation drops, so the relaxation also gets linear cuts that keep
time and memory in the bound: all blocks together cost at least L times the chosen block time
(with one partition for all stages this ties the objective to the candidates, which is what
lets the first round prove optimality in a fraction of a second); each product is at least the
count times the quantity's smallest value (times, activations, states, gradient sync,
optimizer, buffers); the slowest stage holds at least ceil(L / p) of the cheapest blocks and is
at least the mean stage. (Stages are not symmetric: an earlier stage holds more micro-batches
in flight, so no order is imposed on their block counts.) The search is bounded
(deterministic time), seeded, warm-started from a hint, and reports the plan's own linearised
objective and the proven bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from shardc.ir import ZERO_STAGES
from shardc.search.constraints import Builder
from shardc.search.evaluate import Assignment, per_stage
from shardc.search.objective import objective
from shardc.search.problem import Problem
from shardc.search.sections import STAGE_CLASSES, Model

WALL_GUARD = 20.0  # a solve's default wall-clock guard, in multiples of its deterministic limit
UNIFORM_SHARE = 0.6  # of a solve's time limit, for the round with one block partition (see `solve`)
STAGE_SHARE = 0.3  # at most this share for the per-stage round (it rarely proves optimality)
LINEARIZATION = 2  # CP-SAT linearises the products too (McCormick), which is where the bound comes from


@dataclass(frozen=True, slots=True)
class SolveResult:
    assignment: Assignment | None
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN
    objective_s: float
    bound_s: float
    wall_s: float
    deterministic_s: float = 0.0  # CP-SAT's deterministic time spent (what the budget counts)

    @property
    def gap(self) -> float:
        if self.assignment is None or self.objective_s <= 0:
            return float("inf")
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


def solve(problem: Problem, limit_bytes: float, time_limit: float, seed: int = 0, workers: int = 1,
          hint: Assignment | None = None, zeros: tuple[int, ...] = ZERO_STAGES,
          recomputes: tuple[int, ...] = (0, 1, 2), stage_limit: int = STAGE_CLASSES,
          wall_limit: float | None = None, cutoff: float | None = None) -> SolveResult:
    """Build and solve the model; `hint` warm-starts it (a grid plan or a saved plan).
    `stage_limit` bounds the distinct block partitions over the stages (1: one for all).
    `wall_limit` is a wall-clock guard (default `WALL_GUARD` times the limit): the budget is
    CP-SAT's deterministic time, so that a fixed seed gives the same plan on a loaded machine.

    Two rounds when stages may differ: first the model with one block partition for every
    stage (`UNIFORM_SHARE` of the time limit), then the per-stage model warm-started from that
    plan and cut off at its objective, so that it spends its time on strictly better plans
    (what the first round left, at most `STAGE_SHARE` of the limit: its relaxation is weaker,
    one product per stage where the first round's block count is the constant L).
    The bound is the per-stage model's (a cut-off model proven infeasible proves the first
    plan optimal). With `cutoff` (the search's incumbent) the second round looks only for plans
    better than both; proving there is none bounds the problem by the smaller (the first
    round runs free, from its hint, which is where good plans are found)."""
    p, L = problem.shape.pp, problem.layers
    wall = wall_limit if wall_limit is not None else WALL_GUARD * time_limit
    if stage_limit <= 1 or p <= 1 or L <= 1:
        return _solve_one(problem, limit_bytes, time_limit, seed, workers, hint, zeros, recomputes, 1, None, wall)
    first = _solve_one(problem, limit_bytes, UNIFORM_SHARE * time_limit, seed, workers, hint, zeros, recomputes, 1,
                       None, wall)
    rest = max(min(time_limit - first.deterministic_s, STAGE_SHARE * time_limit), 0.01)
    found = [v for v in (first.objective_s if first.assignment is not None else None, cutoff) if v is not None]
    cutoff = min(found) if found else None
    start = first.assignment or hint
    if hint is not None and hint.stage_choice and first.assignment is not None:  # a per-stage warm start
        lin = objective(problem, hint.choice, hint.stages, hint.zero, hint.stage_choice)
        if max(lin.memory_bytes) <= limit_bytes and lin.step_time_s < first.objective_s:
            start = hint
    second = _solve_one(problem, limit_bytes, rest, seed, workers, start, zeros, recomputes,
                        stage_limit, cutoff, max(wall - first.wall_s, 0.5))
    second = _cut(second, cutoff)
    spent, wall = first.deterministic_s + second.deterministic_s, first.wall_s + second.wall_s
    if second.assignment is not None and (cutoff is None or second.objective_s < cutoff):
        return SolveResult(second.assignment, second.status, second.objective_s, second.bound_s, wall, spent)
    if first.assignment is None:
        return SolveResult(None, second.status, float("inf"), second.bound_s, wall, spent)
    exact = second.status in ("OPTIMAL", "INFEASIBLE") and cutoff is not None and cutoff >= first.objective_s
    return SolveResult(first.assignment, "OPTIMAL" if exact else "FEASIBLE", first.objective_s,
                       min(second.bound_s, first.objective_s), wall, spent)


def _cut(result: SolveResult, cutoff: float | None) -> SolveResult:
    """A cut-off model's result for the whole problem: proven infeasible means nothing beats the
    cut-off (its bound); no answer within the budget means at most the cut-off."""
    if cutoff is None or result.assignment is not None:
        return result
    if result.status == "INFEASIBLE":
        return SolveResult(None, "INFEASIBLE", float("inf"), cutoff, result.wall_s, result.deterministic_s)
    return SolveResult(None, result.status, float("inf"), min(result.bound_s, cutoff), result.wall_s,
                       result.deterministic_s)


def _solve_one(problem: Problem, limit_bytes: float, time_limit: float, seed: int, workers: int,
               hint: Assignment | None, zeros: tuple[int, ...], recomputes: tuple[int, ...], stage_limit: int,
               cutoff: float | None, wall: float) -> SolveResult:
    """One CP-SAT model (the module's), optionally cut off at `cutoff` seconds (strictly better)."""
    built = Builder(problem, limit_bytes, zeros, recomputes, stage_limit)
    for s in range(problem.shape.pp):
        built.stage(s)
    goal = built.goal()
    M, md = built.M, built.M.md
    if cutoff is not None:
        md.add(goal <= int(cutoff / M.tu * (1 + 1e-3)))  # rounding slack: the cut-off plan itself stays feasible
    md.minimize(goal)
    if hint is not None:
        _hint(M, built.classes, built.counts, hint)
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.random_seed = seed
    prm.num_workers = max(1, workers)
    prm.max_deterministic_time = max(time_limit, 0.01)
    prm.max_time_in_seconds = min(max(wall, 0.5), 1e6)  # a guard only: the budget is deterministic
    if workers > 1:
        prm.interleave_search = True
    prm.linearization_level = LINEARIZATION
    status = solver.solve(md)
    if status == cp_model.MODEL_INVALID:  # a bug in this module, never the input
        raise AssertionError(f"CP-SAT model invalid: {md.validate()}")
    return _result(built, solver, status)


def _result(built: Builder, solver: cp_model.CpSolver, status: Any) -> SolveResult:
    """The solver's answer as an assignment, priced by the plan's own linearised objective."""
    problem, M, classes, p = built.problem, built.M, built.classes, built.p
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(None, name, float("inf"), solver.best_objective_bound * M.tu
                           if status != cp_model.INFEASIBLE else float("inf"), solver.wall_time,
                           solver.deterministic_time)
    per_class = [tuple(next(c for c, var in enumerate(row) if solver.value(var)) for row in M.xs[k])
                 for k in range(built.K)]
    stages = tuple((solver.value(k[0]), solver.value(k[1]), solver.value(k[2])) for _, k in built.counts)
    zero = next(z for z in ZERO_STAGES if solver.value(M.z[z]))
    a = per_stage(problem, per_class[classes[0]], [per_class[classes[s]] for s in range(p)], stages, zero)
    # The plan's own linearised objective: a FEASIBLE answer may leave slack in the auxiliary
    # maxima, and the integer model rounds; `objective` is what the plan is worth.
    value = objective(problem, a.choice, a.stages, a.zero, a.stage_choice).step_time_s
    return SolveResult(a, name, value, min(solver.best_objective_bound * M.tu, value), solver.wall_time,
                       solver.deterministic_time)


def _hint(M: Model, classes: list[int], counts: list, hint: Assignment) -> None:
    md = M.md
    seen: set[int] = set()
    for s, c in enumerate(classes):
        if c in seen:
            continue
        seen.add(c)
        for g, cc in enumerate(hint.at(s) if len(hint.stages) == len(classes) else hint.choice):
            if c > min(seen) and M.p.groups[g].section != "block":
                continue  # the prefix's and suffix's candidates are shared by the classes
            for j in range(len(M.xs[c][g])):
                md.add_hint(M.xs[c][g][j], j == cc)
    for z in ZERO_STAGES:
        md.add_hint(M.z[z], z == hint.zero)
    for (n, k), row in zip(counts, hint.stages):
        md.add_hint(n, sum(row))
        for r in range(3):
            md.add_hint(k[r], row[r])
