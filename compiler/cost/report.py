"""Showing an estimate: rich tables, JSON, a matplotlib plot, and `run_estimate` for the CLI."""

from __future__ import annotations

import inspect
from typing import Any

from shardc.cost.estimate import MEMORY_CATEGORIES, TIME_CATEGORIES, Estimate
from shardc.hardware import format_bytes
from shardc.ir.diagnostics import ShardcError


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
                                           f"{format_bytes(estimate.memory_capacity_bytes)}"),
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
    memory.add_row("total", *(format_bytes(s.memory_bytes) for s in estimate.stages))
    memory.add_row("micro-batches in flight", *(str(s.in_flight) for s in estimate.stages))
    return [summary, time, memory]


def plot(estimate: Estimate, path: str) -> None:
    """Stacked bars per pipeline stage: memory by category (left) and step time by category (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [f"stage {s.stage}" for s in estimate.stages]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(stages) + 6), 4.5))
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
    if estimate.memory_per_device_bytes >= estimate.memory_capacity_bytes / 4:
        ax_mem.axhline(estimate.memory_capacity_bytes / mem_scale, color="black", linestyle="--", linewidth=1,
                       label="capacity")
    ax_mem.set_title(f"memory per device (capacity {format_bytes(estimate.memory_capacity_bytes)})")
    ax_time.set_title(f"step time {estimate.step_time_s:.3g} s, MFU {estimate.mfu:.1%}")
    fig.suptitle(f"{estimate.plan}\non {estimate.cluster}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _trace(loaded: Any, allow_opaque: bool) -> Any:
    try:
        from shardc.frontend import trace
    except ImportError as err:
        raise ShardcError("the torch frontend (shardc.frontend.trace) is not available") from err
    kwargs: dict[str, Any] = {}
    params = inspect.signature(trace).parameters
    if "allow_opaque" in params:
        kwargs["allow_opaque"] = allow_opaque
    if "name" in params:
        kwargs["name"] = loaded.name
    return trace(loaded.model, loaded.example_inputs, **kwargs)


def prepare_graph(model_spec: str, cluster: Any, plan: Any, *, device: str = "meta", allow_opaque: bool = False):
    """Load, trace, group layers, validate the plan against the model and apply it.

    A file factory or `hf:` spec that does not pin `batch` in its query and whose default
    example batch the plan cannot split (dp*mb must divide it, or dp when gbs is given) is
    traced at batch dp*mb instead (the global batch then defaults to one micro-batch per
    replica); a pinned batch that does not work is reported by `validate_plan`."""
    from shardc.analysis.dims import model_dims
    from shardc.frontend.spec import load_model
    from shardc.passes.group_layers import group_layers
    from shardc.plan.parallel import validate_plan

    loaded = load_model(model_spec, device=device)
    spec = spec_for_plan(model_spec, plan, loaded)
    if spec != model_spec:
        loaded = load_model(spec, device=device)
    graph = _trace(loaded, allow_opaque)
    group_layers(graph)
    validate_plan(plan, devices=cluster.num_devices, **model_dims(graph).as_kwargs())
    from shardc.passes.apply_plan import apply_plan

    return apply_plan(graph, plan)


def spec_for_plan(model_spec: str, plan: Any, loaded: Any) -> str:
    """`model_spec` with `batch=dp*mb` added when its default batch does not fit the plan and
    nothing pins it (see `prepare_graph`); else `model_spec` unchanged."""
    from shardc.frontend.spec import parse_query

    base, _, query = model_spec.partition("?")
    if not (base.startswith("hf:") or base.endswith(".py") or ".py:" in base):
        return model_spec
    if "batch" in parse_query(query, model_spec) or not loaded.example_inputs:
        return model_spec
    first = loaded.example_inputs[0]
    shape = getattr(first, "shape", None)
    if not shape:
        return model_spec
    batch = int(shape[0])
    need = plan.dp if plan.gbs else plan.dp * plan.mb
    if batch % need == 0 or not _takes_batch(model_spec):
        return model_spec
    return f"{model_spec}{'&' if query else '?'}batch={plan.dp * plan.mb}"


def _takes_batch(model_spec: str) -> bool:
    """Whether the spec's factory accepts `batch` (hf: specs always do)."""
    if model_spec.startswith("hf:"):
        return True
    from shardc.frontend.spec import _FILE_SPEC, _import_file

    match = _FILE_SPEC.match(model_spec)
    if match is None:
        return False
    from pathlib import Path

    path = Path(match["path"]).expanduser().resolve()
    if not path.is_file():
        return False
    fn = getattr(_import_file(path), match["factory"] or "default", None)
    if not callable(fn):
        return False
    params = inspect.signature(fn).parameters
    return "batch" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def run_estimate(model_spec: str, cluster: str, plan: str, *, json_out: bool = False, plot: str | None = None,
                 console: Any = None, device: str = "meta", allow_opaque: bool = False) -> int:
    """`shardc estimate`: everything from the model spec to the printed estimate. Returns 0;
    a plan that does not fit is still printed (marked) and returns 0 as well."""
    from rich.console import Console

    from shardc.cost.model import estimate
    from shardc.hardware import parse_cluster
    from shardc.plan.parallel import ParallelPlan

    console = console or Console()
    the_cluster = parse_cluster(cluster)
    the_plan = ParallelPlan.parse(plan)
    graph = prepare_graph(model_spec, the_cluster, the_plan, device=device, allow_opaque=allow_opaque)
    result = estimate(graph, the_cluster, the_plan)
    if plot:
        _plot(result, plot)
    if json_out:
        console.print_json(result.to_json()) if hasattr(console, "print_json") else print(result.to_json())
        return 0
    for table in tables(result):
        console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")
    if plot:
        console.print(f"plot written to {plot}")
    return 0


_plot = plot
