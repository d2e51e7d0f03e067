"""Steepest descent over a plan's stage rows: the local search `refine` and `schedules` share.

Rule: from a point and its evaluation, every neighbour of its stage rows (blocks per stage by
recomputation: none, selective, full) is evaluated, and the best one is taken while it ranks
lower (`evaluation_key`: bytes over the memory limit first, then step time). The caller gives
the neighbours and the stop rule (`StopRule`), which is asked before every evaluation:
`refine` spends a count of evaluations (deterministic: a fixed input gives the same plan on a
loaded machine) and keeps the best neighbour of a round the count cuts short; `schedules`
watches a wall-clock deadline (`by_deadline`), drops a round the deadline cuts short, and
takes a bounded number of moves.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shardc.search.evaluate import Assignment, Evaluation

Rows = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class StopRule:
    """When a descent stops: `spent()` is asked before every round and every evaluation; a round
    it cuts short still moves to the best neighbour found so far when `keeps_cut_round`; at most
    `rounds` moves are taken (None: no bound but `spent`)."""

    spent: Callable[[], bool]
    keeps_cut_round: bool
    rounds: int | None = None


def by_deadline(deadline: float, rounds: int) -> StopRule:
    """Stop once the wall clock passes `deadline` (a cut round is dropped) or after `rounds` moves."""
    return StopRule(lambda: time.perf_counter() > deadline, keeps_cut_round=False, rounds=rounds)


def evaluation_key(ev: Evaluation, limit: float) -> tuple[float, float]:
    """How local searches rank evaluations: bytes over `limit` first, then step time."""
    return (max(0.0, ev.memory_per_device_bytes - limit), ev.step_time_s)


def descend(a: Assignment, ev: Evaluation, limit: float, neighbours: Callable[[Rows, bool], Iterable[Rows]],
            evaluate: Callable[[Assignment], Evaluation], stop: StopRule) -> tuple[Assignment, Evaluation]:
    """From `a` (evaluated `ev`), the module's descent: each round evaluates `neighbours(rows,
    fits)` of the current point (its vector and ZeRO stage kept) with `evaluate` and moves to the
    best one while it ranks below the current point by `evaluation_key` against `limit`; it ends
    when no neighbour does, or as `stop` says. Returns the point reached and its evaluation."""
    moved = 0
    while (stop.rounds is None or moved < stop.rounds) and not stop.spent():
        step: tuple[Assignment, Evaluation] | None = None
        cut = False
        for rows in neighbours(a.stages, ev.fits):
            if stop.spent():
                cut = True
                break
            cand = dataclasses.replace(a, stages=rows)
            got = evaluate(cand)
            if evaluation_key(got, limit) < evaluation_key(step[1] if step else ev, limit):
                step = (cand, got)
        if step is None or (cut and not stop.keeps_cut_round):
            break
        a, ev = step
        moved += 1
    return a, ev
