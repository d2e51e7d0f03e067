"""Findings stated from the study's own measurements, each with the numbers behind it.

Every finding is computed from `results.json` data, never written in advance: where the
plans a finding needs did not run, it says so instead of concluding.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from shardc.plan.parallel import ParallelPlan
from shardc.study.pipeline_report import findings as pipeline_findings
from shardc.study.plans import label, parse_study_plan

MiB = 2**20


def _plan(plan_text: str) -> ParallelPlan:
    """The parallel plan of a study plan's text (which may add `split=` and `bucket_mb=`)."""
    return parse_study_plan(plan_text).plan


def _ok(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in data["plans"] if p["status"] == "ok"]


def pure(p: dict[str, Any]) -> str | None:
    """'dp', 'tp' or 'pp' when the plan uses only that kind of parallelism (plain settings)."""
    if p["plan"].startswith("plan_file="):  # the solver's plan: not one kind of parallelism by construction
        return None
    plan = _plan(p["plan"])
    degrees = {a: getattr(plan, a) for a in ("dp", "tp", "pp", "cp")}
    used = [a for a, d in degrees.items() if d > 1]
    plain = plan.zero == 0 and plan.recompute == "none" and not p.get("split") and p.get("bucket_mb") is None \
        and not plan.sp and plan.schedule == "1f1b"
    return used[0] if len(used) == 1 and plain else None


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def pp_vs_dp(data: dict[str, Any]) -> str:
    lines = []
    by_n: dict[int, dict[str, dict[str, Any]]] = {}
    for p in _ok(data):
        kind = pure(p)
        if kind:
            by_n.setdefault(p["nproc"], {}).setdefault(kind, p)
    for n, kinds in sorted(by_n.items()):
        if "dp" not in kinds or "pp" not in kinds:
            continue
        dp, pp = kinds["dp"], kinds["pp"]
        faster = "pipeline" if pp["measured_step_time_s"] < dp["measured_step_time_s"] else "data"
        wait_pp = statistics.mean(r["time_breakdown"].get("waiting_s", 0.0) for r in pp["ranks"])
        comm_dp = statistics.mean(r["time_breakdown"].get("exposed_communication_s", 0.0) for r in dp["ranks"])
        lines.append(
            f"- {n} processes: {faster} parallelism is faster here: {label(dp['plan'])} "
            f"{_ms(dp['measured_step_time_s'])} vs {label(pp['plan'])} {_ms(pp['measured_step_time_s'])} "
            f"(predicted {_ms(dp['predicted_step_time_s'])} vs {_ms(pp['predicted_step_time_s'])}). "
            f"Per-rank peak memory {max(dp['measured_peak_memory_bytes']) / MiB:.1f} MiB (DP, every rank holds "
            f"the whole model and its optimizer state) vs {max(pp['measured_peak_memory_bytes']) / MiB:.1f} MiB "
            f"(PP, the largest stage). Why: DP exposes {_ms(comm_dp)} of gradient all-reduce per step; "
            f"PP ranks wait {_ms(wait_pp)} per step on average for their neighbours (the bubble of "
            f"{pp['predicted'].get('bubble_fraction', 0):.0%} predicted) while sending only activations.")
    return "\n".join(lines) or "- Not measured: the study needs a pure dp=N and pp=N plan at the same N."


def _stage_total(p: dict[str, Any]) -> tuple[float, float]:
    stages: dict[int, float] = {}
    for r in p["ranks"]:
        stages[r["stage"]] = max(stages.get(r["stage"], 0.0), r["measured_peak_memory_bytes"])
    return sum(stages.values()), max(stages.values())


