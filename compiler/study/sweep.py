"""`shardc study`: run every plan of a sweep for real, predict it, compare, report.

Order of work: the plans (a file's, a `--sweep`, or the default sweep: candidates for this
model and cluster filtered by the `validate-plan` pass, plus the solver's plan file; `--sweep
pipeline` is filtered the same way, without the solver's plan); every
plan is predicted before the first one is launched, and that before-run prediction is the
headline. For each one not already in `DIR/results.json` (a resumed study keeps what it has),
partition it once through the driver (`shardc.study.predict`: the study pipeline up to its
`estimate` pass, on the model built with real weights) and predict it from that graph; a plan predicted not to fit the local memory is recorded as
`does_not_fit` and not run; the others are lowered from that same partitioned graph
(`shardc.compile` with the graph as the plan) and run in one process group per process count
(`shardc.study.runs`), after an all_reduce-by-size benchmark, `rounds` times, each round in an
order shuffled by the seed. Once a plan has run it is predicted again, from the same graph,
on the profile at the speed the machine ran it
(`calibration.profile.at_speed`: every rank times the probe workload of
`shardc.calibration.speed` before and after each measured step, against the profile's
reference time for it); both predictions are recorded, the second as a secondary figure only.

On `--device cuda` each process count needs as many GPUs (NCCL, rank r on `cuda:r`); plans are
predicted on the GPU preset `--cluster` names (`H200`) or the visible GPU's, and after the sweep
the matmuls of the model and a size sweep are timed on the GPU and the preset's efficiency
curve fitted to them (`shardc.calibration.gpu`): the report says how far the preset was off.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardc.driver import Flags, Source, open_model
from shardc.ir.diagnostics import ShardcError
from shardc.study.plans import (
    PIPELINE_SWEEP,
    STUDY_STEPS,
    StudyPlan,
    default_sweep,
    parse_study_plan,
    pipeline_sweep,
    read_plans_file,
    sweep_plans,
)
from shardc.study.predict import (
    model_layers,
    partition,
    score,
    solver_plan_file,
    study_cluster,
    study_pipeline,
    validation_problem,
)
from shardc.study.runs import Predictions, ResultsStore, run_groups, status_entry

ALLREDUCE_SIZES = (64, 1024, 16384, 131072, 1 << 20, 4 << 20)
JOB_TIMEOUT_S = 150.0


@dataclass
class Study:
    """What the plans of one study share: the model (built once, with the weights the runs
    start from), the device, this machine's profile (CPU), the pipeline flags, what every job
    carries (`settings`), the clusters made so far and each prepared plan's partitioned IR."""

    model_spec: str
    source: Source
    device: str
    profile: Any
    memory_limit_bytes: int | None
    gpu_preset: str | None
    flags: Flags
    settings: dict[str, Any]
    clusters: dict[int, Any] = field(default_factory=dict)
    partitioned: dict[str, str] = field(default_factory=dict)  # plan id -> its IR before lowering
    parsed: dict[str, Any] = field(default_factory=dict)  # plan id -> that IR parsed (re-scored every round)

    def cluster_for(self, n: int) -> Any:
        """The cluster plans of `n` processes are predicted on (made once per `n`)."""
        if n not in self.clusters and self.device == "cuda":
            from shardc.backends.torch.launch import choose_backend
            from shardc.calibration.gpu import gpu_study_cluster
            from shardc.hardware import with_overrides

            choose_backend(n, "cuda")
            gpus = gpu_study_cluster(n, self.gpu_preset)
            limit = self.memory_limit_bytes
            self.clusters[n] = gpus if limit is None else with_overrides(gpus, memory_limit_bytes=limit)
        if n not in self.clusters:
            self.clusters[n] = study_cluster(n, profile=self.profile, memory_limit_bytes=self.memory_limit_bytes)
        return self.clusters[n]

    def prepare(self, sp: StudyPlan, cluster: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(the job to run, or None when it is predicted not to fit; the predicted figures) of
        one plan: partitioned once, predicted from that graph, and that graph lowered."""
        from shardc.api import compile as compile_plan

        graph, _ = partition(self.source, sp, cluster, self.flags)
        _, predicted = score(graph, sp, cluster, self.flags)
        if not predicted["fits"]:
            return None, predicted
        plan = sp.plan
        compiled = compile_plan(self.source.model, self.source.inputs, plan=graph, name=self.source.name,
                                input_names=self.source.input_names, print_after_all=self.flags.print_after_all,
                                time_passes=self.flags.time_passes)
        self.partitioned[sp.id] = compiled.partitioned_ir
        job = {"id": sp.id, "kind": "plan", "plan": plan, "bucket_mb": sp.bucket_mb, "compiled": compiled,
               "micro_batches": plan.micro_batches(int(self.source.inputs[0].shape[0])),
               "mesh_axes": [tuple(a) for a in predicted["mesh_axes"]], "runtime": "shardc", **self.settings}
        if sp.bucket_mb is not None and (plan.pp == 1 or sp.split is None):
            # plain DDP with its bucket size set: the worker accumulates the micro-batches itself
            job.update(runtime="ddp-bucket", traced_batch=plan.dp * plan.mb)
        return job, predicted

    def recalibrated(self, sp: StudyPlan, results: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The plan predicted again, from its partitioned graph, on the profile at the speed the
        machine ran it (`at_speed`); None on CUDA or without speed probes."""
        from shardc.study.compare import plan_speed

        return self._at(sp, plan_speed(results))

    def probed(self, sp: StudyPlan, results: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The plan predicted, from its partitioned graph, on the profile at the speed the probe read
        just before its first step (`compare.probed_speed`; the issue's before-run prediction with a
        probe taken just before the plan starts: nothing from its own steps); None on CUDA or
        without those readings."""
        from shardc.study.compare import probed_speed

        return self._at(sp, probed_speed(results))

    def _at(self, sp: StudyPlan, factor: float | None) -> dict[str, Any] | None:
        """The plan's prediction on the profile at speed `factor` (x its reference time)."""
        from shardc.calibration.profile import at_speed
        from shardc.ir.parser import parse

        if self.device != "cpu" or factor is None:
            return None
        # the probe read the contention among the plan's processes too: `local_cluster` adds it back
        mode = factor / (self.profile.contention_factor(sp.devices) if self.profile is not None else 1.0)
        cluster = study_cluster(sp.devices, profile=at_speed(self.profile, mode),
                                memory_limit_bytes=self.memory_limit_bytes)
        quiet = replace(self.flags, print_after_all=False, time_passes=False)  # the progress bar is drawing
        if sp.id not in self.parsed:  # `score` leaves the graph as it is: parsed once, re-scored each round
            self.parsed[sp.id] = parse(self.partitioned[sp.id])
        _, predicted = score(self.parsed[sp.id], sp, cluster, quiet)
        return {**predicted, "cluster": str(cluster), "speed_factor": factor}


def run_study(model_spec: str, nproc: int | str | Sequence[int], *, plans_file: str | None = None,
              sweep: str | None = None, device: str = "cpu", out_dir: str | os.PathLike[str],
              steps: int = STUDY_STEPS, warmup: int = 2, console: Any = None, profile: Any = None,
              memory_limit_bytes: int | None = None, job_timeout_s: float = JOB_TIMEOUT_S,
              allreduce_sizes: Sequence[int] = ALLREDUCE_SIZES, report: bool = True,
              fresh_profile: bool = False, cluster: str | None = None, gpu_calibration: bool | None = None,
              flags: Flags | None = None, rounds: int = 1, seed: int = 0, solver: bool = True) -> int:
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
    `flags` (`shardc.driver.Flags`): the study pipeline (`--pipeline`, which must keep the
    `estimate` pass), and whether each plan's passes are printed and timed.
    `rounds`: how many times every plan runs, each round in an order shuffled by `seed` (the
    report gives each plan's range over rounds). `solver=False` leaves the plan files out of
    the default sweep (the solver's and the rotating partition's).
    """
    if rounds < 1:
        raise ShardcError(f"--rounds {rounds}: run every plan at least once (--rounds 1)")
    import torch
    from rich.console import Console

    console = console or Console(stderr=True)
    nprocs = _nprocs(nproc)
    study_pipeline(flags)  # a bad --pipeline stops the study before anything runs
    _check_device(device, cluster, nprocs)
    out = Path(out_dir)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    torch.manual_seed(0)
    source = open_model(model_spec, device="cpu")
    if device == "cpu" and profile is None:
        profile = _local_profile(out, nprocs, fresh_profile, console)
    reference = 1.0 / profile.probe_alone_rate if profile is not None and profile.probe_alone_rate > 0 else None
    settings = {"model": model_spec, "steps": steps, "warmup": warmup, "seed": 0, "device": device,
                "speed_reference": reference}
    study = Study(model_spec, source, device, profile, memory_limit_bytes, cluster, flags or Flags(), settings)
    store = ResultsStore(out / "results.json", {"model": model_spec, "device": device, "steps": steps,
                                                "warmup": warmup})
    store.data.update(rounds=rounds, seed=seed)
    if sweep is not None and sweep.strip().lower() == PIPELINE_SWEEP and not plans_file:
        texts = default_texts(study, nprocs, out, store, False, pipeline_sweep)
    elif plans_file or sweep:
        texts = plan_texts(nprocs, plans_file, sweep, int(source.inputs[0].shape[0]))
    else:
        texts = default_texts(study, nprocs, out, store, solver)
    # Every plan is predicted here, before any of them is launched: the headline prediction
    # cannot see a measurement of the plan's own steps.
    earlier = [p["id"] for p in store.data["plans"] if p["status"] == "ok"]  # measured by an earlier run here
    jobs, predictions = _prepare_jobs(study, texts, store, None if plans_file else nprocs, rounds)
    kept = [i for i in earlier if i not in predictions]
    if kept:  # a resumed study: say so, its kept plans carry the earlier run's code and machine
        console.print(f"resumed {out / 'results.json'}: {len(kept)} plan(s) kept as an earlier run measured and "
                      "predicted them (e.g. " + ", ".join(kept[:3]) + "); a new --out measures and predicts "
                      "them again")
    for r in range(rounds):
        todo = _round_jobs(jobs, store, r, seed)
        for n in sorted(todo):
            if str(n) not in store.data["allreduce"]:
                todo[n].insert(0, {"id": f"allreduce-{n}", "kind": "allreduce_sizes", "sizes": list(allreduce_sizes),
                                   "device": device})
        store.data.setdefault("orders", {})[str(r)] = [j["id"] for n in sorted(todo) for j in todo[n]]
        run_groups(todo, out / "runs", store, predictions, study.cluster_for, study.recalibrated, job_timeout_s,
                   console, study.probed)
    if gpu_calibration if gpu_calibration is not None else device == "cuda":
        from shardc.study.gpu_report import calibrate_study

        console.print("timing the device's matmuls against the model's device spec (gpu-calibration.md)")
        calibrate_study(store.data, model_spec, study.cluster_for, nprocs, out, device=device)
    store.data["wall_time_s"] = store.data.get("wall_time_s", 0.0) + time.perf_counter() - started
    store.save()
    if report:
        _write_report(store.data, out, console)
    return 0


def _nprocs(nproc: int | str | Sequence[int]) -> list[int]:
    if isinstance(nproc, int):
        return [nproc]
    if isinstance(nproc, str):
        return [int(x) for x in nproc.split(",") if x.strip()]
    return [int(x) for x in nproc]


def _check_device(device: str, cluster: str | None, nprocs: list[int]) -> None:
    """A ShardcError for a device the study cannot run on: not cpu or cuda, a GPU preset on the
    CPU, or fewer GPUs than a process count needs."""
    if device not in ("cpu", "cuda"):
        raise ShardcError(f"--device {device!r}: use cpu or cuda")
    if cluster is not None and device != "cuda":
        raise ShardcError(f"--cluster {cluster}: a GPU preset applies to --device cuda; on the CPU the study "
                          "predicts on this machine's calibrated local profile")
    if device == "cuda":
        from shardc.backends.torch.launch import choose_backend

        for n in nprocs:
            choose_backend(n, "cuda")  # a ShardcError when there are fewer GPUs than processes


def _local_profile(out: Path, nprocs: list[int], fresh: bool, console: Any) -> Any:
    """This machine's profile: measured now (`fresh`, into `out`), else the cached one (measured
    again when it predates the eager op costs)."""
    from shardc.calibration.local import load_profile, run_calibration

    if fresh:
        return run_calibration(out / "local-profile.json", quick=True, nprocs=tuple(n for n in nprocs if n > 1),
                               console=console)
    profile = load_profile()
    if profile.eager is None:  # a version 1 cache: the CPU's eager costs were never measured
        console.print("the cached local profile has no eager op costs (version 1); recalibrating it")
        profile = run_calibration(console=console)
    return profile


def plan_texts(nprocs: list[int], plans_file: str | None, sweep: str | None, batch: int) -> list[str]:
    """The plans to study: the file's, or the `--sweep` of `batch`."""
    if plans_file:
        return read_plans_file(plans_file)
    return sweep_plans((sweep or "dp").split(","), nprocs, batch)


def default_texts(study: Study, nprocs: list[int], out: Path, store: ResultsStore, solver: bool,
                  candidates: Callable[[int, int, int], list[str]] = default_sweep) -> list[str]:
    """The default sweep for this model and these process counts: `plans.default_sweep`'s
    candidates (or `candidates`': `plans.pipeline_sweep` for `--sweep pipeline`) that the
    `validate-plan` pass accepts on the study's cluster (the others are
    listed in results.json's `left_out` with the pass's reason), then (with `solver`, the
    default sweep) the rotating partition at the smallest process count N > 1
    (`shardc.study.rotating`: tp = N with its row-parallel linears rotating, written to
    `out/rotate-N.plan`; left out with the reason where tp = N is not valid; one, as a 4-process
    tp plan is among the sweep's slowest) and for each process count the solver's plan (`shardc
    plan` on the same cluster, written to `out/solver-N.plan`), each run from its file. A solver or rotating plan
    that fails to be made is recorded as a failed plan, with its message."""
    batch = int(study.source.inputs[0].shape[0])
    layers = model_layers(study.source)
    texts: list[str] = []
    left: list[dict[str, str]] = []
    grouped: dict[int | None, Any] = {}
    for n in nprocs:
        for text in candidates(n, batch, layers):
            problem = validation_problem(study.source, parse_study_plan(text, batch), study.cluster_for(n), grouped)
            if problem is None:
                texts.append(text)
            else:
                left.append({"plan": text, "reason": problem})
        if solver and n == min(m for m in nprocs if m > 1):  # one rotating plan, at the fewest processes
            texts += _rotating_text(study, n, batch, out, store, grouped, left)
        path = out / f"solver-{n}.plan"
        if not solver or store.done(f"solver-{n}"):
            continue
        if path.exists() and any(p.get("plan", "").endswith(str(path)) for p in store.data["plans"]):
            texts.append(f"plan_file={path}")  # a resumed study runs the file it planned
            continue
        try:
            texts.append(solver_plan_file(study.source, study.cluster_for(n), batch, path))
        except Exception as err:  # the solver failing is a result of the study too
            store.record(status_entry(None, f"solver-{n}", "error", error=f"shardc plan: {type(err).__name__}: {err}"))
    store.data["left_out"] = left
    return texts


def _rotating_text(study: Study, n: int, batch: int, out: Path, store: ResultsStore, grouped: dict[int | None, Any],
                   left: list[dict[str, str]]) -> list[str]:
    """`plan_file=out/rotate-N.plan` for the rotating plan of `n` processes (made now, or the
    file a resumed study made); none when tp = n is refused (the reason in `left`) or its
    making fails (recorded as a failed plan)."""
    from shardc.study.rotating import rotating_plan_file

    if n < 2 or store.done(f"rotate-{n}"):
        return []
    tp = f"tp={n},mb={batch}"
    problem = validation_problem(study.source, parse_study_plan(tp, batch), study.cluster_for(n), grouped)
    if problem is not None:
        left.append({"plan": f"rotating partition on {tp}", "reason": problem})
        return []
    path = out / f"rotate-{n}.plan"
    if path.exists() and any(p.get("plan", "").endswith(str(path)) for p in store.data["plans"]):
        return [f"plan_file={path}"]  # a resumed study runs the file it made
    try:
        return [rotating_plan_file(study.source, study.cluster_for(n), n, batch, path)]
    except Exception as err:  # a result of the study too
        store.record(status_entry(None, f"rotate-{n}", "error", error=f"rotating plan: {type(err).__name__}: {err}"))
        return []


def _round_jobs(jobs: dict[int, list[dict[str, Any]]], store: ResultsStore, r: int, seed: int
                ) -> dict[int, list[dict[str, Any]]]:
    """Round `r`'s jobs: the plans that ran in fewer than r+1 rounds and have not failed, in an
    order shuffled by (`seed`, r); `details` (the profiled and memory-tracked steps) only in a
    plan's first round, as `compare.merge_rounds` keeps the first round's."""
    import random

    rng = random.Random(seed * 1000 + r)
    out: dict[int, list[dict[str, Any]]] = {}
    for n, group in jobs.items():
        todo = [{**j, "details": store.rounds_done(j["id"]) == 0} for j in group
                if store.rounds_done(j["id"]) <= r and not store.failed(j["id"])]
        rng.shuffle(todo)
        if todo:
            out[n] = todo
    return out


def _prepare_jobs(study: Study, texts: list[str], store: ResultsStore, nprocs: list[int] | None, rounds: int = 1
                  ) -> tuple[dict[int, list[dict[str, Any]]], Predictions]:
    """(process count -> the jobs to run, the predictions of their plans) for the plans not in
    `store` yet (or run in fewer than `rounds` rounds), of the `nprocs` process counts (None: any); plans that are invalid or predicted
    not to fit are recorded in `store` instead."""
    batch = int(study.source.inputs[0].shape[0])
    jobs: dict[int, list[dict[str, Any]]] = {}
    predictions: Predictions = {}
    for text in texts:
        try:
            sp = parse_study_plan(text, batch)
        except ShardcError as err:
            if not store.done(text):
                store.record(status_entry(None, text, "invalid", error=str(err)))
            continue
        if store.finished(sp.id, rounds) or (nprocs is not None and sp.devices not in nprocs):
            continue
        try:
            cluster = study.cluster_for(sp.devices)
            job, predicted = study.prepare(sp, cluster)
        except Exception as err:  # a plan the compiler rejects is a result too
            store.record(status_entry(sp, text, "invalid", error=f"{type(err).__name__}: {err}"))
            continue
        if job is None:
            store.record(status_entry(sp, text, "does_not_fit", predicted=predicted, cluster=str(cluster),
                                      error=f"predicted not to fit: {predicted['overflow']}"))
            continue
        predictions[sp.id] = (sp, {**predicted, "cluster": str(cluster)})
        jobs.setdefault(sp.devices, []).append(job)
    return jobs, predictions


def _write_report(data: dict[str, Any], out: Path, console: Any) -> None:
    from shardc.study.gpu_report import append_to_report
    from shardc.study.report import write_report

    write_report(data, out)
    append_to_report(data, out)
    console.print(f"study written to {out}/ (report.md, results.json, plots)")
