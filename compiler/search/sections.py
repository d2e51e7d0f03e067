"""The CP-SAT model's variables and section sums (`shardc.search.constraints` builds the stages
on them, `shardc.search.cpsat` solves).

Rules:
- Candidates: a boolean per (group, candidate). The prefix's and suffix's groups have one set;
  the block's groups have one set per stage class (`stage_classes`: stages of one class share
  their blocks' partitions), so stages can partition their blocks differently while the model
  stays at most `classes x block groups x candidates` booleans.
- Edges: a boolean per (produced layout class, required layout class) pair, tied to the two
  ends' candidates by transportation constraints, one set per place the edge occurs: the prefix
  and suffix edges once (`first` edges read by the first stage's class, `last` edges written by
  the last stage's), the block's own and `chain` edges once per class, and the `chain` edges
  once more per boundary between stages of different classes (producer in the earlier class).
- Per section (prefix, suffix, block of each class): sums of the chosen coefficients
  (`shardc.search.linear.CAND_KEYS`), edges included, in integer units: time in 1/50000 of the
  cheapest micro-batch pass, bytes in 1/100000 of the memory limit. A stage boundary adds to
  the later stage the chain forward across the two partitions less that within the later
  class, and to the earlier stage the chain gradient across less that within the earlier class
  (within-class gradients are then exact maxima, not upper bounds, so that the difference is).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ortools.sat.python import cp_model

from shardc.ir import ZERO_STAGES
from shardc.search.linear import CAND_KEYS, EDGE_SECTION, coefficients
from shardc.search.problem import Problem

TIME_STEPS = 5e4  # integer units in the cheapest micro-batch time
TIME_KEYS = ("time", "fwd", "core", "cfwd", "cbwd", "other")
STAGE_CLASSES = 4  # at most this many distinct block partitions over the pipeline stages


def stage_classes(stages: int, limit: int = STAGE_CLASSES) -> list[int]:
    """The class of every stage: each stage its own up to `limit` stages; beyond, the first and
    the last stage alone (the most activations in flight; the head and loss) and the middle
    stages in `limit - 2` contiguous runs of nearly equal length."""
    if stages <= limit:
        return list(range(stages))
    if limit <= 1:
        return [0] * stages
    if limit == 2:
        return [0] + [1] * (stages - 1)
    runs, mid = max(limit - 2, 1), stages - 2
    return [0] + [1 + j * runs // mid for j in range(mid)] + [runs + 1]


class Model:
    """The CP-SAT model under construction, with its unit conversions."""

    def __init__(self, problem: Problem, limit_bytes: float, zeros: tuple[int, ...], classes: int) -> None:
        self.p, self.co, self.md = problem, coefficients(problem), cp_model.CpModel()
        L = max(problem.layers, 1)
        one = sum(min(r["time"] for r in rows) * (L if v.section == "block" else 1)
                  for rows, v in zip(self.co.cand, problem.groups))
        self.tu = max(one, 1e-9) / TIME_STEPS
        self.mu = max(limit_bytes, 1.0) / 1e5
        self.classes = classes
        shared = {g: [self.md.new_bool_var(f"x{g}_{c}") for c in range(len(v.cands))]
                  for g, v in enumerate(problem.groups) if v.section != "block"}
        self.xs = [[shared[g] if g in shared else [self.md.new_bool_var(f"x{k}_{g}_{c}") for c in range(len(v.cands))]
                    for g, v in enumerate(problem.groups)] for k in range(classes)]
        for k, rows in enumerate(self.xs):
            for g, row in enumerate(rows):
                if k == 0 or g not in shared:
                    self.md.add_exactly_one(row)
        self.z = {z: self.md.new_bool_var(f"zero{z}") for z in ZERO_STAGES}
        self.md.add_exactly_one(self.z.values())
        for z in ZERO_STAGES:
            if z not in zeros:
                self.md.add(self.z[z] == 0)

    def t(self, v: float) -> int:
        return int(round(v / self.tu))

    def m(self, v: float) -> int:
        return int(round(v / self.mu))

    def var(self, ub: float, name: str) -> cp_model.IntVar:
        return self.md.new_int_var(0, max(int(ub), 0), name)

    def lin(self, section: str, key: str, unit, k: int = 0) -> tuple[cp_model.LinearExpr, int]:
        """sum of a candidate coefficient over a section's groups (class `k`), and an upper bound."""
        terms, ub = [], 0
        for g, v in enumerate(self.p.groups):
            if v.section == section:
                vals = [unit(r[key]) for r in self.co.cand[g]]
                terms += [c * x for c, x in zip(vals, self.xs[k][g]) if c]
                ub += max(vals)
        return sum(terms), ub

    def low(self, section: str, per_row: Callable[[dict[str, float]], int]) -> int:
        """A constant lower bound of a section sum: every group at its smallest coefficient."""
        return sum(min(per_row(r) for r in self.co.cand[g]) for g, v in enumerate(self.p.groups)
                   if v.section == section)

    def by_zero(self, section: str, name: str, per_zero, k: int = 0) -> tuple[cp_model.IntVar, int]:
        """A variable >= the section's sum of `per_zero(row, z)` for the selected ZeRO stage."""
        exprs, ub = {}, 0
        for z in ZERO_STAGES:
            terms, top = [], 0
            for g, v in enumerate(self.p.groups):
                if v.section == section:
                    vals = [per_zero(r, z) for r in self.co.cand[g]]
                    terms += [c * x for c, x in zip(vals, self.xs[k][g]) if c]
                    top += max(vals)
            exprs[z], ub = sum(terms), max(ub, top)
        var = self.var(ub, f"{section}{k}_{name}")
        for z in ZERO_STAGES:
            self.md.add(var >= exprs[z]).OnlyEnforceIf(self.z[z])
        return var, ub

    def pairs(self, i: int, kp: int, kc: int, tag: str) -> list[list[Any]]:
        """The class-pair booleans of edge `i`, producer in class `kp`, consumer in `kc`."""
        e, md = self.p.edges[i], self.md
        xp, xc = self.xs[kp][e.producer], self.xs[kc][e.consumer]
        na, nb = len(e.prod_info), len(e.cons_grad)
        yy = [[md.new_bool_var(f"y{tag}_{i}_{a}_{b}") for b in range(nb)] for a in range(na)]
        for a in range(na):
            md.add(sum(yy[a]) == sum(xp[c] for c, k in enumerate(e.prod_class) if k == a))
        for b in range(nb):
            md.add(sum(yy[a][b] for a in range(na)) == sum(xc[c] for c, k in enumerate(e.cons_class) if k == b))
        return yy


