"""Plan quality: the solver's plan against the best grid plan, on the cases of issue 4.

The grid is every Megatron-LM configuration (`shardc.search.grid`: tp, pp, dp, vpp, cp, sp,
micro-batch, recompute none/selective/full or the first N blocks of every chunk, ZeRO 0/1).

    .venv/bin/python benchmarks/plan_quality.py [--time-limit S] [--wall-stop X] [--only NAME] [--markdown]
    .venv/bin/python benchmarks/plan_quality.py --measure [--cases NAME ...] [--steps N] [--repeats R]

For each case: predicted step time of the solver's plan and of the best grid plan, both by
`shardc.cost.estimate` on the graph annotated with the plan (the numbers `shardc plan`
prints), their ratio, memory per device, and wall-clock solve time on this machine. Models are
the example specs traced on the meta device, as `shardc plan SPEC` traces them (tracing is in
the total time, not in the solve time). GPT-3 175B (vocabulary padded to 51200 as Megatron's)
is also compared with Megatron's published configuration (t=8, p=16, d=8, full recomputation).

With `--measure`, small memory-tight cases on `local4` instead: both plans trained for real,
interleaved, measured beside their predictions (`plan_measure.py` beside this file).
"""

from __future__ import annotations

import argparse
import time

from shardc.driver import load, solver_batch
from shardc.hardware import parse_cluster
from shardc.ir import RECOMPUTE_CHOICES
from shardc.search.cpsat import solve
from shardc.search.evaluate import evaluate
from shardc.search.grid import grid_assignments
from shardc.search.outer import WALL_STOP, Found, score, search
from shardc.search.problem import MeshShape, build_problem, graph_facts

GPT3 = "examples/gpt.py:gpt3_175b?vocab_size=51200"
LLAMA_7B = "examples/llama.py:llama_7b?seq=2048"
# Llama-2-13B at its own 4096-token context on one DGX A100-40GB node: at the device's usable
# memory (40 GiB less the CUDA context, NCCL's buffers and 5% fragmentation: 36.5 GiB) every
# Megatron point must recompute, so this is memory-tight without a limit of our choosing.
LLAMA_13B_4K = "examples/llama.py:llama_13b?seq=4096"
CASES = [
    # name, model spec (traced at the global batch, as `shardc plan`), cluster, gbs, memory limit GiB
    # (None: the device's usable memory, its capacity less its headroom)
    ("GPT-2 1.5B, 8xA100-40GB", "examples/gpt.py:gpt2_xl", "8xA100-40GB", 64, None),
    ("Llama-7B, 8xH100", LLAMA_7B, "8xH100", 64, None),
    ("Llama-70B, 64xH100", "examples/llama.py:llama_70b", "64xH100", 128, None),
    ("GPT-3 175B, 1024xA100-80GB", GPT3, "1024xA100-80GB", 1536, None),
    ("Llama-7B 32k seq, 8xH100", "examples/llama.py:llama_7b?seq=32768", "8xH100", 8, None),
    ("memory-tight: Llama-2-13B 4k seq, 8xA100-40GB", LLAMA_13B_4K, "8xA100-40GB", 64, None),
    # Llama-7B squeezed to 20 GiB: a tie until session 7 (the grid's tp=4 x pp=2 with sp, mb=2,
    # recomputing 1 of each stage's 16 blocks); since session 7's pricing the grid's best is
    # interleaved (vpp=2, mb=1) and the solver's per-stage recomputation (mb=2) wins by 0.8%
    ("Llama-7B, 8xA100-40GB at 20 GiB", LLAMA_7B, "8xA100-40GB", 64, 20.0),
]


def run_case(name, spec, cluster_name, gbs, limit_gb, time_limit, grid2d=False, wall_stop=WALL_STOP):
    t0 = time.perf_counter()
    graph = load(spec, batch=solver_batch(gbs))
    cluster = parse_cluster(cluster_name)
    limit = limit_gb * 2**30 if limit_gb else float(cluster.device.usable_memory_bytes)
    facts = graph_facts(graph, cluster)
    result = search(facts, cluster, gbs, limit, time_limit, grid2d=grid2d, wall_stop=wall_stop)
    wall = time.perf_counter() - t0
    best, grid = result.best, result.grid
    row = {"case": name, "solve_s": result.solve_time_s, "baseline_s": result.baseline_s, "total_s": wall,
           "gap": result.gap,
           "solved": result.shapes_solved, "pruned": result.shapes_pruned}
    if best is not None:
        row |= {"step_s": best.step_time_s, "mem_gib": best.memory_per_device_bytes / 2**30, "source": best.source,
                "eval_s": best.evaluation.step_time_s,
                "plan": f"{best.problem.shape}, mb={best.problem.mb}, zero={best.assignment.zero}, "
                        f"blocks {describe_stages(best)}"}
    if grid is not None:
        row |= {"grid_step_s": grid.step_time_s, "grid_mem_gib": grid.memory_per_device_bytes / 2**30,
                "grid_plan": grid.grid_point.plan_string(gbs)}
    if best is not None and grid is not None and best is not grid:
        row |= {"categories": categories(best), "grid_categories": categories(grid)}
    if spec == GPT3:
        problem = build_problem(facts, cluster, MeshShape(16, 8, 1, 8), 1, gbs)
        found = [Found(problem, a, evaluate(problem, a, limit), "grid", grid_point=p)
                 for p, a in grid_assignments(problem) if p.recompute == "full" and p.zero == 0 and not p.sp]
        for f in found:
            score(f, cluster)
            if f.memory_per_device_bytes <= limit:
                row["megatron_step_s"] = f.step_time_s
    return row


