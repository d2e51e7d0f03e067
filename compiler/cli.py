"""The `shardc` command line: inspect, estimate, plan, compile, run, study, calibrate.

Every command that takes a model accepts the one model syntax of `shardc.frontend.spec`
(`path/file.py:factory?k=v`, `hf:gpt2?n_layer=2`, `model.onnx`, a printed `.ir` file), and
every command that takes a plan accepts the syntax of `ParallelPlan.parse`.
Each command is a pipeline over the same passes, run by `shardc.driver` (`--pipeline` replaces
it, `--print-after-all` and `--time-passes` show it at work).
A `ShardcError` is printed as its message alone (exit code 2), never as a stack trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from shardc.driver import PIPELINES, Flags, as_cluster, estimate, open_model, run, solve
from shardc.hardware import with_memory_limit
from shardc.ir.diagnostics import ShardcError
from shardc.study.plans import STUDY_STEPS


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path/file.py:factory[?k=v&...], hf:TYPE[?k=v&...], or a .onnx file")
    p.add_argument("--device", default="meta", choices=["meta", "cpu"],
                   help="where to build the model for tracing (meta allocates no weights)")
    p.add_argument("--allow-opaque", action="store_true",
                   help="keep ops without a registry entry as replicated opaque nodes instead of failing")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=8x128",
                   help="static shape for a dynamic input (ONNX models)")


def _add_pipeline(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--pipeline", default=None, metavar="PASSES",
                   help=f"the passes to run, a pipeline string (default: {default})")
    p.add_argument("--print-after-all", action="store_true", help="print the IR after every pass")
    p.add_argument("--time-passes", action="store_true", help="print a table of the time each pass took")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="print the IR of a model and a per-layer table")
    _add_model(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-ir", action="store_true", help="only the per-layer table")
    _add_pipeline(p, PIPELINES["inspect"])

    p = sub.add_parser("estimate", help="predict step time and memory of a plan on a cluster")
    _add_model(p)
    p.add_argument("--cluster", required=True, help="e.g. 8xA100-80GB, 64xH100, 2x8xH100, local")
    p.add_argument("--plan", help="e.g. dp=8,tp=8,pp=16,mb=1,gbs=1536,recompute=full, or a plan file FILE.plan "
                                  "written by `shardc plan -o` (none: the model is a partitioned .ir file, as "
                                  "`shardc plan -o` writes beside it)")
    p.add_argument("--memory-limit", type=float, metavar="GB",
                   help="usable memory per device in GiB, judged for fit (default: the device's memory less its "
                        "headroom: CUDA context, NCCL buffers, allocator fragmentation)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="FILE.png", help="draw the per-device memory and time breakdown")
    _add_pipeline(p, PIPELINES["estimate"])

    p = sub.add_parser("plan", help="search the best plan for a model on a cluster")
    _add_model(p)
    p.add_argument("--cluster", required=True)
    p.add_argument("--gbs", type=int, required=True, help="global batch size (sequences per step)")
    p.add_argument("--memory-limit", type=float, metavar="GB",
                   help="usable memory per device in GiB (default: the device's memory less its headroom)")
    p.add_argument("--time-limit", type=float, default=30.0, metavar="S",
                   help="the search's time limit in wall seconds: CP-SAT's solves (each stopped at its share on "
                        "the wall clock or in CP-SAT's deterministic seconds, whichever comes first; the solve "
                        "pass's wall-stop=inf counts deterministic seconds only, so a seed fixes the plan), the "
                        "interleaved and zero-bubble shapes; pricing the candidates and scanning the Megatron grid "
                        "baseline come on top (printed as the baseline's share of the solve time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="CP-SAT worker count (fixed for determinism)")
    p.add_argument("--warm-start", metavar="PLAN", help="a plan file from an earlier run")
    p.add_argument("--grid2d", action="store_true",
                   help="also search tp x tq meshes with PrimePar's 2-D grids P(q x q) (more shapes to solve)")
    p.add_argument("--no-zero-bubble", action="store_true",
                   help="search Megatron's schedules only (1F1B, interleaved), not torch's zero-bubble ones")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="training precision to plan for (fp32: what `shardc run` trains on CPU processes)")
    p.add_argument("-o", "--output", metavar="PLAN", help="write the chosen plan (and its IR) here")
    p.add_argument("--json", action="store_true")
    _add_pipeline(p, "group-layers,solve{gbs=...} with the options above")

    p = sub.add_parser("compile", help="partition, lower and generate per-rank code")
    _add_model(p)
    p.add_argument("--plan", required=True)
    p.add_argument("-o", "--output", required=True, metavar="DIR")
    _add_pipeline(p, PIPELINES["compile"])

    p = sub.add_parser("run", help="compile and train on local processes")
    _add_model(p)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--plan", help="plan text (default: dp=NPROC) or a plan file FILE.plan written by "
                                      "`shardc plan -o` for NPROC devices")
    group.add_argument("--cluster", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    _add_pipeline(p, PIPELINES["estimate"] + " (for the prediction)")

    p = sub.add_parser("study", help="run many plans for real and compare them with the model's predictions")
    p.add_argument("model")
    p.add_argument("--nproc", default="2,4", help="process counts, e.g. 2 or 2,4")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--plans", metavar="FILE", help="a file with one plan per line")
    group.add_argument("--sweep", metavar="KEYS", help="vary these plan keys, e.g. dp,tp,pp,zero,recompute,mb; or `pipeline`: "
                       "pp vs dp, stage splits, schedules and p2p block size")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--cluster", default=None, metavar="PRESET",
                   help="--device cuda: the GPU preset to predict on (default: the visible GPU's, e.g. H200)")
    p.add_argument("--calibrate-matmuls", action=argparse.BooleanOptionalAction, default=None,
                   help="after the sweep, time matmuls against the device spec (default: on with --device cuda)")
    p.add_argument("--out", required=True, metavar="DIR", help="where the report and results.json go")
    p.add_argument("--steps", type=int, default=STUDY_STEPS,
                   help="measured steps per plan and round (medians; the probe times the machine beside each)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every plan this many times, each round in a shuffled order (--seed); the report gives "
                        "each plan's range over rounds")
    p.add_argument("--seed", type=int, default=0, help="the shuffle of the plans' order in each round")
    p.add_argument("--fresh-profile", action="store_true",
                   help="recalibrate this machine before the sweep (its load changes the predictions)")
    _add_pipeline(p, PIPELINES["study"] + " (its passes before estimate make the graph that runs)")

    p = sub.add_parser("calibrate", help="measure this machine and cache the local profile")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--out", metavar="FILE", help="where to write the profile (default: the cache)")
    p.add_argument("--allow-busy", action="store_true",
                   help="measure even when other processes keep the machine busy (the profile records it, and "
                        "every command using it warns); default: wait up to --wait seconds for quiet, then refuse")
    p.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for the machine to go quiet before measuring (default 60)")
    p.add_argument("--draws", type=int, default=None, metavar="N",
                   help="measure everything N times, one after the other, and keep each figure's median "
                        "(default 3; 1 with --quick)")
    return parser


def _source(args: argparse.Namespace, device: str | None = None) -> Any:
    """The model the command names, with `--device`, `--allow-opaque` and `--input-shape`."""
    shapes = None
    if args.input_shape:
        from shardc.frontend.onnx import parse_input_shapes

        shapes = parse_input_shapes(args.input_shape)
    return open_model(args.model, device=device or args.device, allow_opaque=args.allow_opaque,
                      input_shapes=shapes)


def _flags(args: argparse.Namespace) -> Flags:
    """The pipeline flags; with --json the IR and timings go to stderr, keeping stdout JSON."""
    return Flags(args.pipeline, args.print_after_all, args.time_passes,
                 out=sys.stderr if getattr(args, "json", False) else None)


def cmd_inspect(args: argparse.Namespace) -> int:
    from shardc.passes.annotate_cost import cost_table
    from shardc.passmanager import PassContext

    console = _console()
    graph = _source(args).trace().graph
    pipeline = PIPELINES["inspect"] if args.pipeline is None else args.pipeline
    if pipeline:
        graph = run(graph, pipeline, PassContext(), _flags(args))
    from shardc.frontend import coverage

    rows = cost_table(graph)
    opaque = [n for n in graph.nodes if n.op == "opaque"]
    report = coverage(graph)
    if args.json:
        out = {
            "name": graph.name,
            "params": graph.param_count(),
            "flops_forward": sum(int(r.flops) for r in rows),
            "saved_activation_bytes": sum(int(r.saved_bytes) for r in rows),
            "nodes": len(graph.nodes),
            "opaque_ops": sorted({str(n.attrs.get("target", "?")) for n in opaque}),
            "fallback_ops": [op.target for op in report.fallback],
            "replicated_ops": [op.target for op in report.replicated],
            "layers": [r.to_json() for r in rows],
        }
        print(json.dumps(out, indent=2))
        return 0
    if not args.no_ir:
        print(str(graph), end="")
    from rich.table import Table

    table = Table(title=f"{graph.name}: {graph.param_count():,} parameters, {len(graph.nodes)} nodes")
    for col in ("layer", "block", "nodes", "params", "FLOPs (fwd)", "saved act. bytes"):
        table.add_column(col, justify="left" if col in ("layer", "block") else "right")
    for r in rows:
        table.add_row(r.layer, r.block, str(r.nodes), f"{r.params:,}", f"{r.flops:.3e}", f"{r.saved_bytes:,}")
    console.print(table)
    if not report.complete:
        console.print(str(report))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    """Prints the estimate; a plan that does not fit is still printed (marked) and returns 0."""
    from shardc.cost.report import plot, tables

    cluster: Any = args.cluster
    if args.memory_limit is not None:
        parsed = as_cluster(args.cluster)
        assert parsed is not None  # --cluster is required
        cluster = with_memory_limit(parsed, args.memory_limit)
    result, _ = estimate(_source(args), cluster, args.plan, flags=_flags(args))
    if args.plot:
        plot(result, args.plot)
    console = _console()
    if args.json:
        console.print_json(result.to_json())
        return 0
    for table in tables(result):
        console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")
    if args.plot:
        console.print(f"plot written to {args.plot}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from shardc.search.report import plan_summary, print_plan, write_plan

    started = time.perf_counter()
    graph, ctx = solve(_source(args, device="meta"), args.cluster, args.gbs, flags=_flags(args), time_limit=args.time_limit,
                       seed=args.seed, workers=args.workers, memory_limit_gb=args.memory_limit,
                       warm_start=args.warm_start, grid2d=args.grid2d, dtype=args.dtype,
                       schedules=not args.no_zero_bubble)
    result = ctx.options["search"]
    if args.output:
        write_plan(args.output, graph, result.best, args.gbs)
    summary = plan_summary(graph, result, args.gbs, time.perf_counter() - started)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print_plan(_console(), result.best, result.grid, summary, graph, args.gbs)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from shardc.api import compile_to_dir

    compile_to_dir(args.model, args.plan, args.output, flags=_flags(args))
    print(f"wrote {args.output}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from shardc.run import run_model

    return run_model(args.model, nproc=args.nproc, steps=args.steps, plan=args.plan, cluster=args.cluster,
                     seed=args.seed, json_out=args.json, console=_console(), flags=_flags(args))


def cmd_study(args: argparse.Namespace) -> int:
    from shardc.study.sweep import run_study

    return run_study(args.model, args.nproc, plans_file=args.plans, sweep=args.sweep, device=args.device,
                     out_dir=args.out, steps=args.steps, warmup=args.warmup, console=_console(),
                     fresh_profile=args.fresh_profile, cluster=args.cluster,
                     gpu_calibration=args.calibrate_matmuls, flags=_flags(args), rounds=args.rounds,
                     seed=args.seed)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from shardc.calibration.local import print_profile, run_calibration

    profile = run_calibration(args.out, quick=args.quick, busy="record" if args.allow_busy else "refuse",
                              wait_s=args.wait, draws=args.draws)
    print_profile(profile, _console())
    return 0


COMMANDS = {
    "inspect": cmd_inspect, "estimate": cmd_estimate, "plan": cmd_plan, "compile": cmd_compile,
    "run": cmd_run, "study": cmd_study, "calibrate": cmd_calibrate,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardc` console script."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ShardcError as err:
        print(f"shardc {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"shardc {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
