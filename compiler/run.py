"""`shardc run MODEL --nproc N --steps K [--plan P | --cluster C]`: compile, train on N local processes.

Rule: the plan (from `--plan`: plan text, or a plan file `shardc plan -o` wrote, which runs the
solver's partitions, stages and recomputation as the file says; else data parallel over all
processes) must use exactly N devices. The cost model predicts step time and per-rank memory for the cluster (`--cluster`,
else this machine's calibrated `local` profile when one is cached); the plan is compiled once
here and torchrun starts N workers (`python -m shardc.run`, launched by
`shardc.backends.torch.launch`), gloo on CPU, NCCL when every worker has a GPU. Each worker
trains in the loop the study uses too (`shardc.train`): the model built with `--seed`, K AdamW
steps on synthetic data fixed by the seed, and reports its losses, step times (median of steps
after the first) and peak memory (one more step under the memory tracker, with the optimizer
state in place: every live tensor storage by role on CPU, `torch.cuda.max_memory_allocated` on
GPU). A worker that fails makes torchrun stop the others; the error names the rank and its
exception. The whole run is bounded by a timeout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from shardc.driver import Flags, estimate, plan_file_of
from shardc.ir.diagnostics import ShardcError
from shardc.ir.files import write_json_atomic
from shardc.plan.file import PlanFile
from shardc.plan.parallel import ParallelPlan
from shardc.train import Hooks, Trainee, TrainOptions, parallelized, train

DEFAULT_TIMEOUT_S = 600.0


def resolve_file(plan: str | os.PathLike[str] | PlanFile | None, nproc: int) -> PlanFile | None:
    """The plan file `plan` names (`driver.plan_file_of`), checked to be a plan for `nproc`
    devices; None when `plan` is plan text (or None)."""
    if nproc < 1:
        raise ShardcError(f"--nproc must be >= 1, got {nproc}")
    file = plan_file_of(plan)
    if file is not None and file.plan.devices != nproc:
        raise ShardcError(f"plan file {file.path} is a plan for {file.plan.devices} devices ({file.plan}) but --nproc "
                          f"is {nproc}", hint=f"run it with --nproc {file.plan.devices}, or plan again for {nproc} "
                          f"devices (`shardc plan --cluster local{nproc} -o FILE.plan`)")
    return file


def resolve_plan(plan: str | None, nproc: int, on_gpus: bool | None = None) -> ParallelPlan:
    """The plan to run: `plan` or data parallel over `nproc`; checks the size. A dtype the plan
    names is run as named (bf16/fp16 mixed precision on CPU processes too). A plan that names
    none runs the plan default (bf16) on GPUs but fp32 on CPU processes (`on_gpus`; None: the
    launcher's choice): the model is built in fp32 and CPU matmuls gain nothing from bf16, so
    a CPU run is the fp32 model's unless asked otherwise. The prediction prices the same dtype."""
    if nproc < 1:
        raise ShardcError(f"--nproc must be >= 1, got {nproc}")
    parsed = ParallelPlan.parse(plan if plan else f"dp={nproc}")
    if "dtype=" not in (plan or "") and not (_on_gpus() if on_gpus is None else on_gpus):
        parsed = dataclasses.replace(parsed, dtype="fp32")
    if parsed.devices != nproc:
        raise ShardcError(f"plan {plan!r} uses dp*tp*pp*cp = {parsed.devices} devices but --nproc is {nproc}",
                          hint=f"run with --nproc {parsed.devices}, or change the plan's degrees to multiply to {nproc}")
    return parsed


def _on_gpus() -> bool:
    """Whether `shardc run` will train on CUDA devices (the launcher's own choice)."""
    from shardc.backends.torch.launch import choose_backend

    return choose_backend(1) == "nccl"


def prediction_cluster(cluster: str | None, nproc: int) -> str:
    """The cluster `shardc run` predicts for: `--cluster` (`local` meaning this machine with
    `nproc` processes), else the visible GPUs, else this machine's calibrated profile (a
    ShardcError when it was never calibrated)."""
    if cluster is None and _on_gpus():
        from shardc.calibration.gpu import detected_preset

        return f"{nproc}x{detected_preset()}"  # the processes run on these GPUs
    if cluster is None:
        from shardc.calibration.local import load_profile

        load_profile(calibrate_if_missing=False)  # raises when this machine was never calibrated
        return f"local{nproc}"
    return f"local{nproc}" if cluster == "local" else cluster


def predict(spec: str, plan: ParallelPlan | PlanFile, cluster: str | None, nproc: int,
            flags: Flags | None = None) -> tuple[Any, str]:
    """(Estimate or None, a note on where the prediction came from or why there is none): the
    driver's `estimate` pipeline, as `shardc estimate` runs it (for a plan file: the estimate
    of the graph the file partitions, the one that runs)."""
    try:
        cluster = prediction_cluster(cluster, nproc)
        est, _ = estimate(spec, cluster, plan, flags=flags or Flags())
        return est, f"cost model on cluster {cluster}"
    except ShardcError as err:
        return None, f"no prediction: {err.message}"
    except Exception as err:  # the prediction is a report, never a reason not to train
        return None, f"no prediction: {type(err).__name__}: {err}"


def _check_batch(spec: str, file: PlanFile, example_inputs: Any) -> None:
    """The workers train on the spec's example batch: it must be the plan file's global batch."""
    firsts = {x.shape[0] for x in example_inputs if hasattr(x, "shape") and len(x.shape)}
    gbs = file.plan.global_batch()
    if firsts and firsts != {gbs}:
        raise ShardcError(f"plan file {file.path} was planned for a global batch of {gbs} sequences, but model {spec} "
                          f"trains on a batch of {sorted(firsts)[0]}",
                          hint=f"give the model its plan's batch (e.g. `{spec.split('?')[0]}?batch={gbs}`), or plan "
                          "again with --gbs set to the model's batch")


def _plan_of(plan: ParallelPlan | PlanFile) -> ParallelPlan:
    return plan.plan if isinstance(plan, PlanFile) else plan


def _predicted_memory(est: Any, plan: ParallelPlan | PlanFile, rank: int) -> int | None:
    if est is None or not est.stages:
        return None
    plan = _plan_of(plan)
    pp_rank = rank // (plan.dp * plan.ep * plan.cp * plan.tp)
    stage = est.stages[min(pp_rank, len(est.stages) - 1)]
    return int(stage.rank_memory_bytes(plan.mesh().coordinates(rank)))


def launch(spec: str, plan: ParallelPlan | PlanFile, *, nproc: int, steps: int, seed: int, timeout_s: float,
           env: dict[str, str] | None = None, cluster: str | None = None,
           state_out: Path | None = None) -> list[dict[str, Any]]:
    """Train on `nproc` torchrun workers; each rank's report, or a ShardcError naming the failed rank.

    The plan is compiled here, once, for the model built with `seed`; every worker loads it. A
    plan file is compiled as `shardc.compile` does (its partitions priced on `cluster`, else the
    one it records); the model's example batch must be the file's global batch, the batch the
    workers train on. With `state_out`, rank 0 saves every parameter unsharded there after the
    last step (`CompiledPlan.full_state_dict`; the memory-tracked step is the last update)."""
    return launch_all([(spec, plan)], nproc=nproc, steps=steps, seed=seed, timeout_s=timeout_s, env=env,
                      cluster=cluster, state_outs=None if state_out is None else [state_out])[0]


def launch_all(runs: list[tuple[str, ParallelPlan | PlanFile]], *, nproc: int, steps: int, seed: int,
               timeout_s: float, env: dict[str, str] | None = None, cluster: str | None = None,
               state_outs: list[Path] | None = None) -> list[list[dict[str, Any]]]:
    """`launch` for several (model spec, plan) runs in one torchrun: the workers start and join
    the group once and train each run in turn, on a fresh model, optimizer and memory tracker.
    Per run, each rank's report; `state_outs[i]` receives run i's final parameters."""
    import torch

    from shardc.backends.torch.launch import torchrun

    with tempfile.TemporaryDirectory(prefix="shardc-run-") as tmp:
        out = Path(tmp)
        entries = []
        for i, (spec, plan) in enumerate(runs):
            torch.save(_compiled(spec, plan, seed, cluster), out / f"compiled{i}.pt")
            entries.append({"model": spec, "compiled": f"compiled{i}.pt",
                            "state_out": None if state_outs is None else str(state_outs[i])})
        config = {"runs": entries, "steps": steps, "seed": seed, "out_dir": str(out),
                  "pg_timeout_s": min(60.0, timeout_s)}
        write_json_atomic(out / "config.json", config)
        code, log = torchrun(nproc, "shardc.run", [str(out / "config.json")],
                             timeout_s=timeout_s, log_dir=out, env=env)
        errors = sorted(out.glob("rank*.error"), key=lambda p: p.stat().st_mtime)
        if code != 0 or errors:
            if errors:
                first = errors[0]
                rank = first.stem.removeprefix("rank")
                text = first.read_text().strip()
                head = text.splitlines()[0]
                raise ShardcError(f"rank {rank} failed: {head}; the other ranks were stopped "
                                  f"(torchrun exit code {code})", hint=_last_frame(text))
            if code == -9:
                raise ShardcError(f"the run did not finish within {timeout_s:.0f} s and was killed",
                                  hint="raise the timeout or use fewer steps")
            raise ShardcError(f"torchrun failed with exit code {code}:\n{log[-3000:]}")
        per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    return [[reports[i] for reports in per_rank] for i in range(len(runs))]


def _compiled(spec: str, plan: ParallelPlan | PlanFile, seed: int, cluster: str | None) -> Any:
    """`plan` compiled for the model `spec` builds with `seed` (real weights on the CPU)."""
    import torch

    from shardc.api import compile as shardc_compile
    from shardc.frontend.spec import load_model

    torch.manual_seed(seed)
    loaded = load_model(spec, device="cpu")
    named: dict[str, Any] = {}
    if isinstance(plan, PlanFile):  # traced under the spec's name and input names, as `shardc plan` traced it
        _check_batch(spec, plan, loaded.example_inputs)
        named = {"name": loaded.name, "input_names": loaded.input_names, "cluster": cluster}
    return shardc_compile(loaded.model, tuple(loaded.example_inputs), plan=plan, **named)


def worker_main(config_path: str) -> int:
    """One rank of `shardc run` under torchrun: join the group, train each compiled run in turn
    (`shardc.train.train`, `steps` AdamW steps: the first untimed; its final parameters saved
    unsharded by rank 0 when asked), write `rank<k>.json` (the reports, one per run); a failure
    is written to `rank<k>.error` and re-raised, so torchrun stops the others."""
    import gc

    import torch
    import torch.distributed as dist

    config = json.loads(Path(config_path).read_text())
    out_dir = Path(config["out_dir"])
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        device = _join_group(config)
        steps = config["steps"]
        options = TrainOptions(steps=max(1, steps - 1), warmup=min(1, steps - 1), lr=config.get("lr", 1e-3),
                               seed=config["seed"])
        reports = []
        for run in config["runs"]:
            reports.append(_train_one(out_dir / run["compiled"], run["model"], options, device, rank,
                                      run.get("state_out")))
            gc.collect()  # the last run's module and optimizer state must not count in the next one's memory
        write_json_atomic(out_dir / f"rank{rank}.json", reports)
        dist.destroy_process_group()
        return 0
    except BaseException as err:
        (out_dir / f"rank{rank}.error").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise


def _train_one(path: Path, spec: str, options: TrainOptions, device: Any, rank: int,
               state_out: str | None) -> dict[str, Any]:
    """Train one compiled plan on this rank; its report (and rank 0 saves its final state)."""
    import torch

    compiled = torch.load(path, weights_only=False)
    built: list[Trainee] = []

    def build(plan: Any, model: Any, on: Any) -> Trainee:  # keeps the module, for its final state
        built.append(parallelized(plan, model, on))
        return built[-1]

    report = train(compiled, spec, options, device=device, build=build, hooks=_InjectedFailure(rank))
    if state_out:
        state = compiled.full_state_dict(built[-1].module)  # a collective: every rank takes part
        if rank == 0:
            tmp = Path(state_out + ".tmp")
            torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, tmp)
            os.replace(tmp, state_out)
    return {"rank": rank, "losses": list(report.losses), "step_times_s": list(report.step_times_s),
            "median_step_time_s": report.median_step_s, "peak_memory_bytes": report.peak_memory_bytes,
            "peak_memory_breakdown": dict(report.memory.get("peak_breakdown", {})),
            **{key: report.memory[key] for key in ("peak_storages", "peak_when") if key in report.memory},
            "backend": report.backend, "device": report.device,
            "collectives": [dict(c) for c in report.collectives]}  # the tracked (last) step's


