"""The solver's search of pipeline schedules and stage boundaries: zero-bubble schedules, their
virtual stages, and stages of unequal block counts.

The CP-SAT model (`shardc.search.constraints`) prices 1F1B on one model chunk per device; the
schedules it does not model are searched here, by the same `evaluate` as every plan (the cost
model's composition: the schedule simulated in torch's own order with the backward split into
input- and weight-gradient passes, the activations in flight per device under that schedule,
the embedding, head and loss on the stages that hold them), so the objective sees per-stage
time and per-stage memory. Rules:
- Shapes (`schedule_shapes`): every pipelined shape of Megatron's schedules (pp > 1, vpp = 1,
  one tensor axis) is also offered under torch's zero-bubble schedules: `zbv` and `dualpipev`
  with vpp = 2 (a V of 2pp virtual stages), `interleaved-zb` with vpp = 1..`max_vpp` and every
  deeper interleaving Megatron runs (`grid.interleavings`: up to one block per chunk); each
  virtual stage needs a block. Micro-batch counts torch's schedule refuses
  (`shardc.plan.parallel.microbatch_problem`) are not offered. ZeRO 0 and 1 are searched
  where there is a data-parallel group to shard over (`SCHEDULE_ZEROS`; the torch backend runs
  ZeRO there as one FSDP2 unit per stage, reduce-scattered after the stage's last weight-gradient
  pass, its weights gathered through the step whatever the stage: ZeRO-2 and 3 run and are
  priced as ZeRO-1, so they are not tried apart).
- Candidate vectors: as for interleaved shapes (`shardc.search.interleave`): the grid's Megatron
  layouts on the shape and the solver's best vectors of the shape with Megatron's schedule and
  no interleaving; every virtual stage runs the vector.
- Stages (`start_point`, `rebalance`): from the even split (`stage_sizes`) with one
  recomputation for every block (each tried), or per device as few fully recomputed (or
  selective) blocks as its memory needs (read off the uniform points), a local search moves one block between neighbouring virtual stages, or
  changes one block's recomputation by one step (none <-> selective <-> full) on one stage,
  taking the best move while it lowers (overflow beyond the limit, step time), every virtual
  stage keeping a block; so the stages holding the embedding, head and loss, or more
  micro-batches in flight, end up with fewer blocks where that pays. Interleaved 1F1B plans are
  rebalanced alike (`search_schedules`), so the two families are compared on equal terms.
- Bounded: no new evaluation starts past the deadline (the outer search gives these a share of
  `--time-limit` on the wall clock); every problem whose lower bound beats the best step time so
  far gets its start point (a few evaluations), then the local search runs from the fastest
  starts first, skipping starts `REBALANCE_MARGIN` above the best so far.
"""

from __future__ import annotations

import dataclasses
import math
import time

from shardc.analysis.stages import device_stages, stage_sizes
from shardc.cost.compose import zero_group
from shardc.plan.parallel import ZB_SCHEDULES, microbatch_problem
from shardc.search.descent import by_deadline, descend, evaluation_key
from shardc.search.evaluate import Assignment, Evaluation, evaluate
from shardc.search.grid import interleavings, layouts
from shardc.search.interleave import SOLVED_VECTORS
from shardc.search.problem import MeshShape, Problem

SCHEDULE_ZEROS = (0, 1)  # ZeRO 1 only where the data-parallel group has more than one device
MAX_ROUNDS = 64  # local-search moves per start point (each the best neighbour)
REBALANCE_MARGIN = 0.1  # a start this far above the best step time so far is not searched further


def schedule_shapes(shapes: list[MeshShape], layers: int, max_vpp: int) -> list[MeshShape]:
    """The zero-bubble variants of `shapes` (see the module rule), in the order of `shapes`."""
    out = []
    for s in shapes:
        if s.pp <= 1 or s.vpp != 1 or s.schedule or s.tq != 1:
            continue
        depths = sorted({*range(1, max_vpp + 1), *interleavings(layers, s.pp)})
        variants = [("zbv", 2), ("dualpipev", 2)] + [("interleaved-zb", v) for v in depths]
        out += [dataclasses.replace(s, vpp=v, schedule=name) for name, v in variants if s.pp * v <= layers]
    return out


