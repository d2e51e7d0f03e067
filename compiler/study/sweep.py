"""`shardc study`: run every plan of a sweep for real, predict it, compare, report.

Order of work: parse the plans; for each one not already in `DIR/results.json` (a resumed
study keeps what it has), predict it with the cost model; a plan predicted not to fit the
local memory is recorded as `does_not_fit` and not run; the others run in one process group
per process count (`launch.spawn`), after an all_reduce-by-size benchmark. Every finished
plan is written to `results.json` at once (atomically), so an interrupted study loses at most
the plan in flight and resumes with the next. A plan that fails is recorded with its error
(the failing rank's exception) and the rest of the group restarts in a fresh process group.
Once a plan has run it is predicted again on the profile at the speed the machine ran it
(`calibrate.at_speed`: every rank times the probe workload of `shardc.calibration.speed` before and after
each measured step, against the profile's reference time for it); both predictions are recorded.

On `--device cuda` each process count needs as many GPUs (NCCL, rank r on `cuda:r`); plans are
predicted on the GPU preset `--cluster` names (`H200`) or the visible GPU's, and after the sweep
the matmuls of the model and a size sweep are timed on the GPU and the preset's efficiency
curve fitted to them (`shardc.calibration.gpu`): the report says how far the preset was off.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardc.ir.diagnostics import ShardcError
from shardc.study.plans import DEFAULT_SWEEP, StudyPlan, parse_study_plan, read_plans_file, sweep_plans

RESULTS_VERSION = 1
ALLREDUCE_SIZES = (64, 1024, 16384, 131072, 1 << 20, 4 << 20)
JOB_TIMEOUT_S = 150.0


class ResultsStore:
    """`results.json`: the study's every number, rewritten atomically after each plan."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"version": RESULTS_VERSION, **meta, "plans": [], "allreduce": {}}
        if path.exists():
            try:
                old = json.loads(path.read_text())
            except ValueError:
                old = None
            if old and old.get("version") == RESULTS_VERSION and old.get("model") == meta.get("model"):
                self.data["plans"] = old.get("plans", [])
                self.data["allreduce"] = old.get("allreduce", {})

    def done(self, plan_id: str) -> bool:
        return any(p["id"] == plan_id for p in self.data["plans"])

    def record(self, entry: dict[str, Any]) -> None:
        self.data["plans"] = [p for p in self.data["plans"] if p["id"] != entry["id"]] + [entry]
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def _nprocs(nproc: int | str | Sequence[int]) -> list[int]:
    if isinstance(nproc, int):
        return [nproc]
    if isinstance(nproc, str):
        return [int(x) for x in nproc.split(",") if x.strip()]
    return [int(x) for x in nproc]


def plan_texts(nprocs: list[int], plans_file: str | None, sweep: str | None, batch: int) -> list[str]:
    if plans_file:
        return read_plans_file(plans_file)
    if sweep:
        return sweep_plans(sweep.split(","), nprocs, batch)
    return [t for n in nprocs for t in DEFAULT_SWEEP.get(n, (f"dp={n}",))]


def _entry(sp: StudyPlan | None, text: str, status: str, **kw: Any) -> dict[str, Any]:
    return {"id": sp.id if sp else text, "plan": sp.text if sp else text, "nproc": sp.devices if sp else None,
            "status": status, **kw}


