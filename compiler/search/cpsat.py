"""The CP-SAT model of one mesh shape and micro-batch size (OR-Tools).

Variables: a boolean per (group, candidate); per edge, a boolean per (produced layout class,
required layout class) pair, tied to the candidates by transportation constraints; per
pipeline stage, block counts under each recomputation; one ZeRO stage. The objective and the
memory constraints are `shardc.search.linear.objective`'s formulas (the linearisation of the
analytical model), with times in integer units of 1/50000 of the cheapest micro-batch pass
(fine enough that one node's time survives rounding, which a unit tied to the costliest
candidates did not) and bytes in units of 1/100000 of the memory limit; products of block
counts and per-block quantities use multiplication constraints, which the LP relaxation drops,
so each product also gets a linear cut (count x the quantity's smallest value) that keeps
per-stage time and memory in the bound. The search is bounded (deterministic time), seeded,
warm-started from a hint, and reports the plan's own linearised objective and the proven bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ortools.sat.python import cp_model

from shardc.cost.memory import in_flight
from shardc.search.evaluate import Assignment
from shardc.search.linear import CAND_KEYS, EDGE_SECTION, coefficients, objective
from shardc.search.problem import ZEROS, Problem

SECTIONS = ("pre", "block", "post")
TIME_STEPS = 5e4  # integer units in the cheapest micro-batch time (see `_Model`)
TIME_KEYS = ("time", "fwd", "core", "cfwd", "cbwd", "other")


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


class _Model:
    """The CP-SAT model under construction, with its unit conversions."""

    def __init__(self, problem: Problem, limit_bytes: float, zeros: tuple[int, ...]) -> None:
        self.p, self.co, self.md = problem, coefficients(problem), cp_model.CpModel()
        L = max(problem.layers, 1)
        # The time unit resolves the cheapest plan's micro-batch to TIME_STEPS units, so that
        # a node's time, not only a layer's, survives the rounding to integers.
        one = sum(min(r["time"] for r in rows) * (L if v.section == "block" else 1)
                  for rows, v in zip(self.co.cand, problem.groups))
        self.tu = max(one, 1e-9) / TIME_STEPS
        self.mu = max(limit_bytes, 1.0) / 1e5
        self.limit = limit_bytes
        self.x = [[self.md.new_bool_var(f"x{g}_{c}") for c in range(len(v.cands))] for g, v in enumerate(problem.groups)]
        for row in self.x:
            self.md.add_exactly_one(row)
        self.z = {z: self.md.new_bool_var(f"zero{z}") for z in ZEROS}
        self.md.add_exactly_one(self.z.values())
        for z in ZEROS:
            if z not in zeros:
                self.md.add(self.z[z] == 0)

    def t(self, v: float) -> int:
        return int(round(v / self.tu))

    def m(self, v: float) -> int:
        return int(round(v / self.mu))

    def var(self, ub: float, name: str) -> cp_model.IntVar:
        return self.md.new_int_var(0, max(int(ub), 0), name)

    def lin(self, section: str, key: str, unit) -> tuple[cp_model.LinearExpr, int]:
        """sum of a candidate coefficient over a section's groups, and an upper bound."""
        terms, ub = [], 0
        for g, v in enumerate(self.p.groups):
            if v.section == section:
                vals = [unit(r[key]) for r in self.co.cand[g]]
                terms += [k * x for k, x in zip(vals, self.x[g]) if k]
                ub += max(vals)
        return sum(terms), ub

    def low(self, section: str, per_row: Callable[[dict[str, float]], int]) -> int:
        """A constant lower bound of a section sum: every group at its smallest coefficient."""
        return sum(min(per_row(r) for r in self.co.cand[g]) for g, v in enumerate(self.p.groups)
                   if v.section == section)

    def by_zero(self, section: str, name: str, per_zero) -> tuple[cp_model.IntVar, int]:
        """A variable >= the section's sum of `per_zero(row, z)` for the selected ZeRO stage."""
        exprs, ub = {}, 0
        for z in ZEROS:
            terms, top = [], 0
            for g, v in enumerate(self.p.groups):
                if v.section == section:
                    vals = [per_zero(r, z) for r in self.co.cand[g]]
                    terms += [k * x for k, x in zip(vals, self.x[g]) if k]
                    top += max(vals)
            exprs[z], ub = sum(terms), max(ub, top)
        var = self.var(ub, f"{section}_{name}")
        for z in ZEROS:
            self.md.add(var >= exprs[z]).OnlyEnforceIf(self.z[z])
        return var, ub


