"""The study's report: `report.md` (tables, targets, findings), PNG plots, and `results.json`'s summary.

Plots (matplotlib, Agg): `time.png` predicted vs measured step time per plan;
`memory.png` predicted vs measured peak memory per rank; `pipeline_memory.png` per-stage
memory of pipelined plans (balanced and unbalanced partitions side by side);
`block_size.png` all_reduce time and bus bandwidth by message size, and step time by DDP
bucket size; `parallelism.png` DP vs PP vs TP step time and memory at equal process counts;
`time_breakdown.png` where each plan's measured step goes (compute, exposed communication,
waiting, other); `pipeline_schedules.png` and `p2p_block.png` the pipeline study's schedules and
point-to-point block sizes (`shardc.study.pipeline_report`).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from shardc.backends.torch.launch import write_json
from shardc.study import pipeline_report
from shardc.study.compare import summary as make_summary
from shardc.study.findings import findings, pure
from shardc.study.plans import label
from shardc.study.plotting import legend as _legend
from shardc.study.plotting import pyplot as _plt
from shardc.study.plotting import save as _save

MiB = 2**20


def _ok(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in data["plans"] if p["status"] == "ok"]


def plot_time(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
    ran = _ok(data)
    fig, ax = plt.subplots(figsize=(7, 6))
    xs = [p["measured_step_time_s"] * 1e3 for p in ran]
    ys = [p["predicted_step_time_s"] * 1e3 for p in ran]
    ax.scatter(xs, ys, c=[p["nproc"] for p in ran], cmap="viridis")
    for p, x, y in zip(ran, xs, ys):
        ax.annotate(label(p["plan"]), (x, y), fontsize=6)
    if xs:
        lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=1, label="predicted = measured")
        ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], alpha=0.1, label="+-15%")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("step time predicted before the run (ms)")
    ax.set_title("step time: predicted vs measured (colour: processes)")
    _legend(ax)
    _save(plt, fig, path)


def plot_memory(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
    ran = _ok(data)
    names = [f"{label(p['plan'])} r{r['rank']}" for p in ran for r in p["ranks"]]
    meas = [r["measured_peak_memory_bytes"] / MiB for p in ran for r in p["ranks"]]
    pred = [r["predicted_peak_memory_bytes"] / MiB for p in ran for r in p["ranks"]]
    fig, ax = plt.subplots(figsize=(max(8, 0.28 * len(names) + 2), 5))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], meas, width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], pred, width=0.4, label="predicted")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=80, fontsize=6)
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_title("peak memory per rank: measured vs predicted")
    _legend(ax)
    _save(plt, fig, path)


def plot_pipeline_memory(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
    piped = [p for p in _ok(data) if p["predicted"].get("stages") and len(p["predicted"]["stages"]) > 1]
    splits = {(p["nproc"], p["plan"].split(",split=")[0]) for p in piped if p.get("split")}
    if splits:  # a pipeline sweep: the split plans and their balanced twins, not every schedule and mb
        piped = [p for p in piped if (p["nproc"], p["plan"].split(",split=")[0]) in splits]
    fig, axes = plt.subplots(1, max(1, len(piped)), figsize=(3.2 * max(1, len(piped)) + 1, 4.5), squeeze=False)
    for ax, p in zip(axes[0], piped):
        stages = sorted({r["stage"] for r in p["ranks"]})
        meas = [max(r["measured_peak_memory_bytes"] for r in p["ranks"] if r["stage"] == s) / MiB for s in stages]
        pred = [next(x["memory_bytes"] for x in p["predicted"]["stages"] if x["stage"] == s) / MiB for s in stages]
        ax.bar([s - 0.2 for s in stages], meas, width=0.4, label="measured")
        ax.bar([s + 0.2 for s in stages], pred, width=0.4, label="predicted")
        ax.set_xticks(stages)
        ax.set_xlabel("stage")
        split = "+".join(map(str, p["split"])) if p.get("split") else "balanced"
        ax.set_title(f"{label(p['plan'])}\n{split}: total {sum(meas):.1f} MiB", fontsize=7)
    axes[0][0].set_ylabel("peak memory (MiB)")
    _legend(axes[0][0])
    if not piped:
        axes[0][0].text(0.5, 0.5, "no pipelined plan ran", ha="center")
    _save(plt, fig, path)


def plot_block_size(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    for n, entry in sorted(data.get("allreduce", {}).items()):
        pts = entry.get("points") or []
        if not pts:
            continue
        b = [x["bytes"] for x in pts]
        ax1.plot(b, [x["measured_s"] * 1e3 for x in pts], "o-", label=f"{n} proc measured")
        ax1.plot(b, [x["predicted_s"] * 1e3 for x in pts], "x--", label=f"{n} proc predicted")
        ax2.plot(b, [x["measured_bus_gbps"] for x in pts], "o-", label=f"{n} proc")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        _legend(ax)
    ax1.set_ylabel("all_reduce time (ms)")
    ax1.set_title("all_reduce time by message size")
    ax2.set_ylabel("bus bandwidth (GB/s)")
    ax2.set_title("all_reduce bus bandwidth by message size")
    buckets = sorted((p for p in _ok(data) if p.get("bucket_mb") is not None), key=lambda p: p["bucket_mb"])
    if buckets:
        xs = [p["bucket_mb"] for p in buckets]
        ax3.plot(xs, [p["measured_step_time_s"] * 1e3 for p in buckets], "o-", label="measured")
        ax3.plot(xs, [p["predicted_step_time_s"] * 1e3 for p in buckets], "x--", label="predicted before run")
        ax3.set_xscale("log")
        _legend(ax3)
        ax3.set_title(f"step time by DDP bucket size\n{label(buckets[0]['plan'].split(',bucket_mb')[0])}", fontsize=8)
    ax3.set_xlabel("bucket size (MiB)")
    ax3.set_ylabel("step time (ms)")
    _save(plt, fig, path)


def plot_parallelism(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
    rows = [(p["nproc"], pure(p), p) for p in _ok(data) if pure(p)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [f"{k}={n}" for n, k, _ in sorted(rows, key=lambda r: (r[0], r[1]))]
    ordered = [p for _, _, p in sorted(rows, key=lambda r: (r[0], r[1]))]
    xs = range(len(names))
    ax1.bar([x - 0.2 for x in xs], [p["measured_step_time_s"] * 1e3 for p in ordered], width=0.4, label="measured")
    ax1.bar([x + 0.2 for x in xs], [p["predicted_step_time_s"] * 1e3 for p in ordered], width=0.4, label="predicted")
    ax2.bar([x - 0.2 for x in xs], [max(p["measured_peak_memory_bytes"]) / MiB for p in ordered], width=0.4,
            label="measured")
    ax2.bar([x + 0.2 for x in xs], [max(p["predicted_peak_memory_bytes"]) / MiB for p in ordered], width=0.4,
            label="predicted")
    for ax, what in ((ax1, "step time (ms)"), (ax2, "largest rank peak memory (MiB)")):
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names)
        ax.set_ylabel(what)
        _legend(ax)
    ax1.set_title("DP vs PP vs TP at equal process counts")
    _save(plt, fig, path)


def plot_breakdown(data: dict[str, Any], path: Path) -> None:
    plt = _plt()
    ran = _ok(data)
    cats = ("compute_s", "exposed_communication_s", "other_s")
    names = [label(p["plan"]) for p in ran]
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(names) + 2), 5))
    bottom = [0.0] * len(ran)
    for cat in cats:
        vals = [max(r["time_breakdown"].get(cat, 0.0) for r in p["ranks"]) * 1e3 for p in ran]
        ax.bar(names, vals, bottom=bottom, label=cat.replace("_s", ""))
        bottom = [b + v for b, v in zip(bottom, vals)]
    waits = [max(r["time_breakdown"].get("waiting_s", 0.0) for r in p["ranks"]) * 1e3 for p in ran]
    ax.scatter(names, waits, color="black", marker="_", s=200, label="waiting (part of communication)", zorder=3)
    ax.set_ylabel("ms (slowest rank per category)")
    ax.set_title("measured step breakdown (torch.profiler)")
    ax.tick_params(axis="x", rotation=80, labelsize=6)
    _legend(ax)
    _save(plt, fig, path)


PLOTS = {"time.png": plot_time, "memory.png": plot_memory, "pipeline_memory.png": plot_pipeline_memory,
         "block_size.png": plot_block_size, "parallelism.png": plot_parallelism,
         "time_breakdown.png": plot_breakdown, "pipeline_schedules.png": pipeline_report.plot_schedules,
         "p2p_block.png": pipeline_report.plot_p2p}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _load_line(data: dict[str, Any]) -> str:
    """The machine's load while the plans ran (1-minute load average as each plan finished)."""
    loads = [p["load_average"] for p in data["plans"] if p.get("load_average") is not None]
    if not loads:
        return ""
    return (f" Load average while the plans ran: median {statistics.median(loads):.1f}, "
            f"range {min(loads):.1f}-{max(loads):.1f} (on {os.cpu_count()} cores).")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _left_out(data: dict[str, Any]) -> str:
    """The default sweep's candidates the plan validation refused for this model and cluster."""
    left = data.get("left_out") or []
    if not left:
        return ""
    rows = "\n".join(f"- `{x['plan']}`: " + "; ".join(line.strip(" -") for line in x["reason"].splitlines()[1:]
                                                        or x["reason"].splitlines())[:300] for x in left)
    return (f"The default sweep left out {len(left)} candidate(s) that the plan validation (`validate-plan`) "
            f"refuses for this model and cluster:\n\n{rows}\n")


