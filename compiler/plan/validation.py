"""A plan checked against a cluster size and a model's dimensions (`validate_plan`), and the
micro-batch counts torch's pipeline schedules accept (`microbatch_problem`).

Every broken constraint is named with the nearest valid values (degrees, batch sizes, micro-batch
sizes), so that one error says how to fix the plan.
"""

from __future__ import annotations

import math

from shardc.ir import Axis
from shardc.ir.diagnostics import ShardcError
from shardc.plan.nearest import batch_suggestions, divisors, nearest
from shardc.plan.uniform import ParallelPlan


def validate_plan(plan: ParallelPlan, *, devices: int, layers: int, heads: int | None, hidden: int | None,
                  kv_heads: int | None = None, batch: int | None = None, seq: int | None = None,
                  vocab: int | None = None) -> None:
    """Check `plan` against `devices` and the model's dimensions; raise one ShardcError naming
    every broken constraint with the nearest valid values. Dims given as None are not checked.

    Rules: dp*tp*pp*cp == devices; tp divides heads, kv_heads and hidden; pp*vpp <= layers;
    the global batch (gbs, else `batch`) divisible by dp*mb, and the micro-batch count it gives
    one torch's pipeline schedule accepts (`microbatch_problem`); cp divides the sequence; with
    sp=1, tp*cp divides the sequence; recompute_layers at most the layers of a model chunk.
    `vocab` is not constrained: a vocab-parallel embedding
    pads it to a multiple of tp.
    """
    problems: list[str] = []
    if plan.devices != devices:
        problems.append(_degree_problem(plan, devices))
    if plan.tp > 1:
        dims = {"heads": heads, "kv_heads": kv_heads, "hidden": hidden}
        bad = [f"{k}={v}" for k, v in dims.items() if v is not None and v % plan.tp]
        if bad:
            common = math.gcd(*[v for v in dims.values() if v is not None])
            valid = [d for d in divisors(common) if d <= devices]
            problems.append(f"tp={plan.tp} does not divide {' and '.join(bad)}; valid tp: "
                            + ", ".join(map(str, valid)))
    if plan.stages > layers:
        low = 2 if plan.vpp > 1 else 1
        valid_pp = [p for p in divisors(layers) if low <= p and p * plan.vpp <= layers and p <= devices]
        what = f"pp*vpp = {plan.pp}*{plan.vpp} = {plan.stages} stages" if plan.vpp > 1 else f"pp={plan.pp} stages"
        text = (f"{what} for {layers} layers: each stage needs at least one layer, so pp <= "
                f"{layers // plan.vpp}; pp dividing the layers evenly: ")
        text += ", ".join(map(str, nearest(valid_pp, plan.pp, 6))) or "none"
        if plan.vpp > 1:
            text += f"; with pp={plan.pp}, vpp <= {max(1, layers // plan.pp)}"
        problems.append(text)
    most = -(-layers // plan.stages) if plan.stages <= layers else 1
    if plan.recompute_layers is not None and plan.recompute_layers > most:
        problems.append(f"recompute_layers={plan.recompute_layers} but a pipeline model chunk holds at most {most} "
                        f"of the {layers} layers over pp*vpp = {plan.stages} chunks; use recompute_layers <= "
                        f"{most} or all")
    gbs = plan.gbs if plan.gbs is not None else batch
    if gbs is not None and gbs % (plan.dp * plan.mb):
        problems.append(f"global batch {gbs} not divisible by dp*mb = {plan.dp}*{plan.mb} = "
                        f"{plan.dp * plan.mb} (micro-batch count must be whole); "
                        + batch_suggestions(gbs, plan.dp, plan.mb))
    elif gbs is not None:
        short = microbatch_problem(plan, gbs // (plan.dp * plan.mb))
        if short:
            problems.append(short + "; " + _pipeline_suggestions(plan, gbs))
    if seq is not None and plan.cp > 1 and seq % plan.cp:
        valid = [c for c in divisors(seq) if c <= devices]
        problems.append(f"cp={plan.cp} does not divide the sequence length {seq}; valid cp: "
                        + ", ".join(map(str, nearest(valid, plan.cp, 6))))
    if seq is not None and plan.cp > 1 and plan.cp_layout == "zigzag" and seq % plan.cp == 0 and seq % (2 * plan.cp):
        problems.append(f"cp={plan.cp}:zigzag cuts the sequence {seq} into 2*cp = {2 * plan.cp} chunks, which do "
                        "not divide it; use a contiguous cp or a cp dividing " + str(seq // 2 if seq % 2 == 0 else 1))
    if seq is not None and plan.sp and plan.tp > 1 and seq % (plan.tp * plan.cp):
        problems.append(f"sp=1 splits the sequence {seq} over tp*cp = {plan.tp * plan.cp} ranks, which "
                        f"does not divide it; use sp=0 or a tp dividing {seq // math.gcd(seq, plan.cp)}")
    if plan.ep > 1 and plan.mb % plan.ep:
        problems.append(f"ep={plan.ep} splits each micro-batch of mb={plan.mb} sequences over its ranks, which "
                        f"does not divide it; use mb a multiple of {plan.ep}")
    if problems:
        raise ShardcError(f"plan {plan} is not valid for {devices} devices:\n  - " + "\n  - ".join(problems))


def microbatch_problem(plan: ParallelPlan, m: int) -> str | None:
    """Why torch's schedule for `plan` refuses `m` micro-batches per step, or None when it runs
    them. The rules are torch.distributed.pipelining's own constructor checks: Schedule1F1B
    needs m >= pp (its stage count); ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble run
    in max(1, m // pp) rounds and need m divisible by that (so m < pp is allowed); ScheduleGPipe
    and ScheduleZBVZeroBubble take any m >= 1; ScheduleDualPipeV needs m >= its 2*pp stages."""
    if plan.pp == 1 or plan.schedule in ("gpipe", "zbv"):
        return None
    if plan.schedule == "dualpipev" and m < 2 * plan.pp:
        return (f"{m} micro-batch{'es' if m != 1 else ''} per step for pp={plan.pp}: DualPipeV needs at least as "
                f"many micro-batches as its 2*pp = {2 * plan.pp} virtual stages (m = gbs/(dp*mb) >= {2 * plan.pp})")
    if plan.schedule == "1f1b" and m < plan.pp:
        return (f"{m} micro-batch{'es' if m != 1 else ''} per step for pp={plan.pp} stages: the 1F1B "
                f"schedule needs at least as many micro-batches as stages (m = gbs/(dp*mb) >= {plan.pp})")
    rounds = max(1, m // plan.pp)
    if plan.schedule in ("interleaved", "interleaved-zb") and m % rounds:
        what = "interleaved 1F1B" if plan.schedule == "interleaved" else "interleaved zero bubble"
        return (f"{m} micro-batches per step for pp={plan.pp}: {what} runs them in "
                f"max(1, m // pp) = {rounds} rounds and needs m divisible by that (m < pp, or m a "
                f"multiple of m // pp, e.g. a multiple of pp)")
    return None


def _pipeline_suggestions(plan: ParallelPlan, gbs: int) -> str:
    """Valid values of gbs, mb and dp near the plan's, for the micro-batch count's sake."""
    per = plan.dp * plan.mb
    ok_m = [m for m in range(1, 4 * plan.pp + 1) if microbatch_problem(plan, m) is None]
    near_gbs = [m * per for m in nearest(ok_m, gbs // per, 3)]
    text = f"valid gbs with dp={plan.dp}, mb={plan.mb}: {', '.join(map(str, near_gbs))}"
    if gbs % plan.dp == 0:
        mbs = [mb for mb in divisors(gbs // plan.dp) if microbatch_problem(plan, gbs // (plan.dp * mb)) is None]
        text += f"; valid mb with gbs={gbs}: {', '.join(map(str, mbs[:6])) or 'none'}"
    dps = [d for d in divisors(gbs) if d < plan.dp and gbs % (d * plan.mb) == 0
           and microbatch_problem(plan, gbs // (d * plan.mb)) is None]
    if dps:
        text += f"; or a smaller dp (more devices on tp/pp/cp): {', '.join(map(str, dps[-3:]))}"
    if plan.schedule in ("1f1b", "interleaved") and plan.vpp == 1:
        text += "; or schedule=gpipe, which runs fewer micro-batches than stages"
    return text


def _degree_problem(plan: ParallelPlan, devices: int) -> str:
    degrees = {Axis.DP: plan.dp, Axis.TP: plan.tp, Axis.PP: plan.pp, Axis.CP: plan.cp}
    text = (f"dp*tp*pp*cp = {plan.dp}*{plan.tp}*{plan.pp}*{plan.cp} = {plan.devices} but the cluster has "
            f"{devices} devices")
    if plan.ep > 1:
        text = (f"dp*tp*pp*cp*ep = {plan.dp}*{plan.tp}*{plan.pp}*{plan.cp}*{plan.ep} = {plan.devices} but the "
                f"cluster has {devices} devices")
    fixes = []
    for key, value in degrees.items():
        rest = plan.devices // value
        if devices % rest == 0:
            fixes.append(f"{key}={devices // rest}")
    if fixes:
        return text + "; to fit, change one degree: " + " or ".join(fixes)
    return text + f"; the degrees must multiply to {devices} (e.g. dp={devices} alone)"
