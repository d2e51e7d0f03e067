"""The baseline a Megatron user would try: every uniform dp x tp x pp plan, scored by the same model.

A grid point is a factorisation dp*tp*pp of the device count, a micro-batch size, one
recomputation for every block (none, selective, full) and ZeRO 0 or 1, with Megatron's
tensor-parallel layout (`megatron_choice`): column-parallel then row-parallel linears (a fused
qkv split strided), heads split in attention (an unfused attention's softmax and dropout follow
the heads), a vocabulary-parallel embedding and loss, everything else replicated along tp,
partial sums all-reduced, blocks split evenly over stages (the embedding and the head not
recomputed, as Megatron-LM does). Each point is an `Assignment` of the solver's own space,
evaluated with `evaluate`; the outer search scores the best ones with `shardc.cost.estimate`
on the annotated graph, and the plan it returns is never worse than the best of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardc.ir import RECOMPUTE_CHOICES, Axis, Shard
from shardc.ops.registry import get_op, has_op
from shardc.search.candidates import Candidate
from shardc.search.evaluate import Assignment, Evaluation, balanced_stages, evaluate
from shardc.search.linear import coefficients
from shardc.search.problem import GroupVar, MeshShape, Problem


@dataclass(frozen=True, slots=True)
class GridPoint:
    shape: MeshShape
    mb: int
    recompute: str
    zero: int

    def plan_string(self, gbs: int) -> str:
        """The same point in `ParallelPlan` syntax (what `shardc estimate --plan` takes)."""
        return str(dataclasses.replace(self.shape.plan(self.mb, gbs, self.zero), recompute=self.recompute))


def _megatron_legal(var: GroupVar, cand: Candidate) -> bool:
    part = cand.partitions[0]
    if part is None:
        return True
    if part.temporal:
        return False
    if "->" in cand.label and "tp:S" in cand.label.split("->", 1)[1]:
        return False  # sequence-parallel reduce_scatter: not in the plain grid
    dims = [d for a, d in part.spatial if a == Axis.TP]
    if any(a == Axis.CP for a, _ in part.spatial):
        return False
    if not dims:
        return True
    node = var.group.anchor
    kind = get_op(node.op).kind if has_op(node.op) else "opaque"
    if kind == "contraction" and len(node.inputs) > 1 and node.inputs[1].kind == "parameter":
        return dims[0] in ("n", "k")
    if kind == "contraction":
        return dims[0] not in ("m", "k", "n")
    if kind == "attention":
        return dims[0] == "g"
    if kind in ("index", "loss"):
        return dims[0] == "v"
    return False


def megatron_choice(problem: Problem) -> tuple[int, ...]:
    """Per group, the Megatron-legal candidate (tensor-parallel whenever the op has a tp rule)
    cheapest given the producers chosen so far. Other ops split over tp only by following
    their input as it arrives (heads in an unfused attention), as apply-plan does."""
    co = coefficients(problem)
    choice: list[int] = []
    incoming: dict[int, list[int]] = {}
    for i, e in enumerate(problem.edges):
        incoming.setdefault(e.consumer, []).append(i)
    for g, var in enumerate(problem.groups):
        def _incoming(c: int, g: int = g) -> float:
            t = 0.0
            for i in incoming.get(g, []):
                e = problem.edges[i]
                if e.producer < len(choice):
                    a, b = e.prod_class[choice[e.producer]], e.cons_class[c]
                    t += co.edge_fwd[i][a][b] + co.edge_grad[i][a][b]
            return t

        def follows(c: int, g: int = g) -> bool:
            """Split over tp exactly as the anchor's first input arrives."""
            for i in incoming.get(g, []):
                e = problem.edges[i]
                if (e.member, e.index) == (0, 0) and e.producer < len(choice):
                    have = e.prod_info[e.prod_class[choice[e.producer]]][0].on(Axis.TP)
                    return isinstance(have, Shard) and e.cons_required[e.cons_class[c]].on(Axis.TP) == have
            return False

        def score(c: int, g: int = g) -> float:
            return co.cand[g][c]["time"] + _incoming(c)

        legal = [c for c, cand in enumerate(var.cands) if _megatron_legal(var, cand)] or list(range(len(var.cands)))
        legal += [c for c, cand in enumerate(var.cands) if c not in legal and _plain(cand) and follows(c)]
        # A Megatron user splits every op that has a tensor-parallel rule.
        split = [c for c in legal if any(a == Axis.TP for a, _ in _anchor_spatial(var.cands[c]))]
        legal = split or legal
        node = var.group.anchor
        if len(node.inputs) > 1 and node.inputs[1].kind == "parameter" and any(
                a == Axis.TP and d == "n" for c in legal for a, d in _anchor_spatial(var.cands[c])):
            # Column-parallel unless the input already arrives split on its last dim (then row).
            row = [c for c in legal if any(a == Axis.TP and d == "k" for a, d in _anchor_spatial(var.cands[c]))]
            free_row = [c for c in row if follows(c)]
            legal = free_row or [c for c in legal if c not in row] or legal

        choice.append(min(legal, key=lambda c: (score(c), c)))
    return tuple(choice)


def _anchor_spatial(cand: Candidate) -> tuple[tuple[str, str], ...]:
    """The spatial split of the candidate's anchor; none for the replicated fallback."""
    part = cand.partitions[0]
    return part.spatial if part is not None else ()


def _plain(cand: Candidate) -> bool:
    """A candidate without temporal splits, cp, or a sequence-parallel resolution."""
    part = cand.partitions[0]
    return part is not None and not part.temporal and not any(a == Axis.CP for a, _ in part.spatial) \
        and not ("->" in cand.label and "tp:S" in cand.label.split("->", 1)[1])


def grid_assignments(problem: Problem, recomputes: tuple[str, ...] = RECOMPUTE_CHOICES, zeros: tuple[int, ...] = (0, 1)
                     ) -> list[tuple[GridPoint, Assignment]]:
    """The grid points of one (mesh shape, micro-batch size) problem."""
    if problem.shape.cp != 1:
        return []
    choice = megatron_choice(problem)
    out = []
    for rc in recomputes:
        stages = balanced_stages(problem.layers, problem.shape.pp, rc)
        if stages is None:
            continue
        for z in zeros:
            out.append((GridPoint(problem.shape, problem.mb, rc, z), Assignment(choice, stages, z)))
    return out


def best_grid(problems: list[Problem], limit: float) -> tuple[Problem, GridPoint, Assignment, Evaluation] | None:
    """The fastest grid point that fits in `limit` bytes per device (None when none fits)."""
    best = None
    for problem in problems:
        if problem.shape.tq != 1:  # a Megatron user has one tp axis (tq shapes get them as hints)
            continue
        for point, a in grid_assignments(problem):
            ev = evaluate(problem, a, limit)
            if ev.fits and (best is None or ev.step_time_s < best[3].step_time_s):
                best = (problem, point, a, ev)
    return best
