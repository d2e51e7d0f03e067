"""Runtime benchmark: shardc's generated TP and DP against torch's own, side by side in one run.

    .venv/bin/python benchmarks/runtime.py [--nproc 2] [--steps 10] [--model SPEC]

On the same processes and the same model, four trainers take turns, one step each per round
(so load on the machine hits them alike): shardc's `plan.parallelize` under `tp=N` and under
`dp=N`, torch's `parallelize_module` with the Megatron column/row plan (`eject.megatron_plan`)
and torch's `DistributedDataParallel`. Each step is forward + backward + AdamW. The table gives
median step times and the ratios ours/torch (targets: <= 1.0 for TP, <= 1.05 for DP); the
difference is the overhead of generated code over hand-written sharded code.

A second table (`--compiled-model`, default the study's model, `shardc.study.plans.DEFAULT_MODEL`)
times shardc's own modules eager (`compile=0`) and through torch.compile (`compile=1`, inductor)
under `dp=N` and `tp=N`, taking turns the same way, and prints the ratio compiled / eager
(below 1: fusion pays on this machine). Compilation happens in the warm-up steps, not timed;
`--compiled-model ""` skips the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

DEFAULT_MODEL = "examples/llama.py:tiny?n_layer=4&dim=256&n_head=8&n_kv_head=4&ffn_hidden=640&vocab_size=1024&batch=8&seq=64"


def _trainers(spec: str, nproc: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from shardc.api import compile as shardc_compile
    from shardc.backends.torch.eject import apply_tensor_parallel
    from shardc.frontend.spec import load_model

    def fresh() -> tuple[Any, tuple[Any, ...]]:
        torch.manual_seed(0)
        loaded = load_model(spec, device="cpu")
        return loaded.model, tuple(loaded.example_inputs)

    def lm_loss(model: Any, idx: Any, targets: Any) -> Any:
        logits = model(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    out: dict[str, Any] = {}
    model, example = fresh()
    batch = example[0].shape[0]  # one micro-batch of the whole batch: the same work as torch's side
    ours_tp = shardc_compile(model, example, plan=f"tp={nproc},mb={batch},dtype=fp32").parallelize(model)
    out["shardc tp"] = (ours_tp, lambda m, b: m(*b))
    model, example = fresh()
    mesh = init_device_mesh("cpu", (nproc,), mesh_dim_names=("tp",))
    out["torch parallelize_module tp"] = (apply_tensor_parallel(model, mesh["tp"]), lambda m, b: lm_loss(m, *b))
    model, example = fresh()
    ours_dp = shardc_compile(model, example, plan=f"dp={nproc},mb={batch // nproc},dtype=fp32").parallelize(model)
    out["shardc dp"] = (ours_dp, lambda m, b: m(*b))
    model, example = fresh()
    rank, share = torch.distributed.get_rank(), example[0].shape[0] // nproc
    ddp = DistributedDataParallel(model)
    out["torch DDP"] = (ddp, lambda m, b: lm_loss(m, b[0][rank * share:(rank + 1) * share],
                                                      b[1][rank * share:(rank + 1) * share]))
    out["_example"] = example
    return out


def _compiled_trainers(spec: str, nproc: int) -> dict[str, Any]:
    """shardc's modules of `spec` under dp=N and tp=N, eager and compiled (fp32, one micro-batch)."""
    import torch

    from shardc.api import compile as shardc_compile
    from shardc.frontend.spec import load_model

    out: dict[str, Any] = {}
    for plan in (f"dp={nproc}", f"tp={nproc}"):
        for flag, how in (("0", "eager"), ("1", "compiled")):
            torch.manual_seed(0)
            loaded = load_model(spec, device="cpu")
            example = tuple(loaded.example_inputs)
            mb = example[0].shape[0] // (nproc if plan.startswith("dp") else 1)
            compiled = shardc_compile(loaded.model, example, plan=f"{plan},mb={mb},dtype=fp32,compile={flag}")
            out[f"{plan} {how}"] = (compiled.parallelize(loaded.model), lambda m, b: m(*b))
            out["_example"] = example
    return out


def bench_worker(rank: int, world: int, spec: str, steps: int, warmup: int,
                 compiled: bool = False) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    trainers = (_compiled_trainers if compiled else _trainers)(spec, world)
    batch = trainers.pop("_example")
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, _) in trainers.items()}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for step in range(warmup + steps):
        for name, (module, loss_of) in trainers.items():
            dist.barrier()
            start = time.perf_counter()
            loss = loss_of(module, batch)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            dist.barrier()
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--compiled-model", default=None, help="the model of the compiled vs eager table "
                        "(default: the study's model; empty: skip the table)")
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from shardc.backends.torch.launch import spawn

    results = spawn(bench_worker, args.nproc, args.model, args.steps, args.warmup, timeout_s=1800)
    # a step is as slow as its slowest rank
    medians = {k: statistics.median(max(r[k][i] for r in results) for i in range(args.steps)) for k in results[0]}
    table = Table(title=f"step time, {args.nproc} processes, {args.steps} steps (median), {args.model}")
    for col in ("trainer", "median step (ms)", "ours / torch"):
        table.add_column(col, justify="left" if col == "trainer" else "right")
    pairs = {"shardc tp": "torch parallelize_module tp", "shardc dp": "torch DDP"}
    for name, value in medians.items():
        ratio = f"{value / medians[pairs[name]]:.3f}" if name in pairs else ""
        table.add_row(name, f"{value * 1e3:.2f}", ratio)
    Console().print(table)
    from shardc.study.plans import DEFAULT_MODEL as STUDY_MODEL

    spec = STUDY_MODEL if args.compiled_model is None else args.compiled_model
    if spec:
        Console().print(compiled_table(spec, args.nproc, args.steps, args.warmup))
    return 0


def compiled_table(spec: str, nproc: int, steps: int, warmup: int) -> Any:
    """The compiled vs eager rows: median step of each, and compiled / eager per plan."""
    from rich.table import Table

    from shardc.backends.torch.launch import spawn

    results = spawn(bench_worker, nproc, spec, steps, warmup, True, timeout_s=3600)
    medians = {k: statistics.median(max(r[k][i] for r in results) for i in range(steps)) for k in results[0]}
    table = Table(title=f"compiled (torch.compile, inductor) vs eager, {nproc} processes, {steps} steps "
                        f"(median), {spec}")
    for col in ("plan", "eager step (ms)", "compiled step (ms)", "compiled / eager"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for plan in dict.fromkeys(k.rsplit(" ", 1)[0] for k in medians):
        eager, fused = medians[f"{plan} eager"], medians[f"{plan} compiled"]
        table.add_row(plan, f"{eager * 1e3:.2f}", f"{fused * 1e3:.2f}", f"{fused / eager:.3f}")
    return table


if __name__ == "__main__":
    sys.exit(main())