def cand_sum(M: Model, section: str, k: int, value: Callable[[int, int], float], unit) -> Any:
    """The sum over a section's groups (class `k`) of `unit(value(group, candidate))` chosen."""
    return sum(unit(value(g, c)) * x for g, v in enumerate(M.p.groups) if v.section == section
               for c, x in enumerate(M.xs[k][g]) if unit(value(g, c)))


def _sum(coef: list[list[float]], yy: list[list[Any]], unit) -> Any:
    return sum(unit(coef[a][b]) * yy[a][b] for a in range(len(yy)) for b in range(len(yy[a])) if unit(coef[a][b]))


def edges(M: Model, classes: list[int]) -> tuple[dict[str, dict[str, list]], dict[str, int], dict[int, tuple]]:
    """Edge and gradient terms per section key (`pre`, `post`, `block0`...), their upper bounds,
    and per stage boundary s (between stages s-1 and s of different classes) the forward
    (time, pure forward) into stage s and the gradient out of stage s-1 it adds."""
    p, co = M.p, M.co
    K = M.classes
    keys = ["pre", "post"] + [f"block{k}" for k in range(K)]
    sec: dict[str, dict[str, list]] = {s: {"time": [], "fwd": [], "core": [], "saved": [], "saved_core": [],
                                           "saved_top": []} for s in keys}
    ub = dict.fromkeys(keys, 0)
    cuts = [s for s in range(1, len(classes)) if classes[s] != classes[s - 1]]
    y: dict[tuple[int, str], list[list[Any]]] = {}
    for i, e in enumerate(p.edges):
        if e.kind in ("block", "chain"):
            places = [(k, k, f"block{k}", f"c{k}") for k in range(K)]
        else:
            kp = classes[-1] if e.kind == "last" else 0
            kc = classes[0] if e.kind == "first" else 0
            places = [(kp, kc, EDGE_SECTION[e.kind][0], "")]
        top = max(M.t(v) for row in co.edge_fwd[i] for v in row)
        for kp, kc, where, tag in places:
            yy = y[(i, tag)] = M.pairs(i, kp, kc, tag)
            sec[where]["time"].append(_sum(co.edge_fwd[i], yy, M.t))
            fwd = _sum([[e.fwd_s(a, b) for b in range(len(yy[a]))] for a in range(len(yy))], yy, M.t)
            sec[where]["fwd"].append(fwd)
            if e.core:
                sec[where]["core"].append(fwd)
            ub[where] += top
            top_m = max(M.m(v) for row in co.edge_saved[i] for v in row)
            if top_m:  # the gathered copy a later consumer saves (`linear._edge_saved`)
                saved = _sum(co.edge_saved[i], yy, M.m)
                sec[where]["saved"].append(saved)
                sec[where]["saved_top"].append(top_m)
                if e.core:
                    sec[where]["saved_core"].append(saved)
            if any(M.m(v) for row in co.edge_root[i] for v in row):  # at the producer's layout (`linear._edge_root`)
                root = _sum(co.edge_root[i], yy, M.m)
                sec[where]["saved"].append(root)
                sec[where]["saved_top"].append(max(0, max(M.m(v) for row in co.edge_root[i] for v in row)))
                if co.edge_root_core[i]:
                    sec[where]["saved_core"].append(root)
        if e.kind == "chain":
            for s in cuts:
                y[(i, f"b{s}")] = M.pairs(i, classes[s - 1], classes[s], f"b{s}")
    cross: dict[int, tuple] = {s: (0, 0, 0) for s in cuts}
    for i, e in enumerate(p.edges):
        if e.kind == "chain":
            for s in cuts:
                fwd_t, pure, grad = cross[s]
                within, across = y[(i, f"c{classes[s]}")], y[(i, f"b{s}")]
                pure_c = [[e.fwd_s(a, b) for b in range(len(within[a]))] for a in range(len(within))]
                cross[s] = (fwd_t + _sum(co.edge_fwd[i], across, M.t) - _sum(co.edge_fwd[i], within, M.t),
                            pure + _sum(pure_c, across, M.t) - _sum(pure_c, within, M.t), grad)
    for n, ids in enumerate(p.shares):
        kind = p.edges[ids[0]].kind
        top = max(M.t(v) for i in ids for row in co.edge_grad[i] for v in row)
        if kind in ("block", "chain"):
            grad_places = [(f"block{k}", f"c{k}") for k in range(K)]
        else:
            grad_places = [(EDGE_SECTION[kind][1], "")]
        exact = kind == "chain" and bool(cuts)
        for where, tag in grad_places:
            share = _share(M, [_sum(co.edge_grad[i], y[(i, tag)], M.t) for i in ids], top, f"share{n}{tag}", exact)
            sec[where]["time"].append(share)
            ub[where] += top
            if exact:
                for s in cuts:
                    if f"c{classes[s - 1]}" == tag:
                        fwd_t, pure, grad = cross[s]
                        cross[s] = (fwd_t, pure, grad - share)
        if kind == "chain":
            for s in cuts:
                fwd_t, pure, grad = cross[s]
                across = _share(M, [_sum(co.edge_grad[i], y[(i, f"b{s}")], M.t) for i in ids], top,
                                f"share{n}b{s}", False)
                cross[s] = (fwd_t, pure, grad + across)
    return sec, ub, cross


