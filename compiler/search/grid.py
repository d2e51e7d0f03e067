"""The baseline a Megatron-LM user would try: every uniform Megatron plan, scored by the same model.

A grid point sets what Megatron-LM / Megatron-Core users set: a factorisation pp*dp*cp*tp of
the device count (the outer search's mesh shapes), interleaved stages (vpp: pp*vpp model
chunks, each at least one block, the blocks dealt evenly as Megatron requires: the count
divisible by pp*vpp; every such vpp, up to one block per chunk, `interleavings`), a
micro-batch size, sequence parallelism (sp, with tp > 1), context
parallelism (cp: every op split over the sequence, attention as a ring where the candidates
have one), one recomputation for every block (none, selective, full) or Megatron's partial
full recomputation (`--recompute-num-layers N`, block method: the first N blocks of every
model chunk fully recomputed, the rest not), and ZeRO 0 or 1 (the distributed optimizer).
The tensor-parallel layout is Megatron's (`megatron_choice`): column-parallel then
row-parallel linears (a fused qkv split strided), an MoE layer's experts split over ep (expert
parallelism, on shapes with ep > 1) and their intermediate dim over tp (expert tensor parallelism), heads split in attention (an unfused
attention's softmax and dropout follow the heads), a vocabulary-parallel embedding and loss,
everything else replicated along tp, partial sums all-reduced, or with sp reduce-scattered onto
the sequence (the norms and dropouts between follow it); the embedding and the head are not
recomputed. Each point is an `Assignment` of the solver's own space, evaluated with
`evaluate`; the outer search scores the best ones with `shardc.cost.estimate` on the
annotated graph. Dominated points are pruned: where recompute=none fits, no recomputation
is evaluated (it only adds time); partial recomputation only for a (layout, ZeRO) whose
recompute=none does not fit, and only the smallest N that fits (more recomputed blocks only
cost time).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardc.analysis.stages import stage_sizes
from shardc.cost.compose import zero_group
from shardc.ir import RECOMPUTE_CHOICES, Axis, Shard
from shardc.ops.registry import get_op, has_op
from shardc.plan.parallel import ParallelPlan
from shardc.search.evaluate import Assignment, Evaluation, balanced_stages, evaluate
from shardc.search.follow import Candidate
from shardc.search.linear import coefficients
from shardc.search.problem import GroupVar, MeshShape, Problem

GRID_ZEROS = (0, 1)  # Megatron's plain optimizer and its distributed optimizer


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One Megatron configuration. `recompute_layers` > 0 is partial recomputation: the first
    that many blocks of every model chunk fully recomputed, the others not (`recompute` is then
    "full", as Megatron writes `--recompute-granularity full --recompute-num-layers N`)."""

    shape: MeshShape
    mb: int
    recompute: str
    zero: int
    sp: bool = False
    recompute_layers: int = 0

    def plan(self, gbs: int, dtype: str = "bf16") -> ParallelPlan:
        """The point as a `ParallelPlan` at `dtype` (partial points with `recompute_layers=N`)."""
        plan = dataclasses.replace(self.shape.plan(self.mb, gbs, self.zero, dtype), recompute=self.recompute,
                                   sp=self.sp)
        return dataclasses.replace(plan, recompute_layers=self.recompute_layers or None)

    def plan_string(self, gbs: int, dtype: str = "bf16") -> str:
        """The same point in `ParallelPlan` syntax (what `shardc estimate --plan` takes)."""
        return str(self.plan(gbs, dtype))


def _resolves_sp(cand: Candidate) -> bool:
    """A candidate whose partial sum is reduce-scattered onto a tp split (sequence parallelism)."""
    return "->" in cand.label and "tp:S" in cand.label.split("->", 1)[1]


def _ring_only(part) -> bool:
    """Temporal splits only as a ring over cp (Megatron's context parallelism)."""
    return all(t.rotate == Axis.CP and t.grid is None for t in part.temporal)


def _megatron_legal(var: GroupVar, cand: Candidate, sp: bool = False, cp: bool = False) -> bool:
    part = cand.partitions[0]
    if part is None:
        return True
    if part.temporal and not (cp and _ring_only(part)):
        return False
    if _resolves_sp(cand) and not sp:
        return False  # sequence-parallel reduce_scatter: only in the sp points
    if any(a == Axis.CP for a, _ in part.spatial) and not cp:
        return False
    node = var.group.anchor
    space = var.group.spaces[0]
    experts = [d for d, rule in (space.special if space is not None else ()) if rule == "expert"]
    if node.op == "experts" and any(a == Axis.EP and d not in experts for a, d in part.spatial):
        return False  # Megatron's expert parallelism: the experts split over ep
    dims = [d for a, d in part.spatial if a == Axis.TP]
    if not dims:
        return True
    if node.op == "experts":
        return dims[0] == "i"  # expert tensor parallelism: each expert's intermediate dim
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


