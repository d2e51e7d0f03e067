"""Running a study's jobs: one process group per process count, each result recorded at once.

`run_groups` runs the jobs of each process count in a fresh group of that many processes
(`launch.spawn`, `shardc.study.worker.run_jobs`). Every finished job is written to
`results.json` (`ResultsStore`, atomically), so an interrupted study loses at most the plan in
flight. A job that fails is recorded with its error (the failing rank's exception) and the
rest of the group's jobs start again in a fresh group.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardc.backends.torch.launch import write_json
from shardc.study.plans import StudyPlan

RESULTS_VERSION = 2  # 2: predicted_step_time_s is the before-run prediction (1: at speed)

# plan id -> (the plan, its prediction): what a finished job is compared with
Predictions = dict[str, tuple[StudyPlan, dict[str, Any]]]
# (plan, its ranks' results) -> its prediction at the speed it ran, or None
Recalibrated = Callable[[StudyPlan, list[dict[str, Any]]], dict[str, Any] | None]


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

    def entry(self, plan_id: str) -> dict[str, Any] | None:
        return next((p for p in self.data["plans"] if p["id"] == plan_id), None)

    def rounds_done(self, plan_id: str) -> int:
        """How many rounds the plan has run to the end (0 when it has not, or failed)."""
        p = self.entry(plan_id)
        return len(p.get("round_step_times_s") or [0]) if p is not None and p["status"] == "ok" else 0

    def failed(self, plan_id: str) -> bool:
        """Whether the plan is recorded as not running: invalid, predicted not to fit, or failed."""
        p = self.entry(plan_id)
        return p is not None and p["status"] != "ok"

    def finished(self, plan_id: str, rounds: int) -> bool:
        return self.failed(plan_id) or self.rounds_done(plan_id) >= rounds

    def record(self, entry: dict[str, Any]) -> None:
        self.data["plans"] = [p for p in self.data["plans"] if p["id"] != entry["id"]] + [entry]
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data, indent=1)


def status_entry(sp: StudyPlan | None, text: str, status: str, **kw: Any) -> dict[str, Any]:
    """A plan's entry in results.json when it did not run to the end: `status` is `invalid`,
    `does_not_fit` or `error`, with what `kw` adds (the error, the prediction)."""
    return {"id": sp.id if sp else text, "plan": sp.text if sp else text, "nproc": sp.devices if sp else None,
            "status": status, **kw}


def run_groups(jobs: dict[int, list[dict[str, Any]]], work: Path, store: ResultsStore, predictions: Predictions,
               cluster_for: Callable[[int], Any], recalibrated: Recalibrated, job_timeout_s: float,
               console: Any, probed: Recalibrated | None = None) -> None:
    """Run `jobs` (process count -> its jobs in order) under a progress bar; record each result
    in `store`, compared with its prediction (its prediction again at the speed it ran,
    `recalibrated`, and at the speed probed just before it, `probed`), or its error."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("study", total=sum(len(j) for j in jobs.values()))
        for n in sorted(jobs):
            pending = list(jobs[n])
            while pending:  # a failed job stops its group: the jobs after it start a fresh one
                for job in pending:
                    for r in range(n):
                        (work / f"{job['id']}.rank{r}.json").unlink(missing_ok=True)
                failure = _launch(n, pending, work, job_timeout_s, progress, task)
                finished = 0
                for job in pending:
                    finished += 1
                    files = [work / f"{job['id']}.rank{r}.json" for r in range(n)]
                    results = [json.loads(f.read_text()) for f in files if f.exists()]
                    errors = [x for x in results if "error" in x]
                    if len(results) == n and not errors:
                        _collect(job, results, store, predictions, cluster_for, recalibrated, probed)
                        continue
                    message = errors[0]["error"] if errors else (failure or "process group stopped")
                    _record_error(job, message, errors[0].get("traceback", "") if errors else "", store, predictions)
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


def _record_error(job: dict[str, Any], message: str, tb: str, store: ResultsStore, predictions: Predictions) -> None:
    if job["kind"] != "plan":
        store.data["allreduce"][job["id"].split("-")[1]] = {"error": message}
        store.save()
        return
    sp, predicted = predictions[job["id"]]
    before = store.entry(sp.id)  # a plan that ran in earlier rounds and failed now: a failure, rounds kept
    earlier = {"earlier_round_step_times_s": before.get("round_step_times_s")} if before and before["status"] == "ok" \
        else {}
    store.record(status_entry(sp, sp.text, "error", error=message.strip().splitlines()[0][:500] if message else "",
                              traceback=tb[-2000:], predicted=predicted, **earlier))


def _collect(job: dict[str, Any], results: list[dict[str, Any]], store: ResultsStore, predictions: Predictions,
             cluster_for: Callable[[int], Any], recalibrated: Recalibrated, probed: Recalibrated | None = None) -> None:
    from shardc.study.compare import allreduce_entry, plan_entry

    if job["kind"] == "allreduce_sizes":
        n = len(results)
        store.data["allreduce"][str(n)] = allreduce_entry(results[0]["points"], cluster_for(n))
        store.save()
        return
    from shardc.study.compare import merge_rounds, round_entry

    sp, predicted = predictions[job["id"]]
    now = recalibrated(sp, results)
    pre = probed(sp, results) if probed is not None else None
    before = store.entry(job["id"])
    earlier = before is not None and before["status"] == "ok"
    # A later round timed the steps only (`job["details"]` off): the first round's details stay.
    entry = round_entry(results, now, pre) if earlier and not job.get("details", True) else plan_entry(
        sp, predicted, results, now, pre)
    # The machine's 1-minute load average as the plan finished: how shared the cores were.
    entry["load_average"] = os.getloadavg()[0]
    store.record(merge_rounds(before, entry) if earlier and before is not None else entry)


