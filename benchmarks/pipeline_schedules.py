"""Zero-bubble schedules, predicted: the solver's best plan with them against its best
1F1B/interleaved plan, and the predicted zero-bubble gain over 1F1B against sail-sg's measured one.

Part 1 (`--part solver`): GPT-3 175B on 1024xA100-80GB (gbs 1536) and Llama-70B on 64xH100
(gbs 128): one `shardc.search.outer.search` each (the shapes Megatron users run these on: tp=8
inside a node, pp as listed, dp the rest; `--all-shapes` for every shape), and per schedule
family (Megatron's 1F1B/interleaved, zero bubble) the best plan that fits, scored by
`shardc.cost.estimate`; the gain is explained by the bubble each recovers (idle time of the
busiest device) and the memory it spends.

Part 2 (`--part paper`): Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Table 3
(GPT-3-like models 1.5B/6.2B/14.6B/28.3B, sequence 1024, pure pipelines of 8/8/16/32 A100-80GB,
micro-batch 6/3/1/1, 24..256 micro-batches) and Table 4 (measured samples per GPU per second of
1F1B, ZB-1p and ZB-2p). Each configuration is estimated under 1F1B and under the zero-bubble
schedules shardc runs (torch's `zbv`, `interleaved-zb`), and the predicted gain over 1F1B is
printed beside the measured gains of ZB-1p (1F1B's memory) and ZB-2p (twice its activations).
The schedules differ (ZB-1p/2p are sail-sg's searched schedules; zbv is their later ZB-V, which
they report near ZB-2p at ZB-1p's memory), so the comparison is of gains, not of schedules.

Predictions only (no timings of this machine): `python benchmarks/pipeline_schedules.py`.

Part 3 (`--measure`, timings of this machine): the zero-bubble target measured. A pipeline-bound
4-stage GPT (`shardc.study.pipeline_measure`: 8 equal blocks, 8 micro-batches, 1F1B's bubble
27%; `--pp 2`: 4 blocks, 4 micro-batches, 20%) runs under 1F1B, interleaved 1F1B, ZB-V,
interleaved zero bubble and DualPipeV on pp gloo processes, alternating over `--repeats`
rounds (each round every schedule once, in a shuffled order), and the table gives per schedule the predicted step, the measured one (median and
range over rounds), the ratio to 1F1B predicted and measured (paired round by round) and
whether they agree within 10%, then every rank's peak memory measured against predicted. Run
it on a quiet machine, right after `shardc calibrate`: `python benchmarks/pipeline_schedules.py
--measure --repeats 8` (single schedules spread 15-20% over rounds; three do not settle 10%). With fewer
cores than processes the prediction lets a rank idle in a bubble lend its core to the busy ones
(`shardc.cost.pipeline_shared`), as the local cluster's estimate does everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from shardc.driver import estimate, load, solver_batch
from shardc.hardware import parse_cluster
from shardc.search.evaluate import evaluate
from shardc.search.outer import FAMILIES, Found, search
from shardc.search.problem import MeshShape, build_problem, graph_facts
from shardc.search.report import describe

SOLVER_CASES = [
    # name, model spec, cluster, gbs, Megatron-style shapes (pp, dp, cp, tp)
    ("GPT-3 175B, 1024xA100-80GB", "examples/gpt.py:gpt3_175b?vocab_size=51200", "1024xA100-80GB", 1536,
     [(8, 16, 1, 8), (16, 8, 1, 8)]),
    ("Llama-70B, 64xH100", "examples/llama.py:llama_70b", "64xH100", 128, [(4, 2, 1, 8), (8, 1, 1, 8)]),
]

# Qi et al. 2024 (ICLR), Table 3: layers, heads, hidden, GPUs (= pipeline stages), micro-batch size;
# Table 4: per micro-batch count, samples per GPU per second of 1F1B, ZB-1p, ZB-2p (measured).
PAPER = [
    ("1.5B", 22, 24, 2304, 8, 6, {24: (11.8, 12.9, 14.5), 32: (12.5, 13.4, 14.8), 64: (13.6, 14.2, 14.9)}),
    ("6.2B", 30, 32, 4096, 8, 3, {24: (3.50, 3.88, 4.32), 32: (3.70, 4.00, 4.35), 64: (4.03, 4.20, 4.39)}),
    ("14.6B", 46, 40, 5120, 16, 1, {48: (1.40, 1.61, 1.81), 64: (1.49, 1.67, 1.83), 128: (1.64, 1.76, 1.85)}),
    ("28.3B", 62, 48, 6144, 32, 1, {96: (0.76, 0.87, 0.99), 128: (0.80, 0.90, 1.00), 256: (0.88, 0.96, 1.00)}),
]
PAPER_SCHEDULES = ("zbv", "interleaved-zb")


def idle(found: Found) -> float:
    """The busiest device's idle share of the step (the `bubble` category of the estimate)."""
    assert found.estimate is not None
    s = min(found.estimate.stages, key=lambda x: x.time.get("bubble", 0.0))
    return s.time.get("bubble", 0.0) / found.estimate.step_time_s