def megatron_choice(problem: Problem, sp: bool = False) -> tuple[int, ...]:
    """Per group, the Megatron-legal candidate (tensor-parallel whenever the op has a tp rule)
    cheapest given the producers chosen so far. Other ops split over tp only by following
    their input as it arrives (heads in an unfused attention; with `sp`, norms and dropouts on
    the sequence), as apply-plan does. With `sp`, partial sums that can be reduce-scattered onto
    a tp split are (Megatron's sequence parallelism); on a shape with cp > 1 every op with a cp
    split takes one (the sequence over cp, attention as a ring where it has one)."""
    co = coefficients(problem)
    cp = problem.shape.cp > 1
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

        legal = [c for c, cand in enumerate(var.cands) if _megatron_legal(var, cand, sp, cp)] \
            or list(range(len(var.cands)))
        # A Megatron user splits every op that has a tensor-parallel rule by that rule; the
        # others follow their input's tp split as it arrives.
        split = [c for c in legal if any(a == Axis.TP for a, _ in _anchor_spatial(var.cands[c]))]
        if not split:
            legal += [c for c, cand in enumerate(var.cands) if c not in legal and _plain(cand, cp) and follows(c)]
            split = [c for c in legal if any(a == Axis.TP for a, _ in _anchor_spatial(var.cands[c]))]
        legal = split or legal
        if cp:  # Megatron's cp splits every op's sequence over the cp ranks
            legal = [c for c in legal if any(a == Axis.CP for a, _ in _anchor_spatial(var.cands[c]))] or legal
        node = var.group.anchor
        if len(node.inputs) > 1 and node.inputs[1].kind == "parameter" and any(
                a == Axis.TP and d == "n" for c in legal for a, d in _anchor_spatial(var.cands[c])):
            # Column-parallel unless the input already arrives split on its last dim (then row).
            row = [c for c in legal if any(a == Axis.TP and d == "k" for a, d in _anchor_spatial(var.cands[c]))]
            free_row = [c for c in row if follows(c)]
            legal = free_row or [c for c in legal if c not in row] or legal
        if sp:  # every partial sum that can land on the sequence does (reduce-scatter)
            legal = [c for c in legal if _resolves_sp(var.cands[c])] or legal

        choice.append(min(legal, key=lambda c: (score(c), c)))
    return tuple(choice)


def _anchor_spatial(cand: Candidate) -> tuple[tuple[str, str], ...]:
    """The spatial split of the candidate's anchor; none for the replicated fallback."""
    part = cand.partitions[0]
    return part.spatial if part is not None else ()


def _plain(cand: Candidate, cp: bool = False) -> bool:
    """A candidate without temporal splits or a sequence-parallel resolution, and without cp
    unless the shape has it."""
    part = cand.partitions[0]
    return part is not None and not part.temporal and (cp or not any(a == Axis.CP for a, _ in part.spatial)) \
        and not _resolves_sp(cand)


def layouts(problem: Problem) -> list[tuple[bool, tuple[int, ...]]]:
    """The grid's tensor layouts on `problem`'s shape: (sp, candidate vector), Megatron's without
    and, with tp > 1, with sequence parallelism (the same vector when sp changes nothing)."""
    out = [(False, megatron_choice(problem))]
    if problem.shape.tp * problem.shape.tq > 1:
        with_sp = megatron_choice(problem, sp=True)
        if with_sp != out[0][1]:
            out.append((True, with_sp))
    return out


def vpp_admissible(layers: int, pp: int, vpp: int) -> bool:
    """Megatron's rule for interleaved stages: pp > 1 and the blocks divisible by pp*vpp (every
    model chunk the same number of blocks, at least one)."""
    return vpp == 1 or (pp > 1 and layers % (pp * vpp) == 0)


