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
               recalibrated: dict[str, Any] | None = None) -> dict[str, Any]:
    """The results.json entry of a plan that ran: every measured and predicted number and the errors.

    `predicted` is the model on the profile the study started with, at the profile's reference
    speed; `recalibrated` the same model on that profile at the speed the probe read beside the
    plan's steps (`calibrate.at_speed`, `plan_speed`). The step-time error is the recalibrated one
    when given (this machine's cores flip between speeds 1.45x apart within seconds, whatever the
    plan); both are kept."""
    results = sorted(results, key=lambda r: r["rank"])
    steps = len(results[0]["step_times_s"])
    slowest = [max(r["step_times_s"][k] for r in results) for k in range(steps)]
    measured_step = statistics.median(slowest)
    cpu = [r["cpu_step_times_s"] for r in results if r.get("cpu_step_times_s")]
    cpu_step = statistics.median(max(c[k] for c in cpu) for k in range(len(cpu[0]))) if cpu else None
    breakdown = profile_breakdown([r.get("profile") or {} for r in results])
    ranks = []
    for r, pred, times in zip(results, predicted["ranks"], breakdown):
        mem = r["memory"]
        ranks.append({
            "rank": r["rank"], "stage": pred["stage"],
            "measured_step_time_s": r["median_step_s"], "time_breakdown": times,
            "measured_peak_memory_bytes": mem["peak_bytes"],
            "predicted_peak_memory_bytes": pred["peak_memory_bytes"],
            "memory_error": rel_error(pred["peak_memory_bytes"], mem["peak_bytes"]),
            "measured_memory": mem["peak_breakdown"], "measured_category_peaks": mem["category_peaks"],
            "predicted_memory": pred["memory"], "predicted_time": pred["time"],
            "collectives": _collective_summary(r["collectives"]),
        })
    profile_step = predicted["step_time_s"]
    predicted_step = recalibrated["step_time_s"] if recalibrated else profile_step
    return {
        "id": sp.id, "plan": sp.text, "nproc": sp.devices, "status": "ok", "cluster": predicted.get("cluster"),
        "split": list(sp.split) if sp.split else None, "bucket_mb": sp.bucket_mb,
        "measured_step_time_s": measured_step, "predicted_step_time_s": predicted_step,
        "step_time_error": rel_error(predicted_step, measured_step),
        "predicted_step_time_s_profile": profile_step,
        "step_time_error_profile": rel_error(profile_step, measured_step),
        "speed_factor": plan_speed(results),  # the machine's speed while the steps ran, x the reference time
        "speed_probe_s": [r.get("speed_probe_s") for r in results],
        "measured_cpu_step_time_s": cpu_step,  # the busiest rank's main-thread CPU time, median over steps
        "step_times_s": slowest, "losses": results[0]["losses"],
        "measured_peak_memory_bytes": [x["measured_peak_memory_bytes"] for x in ranks],
        "predicted_peak_memory_bytes": [x["predicted_peak_memory_bytes"] for x in ranks],
        "memory_errors": [x["memory_error"] for x in ranks],
        "max_abs_memory_error": max(abs(x["memory_error"] or 0.0) for x in ranks),
        "ranks": ranks, "predicted": predicted,
        "predicted_recalibrated": recalibrated,
    }


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
    """Targets: memory within 5% per rank, median step-time error, Spearman over plans."""
    ran = [p for p in data["plans"] if p["status"] == "ok"]
    time_errors = [abs(p["step_time_error"]) for p in ran if p.get("step_time_error") is not None]
    mem_errors = [abs(e) for p in ran for e in p["memory_errors"] if e is not None]
    rho = spearman([p["predicted_step_time_s"] for p in ran], [p["measured_step_time_s"] for p in ran])
    static = [abs(p["step_time_error_profile"]) for p in ran if p.get("step_time_error_profile") is not None]
    rho_static = spearman([p.get("predicted_step_time_s_profile", p["predicted_step_time_s"]) for p in ran],
                          [p["measured_step_time_s"] for p in ran])
    return {
        "plans": len(data["plans"]), "ran": len(ran),
        "errors": sum(1 for p in data["plans"] if p["status"] == "error"),
        "does_not_fit": sum(1 for p in data["plans"] if p["status"] == "does_not_fit"),
        "invalid": sum(1 for p in data["plans"] if p["status"] == "invalid"),
        "median_abs_step_time_error": statistics.median(time_errors) if time_errors else None,
        "mean_abs_step_time_error": statistics.mean(time_errors) if time_errors else None,
        "spearman_step_time": rho,
        "median_abs_step_time_error_profile": statistics.median(static) if static else None,
        "spearman_step_time_profile": rho_static,
        "max_abs_memory_error": max(mem_errors) if mem_errors else None,
        "median_abs_memory_error": statistics.median(mem_errors) if mem_errors else None,
        "plans_memory_within_5pct": sum(1 for p in ran if p["max_abs_memory_error"] <= 0.05),
        "targets": {"memory_within_5pct_every_plan": bool(ran) and all(p["max_abs_memory_error"] <= 0.05 for p in ran),
                    "median_time_error_within_15pct": bool(time_errors) and statistics.median(time_errors) <= 0.15,
                    "wall_time_under_10_min": data.get("wall_time_s", 0.0) < 600},
    }
