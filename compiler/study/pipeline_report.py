"""The pipeline study's plots and findings (`shardc study --sweep pipeline`), measured beside predicted.

Two plots (matplotlib, Agg), beside the report's `parallelism.png` (pp vs dp at equal processes)
and `pipeline_memory.png` (balanced vs unbalanced stage splits, memory per stage and total):
- `pipeline_schedules.png`: the same pipeline (processes, micro-batch size, blocks) under each
  schedule that ran (GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble, ZB-V, DualPipeV):
  step time measured and predicted before the run, and every pp rank's peak memory.
- `p2p_block.png`: the same 1F1B pipeline at each micro-batch size, i.e. each stage-to-stage
  message size: step time, and the time ranks wait for their peers (measured: collectives' and
  point-to-point waits, the slowest rank) against the model's bubble plus pipeline transfers
  on its critical stage.
Every figure comes from `results.json`; where the plans a finding needs did not run, it says so.
"""

from __future__ import annotations

import statistics
from typing import Any

from shardc.plan.parallel import ParallelPlan
from shardc.study.plans import parse_study_plan
from shardc.study.plotting import legend as _legend
from shardc.study.plotting import pyplot as _plt
from shardc.study.plotting import save as _save

MiB = 2**20


def _plain_pipeline(p: dict[str, Any]) -> ParallelPlan | None:
    """The plan of a ran pipelined plan with nothing else varied (no dp/tp/cp, ZeRO, recomputation,
    split, bucket size or plan file), else None."""
    if p["status"] != "ok" or p["plan"].startswith("plan_file=") or p.get("split") or p.get("bucket_mb") is not None:
        return None
    plan = parse_study_plan(p["plan"]).plan
    plain = plan.pp > 1 and plan.dp == plan.tp == plan.cp == 1 and plan.zero == 0 and plan.recompute == "none"
    return plan if plain and not plan.sp else None


def _name(plan: ParallelPlan) -> str:
    return plan.schedule + (f" vpp={plan.vpp}" if plan.vpp > 1 else "")


def schedule_groups(data: dict[str, Any]) -> list[list[tuple[ParallelPlan, dict[str, Any]]]]:
    """Plans that differ only in schedule (and vpp): groups of two or more, by (processes, mb)."""
    groups: dict[tuple[int, int], dict[str, tuple[ParallelPlan, dict[str, Any]]]] = {}
    for p in data["plans"]:
        plan = _plain_pipeline(p)
        if plan is not None:
            groups.setdefault((p["nproc"], plan.mb), {}).setdefault(_name(plan), (plan, p))
    return [sorted(g.values(), key=lambda x: x[1]["measured_step_time_s"]) for _, g in sorted(groups.items())
            if len(g) > 1]


def p2p_groups(data: dict[str, Any]) -> list[list[tuple[ParallelPlan, dict[str, Any]]]]:
    """Plain 1F1B pipelines that differ only in micro-batch size: groups of two or more, by processes."""
    groups: dict[int, dict[int, tuple[ParallelPlan, dict[str, Any]]]] = {}
    for p in data["plans"]:
        plan = _plain_pipeline(p)
        if plan is not None and plan.schedule == "1f1b" and plan.vpp == 1:
            groups.setdefault(p["nproc"], {}).setdefault(plan.mb, (plan, p))
    return [[g[mb] for mb in sorted(g)] for _, g in sorted(groups.items()) if len(g) > 1]


def p2p_bytes(p: dict[str, Any]) -> float:
    """The median point-to-point message (bytes) rank 0 sent: one micro-batch's stage output."""
    send = p["ranks"][0]["collectives"].get("send")
    return float(send["message_bytes"]["median"]) if send else 0.0


def waiting(p: dict[str, Any]) -> tuple[float, float]:
    """(measured, predicted) seconds a step waits on peers: the slowest rank's measured waiting,
    and the model's bubble plus pipeline transfers on its critical stage."""
    measured = max(r["time_breakdown"].get("waiting_s", 0.0) for r in p["ranks"])
    tb = p["predicted"]["time_breakdown"]
    return measured, tb.get("bubble", 0.0) + tb.get("pp_comm", 0.0)


def _rank_peaks(p: dict[str, Any], key: str) -> list[float]:
    return [r[key] / MiB for r in p["ranks"]]


def plot_schedules(data: dict[str, Any], path: Any) -> None:
    plt = _plt()
    groups = schedule_groups(data)
    fig, axes = plt.subplots(max(1, len(groups)), 2, figsize=(12, 4.5 * max(1, len(groups))), squeeze=False)
    for (ax1, ax2), group in zip(axes, groups):
        names = [_name(plan) for plan, _ in group]
        xs = range(len(group))
        ax1.bar([x - 0.2 for x in xs], [p["measured_step_time_s"] * 1e3 for _, p in group], width=0.4, label="measured")
        ax1.bar([x + 0.2 for x in xs], [p["predicted_step_time_s"] * 1e3 for _, p in group], width=0.4,
                label="predicted before run")
        for x, (_, p) in zip(xs, group):
            ax1.annotate(f"bubble {p['predicted'].get('bubble_fraction', 0):.0%}", (x + 0.2, p["predicted_step_time_s"] * 1e3),
                         fontsize=6, ha="center", va="bottom")
        ax1.set_xticks(list(xs))
        ax1.set_xticklabels(names, rotation=20, fontsize=7)
        ax1.set_ylabel("step time (ms)")
        plan0, p0 = group[0]
        ax1.set_title(f"schedules: pp={plan0.pp}, mb={plan0.mb}, {p0['predicted'].get('micro_batches')} micro-batches",
                      fontsize=8)
        for i, (plan, p) in enumerate(group):
            colour = f"C{i}"
            ranks = [r["rank"] for r in p["ranks"]]
            ax2.plot(ranks, _rank_peaks(p, "measured_peak_memory_bytes"), "o-", color=colour, label=f"{_name(plan)} measured")
            ax2.plot(ranks, _rank_peaks(p, "predicted_peak_memory_bytes"), "x--", color=colour, label="predicted")
        ax2.set_xticks([r["rank"] for r in group[0][1]["ranks"]])
        ax2.set_xlabel("pp rank")
        ax2.set_ylabel("peak memory (MiB)")
        ax2.set_title("peak memory per rank (solid: measured, dashed: predicted)", fontsize=8)
        _legend(ax1)
        ax2.legend(fontsize=6, ncol=2)
    if not groups:
        axes[0][0].text(0.5, 0.5, "no two schedules ran on the same pipeline (shardc study --sweep pipeline)",
                        ha="center", fontsize=8)
    _save(plt, fig, path)


