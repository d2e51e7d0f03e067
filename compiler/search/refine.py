"""The local search after CP-SAT on Megatron's pipelines: per-stage recomputation and stage
boundaries of the fastest plans, scored by `evaluate`.

CP-SAT minimises the linearisation of the model (`shardc.search.objective`) in a deterministic
budget that every shape shares, so on a memory-tight case the plan it returns, or the grid
point it was warm-started from, can leave unused a per-stage freedom the evaluated model prices:
1F1B's stage s holds p - s micro-batches in flight, so a later stage needs less recomputation
than an earlier one, and the stage holding the head or the embedding may take fewer blocks.
Rules:
- Plans refined: the `REFINED` fastest fitting plans by evaluation among those given (the
  grid's and the solver's pipelined plans with Megatron's schedule and one model chunk per device), one
  per (shape, micro-batch, candidate vectors, ZeRO stage). Vectors and ZeRO stage are kept; only
  the block counts per stage and their recomputation change, which `annotate_graph` writes as
  per-layer annotations the backend runs (the per-stage mixes `shardc.search.schedules` and
  the CP-SAT model already emit). Every stage keeps at least one block.
- Starts: the plan itself, and the plan with each stage's recomputation cut to the least its
  memory needs (`least_recompute`): per stage, by bisection on that stage's evaluated memory
  (which does not depend on the other stages' counts), the fewest blocks recomputed in the
  stage's heaviest kind (full, else selective), the rest not recomputed.
- Moves (`moves`): one block of a stage changes its recomputation to any other (towards more
  only while the point does not fit: more recomputation of a fitting point only costs time);
  one block moves to a neighbouring stage keeping its recomputation; or it moves and the
  receiving stage recomputes one more block in full (or the giving stage one fewer), so that a
  block can cross a boundary memory would otherwise close. The best move is taken while it
  lowers (overflow beyond the limit, step time): `shardc.search.descent.descend`, which the
  pipeline-schedule search (`shardc.search.schedules.rebalance`) runs with other moves.
- Bounded deterministically: at most `evaluations` evaluations over all plans (the outer search
  gives `EVALUATIONS_PER_SECOND` per second of its time limit), so a fixed input gives the same
  plan on a loaded machine; no evaluation starts past the wall-clock `deadline` (a guard).
"""

from __future__ import annotations

import dataclasses
import time

from shardc.search.descent import Rows, StopRule, descend
from shardc.search.evaluate import Assignment, Evaluation, evaluate
from shardc.search.problem import Problem

REFINED = 4  # plans refined, the fastest first
EVALUATIONS_PER_SECOND = 12  # evaluations per second of the outer search's time limit


class _Budget:
    """Evaluations left and the wall-clock guard; `evaluate` through it."""

    def __init__(self, evaluations: int, deadline: float) -> None:
        self.left, self.deadline = evaluations, deadline

    def spent(self) -> bool:
        return self.left <= 0 or time.perf_counter() > self.deadline

    def evaluate(self, problem: Problem, a: Assignment, limit: float) -> Evaluation:
        self.left -= 1
        return evaluate(problem, a, limit)


def _with(rows: Rows, *changes: tuple[int, int, int]) -> Rows | None:
    """`rows` with `changes` ((stage, recomputation, blocks added)) applied; None when a count
    goes negative or a stage is left without blocks."""
    new = [list(r) for r in rows]
    for s, r, d in changes:
        new[s][r] += d
    if any(x < 0 for row in new for x in row) or any(sum(row) < 1 for row in new):
        return None
    return tuple((row[0], row[1], row[2]) for row in new)


