"""The CP-SAT model of one mesh shape and micro-batch size (OR-Tools).

Variables (`shardc.search.sections`): a boolean per (group, candidate), the block's groups once
per stage class, so that stages partition their blocks differently; per edge, booleans per
layout class pair; per pipeline stage, block counts under each recomputation; one ZeRO stage.
The objective and the memory constraints are `shardc.search.linear.objective`'s formulas (the
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
from functools import partial
from typing import Any

from ortools.sat.python import cp_model

from shardc.cost.memory import in_flight
from shardc.ir import ZERO_STAGES
from shardc.search.evaluate import Assignment, per_stage
from shardc.search.linear import objective
from shardc.search.problem import Problem
from shardc.search.sections import STAGE_CLASSES, Model, cand_sum, edges, section, stage_classes

SECTIONS = ("pre", "block", "post")
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


def _state_units(model: Model, per_param: float, row: dict[str, float]) -> int:
    return model.m(per_param * row["numel"])


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
    p, m, L = problem.shape.pp, problem.micro_batches, problem.layers
    classes = stage_classes(p, max(1, stage_limit)) if L > 0 else [0] * p
    K = max(classes) + 1
    M = Model(problem, limit_bytes, zeros, K)
    md, co = M.md, M.co
    sec, ub_t, cross = edges(M, classes)
    pre = section(M, "pre", 0, sec["pre"], ub_t["pre"], zeros)
    post = section(M, "post", 0, sec["post"], ub_t["post"], zeros)
    blks = [section(M, "block", k, sec[f"block{k}"], ub_t[f"block{k}"], zeros) for k in range(K)]
    send_ub = max(b["send_ub"] for b in blks)
    tl_ub = max(b["time_ub"] + b["fwd_ub"] + b["z3_ub"] for b in blks) + 1
    act_ub = max(b["saved_ub"] + b["inputs_ub"] for b in blks) + 1
    cross_ub = sum(ub_t[f"block{k}"] for k in range(K)) + 1
    counts = []
    tl: list[list[Any]] = []
    act: list[list[Any]] = []
    agg: list[dict[str, Any]] = []
    if L > 0:
        for j, blk in enumerate(blks):
            t_k = [M.var(tl_ub, f"layer_time{j}_{r}") for r in range(3)]
            md.add(t_k[0] == blk["time"] + blk["z3"])
            md.add(t_k[1] == blk["time"] + blk["z3"] + blk["core"])
            md.add(t_k[2] == blk["time"] + blk["z3"] + blk["fwd"])
            a_k = [M.var(act_ub, f"act{j}_{r}") for r in range(3)]
            md.add(a_k[0] == blk["saved"])
            md.add(a_k[1] == blk["saved"] - blk["saved_core"])
            md.add(a_k[2] == blk["inputs"])
            tl.append(t_k)
            act.append(a_k)
            one = {}
            for key in ("fwd", "saved_core", "other"):
                one[key] = M.var(blk[key + "_ub"], f"block{j}_{key}")
                md.add(one[key] == blk[key])
            agg.append(one)
        to_t, to_m = M.t, M.m
        low_tl = [M.low("block", lambda r: to_t(r["time"])), M.low("block", lambda r: to_t(r["time"]) + to_t(r["core"])),
                  M.low("block", lambda r: to_t(r["time"]) + to_t(r["fwd"]))]
        low_act = [M.low("block", lambda r: to_m(r["saved"])),
                   M.low("block", lambda r: to_m(r["saved"]) - to_m(r["saved_core"])),
                   M.low("block", lambda r: to_m(r["inputs"]))]
        low_fwd = M.low("block", lambda r: to_t(r["fwd"]))
        low_state = min(M.low("block", partial(_state_units, M, co.state[z])) for z in zeros)
        low_buf = M.low("block", lambda r: to_m(2 * r["numel"] * co.w_elem))
        low_grad = M.low("block", lambda r: to_m(r["gbytes"]))
        low_sync = min(M.low("block", lambda r, z=z: to_t((co.serial[z][1] if co.fsdp[z] else co.rate[z]) * r["gbytes"]))
                       for z in zeros)
        low_after = min(M.low("block", lambda r, z=z: to_t(r["numel"] * (co.optimizer[z] + co.gather[z][1] * co.w_elem)))
                        for z in zeros)
    tail = M.var(max(M.t(t) for t in co.tail), "tail")
    for z in ZERO_STAGES:
        md.add(tail == M.t(co.tail[z])).OnlyEnforceIf(M.z[z])
    gather_alpha = sum(M.t(co.gather[z][0]) * M.z[z] for z in ZERO_STAGES if co.gather[z][0])
    serial = md.new_bool_var("fsdp")  # the ZeRO stage runs as FSDP2 (`Coefficients.fsdp`)
    md.add(serial == sum(M.z[z] for z in ZERO_STAGES if co.fsdp[z]))
    serial_alpha = sum(M.t(co.serial[z][0]) * M.z[z] for z in ZERO_STAGES if co.fsdp[z])
    bucketed = md.new_bool_var("bucketed")  # ZeRO 1-3 as textbook ZeRO (two gradient buckets)
    md.add(bucketed == sum(M.z[z] for z in ZERO_STAGES if z >= 1 and not co.fsdp[z]))
    stage_times, exposed, after = [], [], []
    block_terms: list[Any] = []
    horizon = (L * tl_ub + pre["time_ub"] + post["time_ub"] + pre["z3_ub"] + post["z3_ub"] + 2 * send_ub
               + 2 * cross_ub + 1) * 2

    def prod(a, b, ub, name):
        v = M.var(ub, name)
        md.add_multiplication_equality(v, [a, b])
        return v

    for s in range(p):
        first, last = s == 0, s == p - 1
        c = classes[s]
        blk = blks[c]
        k = [M.var(L, f"k{s}_{r}") for r in range(3)]
        for r in range(3):
            if r not in recomputes:
                md.add(k[r] == 0)
        n = M.var(L, f"n{s}")
        md.add(n >= (0 if (first or last or L == 0) else 1))
        md.add(sum(k) == n)
        counts.append((n, k))
        edge_sends = (blk["send"] if not last else 0) + (blks[classes[s - 1]]["send"] if not first else 0)
        pre_t = (pre["time"] + pre["z3"]) if first else 0
        post_t = (post["time"] + post["z3"]) if last else 0
        cross_t: Any = 0
        cross_w: Any = 0
        if s in cross:
            cross_t += cross[s][0]
            cross_w += cross[s][0] - cross[s][1]
        if s + 1 in cross:
            cross_t += cross[s + 1][2]
            cross_w += cross[s + 1][2]
        mem = []
        if L > 0:
            pt = [prod(k[r], tl[c][r], L * tl_ub, f"pt{s}_{r}") for r in range(3)]
            block_terms += pt
            pa = [prod(k[r], act[c][r], L * act_ub, f"pa{s}_{r}") for r in range(3)]
            nf = prod(n, agg[c]["fwd"], L * blk["fwd_ub"], f"nf{s}")
            nsync = prod(n, blk["sync"], L * blk["sync_ub"], f"nsync{s}")
            nstate = prod(n, blk["state"], L * blk["state_ub"], f"nstate{s}")
            nafter = prod(n, blk["after"], L * blk["after_ub"], f"nafter{s}")
            nbuf = prod(n, blk["buf"], L * blk["buf_ub"], f"nbuf{s}")
            ngrad = prod(n, blk["gmem"], L * blk["gmem_ub"], f"ngrad{s}") if co.buffer_cap else 0
            nother = prod(n, agg[c]["other"], L * blk["other_ub"], f"nother{s}") if blk["other_ub"] else 0
            # Linear cuts the LP relaxation sees (it drops the products): a product of a count
            # and a block quantity is at least the count times the quantity's smallest value.
            for r in range(3):
                md.add(pt[r] >= low_tl[r] * k[r])
                md.add(pa[r] >= low_act[r] * k[r])
            md.add(nf >= low_fwd * n)
            md.add(nstate >= low_state * n)
            md.add(nbuf >= low_buf * n)
            md.add(nsync >= low_sync * n)
            md.add(nafter >= low_after * n)
            if co.buffer_cap:
                md.add(ngrad >= low_grad * n)
            stage = sum(pt) + edge_sends + pre_t + post_t + cross_t
            window = sum(pt) - nf + (blks[classes[s - 1]]["send"] if not first else 0) + cross_w
            f = in_flight("1f1b", p, s, m)
            mem += [nstate, f * sum(pa)]
            rw = M.var(act_ub, f"recompute_working{s}")
            has_full, has_sel = md.new_bool_var(f"full{s}"), md.new_bool_var(f"sel{s}")
            md.add(k[2] <= L * has_full)
            md.add(k[1] <= L * has_sel)
            md.add(rw >= act[c][0]).OnlyEnforceIf(has_full)
            md.add(rw >= agg[c]["saved_core"]).OnlyEnforceIf(has_sel)
            mem.append(rw)
            grad_sync, numel_mem, after_t, grad_mem = nsync, nbuf, nafter, ngrad
        else:
            stage, window, nother = edge_sends + pre_t + post_t, 0, 0
            grad_sync, numel_mem, after_t, grad_mem = 0, 0, 0, 0
        for on, part in ((first, pre), (last, post)):
            if on:
                window += part["time"] + part["z3"] - part["fwd"]
                grad_sync += part["sync"]
                numel_mem += part["buf"]
                grad_mem += part["gmem"]
                after_t += part["after"]
                nother += part["other"]
                mem += [part["state"], in_flight("1f1b", p, s, m) * part["saved"]]
        stage_times.append(stage)
        ex = M.var(horizon, f"exposed{s}")
        md.add(ex >= grad_sync - window).OnlyEnforceIf(serial.Not())
        md.add(ex >= grad_sync + serial_alpha).OnlyEnforceIf(serial)  # FSDP2: one collective after backward
        md.add(ex >= tail + (pre["sync"] if first else 0))
        exposed.append(ex + nother)
        after.append(after_t + gather_alpha)
        work = M.var(max(b["work_ub"] for b in (pre, post, *blks)), f"work{s}")
        md.add(work >= blk["work"])
        if first:
            md.add(work >= pre["work"])
        if last:
            md.add(work >= post["work"])
        mem.append(work)
        if co.buffer_cap:
            # DDP: a flat copy of the gradients; textbook ZeRO: two buckets (or all the gradients
            # when fewer); FSDP2: every weight of the stage, gathered twice over at the peak.
            buf = M.var(M.m(co.buffer_cap) + 10 * M.m(limit_bytes), f"buffers{s}")
            capped = md.new_bool_var(f"capped{s}")
            md.add(buf >= grad_mem).OnlyEnforceIf(M.z[0])
            md.add(buf >= numel_mem).OnlyEnforceIf(serial)
            md.add(buf >= M.m(co.buffer_cap)).OnlyEnforceIf([bucketed, capped])
            md.add(buf >= 2 * grad_mem).OnlyEnforceIf([bucketed, capped.Not()])
            mem.append(buf)
            if 3 in zeros and not co.fsdp[3]:
                big = M.var(max(b["pbytes_ub"] for b in (pre, post, *blks)), f"zero3_buffer{s}")
                for part, on in ((blk, True), (pre, first), (post, last)):
                    if on:
                        md.add(big >= part["pbytes"]).OnlyEnforceIf(M.z[3])
                mem.append(big)
        if co.pipeline_buffers:  # torch pipelining: m received, m + in flight sent (or m outputs)
            f = in_flight("1f1b", p, s, m)
            if not first:
                mem.append(cand_sum(M, "block", classes[s - 1], lambda g, c_: co.send_bytes[g][c_], lambda v: M.m(m * v)))
            if not last:
                mem.append(cand_sum(M, "block", c, lambda g, c_: co.send_bytes[g][c_], lambda v, f=f: M.m((m + f) * v)))
            else:
                mem.append(cand_sum(M, "post", 0, lambda g, c_: co.out_bytes[g][c_], lambda v: M.m(m * v))
                           + M.m(m * co.out_const))
        md.add(sum(mem) <= M.m(limit_bytes))
    md.add(sum(n for n, _ in counts) == L)
    _tie_empty_ends(M, classes, counts)
    bottleneck = M.var(horizon, "bottleneck")
    for st in stage_times:
        md.add(bottleneck >= st)
    # Redundant, linear: every block costs at least its class's TL_0 (so at least the smallest
    # of them), the slowest stage holds at least ceil(L / p) blocks of the cheapest time, and
    # is at least the mean stage. The first is what lets the relaxation see the chosen block
    # time behind the products.
    if L > 0:
        if K == 1:
            md.add(sum(block_terms) >= L * tl[0][0])
        else:
            cheapest = M.var(tl_ub, "cheapest_block")
            md.add_min_equality(cheapest, [t_k[0] for t_k in tl])
            md.add(sum(block_terms) >= L * cheapest)
    if L > 0 and p > 1:
        md.add(bottleneck >= -(-L // p) * low_tl[0])
    md.add(p * bottleneck >= sum(stage_times))
    worst_exposed = M.var(horizon * 4, "worst_exposed")
    for exposed_s in exposed:
        md.add(worst_exposed >= exposed_s)
    worst_after = M.var(horizon * 4, "worst_after")
    for af in after:
        md.add(worst_after >= af)
    goal = sum(stage_times) + (m - 1) * bottleneck + worst_exposed + worst_after
    if cutoff is not None:
        md.add(goal <= int(cutoff / M.tu * (1 + 1e-3)))  # rounding slack: the cut-off plan itself stays feasible
    md.minimize(goal)
    if hint is not None:
        _hint(M, classes, counts, hint)
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
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveResult(None, name, float("inf"), solver.best_objective_bound * M.tu
                           if status != cp_model.INFEASIBLE else float("inf"), solver.wall_time,
                           solver.deterministic_time)
    per_class = [tuple(next(c for c, var in enumerate(row) if solver.value(var)) for row in M.xs[k]) for k in range(K)]
    stages = tuple(tuple(solver.value(k[r]) for r in range(3)) for _, k in counts)
    zero = next(z for z in ZERO_STAGES if solver.value(M.z[z]))
    a = per_stage(problem, per_class[classes[0]], [per_class[classes[s]] for s in range(p)], stages, zero)
    # The plan's own linearised objective: a FEASIBLE answer may leave slack in the auxiliary
    # maxima, and the integer model rounds; `objective` is what the plan is worth.
    value = objective(problem, a.choice, a.stages, a.zero, a.stage_choice).step_time_s
    return SolveResult(a, name, value, min(solver.best_objective_bound * M.tu, value), solver.wall_time,
                       solver.deterministic_time)


def _tie_empty_ends(M: Model, classes: list[int], counts: list) -> None:
    """A first (last) stage without blocks runs its neighbour's partitions: there is no stage
    boundary between them to price (`shardc.search.evaluate.per_stage` does the same)."""
    p = len(classes)
    blocks = [g for g, v in enumerate(M.p.groups) if v.section == "block"]
    for s, t in ((0, 1), (p - 1, p - 2)):
        if p < 2 or classes[s] == classes[t]:
            continue
        empty = M.md.new_bool_var(f"empty{s}")
        M.md.add(counts[s][0] == 0).OnlyEnforceIf(empty)
        M.md.add(counts[s][0] >= 1).OnlyEnforceIf(empty.Not())
        for g in blocks:
            for a, b in zip(M.xs[classes[s]][g], M.xs[classes[t]][g]):
                M.md.add(a == b).OnlyEnforceIf(empty)


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