def _state_units(model: _Model, per_param: float, row: dict[str, float]) -> int:
    return model.m(per_param * row["numel"])


def solve(problem: Problem, limit_bytes: float, time_limit: float, seed: int = 0, workers: int = 1,
          hint: Assignment | None = None, zeros: tuple[int, ...] = ZEROS,
          recomputes: tuple[int, ...] = (0, 1, 2)) -> SolveResult:
    """Build and solve the model; `hint` warm-starts it (a grid plan or a saved plan)."""
    M = _Model(problem, limit_bytes, zeros)
    md, co, x = M.md, M.co, M.x
    p, m, L = problem.shape.pp, problem.micro_batches, problem.layers
    # Edges: a boolean per class pair; forward costs to the consumer's section, gradients per share.
    y = []
    sec: dict[str, dict[str, list]] = {s: {"time": [], "fwd": [], "core": []} for s in SECTIONS}
    ub_t = {s: 0 for s in SECTIONS}
    for i, e in enumerate(problem.edges):
        na, nb = len(e.prod_info), len(e.cons_grad)
        yy = [[md.new_bool_var(f"y{i}_{a}_{b}") for b in range(nb)] for a in range(na)]
        for a in range(na):
            md.add(sum(yy[a]) == sum(x[e.producer][c] for c, k in enumerate(e.prod_class) if k == a))
        for b in range(nb):
            md.add(sum(yy[a][b] for a in range(na)) == sum(x[e.consumer][c] for c, k in enumerate(e.cons_class) if k == b))
        y.append(yy)
        fsec = EDGE_SECTION[e.kind][0]
        for a in range(na):
            for b in range(nb):
                sec[fsec]["time"].append(M.t(co.edge_fwd[i][a][b]) * yy[a][b])
                sec[fsec]["fwd"].append(M.t(e.fwd_s(a, b)) * yy[a][b])
                if e.core:
                    sec[fsec]["core"].append(M.t(e.fwd_s(a, b)) * yy[a][b])
        ub_t[fsec] += max(M.t(v) for row in co.edge_fwd[i] for v in row)
    for share_index, ids in enumerate(problem.shares):
        gsec = EDGE_SECTION[problem.edges[ids[0]].kind][1]
        top = max(M.t(v) for i in ids for row in co.edge_grad[i] for v in row)
        share = M.var(top, f"share{share_index}")
        for i in ids:
            md.add(share >= sum(M.t(co.edge_grad[i][a][b]) * y[i][a][b]
                                for a in range(len(y[i])) for b in range(len(y[i][a]))))
        sec[gsec]["time"].append(share)
        ub_t[gsec] += top
    S: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        d: dict[str, Any] = {}
        for key in CAND_KEYS:
            d[key], d[key + "_ub"] = M.lin(section, key, M.t if key in TIME_KEYS else M.m)
        for key in ("time", "fwd", "core"):
            d[key] = d[key] + sum(sec[section][key])
            d[key + "_ub"] += ub_t[section]
        d["work_ub"] = max([M.m(r["transient"]) for g, v in enumerate(problem.groups) if v.section == section
                            for r in co.cand[g]] or [0])
        work = M.var(d["work_ub"], f"{section}_working")
        for g, v in enumerate(problem.groups):
            if v.section == section:
                md.add(work >= sum(M.m(r["transient"]) * xx for r, xx in zip(co.cand[g], x[g])))
        d["work"] = work
        d["sync"], d["sync_ub"] = M.by_zero(section, "sync", lambda r, z: M.t(co.rate[z] * r["gbytes"]))
        d["state"], d["state_ub"] = M.by_zero(section, "state", lambda r, z: M.m(co.state[z] * r["numel"]))
        d["after"], d["after_ub"] = M.by_zero(
            section, "after", lambda r, z: M.t(r["numel"] * (co.optimizer[z] + co.gather[z][1] * co.w_elem)))
        d["buf"], d["buf_ub"] = M.lin(section, "numel", lambda v: M.m(2 * v * co.w_elem))
        d["pbytes"], d["pbytes_ub"] = d["buf"], d["buf_ub"]  # twice a layer'section weights, in memory units
        numel_ub = sum(max(r["numel"] for r in co.cand[g]) for g, v in enumerate(problem.groups) if v.section == section)
        ag_ub = M.t(co.zero3[0]) + M.t(co.zero3[1] * co.w_elem * numel_ub) + 1
        d["z3_ub"] = 2 * ag_ub
        z3 = M.var(d["z3_ub"], f"{section}_z3")
        if 3 in zeros and co.zero3[1] > 0:
            ag = M.t(co.zero3[0]) + sum(M.t(co.zero3[1] * co.w_elem * r["numel"]) * xx
                                        for g, v in enumerate(problem.groups) if v.section == section
                                        for r, xx in zip(co.cand[g], x[g]))
            zf, zb = M.var(ag_ub, f"{section}_z3f"), M.var(ag_ub, f"{section}_z3b")
            md.add(zf >= ag - d["cfwd"]).OnlyEnforceIf(M.z[3])
            md.add(zb >= ag - d["cbwd"]).OnlyEnforceIf(M.z[3])
            md.add(z3 == zf + zb)
        else:
            md.add(z3 == 0)
        d["z3"] = z3
        S[section] = d
    send_expr: Any = 0
    send_ub = 0
    if p > 1:
        for g in range(len(problem.groups)):
            vals = [M.t(s) for s in co.send[g]]
            send_expr += sum(k * xx for k, xx in zip(vals, x[g]) if k)
            send_ub += max(vals)
    blk, pre, post = S["block"], S["pre"], S["post"]
    tl_ub = blk["time_ub"] + blk["fwd_ub"] + blk["z3_ub"] + 1
    counts = []
    if L > 0:
        tl = [M.var(tl_ub, f"layer_time_{r}") for r in range(3)]
        md.add(tl[0] == blk["time"] + blk["z3"])
        md.add(tl[1] == blk["time"] + blk["z3"] + blk["core"])
        md.add(tl[2] == blk["time"] + blk["z3"] + blk["fwd"])
        act_ub = blk["saved_ub"] + blk["inputs_ub"] + 1
        act = [M.var(act_ub, f"act_{r}") for r in range(3)]
        md.add(act[0] == blk["saved"])
        md.add(act[1] == blk["saved"] - blk["saved_core"])
        md.add(act[2] == blk["inputs"])
        fwd_blk = M.var(blk["fwd_ub"], "block_fwd")
        md.add(fwd_blk == blk["fwd"])
        core_saved = M.var(blk["saved_core_ub"], "block_saved_core")
        md.add(core_saved == blk["saved_core"])
        other_blk = M.var(blk["other_ub"], "block_other")
        md.add(other_blk == blk["other"])
        to_t, to_m = M.t, M.m
        low_tl = [M.low("block", lambda r: to_t(r["time"])), M.low("block", lambda r: to_t(r["time"]) + to_t(r["core"])),
                  M.low("block", lambda r: to_t(r["time"]) + to_t(r["fwd"]))]
        low_act = [M.low("block", lambda r: to_m(r["saved"])),
                   M.low("block", lambda r: to_m(r["saved"]) - to_m(r["saved_core"])),
                   M.low("block", lambda r: to_m(r["inputs"]))]
        low_fwd = M.low("block", lambda r: to_t(r["fwd"]))
        low_state = min(M.low("block", partial(_state_units, M, co.state[z])) for z in zeros)
    tail = M.var(max(M.t(t) for t in co.tail), "tail")
    for z in ZEROS:
        md.add(tail == M.t(co.tail[z])).OnlyEnforceIf(M.z[z])
    gather_alpha = sum(M.t(co.gather[z][0]) * M.z[z] for z in ZEROS if co.gather[z][0])
    stage_times, exposed, after = [], [], []
    block_terms: list = []
    horizon = (L * tl_ub + pre["time_ub"] + post["time_ub"] + pre["z3_ub"] + post["z3_ub"] + 2 * send_ub + 1) * 2

    def prod(a, b, ub, name):
        v = M.var(ub, name)
        md.add_multiplication_equality(v, [a, b])
        return v

    for s in range(p):
        first, last = s == 0, s == p - 1
        k = [M.var(L, f"k{s}_{r}") for r in range(3)]
        for r in range(3):
            if r not in recomputes:
                md.add(k[r] == 0)
        n = M.var(L, f"n{s}")
        md.add(n >= (0 if (first or last or L == 0) else 1))
        md.add(sum(k) == n)
        counts.append((n, k))
        edge_sends = send_expr * ((not last) + (not first))
        pre_t = (pre["time"] + pre["z3"]) if first else 0
        post_t = (post["time"] + post["z3"]) if last else 0
        mem = []
        if L > 0:
            pt = [prod(k[r], tl[r], L * tl_ub, f"pt{s}_{r}") for r in range(3)]
            block_terms += pt
            pa = [prod(k[r], act[r], L * act_ub, f"pa{s}_{r}") for r in range(3)]
            nf = prod(n, fwd_blk, L * blk["fwd_ub"], f"nf{s}")
            nsync = prod(n, blk["sync"], L * blk["sync_ub"], f"nsync{s}")
            nstate = prod(n, blk["state"], L * blk["state_ub"], f"nstate{s}")
            nafter = prod(n, blk["after"], L * blk["after_ub"], f"nafter{s}")
            nbuf = prod(n, blk["buf"], L * blk["buf_ub"], f"nbuf{s}")
            nother = prod(n, other_blk, L * blk["other_ub"], f"nother{s}") if blk["other_ub"] else 0
            # Linear cuts the LP relaxation sees (it drops the products): a product of a count
            # and a block quantity is at least the count times the quantity's smallest value.
            for r in range(3):
                md.add(pt[r] >= low_tl[r] * k[r])
                md.add(pa[r] >= low_act[r] * k[r])
            md.add(nf >= low_fwd * n)
            md.add(nstate >= low_state * n)
            stage = sum(pt) + edge_sends + pre_t + post_t
            window = sum(pt) - nf + send_expr * (not first)
            f = in_flight("1f1b", p, s, m)
            mem += [nstate, f * sum(pa)]
            rw = M.var(act_ub, f"recompute_working{s}")
            has_full, has_sel = md.new_bool_var(f"full{s}"), md.new_bool_var(f"sel{s}")
            md.add(k[2] <= L * has_full)
            md.add(k[1] <= L * has_sel)
            md.add(rw >= act[0]).OnlyEnforceIf(has_full)
            md.add(rw >= core_saved).OnlyEnforceIf(has_sel)
            mem.append(rw)
            grad_sync, numel_mem, after_t = nsync, nbuf, nafter
        else:
            stage, window, nother = edge_sends + pre_t + post_t, 0, 0
            grad_sync, numel_mem, after_t = 0, 0, 0
        if first:
            window += pre["time"] + pre["z3"] - pre["fwd"]
            grad_sync += pre["sync"]
            numel_mem += pre["buf"]
            after_t += pre["after"]
            nother += pre["other"]
            mem += [pre["state"], in_flight("1f1b", p, s, m) * pre["saved"]]
        if last:
            window += post["time"] + post["z3"] - post["fwd"]
            grad_sync += post["sync"]
            numel_mem += post["buf"]
            after_t += post["after"]
            nother += post["other"]
            mem += [post["state"], in_flight("1f1b", p, s, m) * post["saved"]]
        stage_times.append(stage)
        ex = M.var(horizon, f"exposed{s}")
        md.add(ex >= grad_sync - window)
        md.add(ex >= tail + (pre["sync"] if first else 0))
        exposed.append(ex + nother)
        after.append(after_t + gather_alpha)
        work = M.var(max(S[t]["work_ub"] for t in SECTIONS), f"work{s}")
        md.add(work >= blk["work"])
        if first:
            md.add(work >= pre["work"])
        if last:
            md.add(work >= post["work"])
        mem.append(work)
        if co.buffer_cap:
            buf = M.var(M.m(co.buffer_cap), f"buffers{s}")
            capped = md.new_bool_var(f"capped{s}")
            md.add(buf >= M.m(co.buffer_cap)).OnlyEnforceIf(capped)
            md.add(buf >= numel_mem).OnlyEnforceIf(capped.Not())
            mem.append(buf)
            if 3 in zeros:
                big = M.var(max(S[t]["pbytes_ub"] for t in SECTIONS), f"zero3_buffer{s}")
                for t, on in (("block", True), ("pre", first), ("post", last)):
                    if on:
                        md.add(big >= S[t]["pbytes"]).OnlyEnforceIf(M.z[3])
                mem.append(big)
        md.add(sum(mem) <= M.m(limit_bytes))
    md.add(sum(n for n, _ in counts) == L)
    bottleneck = M.var(horizon, "bottleneck")
    for st in stage_times:
        md.add(bottleneck >= st)
    # Redundant, linear: every block costs at least TL_0, and the slowest stage at least the mean.
    if L > 0:
        md.add(sum(block_terms) >= L * tl[0])
    md.add(p * bottleneck >= sum(stage_times))
    worst_exposed = M.var(horizon * 4, "worst_exposed")
    for exposed_s in exposed:
        md.add(worst_exposed >= exposed_s)
    worst_after = M.var(horizon * 4, "worst_after")
    for af in after:
        md.add(worst_after >= af)
    md.minimize(sum(stage_times) + (m - 1) * bottleneck + worst_exposed + worst_after)
    if hint is not None:
        for g, c in enumerate(hint.choice):
            for cc in range(len(x[g])):
                md.add_hint(x[g][cc], cc == c)
        for z in ZEROS:
            md.add_hint(M.z[z], z == hint.zero)
        for (n, k), row in zip(counts, hint.stages):
            md.add_hint(n, sum(row))
            for r in range(3):
                md.add_hint(k[r], row[r])
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.random_seed = seed
    prm.num_workers = max(1, workers)
    prm.max_deterministic_time = max(time_limit, 0.01)
    prm.max_time_in_seconds = max(5 * time_limit, 2.0)  # a guard only: the budget is deterministic
    if workers > 1:
        prm.interleave_search = True
    status = solver.solve(md)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(None, name, float("inf"), solver.best_objective_bound * M.tu
                           if status != cp_model.INFEASIBLE else float("inf"), solver.wall_time,
                           solver.deterministic_time)
    choice = tuple(next(c for c, var in enumerate(row) if solver.value(var)) for row in x)
    stages = tuple(tuple(solver.value(k[r]) for r in range(3)) for _, k in counts)
    zero = next(z for z in ZEROS if solver.value(M.z[z]))
    # The plan's own linearised objective: a FEASIBLE answer may leave slack in the auxiliary
    # maxima, and the integer model rounds; `objective` is what the plan is worth.
    value = objective(problem, choice, stages, zero).step_time_s
    return SolveResult(Assignment(choice, stages, zero), name, value,
                       min(solver.best_objective_bound * M.tu, value), solver.wall_time, solver.deterministic_time)