def admissible(problem: Problem) -> bool:
    """Whether torch's schedule of the problem's shape runs its micro-batch count."""
    return microbatch_problem(problem.shape.plan(problem.mb, problem.gbs), problem.micro_batches) is None


def _neighbours(stages: tuple[tuple[int, int, int], ...], fits: bool = False
                ) -> list[tuple[tuple[int, int, int], ...]]:
    """One block moved between neighbouring virtual stages (of the same recomputation), or one
    block's recomputation moved one step (towards more only while the point does not `fit`:
    more recomputation of a fitting point only costs time), every stage keeping a block."""
    out = []
    rows = [list(r) for r in stages]
    for s in range(len(rows)):
        for t in (s - 1, s + 1):
            if not 0 <= t < len(rows) or sum(rows[s]) <= 1:
                continue
            for r in range(3):
                if rows[s][r]:
                    new = [row[:] for row in rows]
                    new[s][r] -= 1
                    new[t][r] += 1
                    out.append(tuple(tuple(x) for x in new))
        for r, q in ((0, 1), (1, 2), (1, 0), (2, 1)):
            if rows[s][r] and not (fits and q > r):
                new = [row[:] for row in rows]
                new[s][r] -= 1
                new[s][q] += 1
                out.append(tuple(tuple(x) for x in new))
    return list(dict.fromkeys(out))  # type: ignore[arg-type]


def rebalance(problem: Problem, a: Assignment, limit: float, deadline: float = float("inf"),
              ev: Evaluation | None = None) -> tuple[Assignment, Evaluation]:
    """The local search of the module rule from `a` (its vector and ZeRO stage kept; `ev` its
    evaluation when known): the point reached, by (memory overflow beyond `limit`, step time),
    taking the best neighbour while it improves (`MAX_ROUNDS` moves at most; the first
    improvement gets stuck sooner: [1,3,3,1] blocks where the best reaches [3,2,2,1]); the
    descent (`shardc.search.descent.descend`) stops at `deadline`, dropping a round it cuts."""
    start = ev or evaluate(problem, a, limit)
    return descend(a, start, limit, _neighbours, lambda cand: evaluate(problem, cand, limit),
                   by_deadline(deadline, MAX_ROUNDS))


def _recomputing(problem: Problem, vec: tuple[int, ...], zero: int, limit: float, r: int,
                 plain: Evaluation, redone: Evaluation, sizes: tuple[int, ...]) -> tuple[Assignment, Evaluation]:
    """Per device, as few blocks under recomputation `r` (the rest none) as its memory needs, read
    off the two uniform evaluations (`plain`: none; `redone`: every block at `r`) as a linear
    saving per block, the first stages of the device taking them first; then one more block on
    each device still over the limit, while that helps (a few evaluations)."""
    shape = problem.shape
    schedule = shape.plan(problem.mb, problem.gbs).schedule
    held = [device_stages(d, shape.pp, shape.vpp, schedule) for d in range(shape.pp)]
    need: list[int] = []
    for d, mine in enumerate(held):
        blocks = sum(sizes[s] for s in mine)
        saving = (plain.stages[d].memory_bytes - redone.stages[d].memory_bytes) / max(1, blocks)
        excess = plain.stages[d].memory_bytes - limit
        need.append(0 if excess <= 0 else blocks if saving <= 0 else min(blocks, math.ceil(excess / saving)))

    def point(counts: list[int]) -> Assignment:
        rows = [[n, 0, 0] for n in sizes]
        for d, mine in enumerate(held):
            left = counts[d]
            for st in mine:
                k = min(left, sizes[st])
                rows[st][0] -= k
                rows[st][r] += k
                left -= k
        return Assignment(vec, tuple((row[0], row[1], row[2]) for row in rows), zero)

    a = point(need)
    ev = evaluate(problem, a, limit)
    for _ in range(8):
        over = [d for d in range(shape.pp) if ev.stages[d].memory_bytes > limit
                and need[d] < sum(sizes[st] for st in held[d])]
        if not over:
            break
        for d in over:
            need[d] += 1
        a2 = point(need)
        ev2 = evaluate(problem, a2, limit)
        if evaluation_key(ev2, limit) >= evaluation_key(ev, limit):
            break
        a, ev = a2, ev2
    return a, ev


