"""The solver's search of interleaved stages (vpp > 1): per device, the recomputation its memory needs.

The CP-SAT model (`shardc.search.constraints`) prices one model chunk per device; with
interleaved 1F1B a device holds `vpp` chunks and the activations of up to
`in_flight("interleaved", ...)` chunk-micro-batches, so interleaved shapes are searched here,
by the same `evaluate` as every plan. Rules:
- Candidate vectors: the given ones (the grid's Megatron layouts on the shape and the
  solver's best vectors of the same shape without interleaving); every chunk runs the vector.
- A chunk of n blocks mixes at most two recomputations (n of one, or k of one and n-k of the
  other: the vertices of the mix's linear program, as `shardc.search.bounds.lower_bound` uses).
  Every mix is evaluated with all chunks at it; a device's memory depends only on its own
  chunks, so each device then takes the fastest mix (by that evaluation's step time) whose
  memory on that device fits, its chunks all at that mix (earlier devices hold more in flight
  and recompute more). That combination is evaluated, and the best fitting point found is
  returned, uniform mixes included, over every ZeRO stage asked for.
- Chunks hold the blocks as apply-plan deals them (`shardc.analysis.stages.stage_sizes`).
"""

from __future__ import annotations

import dataclasses
import time

from shardc.analysis.stages import stage_sizes
from shardc.ir import ZERO_STAGES
from shardc.search.evaluate import Assignment, Evaluation, evaluate
from shardc.search.grid import layouts, vpp_admissible
from shardc.search.problem import Problem

SOLVED_VECTORS = 2  # the solver's best vectors of the shape without interleaving, tried per interleaved shape


def mixes(n: int) -> list[tuple[int, int, int]]:
    """Block counts (none, selective, full) of a chunk of `n` blocks with at most two kinds."""
    out: set[tuple[int, int, int]] = set()
    for a, b in ((0, 1), (1, 2), (0, 2)):
        for k in range(n + 1):
            row = [0, 0, 0]
            row[a], row[b] = k, n - k
            out.add((row[0], row[1], row[2]))
    return sorted(out, key=lambda r: (r[2], r[1]))


def _stages(sizes: tuple[int, ...], pp: int, per_device: list[tuple[int, int, int]]
            ) -> tuple[tuple[int, int, int], ...] | None:
    """Per virtual stage the mix of its device, clipped to the chunk's size (None when a mix
    does not fit a chunk's block count)."""
    out = []
    for s, n in enumerate(sizes):
        mix = per_device[s % pp]
        if sum(mix) != n:
            return None
        out.append(mix)
    return tuple(out)


def interleaved(problem: Problem, vectors: list[tuple[int, ...]], limit: float,
                zeros: tuple[int, ...] = ZERO_STAGES, deadline: float = float("inf")
                ) -> tuple[Assignment, Evaluation] | None:
    """The fastest fitting point of `problem` (an interleaved shape) found by the module rule,
    None when none fits; stops starting new (vector, ZeRO) pairs past `deadline`
    (`time.perf_counter()` seconds)."""
    p = problem.shape.pp
    sizes = stage_sizes(problem.layers, problem.shape.stages)
    if len(set(sizes)) != 1 or min(sizes) < 1:
        return None  # chunks of unequal size: not an admissible interleaving here
    best: tuple[Assignment, Evaluation] | None = None

    def keep(a: Assignment, ev: Evaluation) -> None:
        nonlocal best
        if ev.fits and (best is None or ev.step_time_s < best[1].step_time_s):
            best = (a, ev)

    for vec in dict.fromkeys(vectors):
        for z in zeros:
            if time.perf_counter() > deadline:
                return best
            evals = []
            for mix in mixes(sizes[0]):
                stages = _stages(sizes, p, [mix] * p)
                assert stages is not None
                a = Assignment(vec, stages, z)
                ev = evaluate(problem, a, limit)
                evals.append((ev.step_time_s, mix, ev))
                keep(a, ev)
            per_device = []
            for d in range(p):
                fits = [(t, mix) for t, mix, ev in evals if ev.stages[d].memory_bytes <= limit]
                if not fits:
                    break
                per_device.append(min(fits)[1])
            else:
                stages = _stages(sizes, p, per_device)
                if stages is not None and len(set(per_device)) > 1:
                    a = Assignment(vec, stages, z)
                    keep(a, evaluate(problem, a, limit))
    return best


def search_interleaved(problems: list[Problem], order: list[int], bounds: list[float],
                       solved: list[tuple[Problem, Assignment, float]], incumbent: float, limit: float,
                       deadline: float) -> list[tuple[int, Assignment, Evaluation]]:
    """The interleaved problems among `problems`, visited in `order` while their bound beats the
    best step time so far (from `incumbent`) and the clock is before `deadline`, each searched by
    `interleaved` from the grid's layouts and the `SOLVED_VECTORS` fastest of `solved` (problem,
    assignment, step time) on its shape without interleaving: (problem index, point, evaluation)
    for every problem where a point fits."""
    out = []
    for i in order:
        problem = problems[i]
        if problem.shape.vpp == 1 or problem.shape.schedule or bounds[i] >= incumbent or time.perf_counter() > deadline:
            continue
        if problem.micro_batches % problem.shape.pp or not vpp_admissible(problem.layers, problem.shape.pp,
                                                                          problem.shape.vpp):
            continue
        flat = dataclasses.replace(problem.shape, vpp=1)
        vectors = [choice for _, choice in layouts(problem)]
        vectors += [a.choice for p, a, _ in sorted(solved, key=lambda x: x[2])
                    if p.shape == flat and p.mb == problem.mb][:SOLVED_VECTORS]
        got = interleaved(problem, vectors, limit, deadline=deadline)
        if got is not None:
            out.append((i, got[0], got[1]))
            incumbent = min(incumbent, got[1].step_time_s)
    return out
