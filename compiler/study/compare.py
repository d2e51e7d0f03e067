"""Measured against predicted: one plan's entry in results.json, and the summary statistics.

Definitions:
- measured step time: per step, the slowest rank's time (steps start together after a
  barrier), then the median over the measured steps;
- measured peak memory per rank: the largest total of live tensor bytes during the tracked
  step (`shardc.train.memory`), with its breakdown by category;
- relative error: (predicted - measured) / measured, so +10% means the model over-predicts;
- Spearman's rank correlation of predicted and measured step times over the plans that ran
  (ties get their average rank).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from shardc.calibration.speed import speed_factor
from shardc.study.measure import profile_breakdown
from shardc.study.plans import StudyPlan


def rel_error(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured else None


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rho (Pearson correlation of the ranks); None for fewer than 3 points."""
    if len(x) != len(y) or len(x) < 3:
        return None
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else None


def plan_speed(results: Sequence[dict[str, Any]]) -> float | None:
    """How many times slower than the profile's reference speed the machine ran a plan's measured
    steps (`shardc.calibration.speed`): per step, the slowest rank's probe before it and after it, averaged
    (the ranks of a step wait for each other), the median over steps over the reference; None
    without probes (CUDA, or results from before them)."""
    probes = [r.get("speed_probe_s") or [] for r in results]
    reference = results[0].get("speed_reference_s") if results else None
    steps = min((len(p) for p in probes), default=0) - 1
    if not reference or steps < 1:
        return None
    per_step = [(max(p[k] for p in probes) + max(p[k + 1] for p in probes)) / 2 for k in range(steps)]
    return speed_factor(per_step, reference)


def probed_speed(results: Sequence[dict[str, Any]]) -> float | None:
    """How many times slower than the profile's reference speed the machine ran just before the
    plan's first step (`worker.run_plan`'s `pre_probe_s`: per reading the slowest rank's, the
    median over readings, over the reference); None without those readings."""
    probes = [r.get("pre_probe_s") or [] for r in results]
    reference = results[0].get("speed_reference_s") if results else None
    readings = min((len(p) for p in probes), default=0)
    if not reference or readings < 1:
        return None
    return speed_factor([max(p[k] for p in probes) for k in range(readings)], reference)


