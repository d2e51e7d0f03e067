"""The CP-SAT model of one mesh shape and micro-batch size (OR-Tools).

Variables: a boolean per (group, candidate); per edge, a boolean per (produced layout class,
required layout class) pair, tied to the candidates by transportation constraints; per
pipeline stage, block counts under each recomputation; one ZeRO stage. The objective and the
memory constraints are `shardc.search.evaluate`'s formulas, with times in microseconds and
bytes in KiB; products of block counts and per-block quantities use multiplication
constraints. The search is bounded (deterministic time), seeded, warm-started from a hint,
and reports the proven gap.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model
from shardc.cost.memory import in_flight
from shardc.search.evaluate import Assignment
from shardc.search.problem import ZEROS, Problem

# Units are chosen per model so that one block is ~20000 time units and the memory limit
# ~100000 memory units: coarse enough for fast propagation, fine enough (1e-4) for ranking.


@dataclass(frozen=True, slots=True)
class SolveResult:
    assignment: Assignment | None
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN
    objective_s: float
    bound_s: float
    wall_s: float

    @property
    def gap(self) -> float:
        if self.assignment is None or self.objective_s <= 0:
            return float("inf")
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


class _Units:
    def __init__(self, problem: Problem, limit_bytes: float) -> None:
        block = sum(max(c.time for c in v.costs) for v in problem.groups if v.section == "block")
        total = block + sum(max(c.time for c in v.costs) for v in problem.groups if v.section != "block")
        self.time = max(total, 1e-9) / 2e4
        self.mem = max(limit_bytes, 1.0) / 1e5


def solve(problem: Problem, limit_bytes: float, time_limit: float, seed: int = 0, workers: int = 1,
          hint: Assignment | None = None, zeros: tuple[int, ...] = ZEROS,
          recomputes: tuple[int, ...] = (0, 1, 2)) -> SolveResult:
    """Build and solve the model; `hint` warm-starts it (a grid plan or a saved plan)."""
    units = _Units(problem, limit_bytes)

    def _t(v: float) -> int:
        return int(round(v / units.time))

    def _m(v: float) -> int:
        return int(round(v / units.mem))

    md = cp_model.CpModel()
    p, m, L = problem.shape.pp, problem.micro_batches, problem.layers
    groups = problem.groups
    x = [[md.NewBoolVar(f"x{g}_{c}") for c in range(len(v.cands))] for g, v in enumerate(groups)]
    for row in x:
        md.AddExactlyOne(row)
    zsel = {z: md.NewBoolVar(f"zero{z}") for z in ZEROS}
    md.AddExactlyOne(zsel.values())
    for z in ZEROS:
        if z not in zeros:
            md.Add(zsel[z] == 0)

    def lin(section: str, attr: str) -> cp_model.LinearExpr:
        return sum(_t(getattr(v.costs[c], attr)) * x[g][c] if attr in ("time", "fwd", "fwd_core", "bwd")
                   else _m(getattr(v.costs[c], attr)) * x[g][c]
                   for g, v in enumerate(groups) if v.section == section for c in range(len(v.cands)))

    edge_t = {"pre": [], "block": [], "post": []}
    edge_f = {"pre": [], "block": [], "post": []}
    edge_b = {"pre": [], "block": [], "post": []}
    for i, e in enumerate(problem.edges):
        na, nb = len(e.fwd), len(e.fwd[0])
        y = [[md.NewBoolVar(f"y{i}_{a}_{b}") for b in range(nb)] for a in range(na)]
        for a in range(na):
            md.Add(sum(y[a]) == sum(x[e.producer][c] for c, k in enumerate(e.prod_class) if k == a))
        for b in range(nb):
            md.Add(sum(y[a][b] for a in range(na)) == sum(x[e.consumer][c] for c, k in enumerate(e.cons_class) if k == b))
        for a in range(na):
            for b in range(nb):
                edge_t[e.section].append(_t(e.fwd[a][b] + e.bwd[a][b]) * y[a][b])
                edge_f[e.section].append(_t(e.fwd[a][b]) * y[a][b])
                edge_b[e.section].append(_t(e.bwd[a][b]) * y[a][b])

    upper: dict[str, int] = {}

    def by_zero(section: str, attr: str, unit) -> cp_model.IntVar:
        """max over the selected ZeRO stage of a per-candidate tuple attribute."""
        exprs = {z: sum(unit(getattr(v.costs[c], attr)[z]) * x[g][c] for g, v in enumerate(groups)
                        if v.section == section for c in range(len(v.cands))) for z in ZEROS}
        ub = sum(max(unit(getattr(cc, attr)[z]) for cc in v.costs for z in ZEROS)
                 for v in groups if v.section == section)
        var = md.NewIntVar(0, max(ub, 0), f"{section}_{attr}")
        upper[var.Name()] = max(ub, 0)
        for z in zeros:
            md.Add(var >= exprs[z]).OnlyEnforceIf(zsel[z])
        return var

    def ub_time(section: str, attr: str) -> int:
        return sum(max(_t(getattr(cc, attr)) for cc in v.costs) for v in groups if v.section == section) + sum(
            max(_t(e.fwd[a][b] + e.bwd[a][b]) for a in range(len(e.fwd)) for b in range(len(e.fwd[0])))
            for e in problem.edges if e.section == section)

    sec_time = {s: lin(s, "time") + sum(edge_t[s]) for s in ("pre", "block", "post")}
    gather = {s: by_zero(s, "sync_mb", _t) for s in ("pre", "block", "post")}
    state = {s: by_zero(s, "state", _m) for s in ("pre", "block", "post")}
    sync = {s: by_zero(s, "sync_step", _t) for s in ("pre", "block", "post")}
    trans = {}
    for s in ("pre", "block", "post"):
        ub = max([_m(cc.transient) for v in groups if v.section == s for cc in v.costs] or [0])
        trans[s] = md.NewIntVar(0, ub, f"{s}_working")
        upper[trans[s].Name()] = ub
        for g, v in enumerate(groups):
            if v.section == s:
                md.Add(trans[s] >= sum(_m(v.costs[c].transient) * x[g][c] for c in range(len(v.cands))))
    send = 2 * _t(problem.pricer.p2p(problem.boundary_bytes)) if p > 1 else 0
    pre_time = sec_time["pre"] + gather["pre"]
    post_time = sec_time["post"] + gather["post"]
    stage_times = []
    exposed = []
    big_t = ub_time("block", "time") * 2 + ub_time("block", "fwd") + max(
        _t(sum(max(cc.sync_mb) for cc in v.costs)) for v in groups) + 1 if groups else 1
    counts = []
    if L > 0:
        tl = [md.NewIntVar(0, big_t, f"layer_time_{r}") for r in range(3)]
        md.Add(tl[0] == sec_time["block"] + gather["block"])
        md.Add(tl[1] == sec_time["block"] + lin("block", "fwd_core") + gather["block"])
        md.Add(tl[2] == sec_time["block"] + lin("block", "fwd") + sum(edge_f["block"]) + gather["block"])
        act_ub = sum(max(_m(cc.saved) + _m(cc.layer_input) for cc in v.costs) for v in groups if v.section == "block")
        act = [md.NewIntVar(0, act_ub, f"act_{r}") for r in range(3)]
        md.Add(act[0] == lin("block", "saved"))
        md.Add(act[1] == lin("block", "saved") - lin("block", "saved_core"))
        md.Add(act[2] == lin("block", "layer_input"))
        sync_ub = sum(max(_t(max(cc.sync_step)) for cc in v.costs) for v in groups if v.section == "block")
        exposed_layer = md.NewIntVar(0, sync_ub, "exposed_per_layer")
        md.Add(exposed_layer >= sync["block"] - lin("block", "bwd") - sum(edge_b["block"]))
    for s in range(p):
        first, last = s == 0, s == p - 1
        lo = 0 if (first or last or L == 0) else 1
        k = [md.NewIntVar(0, L, f"k{s}_{r}") for r in range(3)]
        for r in range(3):
            if r not in recomputes:
                md.Add(k[r] == 0)
        n = md.NewIntVar(lo, L, f"n{s}")
        md.Add(sum(k) == n)
        counts.append((n, k))
        terms, mem = [], []
        f = in_flight("1f1b", p, s, m)
        if L > 0:
            for r in range(3):
                prod_t = md.NewIntVar(0, L * big_t, f"pt{s}_{r}")
                md.AddMultiplicationEquality(prod_t, [k[r], tl[r]])
                terms.append(prod_t)
                prod_a = md.NewIntVar(0, L * act_ub, f"pa{s}_{r}")
                md.AddMultiplicationEquality(prod_a, [k[r], act[r]])
                mem.append(f * prod_a)
            st = md.NewIntVar(0, L * upper[state["block"].Name()], f"state{s}")
            md.AddMultiplicationEquality(st, [n, state["block"]])
            mem.append(st)
            ex = md.NewIntVar(0, L * sync_ub, f"exposed{s}")
            md.AddMultiplicationEquality(ex, [n, exposed_layer])
            has_full = md.NewBoolVar(f"full{s}")
            md.Add(k[2] <= L * has_full)
            rw = md.NewIntVar(0, act_ub, f"recompute_working{s}")
            md.Add(rw >= act[0]).OnlyEnforceIf(has_full)
            mem.append(rw)
        else:
            ex = 0
        stage = sum(terms) + send + (pre_time if first else 0) + (post_time if last else 0)
        stage_times.append(stage)
        exposed.append(ex + (sync["pre"] if first else 0) + (sync["post"] if last else 0))
        working = md.NewIntVar(0, max(upper[trans[t].Name()] for t in trans), f"working{s}")
        md.Add(working >= trans["block"])
        if first:
            md.Add(working >= trans["pre"])
            mem += [state["pre"], f * lin("pre", "saved")]
        if last:
            md.Add(working >= trans["post"])
            mem += [state["post"], f * lin("post", "saved")]
        mem.append(working)
        md.Add(sum(mem) <= _m(limit_bytes))
    md.Add(sum(n for n, _ in counts) == L)
    horizon = (L * big_t + 10 * (ub_time("pre", "time") + ub_time("post", "time")) + send + 1) * 4
    bottleneck = md.NewIntVar(0, horizon, "bottleneck")
    for st in stage_times:
        md.Add(bottleneck >= st)
    worst_exposed = md.NewIntVar(0, horizon, "exposed")
    for ex in exposed:
        md.Add(worst_exposed >= ex)
    md.Minimize(sum(stage_times) + (m - 1) * bottleneck + worst_exposed)
    if hint is not None:
        for g, c in enumerate(hint.choice):
            for cc in range(len(x[g])):
                md.AddHint(x[g][cc], cc == c)
        for z in ZEROS:
            md.AddHint(zsel[z], z == hint.zero)
        for (n, k), row in zip(counts, hint.stages):
            md.AddHint(n, sum(row))
            for r in range(3):
                md.AddHint(k[r], row[r])
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.random_seed = seed
    prm.num_workers = max(1, workers)
    prm.max_deterministic_time = max(time_limit, 0.01)
    prm.max_time_in_seconds = max(3 * time_limit, 0.05)
    if workers > 1:
        prm.interleave_search = True
    status = solver.Solve(md)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(None, name, float("inf"), solver.BestObjectiveBound() * units.time
                           if status != cp_model.INFEASIBLE else float("inf"), solver.WallTime())
    choice = tuple(next(c for c, var in enumerate(row) if solver.Value(var)) for row in x)
    stages = tuple(tuple(solver.Value(k[r]) for r in range(3)) for _, k in counts)
    zero = next(z for z in ZEROS if solver.Value(zsel[z]))
    return SolveResult(Assignment(choice, stages, zero), name, solver.ObjectiveValue() * units.time,
                       solver.BestObjectiveBound() * units.time, solver.WallTime())