def prepare(model_spec: str, loaded: Any, sp: StudyPlan, cluster: Any, common: dict[str, Any]
            ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the job to run or None, the predicted figures) for one plan."""
    from shardc.study.predict import predict

    _, predicted = predict(model_spec, sp, cluster)
    if not predicted["fits"]:
        return None, predicted
    plan = sp.plan
    batch = loaded.example_inputs[0].shape[0]
    m = plan.micro_batches(batch)
    job = {"id": sp.id, "kind": "plan", "plan": plan, "bucket_mb": sp.bucket_mb, "micro_batches": m,
           "mesh_axes": [tuple(a) for a in predicted["mesh_axes"]], **common}
    from shardc.api import compile as compile_plan

    split = sp.split if plan.pp > 1 else None
    if split is None and sp.bucket_mb is not None:  # DDP with its bucket size set: one micro-batch graph, accumulated here
        per = plan.dp * plan.mb
        inputs = tuple(x[:per] for x in loaded.example_inputs)
        job["runtime"] = "ddp-bucket"
        job["compiled"] = compile_plan(loaded.model, inputs, plan=plan, input_names=loaded.input_names)
        job["traced_batch"] = per
    else:  # what `shardc run` does: the global batch compiled, `parallelize(model).step(*batch)`;
        # an unbalanced split= deals the blocks to stages before lowering, as the prediction did
        from shardc.study.predict import stage_split

        edit = None if split is None else (lambda graph: stage_split(graph, split, plan.stages))
        job["runtime"] = "shardc"
        job["compiled"] = compile_plan(loaded.model, tuple(loaded.example_inputs), plan=plan,
                                       input_names=loaded.input_names, before_lower=edit)
    return job, predicted


def run_study(model_spec: str, nproc: int | str | Sequence[int], *, plans_file: str | None = None,
              sweep: str | None = None, device: str = "cpu", out_dir: str | os.PathLike[str],
              steps: int = 10, warmup: int = 2, console: Any = None, profile: Any = None,
              memory_limit_bytes: int | None = None, job_timeout_s: float = JOB_TIMEOUT_S,
              allreduce_sizes: Sequence[int] = ALLREDUCE_SIZES, report: bool = True,
              fresh_profile: bool = False, cluster: str | None = None, gpu_calibration: bool | None = None) -> int:
    """Run the study (see the module doc) and write the report to `out_dir`; returns 0.

    `nproc`: process counts (`2`, `"2,4"`); plans of other device counts in a sweep are left
    out, plans from a file run at their own count. `profile` (a LocalProfile) and
    `memory_limit_bytes` replace the cached local profile and the per-process memory.
    `fresh_profile=True` recalibrates this machine first (`shardc calibrate --quick` for these
    process counts, written to `out_dir/local-profile.json`): on a shared machine the load of
    the moment, not that of the last calibration, is what the plans will run under.
    `cluster` (a GPU preset, `--device cuda` only) and `gpu_calibration` (time the device's matmuls
    after the sweep against the device spec the plans were predicted on; by default on CUDA only,
    True on the CPU times small fp32 matmuls against the local profile): see the module doc.
    """
    from rich.console import Console

    from shardc.frontend.spec import load_model
    from shardc.study.predict import study_cluster

    console = console or Console(stderr=True)
    if device not in ("cpu", "cuda"):
        raise ShardcError(f"--device {device!r}: use cpu or cuda")
    if cluster is not None and device != "cuda":
        raise ShardcError(f"--cluster {cluster}: a GPU preset applies to --device cuda; on the CPU the study "
                          "predicts on this machine's calibrated local profile")
    if device == "cuda":
        from shardc.backends.torch.launch import choose_backend

        for n in _nprocs(nproc):
            choose_backend(n, "cuda")  # a ShardcError when there are fewer GPUs than processes
    out = Path(out_dir)
    work = out / "runs"
    work.mkdir(parents=True, exist_ok=True)
    nprocs = _nprocs(nproc)
    started = time.perf_counter()
    import torch

    torch.manual_seed(0)
    loaded = load_model(model_spec, device="cpu")
    batch = int(loaded.example_inputs[0].shape[0])
    if fresh_profile and device == "cpu" and profile is None:
        from shardc.calibration.local import run_calibration

        profile = run_calibration(out / "local-profile.json", quick=True, nprocs=tuple(n for n in nprocs if n > 1),
                                  console=console)
    if device == "cpu" and profile is None:
        from shardc.calibration.local import load_profile, run_calibration

        profile = load_profile()
        if profile.eager is None:  # a version 1 cache: the CPU's eager costs were never measured
            console.print("the cached local profile has no eager op costs (version 1); recalibrating it")
            profile = run_calibration(console=console)
    texts = plan_texts(nprocs, plans_file, sweep, batch)
    clusters: dict[int, Any] = {}

    def cluster_for(n: int) -> Any:
        if n not in clusters and device == "cuda":
            from shardc.backends.torch.launch import choose_backend
            from shardc.calibration.gpu import gpu_study_cluster
            from shardc.hardware import with_overrides

            choose_backend(n, "cuda")
            gpus = gpu_study_cluster(n, cluster)
            clusters[n] = gpus if memory_limit_bytes is None else with_overrides(gpus, memory_bytes=memory_limit_bytes)
        if n not in clusters:
            clusters[n] = study_cluster(n, device, profile=profile, memory_limit_bytes=memory_limit_bytes)
        return clusters[n]

    def recalibrated(sp: StudyPlan, results: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The plan predicted again on the profile at the speed the machine ran it (`at_speed`)."""
        from shardc.study.compare import plan_speed

        factor = plan_speed(results)
        if device != "cpu" or factor is None:
            return None
        from shardc.calibration.local import load_profile
        from shardc.calibration.profile import at_speed
        from shardc.study.predict import predict

        base = profile if profile is not None else load_profile()
        cluster = study_cluster(sp.devices, device, profile=at_speed(base, factor),
                                memory_limit_bytes=memory_limit_bytes)
        return {**predict(model_spec, sp, cluster)[1], "cluster": str(cluster), "speed_factor": factor}

    store = ResultsStore(out / "results.json", {"model": model_spec, "device": device, "steps": steps,
                                                "warmup": warmup})
    common = {"model": model_spec, "steps": steps, "warmup": warmup, "seed": 0, "device": device,
              "speed_reference": 1.0 / profile.probe_alone_rate if profile is not None and profile.probe_alone_rate > 0
              else None}
    jobs: dict[int, list[dict[str, Any]]] = {}
    predictions: dict[str, tuple[StudyPlan, dict[str, Any]]] = {}
    for text in texts:
        try:
            sp = parse_study_plan(text, batch)
        except ShardcError as err:
            if not store.done(text):
                store.record(_entry(None, text, "invalid", error=str(err)))
            continue
        if store.done(sp.id) or (not plans_file and sp.devices not in nprocs):
            continue
        try:
            cluster = cluster_for(sp.devices)
            job, predicted = prepare(model_spec, loaded, sp, cluster, common)
        except Exception as err:  # a plan the compiler rejects is a result too
            store.record(_entry(sp, text, "invalid", error=f"{type(err).__name__}: {err}"))
            continue
        if job is None:
            store.record(_entry(sp, text, "does_not_fit", predicted=predicted, cluster=str(cluster),
                                error=f"predicted not to fit: {predicted['overflow']}"))
            continue
        predictions[sp.id] = (sp, {**predicted, "cluster": str(cluster)})
        jobs.setdefault(sp.devices, []).append(job)
    for n in sorted(jobs):
        if str(n) not in store.data["allreduce"]:
            jobs[n].insert(0, {"id": f"allreduce-{n}", "kind": "allreduce_sizes", "sizes": list(allreduce_sizes),
                               "device": device})
    total = sum(len(j) for j in jobs.values())
    _run_groups(jobs, work, store, predictions, cluster_for, total, job_timeout_s, console, recalibrated)
    if gpu_calibration if gpu_calibration is not None else device == "cuda":
        from shardc.study.gpu_report import calibrate_study

        console.print("timing the device's matmuls against the model's device spec (gpu-calibration.md)")
        calibrate_study(store.data, model_spec, cluster_for, nprocs, out, device=device)
    store.data["wall_time_s"] = store.data.get("wall_time_s", 0.0) + time.perf_counter() - started
    store.save()
    if report:
        from shardc.study.report import write_report

        write_report(store.data, out)
        from shardc.study.gpu_report import append_to_report

        append_to_report(store.data, out)
        console.print(f"study written to {out}/ (report.md, results.json, plots)")
    return 0


