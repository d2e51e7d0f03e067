"""Published runs, predicted: the cost model against every row of `published_data.ROWS`.

    .venv/bin/python benchmarks/published_runs.py [--only TEXT] [--markdown]
    .venv/bin/python benchmarks/published_runs.py --fit H100-SXM   # refit one device's efficiency
    .venv/bin/python benchmarks/published_runs.py --sources        # every row's cluster and source

For each row the model (`examples/gpt.py` or `examples/llama.py` at the row's sizes) is traced on
the meta device, partitioned by apply-plan under the row's plan (recomputation on the repeated
blocks only, as Megatron and torchtitan apply it) and priced by `shardc.cost.estimate` on the
row's cluster with the row's runtime (`options_for`). The table gives the prediction in the
published metric, the published figure and the error (predicted / published - 1), then the
mean and worst absolute error over the rows that are not calibration rows.

The Mixture-of-Experts rows (`published_moe.py`: their own table and summary line, none of
them calibration) follow the dense table, and `--sources` lists them too.

`--fit DEVICE` finds the one matmul efficiency of that device (`DeviceSpec.matmul_efficiency`,
with the half-rate size that goes with it) that puts its calibration rows on their published
figures on average (mean log error zero, by bisection); `shardc.hardware` records the result.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_data import ROWS, PublishedRun, calibration_rows  # noqa: E402  (the data beside this script)
from tables import show  # noqa: E402

from shardc.cost import estimate  # noqa: E402
from shardc.cost.compose import EstimateOptions  # noqa: E402
from shardc.frontend import trace  # noqa: E402
from shardc.frontend.spec import load_model  # noqa: E402
from shardc.hardware import Cluster, LinkSpec, make_cluster, with_overrides  # noqa: E402
from shardc.ir import Graph, Layer  # noqa: E402
from shardc.passes.apply_plan import apply_plan  # noqa: E402
from shardc.passes.group_layers import group_layers, layer_of_path  # noqa: E402
from shardc.plan.parallel import ParallelPlan  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Prediction:
    """One row predicted: the figure in the row's metric, its error against the published one,
    the step time, and whether the plan fits the device's usable memory."""

    row: PublishedRun
    predicted: float
    step_s: float
    fits: bool

    @property
    def error(self) -> float:
        return self.predicted / self.row.published - 1.0


def options_for(row: PublishedRun) -> EstimateOptions:
    """The estimate options of the framework the row ran: Megatron-style runtimes have no
    torch.distributed.pipelining receive buffers, run ZeRO-1 as the textbook distributed
    optimizer (or as the row says) and send pipeline activations scattered over tp (Megatron-LM's
    `scatter_gather_tensors_in_pipeline`, on by default; DeepSpeed's `is_pipe_partitioned` and
    `is_grad_partitioned` whenever tp > 1); DeepSpeed's PipelineEngine runs its TrainSchedule
    with blocking exchanges (`shardc.cost.lockstep`); torchtitan runs FSDP2. Gradients are
    reduced as the row says."""
    if row.runtime == "torchtitan":
        # torchtitan wraps every block in its own fully_shard and prefetches: each block's weights
        # gathered before its forward and its backward behind the neighbour's compute, gradients
        # reduce-scattered block by block during backward, which is textbook ZeRO-3's schedule
        # ("zero"), not shardc's backend's one fully_shard on the whole module ("fsdp2").
        # fully_shard is FSDP2: every gather and reduce-scatter copies into and out of its flat buffers.
        return EstimateOptions(zero_runtime="zero", gradient_reduce=row.gradient_reduce, fsdp_copies=True)
    return EstimateOptions(pipeline_runtime="deepspeed" if row.runtime == "deepspeed" else "none",
                           zero_runtime="zero", gradient_reduce=row.gradient_reduce,
                           tp_comm_overlap=row.tp_comm_overlap, overlap_grad_reduce=row.overlap_grad_reduce,
                           pipeline_scatter_gather=True,
                           zero_gradient_collective="all_reduce" if row.bf16_optimizer else "reduce_scatter",
                           fp32_grad_accumulation=row.bf16_optimizer)