def _collective_summary(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Per collective kind: count, bytes sent (ring), and message sizes (min, median, max)."""
    out: dict[str, Any] = {}
    for kind in sorted({c["kind"] for c in calls}):
        mine = [c for c in calls if c["kind"] == kind]
        sizes = sorted(c["bytes"] for c in mine)
        out[kind] = {"count": len(mine), "sent_bytes": sum(c["sent_bytes"] for c in mine),
                     "message_bytes": {"min": sizes[0], "median": statistics.median(sizes), "max": sizes[-1]},
                     "group_sizes": sorted({c["group_size"] for c in mine})}
    return out


def plan_entry(sp: StudyPlan, predicted: dict[str, Any], results: list[dict[str, Any]],
               recalibrated: dict[str, Any] | None = None, probed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The results.json entry of a plan that ran: every measured and predicted number and the errors.

    Rule: the headline step-time prediction (`predicted_step_time_s`, `step_time_error`) is
    `predicted`, the model on the profile the study started with, made before the plan was
    launched (nothing measured during its own steps enters it). `recalibrated`, the same model
    at the speed the probe read beside the plan's own steps (`calibrate.at_speed`,
    `plan_speed`), is kept as a secondary figure (`predicted_step_time_s_at_speed`): it explains
    a miss after the fact but is not a prediction. `probed`, the same model at the speed the probe
    read just before the plan's first step (`probed_speed`: nothing from its own steps), is a
    before-run prediction too (`predicted_step_time_s_probed`). Memory is compared per rank in
    total and per category (`category_errors`)."""
    results = sorted(results, key=lambda r: r["rank"])
    slowest = slowest_steps(results)
    measured_step = statistics.median(slowest)
    cpu = [r["cpu_step_times_s"] for r in results if r.get("cpu_step_times_s")]
    cpu_step = statistics.median(max(c[k] for c in cpu) for k in range(len(cpu[0]))) if cpu else None
    breakdown = profile_breakdown([r.get("profile") or {} for r in results])
    ranks = []
    for r, pred, times in zip(results, predicted["ranks"], breakdown):
        mem = r["memory"]
        categories = category_errors(mem["peak_breakdown"], pred["memory"], mem["peak_bytes"])
        ranks.append({
            "rank": r["rank"], "stage": pred["stage"],
            "measured_step_time_s": r["median_step_s"], "time_breakdown": times,
            "measured_peak_memory_bytes": mem["peak_bytes"],
            "predicted_peak_memory_bytes": pred["peak_memory_bytes"],
            "memory_error": rel_error(pred["peak_memory_bytes"], mem["peak_bytes"]),
            "measured_memory": mem["peak_breakdown"], "measured_category_peaks": mem["category_peaks"],
            "predicted_memory": pred["memory"], "predicted_time": pred["time"],
            "memory_categories": categories,
            "collectives": _collective_summary(r["collectives"]),
        })
    before = predicted["step_time_s"]
    at_speed = recalibrated["step_time_s"] if recalibrated else None
    worst_category = max((c for x in ranks for c in x["memory_categories"] if c["error"] is not None),
                         key=lambda c: abs(c["error"]), default=None)
    return {
        "id": sp.id, "plan": sp.text, "nproc": sp.devices, "status": "ok", "cluster": predicted.get("cluster"),
        "split": list(sp.split) if sp.split else None, "bucket_mb": sp.bucket_mb,
        "measured_step_time_s": measured_step, "predicted_step_time_s": before,
        "step_time_error": rel_error(before, measured_step),
        "prediction": "before-run",  # the headline: made before the plan's first step
        "predicted_step_time_s_at_speed": at_speed,
        "step_time_error_at_speed": rel_error(at_speed, measured_step) if at_speed is not None else None,
        "predicted_step_time_s_probed": probed["step_time_s"] if probed else None,
        "step_time_error_probed": rel_error(probed["step_time_s"], measured_step) if probed else None,
        "probed_speed_factor": probed_speed(results),  # just before the first step, x the reference time
        "speed_factor": plan_speed(results),  # the machine's speed while the steps ran, x the reference time
        "speed_probe_s": [r.get("speed_probe_s") for r in results],
        "measured_cpu_step_time_s": cpu_step,  # the busiest rank's main-thread CPU time, median over steps
        "step_times_s": slowest, "round_step_times_s": [measured_step], "losses": results[0]["losses"],
        "measured_peak_memory_bytes": [x["measured_peak_memory_bytes"] for x in ranks],
        "predicted_peak_memory_bytes": [x["predicted_peak_memory_bytes"] for x in ranks],
        "memory_errors": [x["memory_error"] for x in ranks],
        "max_abs_memory_error": max(abs(x["memory_error"] or 0.0) for x in ranks),
        "worst_memory_category": worst_category,
        "ranks": ranks, "predicted": predicted,
        "predicted_recalibrated": recalibrated, **warmup_entry(results),
    }


def slowest_steps(results: Sequence[dict[str, Any]]) -> list[float]:
    """Per measured step, the slowest rank's time (the steps start together after a barrier)."""
    return [max(r["step_times_s"][k] for r in results) for k in range(len(results[0]["step_times_s"]))]


def warmup_entry(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The round's warm-up steps (the most any rank ran: they agree) and torch.compile's work
    (`worker.compile_events`, summed over ranks) in the warm-up and in the timed steps, which a
    compiled plan's warm-up must leave at 0."""
    return {"warmup_steps": max(int(r.get("warmup_steps", 0)) for r in results),
            "compiles": {phase: sum(int((r.get("compiles") or {}).get(phase, 0)) for r in results)
                         for phase in ("warmup", "timed")}}


def round_entry(results: list[dict[str, Any]], recalibrated: dict[str, Any] | None = None,
                probed: dict[str, Any] | None = None) -> dict[str, Any]:
    """What `merge_rounds` takes of a plan's later round, which times its steps only (no
    memory, profile or collectives: the first round's are kept): the measured step time, the
    at-speed re-prediction, the probed before-run prediction, the warm-up and compiles."""
    return {"measured_step_time_s": statistics.median(slowest_steps(results)),
            "predicted_step_time_s_at_speed": recalibrated["step_time_s"] if recalibrated else None,
            "predicted_step_time_s_probed": probed["step_time_s"] if probed else None,
            **warmup_entry(results)}


def merge_rounds(first: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """A plan's entry after one more round: the first round's details (memory, breakdown,
    collectives), every round's measured step time (`round_step_times_s`) and at-speed
    re-prediction and probed before-run prediction (each round its own probe: the plan's figure is
    their median); the measured step time is the median over rounds, the errors against it. The
    headline prediction is the same before-run figure every round."""
    rounds = list(first.get("round_step_times_s") or [first["measured_step_time_s"]]) + [later["measured_step_time_s"]]
    at = [x for x in (first.get("round_predicted_at_speed_s") or [first.get("predicted_step_time_s_at_speed")])
          + [later.get("predicted_step_time_s_at_speed")] if x is not None]
    probed = [x for x in (first.get("round_predicted_probed_s") or [first.get("predicted_step_time_s_probed")])
              + [later.get("predicted_step_time_s_probed")] if x is not None]
    measured = statistics.median(rounds)
    at_speed = statistics.median(at) if at else None
    before = statistics.median(probed) if probed else None
    warm = list(first.get("round_warmup_steps") or [first.get("warmup_steps", 0)]) + [later.get("warmup_steps", 0)]
    compiles = {k: (first.get("compiles") or {}).get(k, 0) + (later.get("compiles") or {}).get(k, 0)
                for k in ("warmup", "timed")}
    return {**first, "round_step_times_s": rounds, "round_predicted_at_speed_s": at, "measured_step_time_s": measured,
            "round_warmup_steps": warm, "compiles": compiles,  # compiles: summed over rounds and ranks
            "step_time_error": rel_error(first["predicted_step_time_s"], measured),
            "predicted_step_time_s_at_speed": at_speed,
            "step_time_error_at_speed": rel_error(at_speed, measured) if at_speed is not None else None,
            "round_predicted_probed_s": probed, "predicted_step_time_s_probed": before,
            "step_time_error_probed": rel_error(before, measured) if before is not None else None,
            "load_average": later.get("load_average")}


# Measured categories (`shardc.train.memory`) -> the estimate's categories they are compared with.
# The tracker files model buffers and backward's temporaries apart ("other"); the estimate calls
# what is not state nor saved activations `working` (plus `recompute_working` under recomputation);
# model buffers (a causal mask) are `model_buffers` on both sides, compared within working.
MEMORY_CATEGORIES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("parameters", ("parameters",), ("parameters",)),
    ("gradients", ("gradients",), ("gradients",)),
    ("optimizer", ("optimizer",), ("optimizer",)),
    ("activations", ("activations",), ("activations",)),
    ("buffers", ("buffers",), ("buffers",)),
    ("working", ("other", "model_buffers", "allocator_extra"), ("working", "recompute_working", "model_buffers")),
)
# A category below this share of the rank's measured peak gets no relative error: a few KiB
# against a few KiB says nothing; its difference still shows in the total.
SMALL_CATEGORY = 0.02


def category_errors(measured: dict[str, float], predicted: dict[str, float], peak: float) -> list[dict[str, Any]]:
    """Per memory category at the peak: measured and predicted bytes and the relative error
    (predicted - measured) / measured; None for a category under `SMALL_CATEGORY` of `peak` in
    both. A category measured (near) empty but predicted large gets its error against the
    peak's small-category floor, so it is not hidden."""
    out = []
    floor = SMALL_CATEGORY * peak
    for name, meas_keys, pred_keys in MEMORY_CATEGORIES:
        m = float(sum(measured.get(k, 0) for k in meas_keys))
        q = float(sum(predicted.get(k, 0) for k in pred_keys))
        error = None if max(m, q) < floor else (q - m) / max(m, floor)
        out.append({"category": name, "measured_bytes": m, "predicted_bytes": q, "error": error})
    return out


def allreduce_entry(points: list[list[float]], cluster: Any) -> dict[str, Any]:
    """Measured all_reduce seconds by size beside the model's `collective_time` on the cluster's link."""
    from shardc.cost.comm import collective_time
    from shardc.ops.collectives import ring_traffic

    n = cluster.num_devices
    rows = []
    for nbytes, seconds in points:
        pred = collective_time("all_reduce", nbytes, ((cluster.intra, n),), "ring")
        rows.append({"bytes": nbytes, "measured_s": seconds, "predicted_s": pred,
                     "measured_bus_gbps": ring_traffic("all_reduce", n).fraction * nbytes / seconds / 1e9 if seconds else None,
                     "error": rel_error(pred, seconds)})
    return {"nproc": n, "link": {"latency_s": cluster.intra.latency, "bandwidth": cluster.intra.bandwidth},
            "points": rows}


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """Targets: step time predicted before the run within 15% (median over plans) and Spearman
    >= 0.9; memory per rank within 5% in total and 10% per category, every plan; every plan runs.
    The at-speed figures (the model at the speed read during each plan's own steps) are reported
    beside them, never as the headline."""
    ran = [p for p in data["plans"] if p["status"] == "ok"]
    signed = [p["step_time_error"] for p in ran if p.get("step_time_error") is not None]
    time_errors = [abs(e) for e in signed]
    mem_errors = [abs(e) for p in ran for e in p["memory_errors"] if e is not None]
    rho = spearman([p["predicted_step_time_s"] for p in ran], [p["measured_step_time_s"] for p in ran])
    fast = [p for p in ran if p.get("predicted_step_time_s_at_speed") is not None]
    at_speed = [abs(p["step_time_error_at_speed"]) for p in fast]
    rho_at_speed = spearman([p["predicted_step_time_s_at_speed"] for p in fast],
                            [p["measured_step_time_s"] for p in fast])
    probed = [p for p in ran if p.get("predicted_step_time_s_probed") is not None]
    probed_signed = [p["step_time_error_probed"] for p in probed]
    probed_median = statistics.median(abs(e) for e in probed_signed) if probed else None
    rho_probed = spearman([p["predicted_step_time_s_probed"] for p in probed],
                          [p["measured_step_time_s"] for p in probed])
    worst_cat = [abs(p["worst_memory_category"]["error"]) for p in ran if p.get("worst_memory_category")]
    failed = sum(1 for p in data["plans"] if p["status"] in ("error", "invalid"))
    spreads = [max(r) / min(r) for p in ran if len(r := p.get("round_step_times_s") or []) > 1 and min(r) > 0]
    return {
        "plans": len(data["plans"]), "ran": len(ran),
        "errors": sum(1 for p in data["plans"] if p["status"] == "error"),
        "does_not_fit": sum(1 for p in data["plans"] if p["status"] == "does_not_fit"),
        "invalid": sum(1 for p in data["plans"] if p["status"] == "invalid"),
        "median_abs_step_time_error": statistics.median(time_errors) if time_errors else None,
        "mean_abs_step_time_error": statistics.mean(time_errors) if time_errors else None,
        "predicted_too_fast": sum(1 for e in signed if e < 0),
        "spearman_step_time": rho,
        "median_abs_step_time_error_at_speed": statistics.median(at_speed) if at_speed else None,
        "spearman_step_time_at_speed": rho_at_speed,
        "median_abs_step_time_error_probed": probed_median,
        "predicted_too_fast_probed": sum(1 for e in probed_signed if e < 0),
        "plans_probed": len(probed),
        "spearman_step_time_probed": rho_probed,
        "max_abs_memory_error": max(mem_errors) if mem_errors else None,
        "median_abs_memory_error": statistics.median(mem_errors) if mem_errors else None,
        "median_round_spread": statistics.median(spreads) if spreads else None,  # max/min over rounds
        "plans_memory_within_5pct": sum(1 for p in ran if p["max_abs_memory_error"] <= 0.05),
        "max_abs_memory_category_error": max(worst_cat) if worst_cat else None,
        "plans_memory_categories_within_10pct": sum(1 for e in worst_cat if e <= 0.10),
        "targets": {"memory_within_5pct_every_plan": bool(ran) and all(p["max_abs_memory_error"] <= 0.05 for p in ran),
                    "memory_categories_within_10pct_every_plan": bool(ran) and len(worst_cat) == len(ran)
                    and all(e <= 0.10 for e in worst_cat),
                    "median_time_error_within_15pct": bool(time_errors) and statistics.median(time_errors) <= 0.15,
                    "spearman_at_least_0_9": rho is not None and rho >= 0.9,
                    "probed_median_time_error_within_15pct": probed_median is not None and probed_median <= 0.15,
                    "probed_spearman_at_least_0_9": rho_probed is not None and rho_probed >= 0.9,
                    "every_plan_runs": bool(ran) and failed == 0,
                    "wall_time_under_10_min": data.get("wall_time_s", 0.0) < 600},
    }