def partition(data: dict[str, Any]) -> str:
    lines = []
    pipelined = [p for p in _ok(data) if _plan(p["plan"]).pp > 1]
    for bad in (p for p in pipelined if p.get("split")):
        same = [p for p in pipelined if not p.get("split") and p["nproc"] == bad["nproc"]
                and (_plan(p["plan"]).pp, _plan(p["plan"]).schedule, _plan(p["plan"]).mb)
                == (_plan(bad["plan"]).pp, _plan(bad["plan"]).schedule, _plan(bad["plan"]).mb)]
        if not same:
            continue
        good = same[0]
        (tb, mb), (tg, mg) = _stage_total(bad), _stage_total(good)
        pred_b = sum(s["memory_bytes"] for s in bad["predicted"]["stages"])
        pred_g = sum(s["memory_bytes"] for s in good["predicted"]["stages"])
        verdict = "raises" if tb > tg else "does not raise"
        lines.append(
            f"- The unbalanced partition split={'+'.join(map(str, bad['split']))} {verdict} the total memory: "
            f"summed over stages {tb / MiB:.2f} MiB vs {tg / MiB:.2f} MiB balanced ({(tb / tg - 1):+.0%}; "
            f"predicted {pred_b / MiB:.2f} vs {pred_g / MiB:.2f} MiB), largest stage {mb / MiB:.2f} vs "
            f"{mg / MiB:.2f} MiB. Under 1F1B stage i keeps p-i micro-batches in flight, so blocks moved "
            + ("to the first stage have their activations held more times. " if bad["split"][0] == max(bad["split"])
               else "towards the last stage have their activations held fewer times. ") + "Step time "
            f"{_ms(bad['measured_step_time_s'])} vs {_ms(good['measured_step_time_s'])} balanced.")
    return "\n".join(lines) or "- Not measured: no pipelined plan with a split= beside its balanced twin."


def block_size(data: dict[str, Any]) -> str:
    lines = []
    for n, entry in sorted(data.get("allreduce", {}).items()):
        pts = entry.get("points") or []
        if len(pts) < 2:
            continue
        small, big = pts[0], pts[-1]
        lines.append(
            f"- all_reduce on {n} processes: {small['bytes']} B takes {small['measured_s'] * 1e6:.0f} us "
            f"({small['measured_bus_gbps'] * 1e3:.3f} MB/s bus bandwidth), {big['bytes'] / MiB:.0f} MiB takes "
            f"{big['measured_s'] * 1e3:.2f} ms ({big['measured_bus_gbps']:.2f} GB/s): small messages are "
            f"latency-bound, so a gradient sync cut into many small blocks pays the latency each time.")
    buckets = sorted((p for p in _ok(data) if p.get("bucket_mb") is not None), key=lambda p: p["bucket_mb"])
    if buckets:
        base = re.sub(r",bucket_mb=[^,]*", "", buckets[0]["plan"])
        ref = next((p for p in _ok(data) if p["plan"] == base), None)
        rows = buckets + ([ref] if ref else [])
        parts = [f"{p.get('bucket_mb') or 25:g} MiB: {_ms(p['measured_step_time_s'])} measured / "
                 f"{_ms(p['predicted_step_time_s'])} predicted, "
                 f"{statistics.mean(sum(c['count'] for c in r['collectives'].values()) for r in p['ranks']):.0f} "
                 f"collectives per step" for p in rows]
        lines.append(f"- DDP bucket size on {label(base)}: " + "; ".join(parts) + ".")
    waits = [(p, statistics.mean(r["time_breakdown"].get("waiting_s", 0.0) for r in p["ranks"])) for p in _ok(data)]
    waits = [(p, w) for p, w in waits if p["measured_step_time_s"] > 0]
    if waits:
        worst = max(waits, key=lambda x: x[1] / x[0]["measured_step_time_s"])
        lines.append(f"- Waiting: the most is {label(worst[0]['plan'])}, {worst[1] / worst[0]['measured_step_time_s']:.0%} "
                     f"of its step ({_ms(worst[1])}) spent in collectives before the last peer arrived.")
    return "\n".join(lines) or "- Not measured."