def cluster_for(row: PublishedRun, matmul_efficiency: float | None = None) -> Cluster:
    """The row's cluster: `gpus` devices of its preset, 8 per node, with its inter-node fabric
    when the row names one, and a device efficiency other than the preset's when asked (`--fit`)."""
    cluster = make_cluster(row.device, max(1, row.gpus // 8), min(8, row.gpus))
    if row.inter_gbps is not None:
        inter = cluster.inter
        fabric = LinkSpec(f"{inter.name}@{row.inter_gbps:g}GB/s", row.inter_gbps * 1e9, inter.latency, inter.efficiency)
        cluster = with_overrides(cluster, inter=fabric)
    if matmul_efficiency is not None:
        d = cluster.device
        # The half-rate size moves with the efficiency (`hardware._half_flops`: a fixed 5 us).
        half = d.matmul_half_flops * matmul_efficiency / d.matmul_efficiency
        cluster = replace(cluster, device=replace(d, matmul_efficiency=matmul_efficiency, matmul_half_flops=half))
    return cluster


def row_plan(row: PublishedRun) -> ParallelPlan:
    """The row's plan, priced with the kernels its framework runs (`PublishedRun.fused_kernels`):
    Transformer Engine's fused modules as compiled pricing describes them (`compile=1`,
    `cost/fusion.py`), the 2021-22 Megatron-LM / Megatron-DeepSpeed kernels (a few fused
    elementwise kernels, the rest per op) and torchtitan's eager PyTorch per op (`compile=0`)."""
    return ParallelPlan.parse(f"{row.plan},compile={1 if row.fused_kernels else 0}")


def row_graph(row: PublishedRun) -> tuple[Graph, ParallelPlan]:
    """The row's model traced at one micro-batch across its data-parallel group and partitioned
    by apply-plan; recomputation kept on the repeated blocks only."""
    plan = row_plan(row)
    spec = f"{ROOT}/{row.model}&seq={row.seq}&batch={plan.dp * plan.mb}"
    loaded = load_model(spec, device="meta")
    graph = group_layers(trace(loaded.model, loaded.example_inputs, name=loaded.name,
                               input_names=loaded.input_names))
    graph = apply_plan(graph, plan)
    for name, layer in graph.layers.items():
        if layer_of_path(name) != name:  # embedding, final norm, LM head: never checkpointed
            graph.layers[name] = Layer(name, layer.block, replace(layer.annotation, recompute="none"))
    return graph, plan


def predict(row: PublishedRun, graph: Graph | None = None, matmul_efficiency: float | None = None) -> Prediction:
    """The row's prediction in its published metric (`graph`: `row_graph`'s, to reuse one)."""
    if graph is None:
        graph, plan = row_graph(row)
    else:
        plan = row_plan(row)
    e = estimate(graph, cluster_for(row, matmul_efficiency), plan, options=options_for(row))
    if row.metric == "step_s":
        value = e.step_time_s
    elif row.metric == "tflops":
        value = e.tflops_per_device
    else:
        value = e.global_batch * row.seq / e.step_time_s / row.gpus
    return Prediction(row, value, e.step_time_s, e.fits)


def fit_efficiency(device: str, lo: float = 0.4, hi: float = 1.0, tol: float = 1e-3,
                   graphs: dict[str, Graph] | None = None) -> float:
    """The matmul efficiency of `device` at which its calibration rows' mean log error is zero
    (`graphs`: row name -> `row_graph`'s graph, to reuse traced ones)."""
    rows = calibration_rows(device)
    if not rows:
        raise SystemExit(f"no calibration rows for {device}")
    graphs = [graphs[r.name] if graphs and r.name in graphs else row_graph(r)[0] for r in rows]

    def mean_log_error(eff: float) -> float:
        errs = []
        for r, g in zip(rows, graphs):
            p = predict(r, g, eff)
            # Faster is a larger throughput but a smaller step time: orient both as "too fast".
            errs.append(math.log(p.predicted / r.published) * (-1 if r.metric == "step_s" else 1))
        return sum(errs) / len(errs)

    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if mean_log_error(mid) > 0 else (mid, hi)
    return (lo + hi) / 2


def summary(predictions: list[Prediction]) -> tuple[float, float]:
    """(mean, worst) absolute error over the predictions of rows that are not calibration rows."""
    errs = [abs(p.error) for p in predictions if not p.row.calibration]
    return (sum(errs) / len(errs), max(errs)) if errs else (0.0, 0.0)


_UNIT = {"step_s": "s/step", "tflops": "TFLOP/s/GPU", "tokens_per_gpu_s": "tok/s/GPU"}


def _fmt(v: float) -> str:
    return f"{v:,.1f}" if v >= 100 else f"{v:.3g}" if v < 10 else f"{v:.1f}"


def print_table(predictions: list[Prediction], markdown: bool) -> None:
    mean, worst = summary(predictions)
    header = ["run", "GPUs", "plan", "metric", "predicted", "published", "error", "role"]
    rows = [[p.row.name, f"{p.row.device} x{p.row.gpus}", p.row.plan, _UNIT[p.row.metric], _fmt(p.predicted),
             _fmt(p.row.published), f"{p.error:+.1%}" + ("" if p.fits else " (does not fit)"),
             "calibration" if p.row.calibration else "check"] for p in predictions]
    checks = any(not p.row.calibration for p in predictions)
    show("published runs: predicted vs published", header, rows,
         f"checks: mean |error| {mean:.1%}, worst {worst:.1%}" if checks else None, markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="rows whose name contains this text")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (the README's)")
    parser.add_argument("--fit", metavar="DEVICE", help="fit DEVICE's matmul efficiency on its calibration rows")
    parser.add_argument("--sources", action="store_true", help="list every row's interconnect and source")
    args = parser.parse_args(argv)
    import published_moe  # the MoE rows, printed after these (issue 15); it imports this module's Prediction
    if args.fit:
        print(f"{args.fit}: matmul_efficiency = {fit_efficiency(args.fit):.3f}")
        return 0
    rows = [r for r in ROWS if not args.only or args.only.lower() in r.name.lower()]
    if args.sources:
        for r in rows:
            print(f"- {r.name} ({r.gpus}x {r.device}; {r.interconnect}): {r.source}" + (f" Note: {r.note}" if r.note else "")
                  + (f" TP overlap: {r.overlap_source}" if r.tp_comm_overlap else ""))
        published_moe.print_sources(published_moe.select(args.only))
        return 0
    if rows:
        print_table([predict(r) for r in rows], args.markdown)
    moe_rows = published_moe.select(args.only)
    if moe_rows:
        print()
        published_moe.print_table([published_moe.predict(r) for r in moe_rows], args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