def categories(found) -> dict[str, float]:
    """Seconds by time category on the busiest device (the stage with the least bubble), by estimate."""
    stage = min(found.estimate.stages, key=lambda s: s.time.get("bubble", 0.0))
    return {k: round(v, 3) for k, v in stage.time.items() if v}


def describe_stages(found) -> str:
    a = found.assignment
    text = ["+".join(f"{k}{r[0]}" for k, r in zip(row, RECOMPUTE_CHOICES) if k) or "0" for row in a.stages]
    out = text[0] if len(set(text)) == 1 else "|".join(text)
    if a.stage_choice:
        differ = sum(1 for g, v in enumerate(found.problem.groups) if v.section == "block"
                     and len({a.at(s)[g] for s in range(len(a.stages))}) > 1)
        out += f", per-stage partitions ({differ} block groups differ)"
    return out


def one_shape(time_limit: float = 10.0) -> list[str]:
    """Solve time of one mesh shape of a 32-layer model (Llama-7B on 8xH100), problem build included."""
    graph = load(LLAMA_7B, batch=solver_batch(64))
    cluster = parse_cluster("8xH100")
    facts = graph_facts(graph, cluster)
    rows = []
    for shape in (MeshShape(4, 2, 1, 1), MeshShape(2, 1, 1, 4), MeshShape(1, 2, 1, 4)):
        t0 = time.perf_counter()
        problem = build_problem(facts, cluster, shape, 1, 64)
        result = solve(problem, float(cluster.device.usable_memory_bytes), time_limit)
        rows.append(f"| Llama-7B (32 blocks), 8xH100, one shape {shape}, mb=1 | {time.perf_counter() - t0:.2f} s | "
                    f"{result.status}, gap {result.gap:.1%} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=None,
                    help="the search's time limit in seconds, as `shardc plan --time-limit` (default 30; with "
                         "--measure 3, the closed-loop tests' limit); tracing, pricing and the grid scan come on "
                         "top: the table's total")
    ap.add_argument("--wall-stop", type=float, default=WALL_STOP,
                    help=f"stop solving past this multiple of the time limit on the wall clock (default {WALL_STOP}, "
                         "as `shardc plan`; inf: never, so that the plan depends on the seed only, not on the load)")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this text")
    ap.add_argument("--grid2d", action="store_true", help="also search tp x tq meshes (PrimePar's 2-D grids)")
    ap.add_argument("--measure", action="store_true",
                    help="train the solver's and the best grid plan on local4 and compare measured with predicted")
    ap.add_argument("--cases", nargs="*", default=None, help="with --measure: the cases to run (default: all)")
    ap.add_argument("--steps", type=int, default=6, help="with --measure: training steps per run, the first untimed")
    ap.add_argument("--repeats", type=int, default=5, help="with --measure: runs of each plan, interleaved")
    args = ap.parse_args()
    if args.measure:
        # beside this file: the script's directory is on sys.path
        from plan_measure import main_measure, select

        main_measure(select(args.cases), args.steps, args.repeats, args.time_limit or 3.0)
        return
    rows = []
    for case in CASES:
        if args.only and args.only.lower() not in case[0].lower():
            continue
        row = run_case(*case, args.time_limit or 30.0, args.grid2d, args.wall_stop)
        rows.append(row)
        print(row, flush=True)
    print()
    if not args.only:
        print("| one mesh shape | build + solve | status |")
        print("|---|---|---|")
        for line in one_shape():
            print(line)
        print()
    print("| case | solver step (s) | grid step (s) | grid / solver | solver mem (GiB) | grid mem (GiB) | solve (s) | gap | solver plan | best grid plan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["grid_step_s"] / r["step_s"] if "grid_step_s" in r and "step_s" in r else float("nan")
        print(f"| {r['case']} | {r.get('step_s', float('nan')):.3f} | {r.get('grid_step_s', float('nan')):.3f} | "
              f"{ratio:.3f} | {r.get('mem_gib', float('nan')):.1f} | {r.get('grid_mem_gib', float('nan')):.1f} | "
              f"{r['solve_s']:.1f} | {r['gap']:.1%} | {r.get('plan', '-')} | {r.get('grid_plan', 'none fits')} |")
        if "megatron_step_s" in r:
            print(f"| (Megatron t=8, p=16, d=8, full recompute) | {r['megatron_step_s']:.3f} | | "
                  f"{r['megatron_step_s'] / r['step_s']:.3f} | | | | | | |")


if __name__ == "__main__":
    main()