def solver_part(time_limit: float, all_shapes: bool, only: str | None = None) -> None:
    print(f"{'case':28} {'family':17} {'step s':>8} {'mem GiB':>8} {'idle':>6}  plan")
    for name, spec, cluster_name, gbs, shapes in SOLVER_CASES:
        if only is not None and not name.startswith(only):
            continue
        t0 = time.perf_counter()
        cluster = parse_cluster(cluster_name)
        facts = graph_facts(load(spec, batch=solver_batch(gbs)), cluster)
        chosen = None if all_shapes else [MeshShape(*s) for s in shapes]
        # wall_stop=inf: the CP-SAT solves stop by deterministic time, not by a loaded machine's clock
        result = search(facts, cluster, gbs, float(cluster.device.usable_memory_bytes), time_limit, shapes=chosen,
                        wall_stop=float("inf"))
        for family in FAMILIES:
            f = result.families.get(family)
            if f is None:
                print(f"{name:28} {family:17} {'none fits':>8}")
                continue
            print(f"{name:28} {family:17} {f.step_time_s:8.3f} {f.memory_per_device_bytes / 2**30:8.1f} "
                  f"{idle(f):6.1%}  {describe(f)}")
        for line in result.log:
            print(f"{'':28} {line}")
        zb, mg = result.families.get("zero-bubble"), result.families.get("1f1b/interleaved")
        if zb is not None:  # the schedule's own share: the same plan (partitions, stages, ZeRO) under 1F1B
            flat = dataclasses.replace(zb.problem.shape, vpp=1, schedule="")
            same = build_problem(facts, cluster, flat, zb.problem.mb, gbs)
            a = zb.assignment
            if len(a.stages) != flat.pp:  # virtual stages folded onto their devices' stage
                a = dataclasses.replace(a, stages=tuple(tuple(int(sum(r[k] for r in a.stages[d::flat.pp]))
                                                              for k in range(3)) for d in range(flat.pp)))
            ev = evaluate(same, a, float(cluster.device.usable_memory_bytes))
            print(f"{'':28} the zero-bubble plan under 1F1B: {ev.step_time_s:.3f} s, "
                  f"{ev.memory_per_device_bytes / 2**30:.1f} GiB ({'fits' if ev.fits else 'does not fit'}; by "
                  f"evaluate): the schedule alone {ev.step_time_s / zb.evaluation.step_time_s:.3f}x")
        if zb is not None and mg is not None:
            print(f"{'':28} zero bubble / 1F1B-interleaved: {mg.step_time_s / zb.step_time_s:.3f}x; idle "
                  f"{idle(mg):.1%} -> {idle(zb):.1%} of the step, memory {mg.memory_per_device_bytes / 2**30:.1f}"
                  f" -> {zb.memory_per_device_bytes / 2**30:.1f} GiB ({time.perf_counter() - t0:.0f} s)")