def _run_groups(jobs: dict[int, list[dict[str, Any]]], work: Path, store: ResultsStore,
                predictions: dict[str, tuple[StudyPlan, dict[str, Any]]], cluster_for: Any, total: int,
                job_timeout_s: float, console: Any, recalibrated: Any = None) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("study", total=total)
        for n in sorted(jobs):
            pending = list(jobs[n])
            while pending:
                for job in pending:
                    for r in range(n):
                        (work / f"{job['id']}.rank{r}.json").unlink(missing_ok=True)
                failure = _launch(n, pending, work, job_timeout_s, progress, task)
                finished = 0
                for job in pending:
                    files = [work / f"{job['id']}.rank{r}.json" for r in range(n)]
                    results = [json.loads(f.read_text()) for f in files if f.exists()]
                    errors = [x for x in results if "error" in x]
                    if len(results) == n and not errors:
                        _collect(job, results, store, predictions, cluster_for, recalibrated)
                        finished += 1
                        continue
                    message = errors[0]["error"] if errors else (failure or "process group stopped")
                    tb = errors[0].get("traceback", "") if errors else ""
                    _record_error(job, message, tb, store, predictions)
                    finished += 1
                    break
                pending = pending[finished:]


def _launch(n: int, pending: list[dict[str, Any]], work: Path, job_timeout_s: float, progress: Any,
            task: Any) -> str | None:
    """Run `pending` on a fresh group of `n` processes, advancing the bar as files appear."""
    from shardc.backends.torch.launch import spawn
    from shardc.study.worker import run_jobs

    outcome: dict[str, Any] = {}

    device = next((job["device"] for job in pending if job.get("device")), None)

    def target() -> None:
        try:
            spawn(run_jobs, n, pending, str(work), timeout_s=job_timeout_s * len(pending) + 60, device=device)
        except Exception as err:
            outcome["error"] = str(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    seen: set[str] = set()
    while thread.is_alive():
        thread.join(0.5)
        for job in pending:
            if job["id"] not in seen and all((work / f"{job['id']}.rank{r}.json").exists() for r in range(n)):
                seen.add(job["id"])
                progress.advance(task)
                progress.update(task, description=f"{n} processes: {job['id'][:40]}")
    return outcome.get("error")


def _record_error(job: dict[str, Any], message: str, tb: str, store: ResultsStore,
                  predictions: dict[str, tuple[StudyPlan, dict[str, Any]]]) -> None:
    if job["kind"] != "plan":
        store.data["allreduce"][job["id"].split("-")[1]] = {"error": message}
        store.save()
        return
    sp, predicted = predictions[job["id"]]
    store.record(_entry(sp, sp.text, "error", error=message.strip().splitlines()[0][:500] if message else "",
                        traceback=tb[-2000:], predicted=predicted))


def _collect(job: dict[str, Any], results: list[dict[str, Any]], store: ResultsStore,
             predictions: dict[str, tuple[StudyPlan, dict[str, Any]]], cluster_for: Any,
             recalibrated: Any = None) -> None:
    from shardc.study.compare import allreduce_entry, plan_entry

    if job["kind"] == "allreduce_sizes":
        n = len(results)
        store.data["allreduce"][str(n)] = allreduce_entry(results[0]["points"], cluster_for(n))
        store.save()
        return
    sp, predicted = predictions[job["id"]]
    now = recalibrated(sp, results) if recalibrated is not None else None
    # The machine's 1-minute load average as the plan finished: how shared the cores were.
    store.record({**plan_entry(sp, predicted, results, now), "load_average": os.getloadavg()[0]})