def _compiled_line(data: dict[str, Any]) -> str:
    """How the compiled plans (`compile=1`) warmed up: torch.compile's work in their warm-up and
    in their timed steps (none expected there: the warm-up runs until a step compiles nothing)."""
    plans = [p for p in data["plans"] if p["status"] == "ok" and "compile=1" in p["plan"]]
    if not plans:
        return ""
    timed = [label(p["plan"]) for p in plans if (p.get("compiles") or {}).get("timed")]
    eager = [label(p["plan"]) for p in plans if not (p.get("compiles") or {}).get("warmup")]
    warm = sorted({w for p in plans for w in (p.get("round_warmup_steps") or [p.get("warmup_steps", 0)])})
    return (f" {len(plans)} compiled plan(s) (torch.compile, inductor): warm-up of {'/'.join(map(str, warm))} steps "
            "covered the compiles" + (f", except in the timed steps of {', '.join(timed)}" if timed else
                                      " (nothing compiled in a timed step)") + "."
            + (f" NOT compiled (ran eagerly): {', '.join(eager)}." if eager else ""))


def markdown(data: dict[str, Any], summary: dict[str, Any]) -> str:
    ok = lambda b: "met" if b else "NOT met"  # noqa: E731
    t = summary["targets"]
    lines = [f"# shardc study: {data['model']}", "",
             f"Device: {data['device']}; {data.get('warmup')} warm-up and {data.get('steps')} measured steps per plan; "
             f"study wall time {data.get('wall_time_s', 0.0):.0f} s. Predictions: the cost model on "
             + ", ".join(sorted({p.get('cluster') or '' for p in data['plans'] if p.get('cluster')})) + "."
             + _load_line(data), "",
             "## Targets", "",
             "Step time is predicted before each plan's first step (the cost model on the calibrated profile; "
             "nothing measured during the plan's own steps); the probed row predicts each plan on the same profile "
             "at the speed a probe read just before its first step (each round its own; their median). The "
             "at-speed figure below re-predicts with the speed the probe read during the plan's own steps: an "
             "explanation after the fact, not a prediction.", "",
             "| target | result | status |", "|---|---|---|",
             f"| step time predicted before the run, median error <= 15% | {_pct(summary['median_abs_step_time_error'])} "
             f"({summary.get('predicted_too_fast', 0)} of {summary['ran']} plans predicted too fast) | "
             f"{ok(t['median_time_error_within_15pct'])} |",
             f"| rank order before the run, Spearman >= 0.9 | {_num(summary['spearman_step_time'])} | "
             f"{ok(t['spearman_at_least_0_9'])} |",
             *([f"| step time before the run at the speed probed just before each plan, median error <= 15%, "
                f"Spearman >= 0.9 | {_pct(summary.get('median_abs_step_time_error_probed'))} "
                f"({summary.get('predicted_too_fast_probed', 0)} of {summary.get('plans_probed', 0)} too fast), "
                f"Spearman {_num(summary.get('spearman_step_time_probed'))} | "
                f"{ok(t.get('probed_median_time_error_within_15pct'))}, "
                f"{ok(t.get('probed_spearman_at_least_0_9'))} |"] if summary.get("plans_probed") else []),
             f"| memory within 5% per rank (total), every plan | {summary['plans_memory_within_5pct']}/{summary['ran']} "
             f"plans; max error {_pct(summary['max_abs_memory_error'])} | {ok(t['memory_within_5pct_every_plan'])} |",
             f"| memory within 10% per category, every plan | {summary['plans_memory_categories_within_10pct']}/"
             f"{summary['ran']} plans; worst {_pct(summary['max_abs_memory_category_error'])} | "
             f"{ok(t['memory_categories_within_10pct_every_plan'])} |",
             f"| every plan runs | {summary['ran']} ran, {summary['errors']} failed, {summary['invalid']} invalid | "
             f"{ok(t['every_plan_runs'])} |",
             f"| (secondary) step time at the speed read during each plan's own steps | median "
             f"{_pct(summary.get('median_abs_step_time_error_at_speed'))}, Spearman "
             f"{_num(summary.get('spearman_step_time_at_speed'))} | not a prediction |",
             f"| sweep under 10 minutes | {data.get('wall_time_s', 0.0):.0f} s | {ok(t['wall_time_under_10_min'])} |", "",
             f"{summary['ran']} plans ran, {summary['errors']} failed, {summary['does_not_fit']} predicted not to fit, "
             f"{summary['invalid']} invalid. {data.get('rounds', 1)} round(s), plans in a shuffled order per round "
             f"(seed {data.get('seed', 0)}).{_compiled_line(data)}", "", _left_out(data),
             "## Plans", "",
             "Step measured: the median over rounds (each round the median of its steps), with the range over rounds. "
             "Predicted: before the run. At speed (secondary): re-predicted at the speed the probe read during the "
             "plan's own steps (speed: x the profile's reference time). Worst category: the memory category "
             "(parameters, gradients, optimizer, activations, buffers, working) with the largest error on any rank.", "",
             "| plan | procs | status | step measured (range over rounds) | predicted before run | error "
             "| at speed (secondary, error) | speed | peak memory measured (MiB, per rank) | predicted "
             "| worst total memory error | worst category error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in data["plans"]:
        if p["status"] == "ok":
            rounds = p.get("round_step_times_s") or [p["measured_step_time_s"]]
            at = p.get("predicted_step_time_s_at_speed")
            worst = p.get("worst_memory_category")
            lines.append(
                f"| {label(p['plan'])} | {p['nproc']} | ok | {p['measured_step_time_s'] * 1e3:.1f} ms "
                f"({min(rounds) * 1e3:.1f}..{max(rounds) * 1e3:.1f}, {len(rounds)}) | "
                f"{p['predicted_step_time_s'] * 1e3:.1f} ms | {_pct(p['step_time_error'])} | "
                + (f"{at * 1e3:.1f} ms ({_pct(p.get('step_time_error_at_speed'))})" if at is not None else "-") + " | "
                + (f"{p['speed_factor']:.2f}" if p.get("speed_factor") else "-") + " | "
                + " / ".join(f"{b / MiB:.2f}" for b in p["measured_peak_memory_bytes"]) + " | "
                + " / ".join(f"{b / MiB:.2f}" for b in p["predicted_peak_memory_bytes"])
                + f" | {p['max_abs_memory_error']:.1%} | "
                + (f"{worst['category']} {_pct(worst['error'])}" if worst else "-") + " |")
        else:
            err = (p.get("error") or "").replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {label(p['plan'])} | {p.get('nproc') or '-'} | {p['status']} | - | - | - | - | - | - | - "
                         f"| - | {err} |")
    lines += ["", "## Where the time goes (measured, slowest rank per category)", "",
              "| plan | step | compute | communication | exposed communication | waiting | other | "
              "predicted breakdown (critical stage) |", "|---|---|---|---|---|---|---|---|"]
    for p in _ok(data):
        worst = max(p["ranks"], key=lambda r: r["time_breakdown"].get("step_s", 0.0))
        tb = worst["time_breakdown"]
        pred = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p["predicted"]["time_breakdown"].items() if v > 1e-5)
        lines.append(f"| {label(p['plan'])} | " + " | ".join(
            f"{tb.get(k, 0.0) * 1e3:.1f}" for k in ("step_s", "compute_s", "communication_s",
                                                     "exposed_communication_s", "waiting_s", "other_s"))
            + f" | {pred} |")
    lines += ["", "## Memory at the peak by category (rank 0 of each plan and the last stage; MiB, measured / predicted)", "",
              "| plan | rank | parameters | gradients | optimizer | activations | buffers | working |",
              "|---|---|---|---|---|---|---|---|"]
    for p in _ok(data):
        shown = {p["ranks"][0]["rank"], p["ranks"][-1]["rank"]}
        for r in (x for x in p["ranks"] if x["rank"] in shown):
            # the categories as the check compares them (`compare.MEMORY_CATEGORIES`)
            cells = [f"{c['measured_bytes'] / MiB:.2f} / {c['predicted_bytes'] / MiB:.2f}"
                     for c in r["memory_categories"]]
            lines.append(f"| {label(p['plan'])} | {r['rank']} | " + " | ".join(cells) + " |")
    lines += ["", "## Communication per step (rank 0)", "", "| plan | collective | count | message sizes (min / median / max B) | sent (ring, B) |",
              "|---|---|---|---|---|"]
    for p in _ok(data):
        for kind, c in p["ranks"][0]["collectives"].items():
            mb = c["message_bytes"]
            lines.append(f"| {label(p['plan'])} | {kind} | {c['count']} | {mb['min']:.0f} / {mb['median']:.0f} / "
                         f"{mb['max']:.0f} | {c['sent_bytes']:.0f} |")
    lines += ["", "## Findings", "", findings(data, summary), "", "## Plots", ""]
    lines += [f"![{name}]({name})" for name in PLOTS]
    lines += ["", "## Method", "", METHOD]
    return "\n".join(lines) + "\n"