def interleavings(layers: int, pp: int) -> list[int]:
    """Every interleaving depth vpp >= 2 Megatron runs on `pp` stages of `layers` blocks: those
    dealing the blocks into pp*vpp equal chunks (`vpp_admissible`), up to one block per chunk
    (vpp = layers/pp, `--num-layers-per-virtual-pipeline-stage 1`). They are the divisors of
    layers/pp, so few (96 blocks on pp=8: 2, 3, 4, 6, 12)."""
    if pp <= 1:
        return []
    return [v for v in range(2, layers // pp + 1) if vpp_admissible(layers, pp, v)]


def partial_stages(layers: int, stages: int, k: int) -> tuple[tuple[int, int, int], ...] | None:
    """Blocks per (virtual) stage as apply-plan deals them, the first `k` of each fully
    recomputed and the rest not (Megatron's `--recompute-method block`)."""
    if stages < 1 or (stages > 1 and layers < stages):
        return None
    return tuple((n - min(k, n), 0, min(k, n)) for n in stage_sizes(layers, stages))


def _fit(problem: Problem, choice: tuple[int, ...], zero: int, limit: float, stages) -> tuple[Assignment, Evaluation]:
    a = Assignment(choice, stages, zero)
    return a, evaluate(problem, a, limit)


def _partial(problem: Problem, choice: tuple[int, ...], zero: int, limit: float
             ) -> tuple[int, Assignment, Evaluation] | None:
    """The smallest N of partial recomputation that fits (memory falls and time grows with N:
    a binary search), None when even N = all but one block per chunk does not."""
    S = problem.shape.stages
    most = max(stage_sizes(problem.layers, S)) - 1
    lo, hi, found = 1, most, None
    while lo <= hi:
        mid = (lo + hi) // 2
        stages = partial_stages(problem.layers, S, mid)
        if stages is None:
            return None
        a, ev = _fit(problem, choice, zero, limit, stages)
        if ev.fits:
            found, hi = (mid, a, ev), mid - 1
        else:
            lo = mid + 1
    return found


def grid_points(problem: Problem, limit: float, recomputes: tuple[str, ...] = RECOMPUTE_CHOICES,
                zeros: tuple[int, ...] = GRID_ZEROS) -> list[tuple[GridPoint, Assignment, Evaluation]]:
    """Every grid point of one (mesh shape with its vpp, micro-batch size) problem, evaluated
    against `limit` bytes per device (see the module rule for partial recomputation). On a
    tp x tq shape the points are the solver's warm starts, not grid points."""
    if problem.shape.schedule or not vpp_admissible(problem.layers, problem.shape.pp, problem.shape.vpp):
        return []  # Megatron's schedules only: no zero-bubble points
    if problem.shape.vpp > 1 and problem.micro_batches % problem.shape.pp:
        return []  # interleaved 1F1B needs the micro-batches to be a multiple of pp
    if zero_group(problem.shape.mesh())[1] == 1:
        zeros = zeros[:1]  # nothing to shard the optimizer over: ZeRO-1 is the same plan
    out = []
    for sp, choice in layouts(problem):
        for z in zeros:
            none_fits = False
            for rc in recomputes:
                stages = balanced_stages(problem.layers, problem.shape.stages, rc)
                if stages is None or none_fits:
                    continue  # recomputation only adds time: dominated where none fits
                a, ev = _fit(problem, choice, z, limit, stages)
                out.append((GridPoint(problem.shape, problem.mb, rc, z, sp), a, ev))
                none_fits = rc == "none" and ev.fits
            if not none_fits and "none" in recomputes and "full" in recomputes:
                part = _partial(problem, choice, z, limit)
                if part is not None:
                    k, a, ev = part
                    out.append((GridPoint(problem.shape, problem.mb, "full", z, sp, k), a, ev))
    return out


def grid_assignments(problem: Problem, recomputes: tuple[str, ...] = RECOMPUTE_CHOICES,
                     zeros: tuple[int, ...] = GRID_ZEROS) -> list[tuple[GridPoint, Assignment]]:
    """The uniform grid points of one problem without evaluating them (no partial recomputation,
    which depends on the memory limit): warm starts for the solver."""
    if problem.shape.vpp != 1 or problem.shape.schedule or not vpp_admissible(problem.layers, problem.shape.pp, 1):
        return []
    out = []
    for sp, choice in layouts(problem):
        for rc in recomputes:
            stages = balanced_stages(problem.layers, problem.shape.pp, rc)
            if stages is None:
                continue
            for z in zeros:
                out.append((GridPoint(problem.shape, problem.mb, rc, z, sp), Assignment(choice, stages, z)))
    return out


def best_grid(problems: list[Problem], limit: float) -> tuple[Problem, GridPoint, Assignment, Evaluation] | None:
    """The fastest grid point that fits in `limit` bytes per device (None when none fits)."""
    best = None
    for problem in problems:
        if problem.shape.tq != 1:  # a Megatron user has one tp axis (tq shapes get them as hints)
            continue
        for point, a, ev in grid_points(problem, limit):
            if ev.fits and (best is None or ev.step_time_s < best[3].step_time_s):
                best = (problem, point, a, ev)
    return best