def _join_group(config: dict[str, Any]) -> Any:
    """Join torchrun's process group on the launcher's backend; this rank's device."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardc.backends.torch.launch import PG_TIMEOUT_S, choose_backend

    backend = choose_backend(int(os.environ["WORLD_SIZE"]), config.get("device"), fallback=False)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=config.get("pg_timeout_s", PG_TIMEOUT_S)))
    return device


class _InjectedFailure(Hooks):
    """`SHARDC_FAIL_RANK=r SHARDC_FAIL_STEP=k`: rank r raises before step k (the failure tests)."""

    def __init__(self, rank: int) -> None:
        fail_rank = os.environ.get("SHARDC_FAIL_RANK")
        mine = fail_rank is not None and int(fail_rank) == rank
        self.step = int(os.environ.get("SHARDC_FAIL_STEP", "0")) if mine else None

    def before_step(self, index: int, timed: bool) -> None:
        if index == self.step:
            raise RuntimeError(f"injected failure (SHARDC_FAIL_RANK, step {index})")


def _last_frame(traceback_text: str) -> str:
    frames = [line.strip() for line in traceback_text.splitlines() if line.strip().startswith("File ")]
    return f"raised at {frames[-1]}" if frames else ""


def summarize(spec: str, plan: ParallelPlan | PlanFile, reports: list[dict[str, Any]], est: Any, note: str) -> dict[str, Any]:
    """The JSON `shardc run --json` prints."""
    ranks = []
    for r in reports:
        ranks.append({"rank": r["rank"], "peak_memory_bytes": r["peak_memory_bytes"],
                      "predicted_peak_memory_bytes": _predicted_memory(est, plan, r["rank"]),
                      "median_step_time_s": r["median_step_time_s"],
                      "collectives": collective_counts(r.get("collectives", ()))})
    return {
        "model": spec, "plan": str(_plan_of(plan)),
        **({"plan_file": plan.path} if isinstance(plan, PlanFile) else {}), "nproc": len(reports), "backend": reports[0]["backend"],
        "losses": reports[0]["losses"],
        "measured_step_time_s": max(r["median_step_time_s"] for r in reports),
        "predicted_step_time_s": None if est is None else float(est.step_time_s),
        "prediction": note,
        "ranks": ranks,
    }


def collective_counts(collectives: Any) -> dict[str, dict[str, float]]:
    """A rank's recorded collectives of one step (`RankReport.collectives`) by kind: how many and
    their bytes in all (each its full buffer)."""
    out: dict[str, dict[str, float]] = {}
    for c in collectives:
        entry = out.setdefault(c["kind"], {"count": 0, "bytes": 0.0})
        entry["count"] += 1
        entry["bytes"] += float(c["bytes"])
    return out


def print_summary(summary: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    from shardc.cost.estimate import format_bytes

    def mem(v: Any) -> str:
        return "-" if v is None else format_bytes(v)

    console.print(f"[bold]shardc run[/bold] {summary['model']} on {summary['nproc']} processes ({summary['backend']})")
    console.print(f"plan: {summary['plan']}")
    console.print(f"prediction: {summary['prediction']}")
    table = Table(title="predicted vs measured")
    for col in ("rank", "step time predicted", "step time measured", "peak memory predicted", "peak memory measured"):
        table.add_column(col, justify="right")
    pred = summary["predicted_step_time_s"]
    for r in summary["ranks"]:
        table.add_row(str(r["rank"]), "-" if pred is None else f"{pred * 1e3:.2f} ms",
                      f"{r['median_step_time_s'] * 1e3:.2f} ms", mem(r["predicted_peak_memory_bytes"]),
                      mem(r["peak_memory_bytes"]))
    console.print(table)
    console.print("losses: " + ", ".join(f"{v:.4f}" for v in summary["losses"]))


def run_model(spec: str, *, nproc: int, steps: int, plan: str | os.PathLike[str] | None = None, cluster: str | None = None,
              seed: int = 0, json_out: bool = False, console: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              env: dict[str, str] | None = None, flags: Flags | None = None) -> int:
    """`shardc run`: see the module docstring. Returns the exit code; failures raise ShardcError.
    `plan` is plan text or a plan file (`shardc plan -o`). `flags` set the prediction's
    pipeline and what it prints."""
    if steps < 1:
        raise ShardcError(f"--steps must be >= 1, got {steps}")
    file = resolve_file(plan, nproc)
    parsed: ParallelPlan | PlanFile = file if file is not None else resolve_plan(None if plan is None else str(plan), nproc)
    est, note = predict(spec, parsed, cluster, nproc, flags)
    reports = launch(spec, parsed, nproc=nproc, steps=steps, seed=seed, timeout_s=timeout_s, env=env)
    summary = summarize(spec, parsed, reports, est, note)
    if json_out:
        print(json.dumps(summary, indent=2))
    else:
        if console is None:
            from rich.console import Console

            console = Console()
        print_summary(summary, console)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