def plot_p2p(data: dict[str, Any], path: Any) -> None:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, group in enumerate(p2p_groups(data)):
        colour, n = f"C{i}", group[0][1]["nproc"]
        xs = [p2p_bytes(p) for _, p in group]
        ax1.plot(xs, [p["measured_step_time_s"] * 1e3 for _, p in group], "o-", color=colour, label=f"{n} proc measured")
        ax1.plot(xs, [p["predicted_step_time_s"] * 1e3 for _, p in group], "x--", color=colour, label="predicted")
        waits = [waiting(p) for _, p in group]
        ax2.plot(xs, [w[0] * 1e3 for w in waits], "o-", color=colour, label=f"{n} proc measured waiting")
        ax2.plot(xs, [w[1] * 1e3 for w in waits], "x--", color=colour, label="predicted bubble + transfers")
        for x, (plan, _) in zip(xs, group):
            ax1.annotate(f"mb={plan.mb}", (x, 0), xycoords=("data", "axes fraction"), fontsize=6, ha="center")
    for ax, what in ((ax1, "step time (ms)"), (ax2, "waiting per step (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("point-to-point message (bytes, one micro-batch's stage output)")
        ax.set_ylabel(what)
        _legend(ax)
    ax1.set_title("1F1B step time by block size (micro-batch size)", fontsize=8)
    ax2.set_title("time waiting for peers: measured (slowest rank) vs predicted (critical stage)", fontsize=8)
    _save(plt, fig, path)


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def schedule_findings(data: dict[str, Any]) -> str:
    lines = []
    for group in schedule_groups(data):
        plan0, p0 = group[0]
        base = next(((plan, p) for plan, p in group if plan.schedule == "1f1b"), None)
        rows = []
        for plan, p in group:
            ratio = ""
            if base is not None and p is not base[1]:
                meas = p["measured_step_time_s"] / base[1]["measured_step_time_s"]
                pred = p["predicted_step_time_s"] / base[1]["predicted_step_time_s"]
                ratio = f", {meas:.2f}x 1F1B measured / {pred:.2f}x predicted"
            rows.append(f"{_name(plan)} {_ms(p['measured_step_time_s'])} measured / {_ms(p['predicted_step_time_s'])} "
                        f"predicted (bubble {p['predicted'].get('bubble_fraction', 0):.0%}{ratio}; largest rank "
                        f"{max(p['measured_peak_memory_bytes']) / MiB:.2f} MiB measured / "
                        f"{max(p['predicted_peak_memory_bytes']) / MiB:.2f} predicted)")
        order_meas = [_name(plan) for plan, _ in group]
        order_pred = [_name(plan) for plan, _ in sorted(group, key=lambda x: x[1]["predicted_step_time_s"])]
        same = "the same order" if order_meas == order_pred else f"predicted order {', '.join(order_pred)}"
        lines.append(f"- pp={plan0.pp}, mb={plan0.mb} on {p0['nproc']} processes, fastest first: " + "; ".join(rows)
                     + f". Measured order {', '.join(order_meas)}; {same}.")
    return "\n".join(lines) or "- Not measured: no two schedules ran on the same pipeline (`--sweep pipeline`)."


def p2p_findings(data: dict[str, Any]) -> str:
    lines = []
    for group in p2p_groups(data):
        parts = []
        for plan, p in group:
            meas, pred = waiting(p)
            parts.append(f"mb={plan.mb} ({p2p_bytes(p) / 1024:.0f} KiB per message, "
                         f"{p['predicted'].get('micro_batches')} micro-batches): step {_ms(p['measured_step_time_s'])} "
                         f"measured / {_ms(p['predicted_step_time_s'])} predicted, waiting {_ms(meas)} measured / "
                         f"{_ms(pred)} predicted bubble + transfers")
        errors = [p["step_time_error"] for _, p in group if p.get("step_time_error") is not None]
        lines.append(f"- 1F1B pp={group[0][0].pp} on {group[0][1]['nproc']} processes by block size: " + "; ".join(parts)
                     + (f". Step-time error over block sizes: median {statistics.median(errors):+.0%}." if errors else "."))
    return "\n".join(lines) or "- Not measured: no 1F1B pipeline ran at two micro-batch sizes (`--sweep pipeline`)."


def findings(data: dict[str, Any]) -> list[str]:
    """The pipeline sections of the report's findings."""
    return ["### Pipeline schedules\n" + schedule_findings(data),
            "### Point-to-point block size and waiting\n" + p2p_findings(data)]
