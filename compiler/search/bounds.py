"""Lower bounds of a problem's step time: the solver's (`lower_bound`, by which the outer search
orders, prunes and proves its gap) and the grid scan's (`grid_bound`, by which the baseline is
scanned). Both bound the linearised objective (`shardc.search.objective.objective`) from below
using only each group's cheapest candidates, so no plan of the problem is faster; the rules are
in each function's docstring."""

from __future__ import annotations

import numpy as np

from shardc.cost.memory import in_flight
from shardc.ir import ZERO_STAGES
from shardc.search.linear import coefficients
from shardc.search.problem import Problem


def lower_bound(problem: Problem, limit: float = float("inf")) -> float:
    """A lower bound of the problem's linearised objective (`shardc.search.objective.objective`),
    the smallest over the ZeRO stages of: every group at its cheapest, edges free, each
    pipeline send at its cheapest, a ZeRO-3 block paying at least the weight gather its most
    smallest compute cannot hide; the pipeline at least sum + (m-1) x slowest stage, where the
    slowest stage is at least the smallest makespan of whole blocks over the stages (the prefix
    on the first, the suffix on the last, sends on every boundary) with each stage's blocks
    recomputed as little as its memory allows (model states at that ZeRO stage, activations of
    its micro-batches in flight, every quantity at its smallest candidate: `_makespan`); with
    interleaved stages (vpp = v), at least the ideal interleaved schedule on the cheapest blocks
    and m times the busiest device's work, a device's stage time as above with its chunks'
    micro-batches in flight (`in_flight` / v in blocks' worth); with a zero-bubble schedule, m
    times an even share of the cheapest per-micro-batch work (no memory term); plus
    the optimizer on an even share of the parameters and the last gradient bucket. Infinite
    when no split of the blocks fits `limit` at any ZeRO stage."""
    co = coefficients(problem)
    L, p, m = problem.layers, problem.shape.pp, problem.micro_batches
    sections = ("pre", "block", "post")
    low = {s: np.zeros(3) for s in sections}  # time per recomputation: none, selective, full
    act = {s: np.zeros(3) for s in sections}
    numel = dict.fromkeys(sections, 0.0)
    compute = np.zeros(2)  # the block's smallest forward and backward compute
    rest = np.zeros(3)  # the block's smallest time besides compute, per recomputation
    send = 0.0
    for rows, v, sends in zip(co.cand, problem.groups, co.send):
        low[v.section] += [min(x["time"] for x in rows), min(x["time"] + x["core"] for x in rows),
                           min(x["time"] + x["fwd"] for x in rows)]
        act[v.section] += [min(x["saved"] for x in rows), min(x["saved"] - x["saved_core"] for x in rows),
                           min(x["inputs"] for x in rows)]
        numel[v.section] += min(x["numel"] for x in rows)
        if v.section == "block":
            compute += [min(x["cfwd"] for x in rows), min(x["cbwd"] for x in rows)]
            rest += [
                min(x["time"] - x["cfwd"] - x["cbwd"] for x in rows),
                min(x["time"] + x["core"] - x["cfwd"] - x["cbwd"] for x in rows),
                min(x["time"] + x["fwd"] - x["cfwd"] - x["cbwd"] for x in rows)]
        send += min(sends)
    send = send if p > 1 else 0.0
    extra = np.array([low["pre"][0] * (s == 0) + low["post"][0] * (s == p - 1) + send * ((s > 0) + (s < p - 1))
                      for s in range(p)])
    params = L * numel["block"] + numel["pre"] + numel["post"]
    best = float("inf")
    for z in ZERO_STAGES:
        tl = low["block"].copy()
        if z >= 3 and co.zero3[1] > 0:
            # A block's compute plus its unhidden gathers is max(compute, gather) each way,
            # nondecreasing in the compute: at least that of the smallest compute.
            gather = co.zero3[0] + co.zero3[1] * co.w_elem * numel["block"]
            tl = np.maximum(tl, rest + max(compute[0], gather) + max(compute[1], gather))
        total = L * tl[0] + extra.sum()
        after = co.optimizer[z] * params / p + co.gather[z][0] + co.gather[z][1] * co.w_elem * params / p
        vpp = problem.shape.vpp
        slowest = max(total / p, _makespan(problem, limit, tl, act, numel, co.state[z], extra, vpp))
        if problem.shape.schedule:  # zero bubble: every device busy on an even share, no bubble, no memory term
            best = min(best, float(total / p * m + after + co.tail[z]))
            continue
        if vpp > 1:  # interleaved: the ideal schedule (bubble (p-1)/(v m) of the work), the busiest device's work
            best = min(best, float(max(total / p * (m + (p - 1) / vpp), m * slowest) + after + co.tail[z]))
            continue
        best = min(best, float(total + (m - 1) * slowest + after + co.tail[z]))
    return best


def _makespan(problem: Problem, limit: float, tl: np.ndarray, act: dict[str, np.ndarray], numel: dict[str, float],
              state: float, extra: np.ndarray, virtual: int = 1) -> float:
    """The smallest T such that the stages hold the L blocks with none above T, a stage's time
    for n blocks being extra_s plus the cheapest mix of recomputations (an LP over the counts,
    its vertices enumerated) whose activations, times the micro-batches in flight, fit beside
    the model states (nondecreasing in n; infinite where nothing fits)."""
    L, p, m = problem.layers, problem.shape.pp, problem.micro_batches
    s = np.arange(p)
    f = np.array([in_flight("interleaved", p, i, m, virtual) / virtual if virtual > 1 else in_flight("1f1b", p, i, m)
                  for i in range(p)], dtype=float)[:, None]
    fixed = ((numel["pre"] * (s == 0) + numel["post"] * (s == p - 1)) * state
             + f[:, 0] * (act["pre"][0] * (s == 0) + act["post"][0] * (s == p - 1)))[:, None]
    n = np.arange(L + 1, dtype=float)[None, :]
    cap = (limit - fixed - n * numel["block"] * state) / f
    a = act["block"]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = np.full(cap.shape, np.inf)
        for r in range(3):
            cost = np.where(n * a[r] <= cap * (1 + 1e-9), np.minimum(cost, n * tl[r]), cost)
            for q in range(r + 1, 3):
                if a[r] != a[q]:
                    k = (cap - n * a[q]) / (a[r] - a[q])
                    ok = (k >= 0) & (k <= n)
                    cost = np.where(ok, np.minimum(cost, k * tl[r] + (n - k) * tl[q]), cost)
    cost = np.where(cap < 0, np.inf, cost) + extra[:, None]
    values = np.unique(cost[np.isfinite(cost)])
    if values.size == 0:
        return float("inf")

    def fits(t: float) -> bool:
        return int(((cost <= t).sum(axis=1) - 1).clip(min=0).sum()) >= L and bool((cost[:, 0] <= t).all())

    lo, hi = 0, values.size - 1
    if not fits(values[hi]):
        return float("inf")
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(values[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(values[lo])


def grid_bound(problem: Problem) -> float:
    """The grid scan's bound: every group at its cheapest, edges free, stages perfectly balanced
    (interleaved: the bubble (p-1)/v micro-batches' chunk time instead of p-1)."""
    co = coefficients(problem)
    per_mb = sum(min(r["time"] for r in rows) * (problem.layers if v.section == "block" else 1)
                 for rows, v in zip(co.cand, problem.groups))
    p, m = problem.shape.pp, problem.micro_batches
    return per_mb * (m + (p - 1) / problem.shape.vpp) / p