def moves(rows: Rows, fits: bool) -> list[Rows]:
    """The neighbours of `rows` by the module's moves (recomputation 0 none, 1 selective, 2 full)."""
    out: list[Rows | None] = []
    p = len(rows)
    for s in range(p):
        for r in range(3):
            for q in range(3):
                if q != r and not (fits and q > r):
                    out.append(_with(rows, (s, r, -1), (s, q, 1)))
        for t in (s - 1, s + 1):
            if not 0 <= t < p:
                continue
            for r in range(3):
                out.append(_with(rows, (s, r, -1), (t, r, 1)))
                # The move with one more block recomputed in full where it arrives, or one fewer where it left.
                out.append(_with(rows, (s, r, -1), (t, r, 1), (t, 0, -1), (t, 2, 1)))
                out.append(_with(rows, (s, r, -1), (t, r, 1), (s, 2, -1), (s, 0, 1)))
    return list(dict.fromkeys(x for x in out if x is not None and x != rows))


def least_recompute(problem: Problem, a: Assignment, limit: float, budget: _Budget) -> Assignment:
    """`a` with each stage's recomputation cut to the least its memory needs (module rule); a
    stage whose memory does not fit as it is keeps its counts."""
    rows = [list(r) for r in a.stages]
    for s, row in enumerate(a.stages):
        kind = 2 if row[2] else 1 if row[1] else 0
        if kind == 0:
            continue
        n = sum(row)
        lo, hi = 0, row[1] + row[2]  # recomputed blocks: hi fits (the plan's own count), find the least
        while lo < hi and not budget.spent():
            mid = (lo + hi) // 2
            trial = [r[:] for r in rows]
            trial[s] = [n - mid, mid if kind == 1 else 0, mid if kind == 2 else 0]
            ev = budget.evaluate(problem, dataclasses.replace(a, stages=tuple((r[0], r[1], r[2]) for r in trial)), limit)
            if ev.stages[s].memory_bytes <= limit:
                hi = mid
            else:
                lo = mid + 1
        if hi < row[1] + row[2]:
            rows[s] = [n - hi, hi if kind == 1 else 0, hi if kind == 2 else 0]
    return dataclasses.replace(a, stages=tuple((r[0], r[1], r[2]) for r in rows))


def local_search(problem: Problem, a: Assignment, ev: Evaluation, limit: float, budget: _Budget
                 ) -> tuple[Assignment, Evaluation]:
    """From `a` (evaluated `ev`), the best move while it lowers (overflow, step time): `descend`
    over the module's `moves`, spending `budget` (a round it cuts short keeps its best move)."""
    return descend(a, ev, limit, moves, lambda cand: budget.evaluate(problem, cand, limit),
                   StopRule(budget.spent, keeps_cut_round=True))


def refine(plans: list[tuple[Problem, Assignment, Evaluation]], limit: float, evaluations: int,
           deadline: float = float("inf")) -> list[tuple[Problem, Assignment, Evaluation]]:
    """The module's search from the `REFINED` fastest fitting `plans` (problem, assignment,
    evaluation): every point found that fits and is strictly faster than the plan it started
    from, in the order found."""
    budget = _Budget(evaluations, deadline)
    seen: set[tuple[int, tuple[object, ...], int]] = set()
    picked = []
    for problem, a, ev in sorted((x for x in plans if x[2].fits), key=lambda x: x[2].step_time_s):
        key = (id(problem), a.stage_choice or a.choice, a.zero)
        if key not in seen:
            seen.add(key)
            picked.append((problem, a, ev))
    out = []
    for problem, a, ev in picked[:REFINED]:
        if budget.spent():
            break
        best_a, best_ev = a, ev
        lean = least_recompute(problem, a, limit, budget)
        starts = [(a, ev)]
        if lean.stages != a.stages and not budget.spent():
            starts.insert(0, (lean, budget.evaluate(problem, lean, limit)))
        for start, start_ev in starts:
            got_a, got_ev = local_search(problem, start, start_ev, limit, budget)
            if got_ev.fits and got_ev.step_time_s < best_ev.step_time_s:
                best_a, best_ev = got_a, got_ev
        if best_ev.step_time_s < ev.step_time_s:
            out.append((problem, best_a, best_ev))
    return out
