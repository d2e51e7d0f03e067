"""Showing an estimate: rich tables and a matplotlib plot (`shardc estimate` prints them; the
driver, `shardc.driver.estimate`, computes the estimate)."""

from __future__ import annotations

from typing import Any

from shardc.cost.estimate import MEMORY_CATEGORIES, TIME_CATEGORIES, Estimate
from shardc.hardware import format_bytes


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms" if seconds < 10 else f"{seconds:,.2f} s"


def tables(estimate: Estimate) -> list[Any]:
    """The summary, time-per-stage and memory-per-stage tables (rich `Table`s)."""
    from rich.table import Table

    summary = Table(title=f"estimate: {estimate.plan} on {estimate.cluster}", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    rows = [
        ("step time", _ms(estimate.step_time_s)),
        ("tokens/s", f"{estimate.tokens_per_s:,.0f}"),
        ("MFU (model FLOPs)", f"{estimate.mfu:.1%}"),
        ("TFLOP/s per device (with recompute)", f"{estimate.tflops_per_device:,.1f}"),
        ("micro-batches x global batch", f"{estimate.micro_batches} x {estimate.global_batch}"),
        ("pipeline bubble (balanced)", f"{estimate.bubble_fraction:.1%}"),
        ("memory per device (peak stage)", f"{format_bytes(estimate.memory_per_device_bytes)} of "
                                           f"{format_bytes(estimate.memory_limit_bytes)} usable"),
        ("memory headroom", estimate.memory_headroom or "not stated"),
        ("fits", "yes" if estimate.fits else f"NO: {estimate.overflow}"),
    ]
    for what, value in rows:
        summary.add_row(what, value)
    time = Table(title="time per step by pipeline stage")
    memory = Table(title="memory per device by pipeline stage")
    for table in (time, memory):
        table.add_column("category")
        for s in estimate.stages:
            table.add_column(f"stage {s.stage}", justify="right")
    for cat in TIME_CATEGORIES:
        if any(s.time.get(cat, 0.0) for s in estimate.stages):
            time.add_row(cat, *(_ms(s.time.get(cat, 0.0)) for s in estimate.stages))
    time.add_row("total", *(_ms(sum(s.time.values())) for s in estimate.stages))
    for cat in MEMORY_CATEGORIES:
        if any(s.memory.get(cat, 0.0) for s in estimate.stages):
            memory.add_row(cat, *(format_bytes(s.memory.get(cat, 0.0)) for s in estimate.stages))
    if any(s.expert_state_bytes for s in estimate.stages):
        memory.add_row("of which expert states", *(format_bytes(s.expert_state_bytes) for s in estimate.stages))
    memory.add_row("total", *(format_bytes(s.memory_bytes) for s in estimate.stages))
    memory.add_row("micro-batches in flight", *(str(s.in_flight) for s in estimate.stages))
    return [summary, time, memory]


def timeline(estimate: Estimate) -> list[tuple[int, str, int, int, float, float]]:
    """The pipeline's ops as the estimate's simulation ran them: (device, F|B|I|W, micro-batch,
    virtual stage, start, end) seconds within one step's pipeline (empty without a pipeline)."""
    from shardc.cost.lockstep import LOCKSTEP, simulate_lockstep
    from shardc.cost.pipeline_shared import simulate_schedule

    inputs = estimate.pipeline
    if inputs is None or inputs.pp <= 1:
        return []
    events: list[tuple[int, str, int, int, float, float]] = []
    if inputs.schedule == LOCKSTEP:
        simulate_lockstep(inputs.fwd, inputs.bwd, inputs.sends, inputs.micro_batches, events=events)
    else:
        simulate_schedule(inputs.schedule, inputs.fwd, inputs.bwd, inputs.micro_batches, inputs.pp,
                          wgrad=inputs.wgrad, events=events, extra=dict(getattr(inputs, "extra", ())),
                          sharing=getattr(inputs, "sharing", None))
    return events


COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#55A868", "W": "#C44E52"}


def _draw_timeline(ax: Any, estimate: Estimate, scale: float, unit: str) -> None:
    """One row per pipeline device, one bar per op (F blue, B or I green, W red; later virtual
    stages of a device lighter), the micro-batch written on it; gaps are the bubbles."""
    inputs = estimate.pipeline
    events = timeline(estimate)
    end = max(e[5] for e in events)
    busy = sum(e[5] - e[4] for e in events)
    for d, kind, j, s, start, stop in events:
        chunk = sorted({e[3] for e in events if e[0] == d}).index(s)
        ax.barh(d, (stop - start) / scale, left=start / scale, height=0.8, color=COLOURS[kind],
                alpha=1.0 - 0.35 * chunk / max(1, inputs.vpp - 1) if inputs.vpp > 1 else 1.0,
                edgecolor="white", linewidth=0.3)
        if (stop - start) / end > 0.012:
            ax.text((start + stop) / 2 / scale, d, str(j), ha="center", va="center", fontsize=5, color="white")
    ax.set_yticks(range(inputs.pp), [f"device {d}" for d in range(inputs.pp)])
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    idle = 1 - busy / (inputs.pp * end)
    ax.set_title(f"schedule {inputs.schedule}, {inputs.micro_batches} micro-batches, vpp={inputs.vpp}: "
                 f"idle {idle:.1%} of the pipeline (F blue, B/I green, W red)", fontsize=8)


def plot(estimate: Estimate, path: str) -> None:
    """With a pipeline, its schedule as a timeline (which micro-batch each device runs when, F,
    B or I and W, the bubbles as gaps) beside stacked bars per pipeline stage of memory by
    category and step time by category; without one, the two bar charts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [f"stage {s.stage}" for s in estimate.stages]
    piped = estimate.pipeline is not None and estimate.pipeline.pp > 1
    width = max(8, 1.2 * len(stages) + 6) + (10 if piped else 0)
    if piped:
        fig, axes = plt.subplots(1, 3, figsize=(width, max(4.5, 0.35 * len(stages) + 2)),
                                 gridspec_kw={"width_ratios": [3, 1, 1]})
        ax_line, ax_mem, ax_time = axes
    else:
        fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(width, 4.5))
    mem_unit, mem_scale = ("GiB", 2**30) if estimate.memory_per_device_bytes >= 2**30 else ("MiB", 2**20)
    time_unit, time_scale = ("s", 1.0) if estimate.step_time_s >= 1 else ("ms", 1e-3)
    for ax, cats, get, unit, scale in (
        (ax_mem, MEMORY_CATEGORIES, lambda s: s.memory, mem_unit, mem_scale),
        (ax_time, TIME_CATEGORIES, lambda s: s.time, time_unit, time_scale),
    ):
        bottom = [0.0] * len(stages)
        for cat in cats:
            values = [get(s).get(cat, 0.0) / scale for s in estimate.stages]
            if any(values):
                ax.bar(stages, values, bottom=bottom, label=cat)
                bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    if estimate.memory_per_device_bytes >= estimate.memory_limit_bytes / 4:
        ax_mem.axhline(estimate.memory_limit_bytes / mem_scale, color="black", linestyle="--", linewidth=1,
                       label="usable")
    ax_mem.set_title(f"memory per device (usable {format_bytes(estimate.memory_limit_bytes)} of "
                     f"{format_bytes(estimate.memory_capacity_bytes)})")
    ax_time.set_title(f"step time {estimate.step_time_s:.3g} s, MFU {estimate.mfu:.1%}")
    if piped:
        _draw_timeline(ax_line, estimate, time_scale, time_unit)
    fig.suptitle(f"{estimate.plan}\non {estimate.cluster}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
