"""The stage constraints and the objective of `shardc.search.cpsat`'s CP-SAT model.

`Builder` creates them on the variables and section sums of `shardc.search.sections`: per stage
class the block's time and activations under each recomputation, then per pipeline stage its
block counts, the products of counts and per-block quantities (with the linear cuts the LP
relaxation needs: a product is at least the count times the quantity's smallest value), the
stage time, the exposed gradient sync and the memory under the limit, then the step time the
model minimises (module docstring of `shardc.search.cpsat`). CP-SAT's search depends on the
order variables and constraints are created in: a fixed seed gives the same plan only while
that order stays, so new terms go after the existing ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from shardc.cost.memory import in_flight
from shardc.ir import ZERO_STAGES
from shardc.search.problem import Problem
from shardc.search.sections import Model, cand_sum, edges, section, stage_classes


def _state_units(model: Model, per_param: float, row: dict[str, float]) -> int:
    return model.m(per_param * row["numel"])


@dataclass
class _Stage:
    """One stage's terms while its constraints are built: time, the backward window that hides
    the gradient sync, memory terms, and the sums the sync and buffers are priced from."""

    time: Any
    window: Any = 0
    mem: list[Any] = field(default_factory=list)
    grad_sync: Any = 0
    numel_mem: Any = 0
    after: Any = 0
    grad_mem: Any = 0
    other: Any = 0


class Builder:
    """One CP-SAT model under construction: the sections, the per-class block terms and their
    lower bounds, then one `stage` at a time, then the `goal` (in that order: module docstring)."""

    def __init__(self, problem: Problem, limit_bytes: float, zeros: tuple[int, ...], recomputes: tuple[int, ...],
                 stage_limit: int) -> None:
        self.problem, self.limit_bytes, self.zeros, self.recomputes = problem, limit_bytes, zeros, recomputes
        self.p, self.m, self.L = problem.shape.pp, problem.micro_batches, problem.layers
        self.classes = stage_classes(self.p, max(1, stage_limit)) if self.L > 0 else [0] * self.p
        self.K = max(self.classes) + 1
        self.M = M = Model(problem, limit_bytes, zeros, self.K)
        sec, ub_t, self.cross = edges(M, self.classes)
        self.pre = section(M, "pre", 0, sec["pre"], ub_t["pre"], zeros)
        self.post = section(M, "post", 0, sec["post"], ub_t["post"], zeros)
        self.blks = [section(M, "block", k, sec[f"block{k}"], ub_t[f"block{k}"], zeros) for k in range(self.K)]
        self.send_ub = max(b["send_ub"] for b in self.blks)
        self.tl_ub = max(b["time_ub"] + b["fwd_ub"] + b["z3_ub"] for b in self.blks) + 1
        self.act_ub = max(b["saved_ub"] + b["inputs_ub"] for b in self.blks) + 1
        cross_ub = sum(ub_t[f"block{k}"] for k in range(self.K)) + 1
        self.counts: list[tuple[Any, list[Any]]] = []
        self.tl: list[list[Any]] = []
        self.act: list[list[Any]] = []
        self.agg: list[dict[str, Any]] = []
        if self.L > 0:
            self._block_classes()
            self._lower_bounds()
        self._zero_terms()
        self.stage_times: list[Any] = []
        self.exposed: list[Any] = []
        self.after: list[Any] = []
        self.block_terms: list[Any] = []
        pre, post = self.pre, self.post
        self.horizon = (self.L * self.tl_ub + pre["time_ub"] + post["time_ub"] + pre["z3_ub"] + post["z3_ub"]
                        + 2 * self.send_ub + 2 * cross_ub + 1) * 2

    def _block_classes(self) -> None:
        """Per stage class, one block's time and saved activations under each recomputation
        (none, selective, full) and its forward, core activations and other terms."""
        M, md = self.M, self.M.md
        for j, blk in enumerate(self.blks):
            t_k = [M.var(self.tl_ub, f"layer_time{j}_{r}") for r in range(3)]
            md.add(t_k[0] == blk["time"] + blk["z3"])
            md.add(t_k[1] == blk["time"] + blk["z3"] + blk["core"])
            md.add(t_k[2] == blk["time"] + blk["z3"] + blk["fwd"])
            a_k = [M.var(self.act_ub, f"act{j}_{r}") for r in range(3)]
            md.add(a_k[0] == blk["saved"])
            md.add(a_k[1] == blk["saved"] - blk["saved_core"])
            md.add(a_k[2] == blk["inputs"])
            self.tl.append(t_k)
            self.act.append(a_k)
            one = {}
            for key in ("fwd", "saved_core", "other"):
                one[key] = M.var(blk[key + "_ub"], f"block{j}_{key}")
                md.add(one[key] == blk[key])
            self.agg.append(one)

    def _lower_bounds(self) -> None:
        """The smallest value of each per-block quantity over the candidates (for the cuts)."""
        M, co, zeros = self.M, self.M.co, self.zeros
        to_t, to_m = M.t, M.m
        self.low_tl = [M.low("block", lambda r: to_t(r["time"])),
                       M.low("block", lambda r: to_t(r["time"]) + to_t(r["core"])),
                       M.low("block", lambda r: to_t(r["time"]) + to_t(r["fwd"]))]
        self.low_act = [M.low("block", lambda r: to_m(r["saved"])),
                        M.low("block", lambda r: to_m(r["saved"]) - to_m(r["saved_core"])),
                        M.low("block", lambda r: to_m(r["inputs"]))]
        self.low_fwd = M.low("block", lambda r: to_t(r["fwd"]))
        self.low_state = min(M.low("block", partial(_state_units, M, co.state[z])) for z in zeros)
        self.low_buf = M.low("block", lambda r: to_m(co.fsdp_buf * r["numel"] * co.w_elem))
        self.low_grad = M.low("block", lambda r: to_m(r["gbytes"]))

        def sync(z: int, r: dict[str, float]) -> int:
            return to_t((co.serial[z][1] if co.serial_sync[z] else co.rate[z]) * r["gbytes"])

        def after(z: int, r: dict[str, float]) -> int:
            return to_t(r["numel"] * (co.optimizer[z] + co.gather[z][1] * co.w_elem))

        self.low_sync = min(M.low("block", partial(sync, z)) for z in zeros)
        self.low_after = min(M.low("block", partial(after, z)) for z in zeros)

    def _zero_terms(self) -> None:
        """What the ZeRO stage adds: the optimizer tail, the gathers' latency, and whether it
        runs as FSDP2 (`Coefficients.fsdp`) or as textbook ZeRO with two gradient buckets."""
        M, md, co = self.M, self.M.md, self.M.co
        self.tail = M.var(max(M.t(t) for t in co.tail), "tail")
        for z in ZERO_STAGES:
            md.add(self.tail == M.t(co.tail[z])).OnlyEnforceIf(M.z[z])
        self.gather_alpha = sum(M.t(co.gather[z][0]) * M.z[z] for z in ZERO_STAGES if co.gather[z][0])
        self.serial = md.new_bool_var("fsdp")
        md.add(self.serial == sum(M.z[z] for z in ZERO_STAGES if co.serial_sync[z]))
        self.serial_alpha = sum(M.t(co.serial[z][0]) * M.z[z] for z in ZERO_STAGES if co.serial_sync[z])
        self.bucketed = md.new_bool_var("bucketed")
        md.add(self.bucketed == sum(M.z[z] for z in ZERO_STAGES if z >= 1 and not co.fsdp[z]))

    def _prod(self, a: Any, b: Any, ub: int, name: str) -> Any:
        v = self.M.var(ub, name)
        self.M.md.add_multiplication_equality(v, [a, b])
        return v

    def stage(self, s: int) -> None:
        """Stage s: its block counts, time, exposed gradient sync, and memory under the limit."""
        M, md, L, p = self.M, self.M.md, self.L, self.p
        first, last = s == 0, s == p - 1
        k = [M.var(L, f"k{s}_{r}") for r in range(3)]
        for r in range(3):
            if r not in self.recomputes:
                md.add(k[r] == 0)
        n = M.var(L, f"n{s}")
        md.add(n >= (0 if (first or last or L == 0) else 1))
        md.add(sum(k) == n)
        self.counts.append((n, k))
        blk, prev = self.blks[self.classes[s]], self.blks[self.classes[s - 1]]
        edge_sends = (blk["send"] if not last else 0) + (prev["send"] if not first else 0)
        pre_t = (self.pre["time"] + self.pre["z3"]) if first else 0
        post_t = (self.post["time"] + self.post["z3"]) if last else 0
        if L > 0:
            st = self._blocks(s, n, k, (edge_sends, pre_t, post_t))
        else:
            st = _Stage(edge_sends + pre_t + post_t)
        for on, part in ((first, self.pre), (last, self.post)):
            if on:
                st.window += part["time"] + part["z3"] - part["fwd"]
                st.grad_sync += part["sync"]
                st.numel_mem += part["buf"]
                st.grad_mem += part["gmem"]
                st.after += part["after"]
                st.other += part["other"]
                st.mem += [part["state"], in_flight("1f1b", p, s, self.m) * part["saved"]]
        self.stage_times.append(st.time)
        ex = M.var(self.horizon, f"exposed{s}")
        md.add(ex >= st.grad_sync - st.window).OnlyEnforceIf(self.serial.Not())
        md.add(ex >= st.grad_sync + self.serial_alpha).OnlyEnforceIf(self.serial)  # FSDP2: one collective after backward
        md.add(ex >= self.tail + (self.pre["sync"] if first else 0))
        self.exposed.append(ex + st.other)
        self.after.append(st.after + self.gather_alpha)
        self._memory(s, st)

    def _blocks(self, s: int, n: Any, k: list[Any], rest: tuple[Any, Any, Any]) -> _Stage:
        """The stage's `n` blocks, `k[r]` under recomputation r: products of the counts and its
        class's per-block quantities, their cuts, the stage time (`rest`: the sends, the prefix's
        and the suffix's time), the backward window, activations in flight and recomputation's
        working memory."""
        M, md, L, co, c = self.M, self.M.md, self.L, self.M.co, self.classes[s]
        blk, prod = self.blks[c], self._prod
        pt = [prod(k[r], self.tl[c][r], L * self.tl_ub, f"pt{s}_{r}") for r in range(3)]
        self.block_terms += pt
        pa = [prod(k[r], self.act[c][r], L * self.act_ub, f"pa{s}_{r}") for r in range(3)]
        nf = prod(n, self.agg[c]["fwd"], L * blk["fwd_ub"], f"nf{s}")
        nsync = prod(n, blk["sync"], L * blk["sync_ub"], f"nsync{s}")
        nstate = prod(n, blk["state"], L * blk["state_ub"], f"nstate{s}")
        nafter = prod(n, blk["after"], L * blk["after_ub"], f"nafter{s}")
        nbuf = prod(n, blk["buf"], L * blk["buf_ub"], f"nbuf{s}")
        ngrad = prod(n, blk["gmem"], L * blk["gmem_ub"], f"ngrad{s}") if co.buffer_cap else 0
        nother = prod(n, self.agg[c]["other"], L * blk["other_ub"], f"nother{s}") if blk["other_ub"] else 0
        # Linear cuts the LP relaxation sees (it drops the products): a product of a count
        # and a block quantity is at least the count times the quantity's smallest value.
        for r in range(3):
            md.add(pt[r] >= self.low_tl[r] * k[r])
            md.add(pa[r] >= self.low_act[r] * k[r])
        md.add(nf >= self.low_fwd * n)
        md.add(nstate >= self.low_state * n)
        md.add(nbuf >= self.low_buf * n)
        md.add(nsync >= self.low_sync * n)
        md.add(nafter >= self.low_after * n)
        if co.buffer_cap:
            md.add(ngrad >= self.low_grad * n)
        cross_t: Any = 0
        cross_w: Any = 0
        if s in self.cross:
            cross_t += self.cross[s][0]
            cross_w += self.cross[s][0] - self.cross[s][1]
        if s + 1 in self.cross:
            cross_t += self.cross[s + 1][2]
            cross_w += self.cross[s + 1][2]
        first = s == 0
        window = sum(pt) - nf + (self.blks[self.classes[s - 1]]["send"] if not first else 0) + cross_w
        f = in_flight("1f1b", self.p, s, self.m)
        mem = [nstate, f * sum(pa)]
        rw = M.var(self.act_ub, f"recompute_working{s}")
        has_full, has_sel = md.new_bool_var(f"full{s}"), md.new_bool_var(f"sel{s}")
        md.add(k[2] <= L * has_full)
        md.add(k[1] <= L * has_sel)
        md.add(rw >= self.act[c][0]).OnlyEnforceIf(has_full)
        md.add(rw >= self.agg[c]["saved_core"]).OnlyEnforceIf(has_sel)
        mem.append(rw)
        mem += self._recompute_copies(s, c, k[2], has_full)
        edge_sends, pre_t, post_t = rest
        # The terms in the order the model has always added them: CP-SAT's search follows it.
        stage = sum(pt) + edge_sends + pre_t + post_t + cross_t
        return _Stage(stage, window, mem, nsync, nbuf, nafter, ngrad, nother)

    def _recompute_copies(self, s: int, c: int, full: Any, has_full: Any) -> list[Any]:
        """Mixed precision's weight copies of the stage's blocks recomputing in full (`full` of
        them, class `c`), as `linear.recompute_copy_bytes`: off the at-rest states, one block's
        while it runs. No terms (the model as before) where no ZeRO stage allowed holds such copies."""
        M, md, co = self.M, self.M.md, self.M.co
        if 2 not in self.recomputes or not any(co.recompute_copy[z] for z in self.zeros):
            return []
        blocks = [g for g, v in enumerate(self.problem.groups) if v.section == "block"]
        ub = max(sum(max(M.m(co.recompute_copy[z] * r["numel"]) for r in co.cand[g]) for g in blocks)
                 for z in ZERO_STAGES) + 1
        copy = M.var(ub, f"recompute_copy{s}")  # one block's copies, exact for the selected ZeRO stage
        for z in ZERO_STAGES:
            md.add(copy == sum(M.m(co.recompute_copy[z] * r["numel"]) * x
                               for g in blocks for r, x in zip(co.cand[g], M.xs[c][g]))).OnlyEnforceIf(M.z[z])
        off = self._prod(full, copy, self.L * ub, f"recompute_copies_off{s}")
        running = M.var(ub, f"recompute_copies_running{s}")
        md.add(running >= copy).OnlyEnforceIf(has_full)
        return [running, -off]

    def _memory(self, s: int, st: _Stage) -> None:
        """The stage's memory under the limit: its terms so far, the largest working memory, the
        gradient buffers of DDP, ZeRO or FSDP2, and torch pipelining's send and receive buffers."""
        M, md, co, p, m = self.M, self.M.md, self.M.co, self.p, self.m
        first, last = s == 0, s == p - 1
        c = self.classes[s]
        blk, pre, post = self.blks[c], self.pre, self.post
        mem = st.mem
        work = M.var(max(b["work_ub"] for b in (pre, post, *self.blks)), f"work{s}")
        md.add(work >= blk["work"])
        if first:
            md.add(work >= pre["work"])
        if last:
            md.add(work >= post["work"])
        mem.append(work)
        if co.buffer_cap:
            # DDP: a flat copy of the gradients; textbook ZeRO: two buckets (or all the gradients
            # when fewer); FSDP2: every weight of the stage, gathered twice over at the peak.
            buf = M.var(M.m(co.buffer_cap) + 10 * M.m(self.limit_bytes), f"buffers{s}")
            capped = md.new_bool_var(f"capped{s}")
            md.add(buf >= st.grad_mem).OnlyEnforceIf(M.z[0])
            md.add(buf >= st.numel_mem).OnlyEnforceIf(self.serial)
            md.add(buf >= M.m(co.buffer_cap)).OnlyEnforceIf([self.bucketed, capped])
            md.add(buf >= 2 * st.grad_mem).OnlyEnforceIf([self.bucketed, capped.Not()])
            mem.append(buf)
            if 3 in self.zeros and not co.fsdp[3]:
                big = M.var(max(b["pbytes_ub"] for b in (pre, post, *self.blks)), f"zero3_buffer{s}")
                for part, on in ((blk, True), (pre, first), (post, last)):
                    if on:
                        md.add(big >= part["pbytes"]).OnlyEnforceIf(M.z[3])
                mem.append(big)
        if co.pipeline_buffers:  # torch pipelining (`peak.pipeline_buffers`): m + 1 received, m + in flight sent (or one output)
            f = in_flight("1f1b", p, s, m)
            if not first:
                mem.append(cand_sum(M, "block", self.classes[s - 1], lambda g, c_: co.send_bytes[g][c_],
                                    lambda v: M.m((m + 1) * v)))
            if not last:
                mem.append(cand_sum(M, "block", c, lambda g, c_: co.send_bytes[g][c_], lambda v, f=f: M.m((m + f) * v)))
            else:
                mem.append(cand_sum(M, "post", 0, lambda g, c_: co.out_bytes[g][c_], lambda v: M.m(v))
                           + M.m(co.out_const))
        md.add(sum(mem) <= M.m(self.limit_bytes))

    def goal(self) -> Any:
        """The step time the model minimises: every stage once, the slowest stage for each further
        micro-batch, the worst exposed gradient sync and the worst optimizer step."""
        M, md, L, p = self.M, self.M.md, self.L, self.p
        md.add(sum(n for n, _ in self.counts) == L)
        _tie_empty_ends(M, self.classes, self.counts)
        bottleneck = M.var(self.horizon, "bottleneck")
        for st in self.stage_times:
            md.add(bottleneck >= st)
        # Redundant, linear: every block costs at least its class's TL_0 (so at least the smallest
        # of them), the slowest stage holds at least ceil(L / p) blocks of the cheapest time, and
        # is at least the mean stage. The first is what lets the relaxation see the chosen block
        # time behind the products.
        if L > 0:
            if self.K == 1:
                md.add(sum(self.block_terms) >= L * self.tl[0][0])
            else:
                cheapest = M.var(self.tl_ub, "cheapest_block")
                md.add_min_equality(cheapest, [t_k[0] for t_k in self.tl])
                md.add(sum(self.block_terms) >= L * cheapest)
        if L > 0 and p > 1:
            md.add(bottleneck >= -(-L // p) * self.low_tl[0])
        md.add(p * bottleneck >= sum(self.stage_times))
        worst_exposed = M.var(self.horizon * 4, "worst_exposed")
        for exposed_s in self.exposed:
            md.add(worst_exposed >= exposed_s)
        worst_after = M.var(self.horizon * 4, "worst_after")
        for af in self.after:
            md.add(worst_after >= af)
        return sum(self.stage_times) + (self.m - 1) * bottleneck + worst_exposed + worst_after


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