def paper_part(only: str | None = None) -> None:
    print("Qi et al., ICLR 2024, Tables 3-4: gain over 1F1B, measured (ZB-1p, ZB-2p) vs predicted")
    print(f"{'model':6} {'pp':>3} {'m':>4} {'1F1B s':>8} " + " ".join(f"{s + ' s':>17}" for s in PAPER_SCHEDULES)
          + f" {'ZB-1p meas':>10} {'ZB-2p meas':>10} " + " ".join(f"{s + ' pred':>19}" for s in PAPER_SCHEDULES))
    for name, layers, heads, hidden, gpus, mb, measured in PAPER:
        if only is not None and name != only:
            continue
        spec = (f"examples/gpt.py:gpt?n_layer={layers}&n_embd={hidden}&n_head={heads}&vocab_size=51200"
                f"&seq=1024&batch=2&tie=false")
        cluster = f"{gpus // 8}x8xA100-80GB" if gpus > 8 else "8xA100-80GB"
        for m, (one, zb1, zb2) in measured.items():
            base = f"pp={gpus},mb={mb},gbs={mb * m},compile=1"
            t = {"1f1b": estimate(spec, cluster, base)[0].step_time_s}
            for s in PAPER_SCHEDULES:
                vpp = 2 if s == "zbv" else 1
                if gpus * vpp <= layers:  # a virtual stage per block at least (zbv: 64 > 62 for 28.3B)
                    t[s] = estimate(spec, cluster, f"{base},schedule={s},vpp={vpp}")[0].step_time_s
            print(f"{name:6} {gpus:3} {m:4} {t['1f1b']:8.3f} "
                  + " ".join(f"{t[s]:17.3f}" if s in t else f"{'n/a':>17}" for s in PAPER_SCHEDULES)
                  + f" {zb1 / one - 1:10.1%} {zb2 / one - 1:10.1%} "
                  + " ".join(f"{t['1f1b'] / t[s] - 1:19.1%}" if s in t else f"{'n/a':>19}" for s in PAPER_SCHEDULES))


def measure_part(args: argparse.Namespace) -> None:
    from shardc.study.pipeline_measure import format_tables, measure_model, oversubscribed, run_measure

    model = args.measure_model or measure_model(args.pp)
    note = oversubscribed(args.pp)
    if note:
        print(f"note: {note}")
    data = run_measure(args.out, repeats=args.repeats, steps=args.steps, warmup=args.warmup, model=model,
                       pp=args.pp, fresh_profile=args.fresh_profile)
    print(f"{model}, pp={args.pp}: {args.repeats} round(s) of {args.steps} measured steps "
          f"(results in {args.out}/results.json)")
    print(format_tables(data))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["solver", "paper", "both"], default="both")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--all-shapes", action="store_true", help="every mesh shape, not Megatron's usual ones")
    ap.add_argument("--model", help="only this model: one of the paper's (1.5B, ...) or a solver case's name start")
    ap.add_argument("--measure", action="store_true", help="measure the schedules on local processes (part 3) instead")
    ap.add_argument("--repeats", type=int, default=8, help="--measure: rounds, each running every schedule once")
    ap.add_argument("--steps", type=int, default=6, help="--measure: measured steps per plan per round")
    ap.add_argument("--warmup", type=int, default=2, help="--measure: steps before those")
    ap.add_argument("--pp", type=int, default=4, help="--measure: pipeline stages (processes)")
    ap.add_argument("--measure-model", help="--measure: the model spec (default: 2pp equal GPT blocks, batch 2pp)")
    ap.add_argument("--out", default="out/pipeline-measure", help="--measure: the study directory (resumed if there)")
    ap.add_argument("--fresh-profile", action="store_true", help="--measure: calibrate this machine first")
    args = ap.parse_args()
    if args.measure:
        measure_part(args)
        return
    if args.part in ("paper", "both"):
        paper_part(args.model)
    if args.part in ("solver", "both"):
        solver_part(args.time_limit, args.all_shapes, args.model)


if __name__ == "__main__":
    main()