METHOD = """\
- Every plan trains for real on local processes (gloo on CPU, NCCL on GPUs) on shardc's own runtime,
  as `shardc run` does: `shardc.compile(model, batch, plan=...).parallelize(model)`, then
  `module.step(*batch)` (the pipeline schedule when pp > 1, gradient accumulation otherwise).
  A `split=` plan deals the blocks to pipeline stages before lowering and runs the same way; the
  study-only key `bucket_mb=` keeps an older path: plain DDP with that bucket size.
  AdamW, gradients kept
  between steps (`zero_grad(set_to_none=False)`), fp32. Warm-up steps, then measured steps, each started
  together after a barrier; the step time is the slowest rank's, median over steps. Before the first
  measured step and after each one every rank times a speed probe (`shardc.calibration.speed`: two calls of a
  small MLP block's eager forward and backward, from cold caches, in CPU time): this virtual machine's
  cores flip between two speeds about 1.45x apart within seconds (the same single-process step runs
  in 41 ms, then 62 ms, then 41 again), and the probe tells which one a step ran at.
- Time breakdown: torch.profiler on one more step. compute = the main thread's ops; communication =
  collective intervals on any thread; exposed = not under compute; waiting = each collective's duration
  minus the shortest any rank saw for the same call (the last to arrive does not wait).
- Memory: one more step under a TorchDispatchMode that accounts every tensor storage the rank holds
  (those alive at the start found through the garbage collector, the rest as ops create them, freed
  through weak references), filed by role: parameters, gradients, optimizer state, saved for backward
  (activations, via saved-tensor hooks), collective buffers (plus DDP's C++ gradient buckets from its
  own log; a bucket written by an op is counted once), model buffers and other (activation and weight
  gradients and temporaries of backward, recomputed activations, which the model calls working and
  recompute_working). Weights FSDP gathers are buffers; torch.distributed.pipelining's receive buffers
  and the stage outputs it keeps are buffers (as the model counts them). Storages the worker held before
  the plan began (earlier plans' leftovers) are not counted. The peak is the largest live total after any op.
- Predictions: `shardc.cost.estimate` on the same plan (the plan's stage split and DDP bucket size passed
  as model inputs), on the calibrated `local` profile for that process count; nothing fitted per plan.
  On a CPU the profile holds eager costs measured by `shardc calibrate` (`calibrate_ops`): per op
  class (matmul, linear, attention's batched matmul, elementwise, transcendental, norm, softmax, loss,
  ...) a per-call cost plus a per-FLOP or per-byte one, forward and autograd backward, views' call and
  autograd node, and AdamW's step per parameter tensor and per element (plain and FSDP2's DTensors), in
  CPU time on one thread; the node costs come from these instead of a roofline, scaled by how much
  slower a process runs while the others share the cores.
  Every figure of the profile was itself timed beside the probe and taken to one reference speed (the
  probe's time at the calibration's start). The headline step-time prediction is made before the plan is
  launched, on that profile at its reference speed: nothing measured during the plan's own steps enters it.
  As a secondary figure the plan is predicted again at the speed the probe read around its own steps
  (`calibrate.at_speed`: per step the slowest rank's probe before and after it, the median over steps,
  over the reference; every cost a process pays scaled by it); it tells how much of a miss was the
  machine's speed, and is not a prediction.
- Rounds: the sweep runs `--rounds` times, each round's plans in an order shuffled with the study's seed;
  a plan's measured step time is the median of its rounds' medians, shown with the range over rounds.
- Memory per category: the tracker's categories at the peak against the estimate's (parameters, gradients,
  optimizer, activations, buffers, and working = the tracker's other + model buffers against the
  estimate's working + recompute_working + model buffers); a category under 2% of the rank's peak in
  both gets no relative error. `python -m shardc.study.memory_check results.json` re-prices a
  recorded study's plans with the current model against its recorded measurements.
- Bytes sent per collective: message size from the op's tensors, ring volume for the group size.
"""


def write_report(data: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write report.md and the plots into `out`, and the summary into results.json; returns the summary."""
    out = Path(out)
    summary = make_summary(data)
    data["summary"] = summary
    for name, fn in PLOTS.items():
        fn(data, out / name)
    (out / "report.md").write_text(markdown(data, summary))
    write_json(out / "results.json", data, indent=1)
    return summary