def _share(M: Model, exprs: list[Any], top: int, name: str, exact: bool) -> Any:
    """The largest of `exprs` (an upper bound the objective pushes down; `exact`: equal to it)."""
    share = M.var(top, name)
    if exact:
        parts = []
        for j, ex in enumerate(exprs):
            v = M.var(top, f"{name}_{j}")
            M.md.add(v == ex)
            parts.append(v)
        M.md.add_max_equality(share, parts)
    else:
        for ex in exprs:
            M.md.add(share >= ex)
    return share


def section(M: Model, name: str, k: int, sec: dict[str, list], ub_t: int, zeros: tuple[int, ...]) -> dict[str, Any]:
    """A section's sums (class `k` for the block) with their upper bounds, working memory, the
    gradient sync, model states, optimizer and ZeRO gathers for the selected ZeRO stage."""
    md, co, p = M.md, M.co, M.p
    x = M.xs[k]
    d: dict[str, Any] = {}
    for key in CAND_KEYS:
        d[key], d[key + "_ub"] = M.lin(name, key, M.t if key in TIME_KEYS else M.m, k)
    for key in ("time", "fwd", "core"):
        d[key] = d[key] + sum(sec[key])
        d[key + "_ub"] += ub_t
    for key in ("saved", "saved_core"):
        d[key] = d[key] + sum(sec[key])
        d[key + "_ub"] += sum(sec["saved_top"])
    mine = [g for g, v in enumerate(p.groups) if v.section == name]
    d["work_ub"] = max([M.m(r["transient"]) for g in mine for r in co.cand[g]] or [0])
    work = M.var(d["work_ub"], f"{name}{k}_working")
    for g in mine:
        md.add(work >= sum(M.m(r["transient"]) * xx for r, xx in zip(co.cand[g], x[g])))
    d["work"] = work
    d["sync"], d["sync_ub"] = M.by_zero(
        name, "sync", lambda r, z: M.t((co.serial[z][1] if co.serial_sync[z] else co.rate[z]) * r["gbytes"]), k)
    d["state"], d["state_ub"] = M.by_zero(name, "state", lambda r, z: M.m(co.state[z] * r["numel"]), k)
    d["after"], d["after_ub"] = M.by_zero(
        name, "after", lambda r, z: M.t(r["numel"] * (co.optimizer[z] + co.gather[z][1] * co.w_elem)), k)
    d["buf"], d["buf_ub"] = M.lin(name, "numel", lambda v: M.m(co.fsdp_buf * v * co.w_elem), k)
    d["gmem"], d["gmem_ub"] = M.lin(name, "gbytes", M.m, k)
    d["pbytes"], d["pbytes_ub"] = d["buf"], d["buf_ub"]  # twice a layer's weights, in memory units
    if co.fsdp_buf != 2:
        d["pbytes"], d["pbytes_ub"] = M.lin(name, "numel", lambda v: M.m(2 * v * co.w_elem), k)
    numel_ub = sum(max(r["numel"] for r in co.cand[g]) for g in mine)
    ag_ub = M.t(co.zero3[0]) + M.t(co.zero3[1] * co.w_elem * numel_ub) + 1
    d["z3_ub"] = 2 * ag_ub
    z3 = M.var(d["z3_ub"], f"{name}{k}_z3")
    if 3 in zeros and co.zero3[1] > 0:
        ag = M.t(co.zero3[0]) + sum(M.t(co.zero3[1] * co.w_elem * r["numel"]) * xx
                                    for g in mine for r, xx in zip(co.cand[g], x[g]))
        zf, zb = M.var(ag_ub, f"{name}{k}_z3f"), M.var(ag_ub, f"{name}{k}_z3b")
        md.add(zf >= ag - d["cfwd"]).OnlyEnforceIf(M.z[3])
        md.add(zb >= ag - d["cbwd"]).OnlyEnforceIf(M.z[3])
        md.add(z3 == zf + zb)
    else:
        md.add(z3 == 0)
    d["z3"] = z3
    send_expr: Any = 0
    send_ub = 0
    if p.shape.pp > 1 and name == "block":
        for g in mine:
            vals = [M.t(s) for s in co.send[g]]
            send_expr += sum(c * xx for c, xx in zip(vals, x[g]) if c)
            send_ub += max(vals)
    d["send"], d["send_ub"] = send_expr, send_ub
    return d