def accuracy(data: dict[str, Any], summary: dict[str, Any]) -> str:
    ran = _ok(data)
    if not ran:
        return "- No plan ran."
    diffs: dict[str, list[float]] = {}
    for p in ran:
        for r in p["ranks"]:
            meas, pred = r["measured_memory"], r["predicted_memory"]
            for cat in ("parameters", "gradients", "optimizer", "activations", "buffers"):
                diffs.setdefault(cat, []).append(pred.get(cat, 0.0) - meas.get(cat, 0.0))
            diffs.setdefault("other (working)", []).append(
                pred.get("working", 0.0) + pred.get("recompute_working", 0.0) - meas.get("other", 0.0)
                - meas.get("model_buffers", 0.0))
    worst = sorted(diffs.items(), key=lambda kv: -abs(statistics.mean(kv[1])))
    text = ", ".join(f"{k} {statistics.mean(v) / MiB:+.2f} MiB" for k, v in worst)
    med = summary.get("median_abs_step_time_error")
    rho = summary.get("spearman_step_time")
    static = summary.get("median_abs_step_time_error_at_speed")
    rho_static = summary.get("spearman_step_time_at_speed")
    spread = _repeat_spread(ran)
    return (f"- Memory: {summary['plans_memory_within_5pct']} of {len(ran)} plans within 5% on every rank; "
            f"largest error {summary['max_abs_memory_error']:.1%}; per category "
            f"{summary.get('plans_memory_categories_within_10pct', 0)} of {len(ran)} plans within 10%, worst "
            + (f"{summary['max_abs_memory_category_error']:.1%}" if summary.get("max_abs_memory_category_error")
               is not None else "-") + f". Mean predicted minus measured by category at the "
            f"peak: {text}.\n"
            f"- Time: median |error| {med:.1%}" + (f", Spearman rank correlation {rho:.2f}" if rho is not None else "")
            + " (predicted before each plan ran)"
            + (f"; re-predicted at the speed read during each plan's own steps (not a prediction): median |error| "
               f"{static:.1%}" if static is not None
               else "")
            + (f", Spearman {rho_static:.2f}" if rho_static is not None else "") + "."
            + (f"\n- Noise floor: the same plan measured {spread}." if spread else "")
            + _by_family(ran))


def family(plan: str) -> str:
    """The kind of plan an error is filed under: what sets it apart from plain data parallelism."""
    keys = dict(kv.split("=", 1) for kv in plan.split(",") if "=" in kv)
    if "plan_file" in keys:
        return "solver plan"
    if keys.get("zero", "0") != "0":
        return "ZeRO (FSDP2)"
    if keys.get("recompute", "none") != "none":
        return "recomputation"
    if "bucket_mb" in keys:
        return "DDP bucket size"
    if int(keys.get("pp", 1)) > 1:
        return "pipeline"
    if int(keys.get("tp", 1)) > 1:
        return "tensor parallel"
    return "data parallel"


def _by_family(ran: list[dict[str, Any]]) -> str:
    """Median signed step-time error by plan family, and how much of a step is CPU work."""
    groups: dict[str, list[float]] = {}
    for p in ran:
        if p.get("step_time_error") is not None:
            groups.setdefault(family(p["plan"]), []).append(p["step_time_error"])
    text = "; ".join(f"{k} {statistics.median(v):+.0%} ({len(v)})" for k, v in sorted(groups.items()))
    busy = [p["measured_cpu_step_time_s"] / p["measured_step_time_s"] for p in ran
            if p.get("measured_cpu_step_time_s") and p.get("measured_step_time_s")]
    cpu = (f"\n- CPU work: the busiest rank's main thread is on a core for {statistics.median(busy):.0%} of the "
           f"step (median over plans; the rest is waiting for a core, for peers or for messages)." if busy else "")
    return (f"\n- Step-time error by kind of plan (median, plans): {text}." if text else "") + cpu


def _repeat_spread(ran: list[dict[str, Any]]) -> str:
    """How much a plan's measured step time moved between rounds (max over min of its rounds'
    medians): the median over plans and the widest, for plans that ran more than one round."""
    spreads = [(max(r) / min(r), p) for p in ran if len(r := p.get("round_step_times_s") or []) > 1 and min(r) > 0]
    if not spreads:
        return ""
    worst = max(spreads, key=lambda x: x[0])
    return (f"a median {statistics.median(x for x, _ in spreads):.2f}x between a plan's fastest and slowest round, "
            f"up to {worst[0]:.2f}x ({label(worst[1]['plan'])})")


def findings(data: dict[str, Any], summary: dict[str, Any]) -> str:
    """The findings section of the report (markdown)."""
    return "\n\n".join([
        "### Pipeline vs data parallelism\n" + pp_vs_dp(data),
        "### Stage partition and total memory\n" + partition(data),
        "### Block size and waiting\n" + block_size(data),
        *pipeline_findings(data),
        "### How far the model is off\n" + accuracy(data, summary),
    ])