def start_point(problem: Problem, vectors: list[tuple[int, ...]], limit: float, zero: int = 0,
                deadline: float = float("inf")) -> tuple[Assignment, Evaluation] | None:
    """The local search's start: the even split (`stage_sizes`), each vector with every block
    under one recomputation, and per device as few recomputed blocks as its memory needs
    (`_recomputing`, full and selective); the best by (overflow, step time)."""
    sizes = stage_sizes(problem.layers, problem.shape.stages)
    if min(sizes) < 1:
        return None
    starts = []
    for vec in dict.fromkeys(vectors):
        if time.perf_counter() > deadline:
            break
        uniform = []
        for r in range(3):
            stages = tuple(tuple(n if i == r else 0 for i in range(3)) for n in sizes)
            a = Assignment(vec, stages, zero)  # type: ignore[arg-type]
            uniform.append((a, evaluate(problem, a, limit)))
        starts += uniform
        if not uniform[0][1].fits:
            starts += [_recomputing(problem, vec, zero, limit, r, uniform[0][1], uniform[r][1], sizes) for r in (1, 2)
                       if uniform[r][1].memory_per_device_bytes < uniform[0][1].memory_per_device_bytes]
    return min(starts, key=lambda x: evaluation_key(x[1], limit)) if starts else None


def search_problem(problem: Problem, vectors: list[tuple[int, ...]], limit: float, zero: int = 0,
                   deadline: float = float("inf")) -> tuple[Assignment, Evaluation] | None:
    """The best fitting point of `problem` from `vectors` (see the module rule), None when none fits."""
    got = start_point(problem, vectors, limit, zero, deadline)
    if got is None:
        return None
    a, ev = rebalance(problem, got[0], limit, deadline, got[1])
    return (a, ev) if ev.fits else None


def search_schedules(problems: list[Problem], order: list[int], bounds: list[float],
                     solved: list[tuple[Problem, Assignment, float]], incumbent: float, limit: float,
                     deadline: float) -> list[tuple[int, Assignment, Evaluation]]:
    """The zero-bubble problems among `problems` whose bound beats `incumbent` (the best step time
    so far): first every one's start point (`start_point`, visited in `order`), then the local
    search from each start, fastest start first, while the clock is before `deadline`: (problem
    index, point, evaluation) for every problem where a point fits. `solved`: (problem,
    assignment, step time) of the plans found so far; the best of each shape with Megatron's
    schedule and no interleaving gives its vectors."""
    # The shapes and micro-batch sizes whose Megatron-schedule plans came out fastest first (the
    # zero-bubble bound, bubble-free and without memory, barely orders them), then by bound.
    fastest: dict[tuple[MeshShape, int], float] = {}
    for p, _, t in solved:
        fastest[(p.shape, p.mb)] = min(t, fastest.get((p.shape, p.mb), float("inf")))

    def promise(i: int) -> tuple[float, float]:
        flat = dataclasses.replace(problems[i].shape, vpp=1, schedule="")
        return fastest.get((flat, problems[i].mb), float("inf")), bounds[i]

    starts = []
    for i in sorted(order, key=promise):
        problem = problems[i]
        if problem.shape.schedule not in ZB_SCHEDULES or bounds[i] >= incumbent or time.perf_counter() > deadline:
            continue
        if not admissible(problem):
            continue
        flat = dataclasses.replace(problem.shape, vpp=1, schedule="")
        vectors = [choice for _, choice in layouts(problem)]
        vectors += [a.choice for p, a, _ in sorted(solved, key=lambda x: x[2])
                    if p.shape == flat and p.mb == problem.mb][:SOLVED_VECTORS]
        zeros = SCHEDULE_ZEROS if zero_group(problem.shape.mesh())[1] > 1 else SCHEDULE_ZEROS[:1]
        for z in zeros:
            got = start_point(problem, vectors, limit, z, deadline)
            if got is not None:
                starts.append((i, *got))
    out = []
    for i, a, ev in sorted(starts, key=lambda x: evaluation_key(x[2], limit)):
        if time.perf_counter() <= deadline and evaluation_key(ev, limit)[1] < incumbent * (1 + REBALANCE_MARGIN):
            a, ev = rebalance(problems[i], a, limit, deadline, ev)
        if ev.fits:
            out.append((i, a, ev))
            incumbent = min(incumbent, ev.step_time_s)
    return out
