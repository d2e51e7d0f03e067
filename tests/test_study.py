"""`shardc study` end to end on 2 gloo processes: the before-run headline, the default sweep,
rounds, resume, failures, does-not-fit, and memory accounting per category.

The sweeps are tiny (the tiny GPT, 1-2 measured steps); the numbers are real measurements, so
the tests check structure, order of work and accounting, not speed.
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics
from pathlib import Path

import pytest
import torch

from shardc.calibration.local import load_profile
from shardc.cli import main
from shardc.study import run_study
from shardc.study import sweep as study_sweep
from shardc.study.compare import category_errors, spearman, summary
from shardc.study.plans import default_sweep, parse_study_plan
from shardc.study.predict import predict, study_cluster
from shardc.study.runs import ResultsStore
from shardc.study.worker import PRE_PROBES
from shardc.train.memory import MemoryTracker, track_memory

MODEL = "examples/gpt.py:tiny?batch=4"
SIZES = (1024, 65536)
SPLIT = "pp=2,mb=1,recompute=full,split=1+1"


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _study(out: Path, plans: list[str], **kw) -> dict:
    run_study(MODEL, 2, plans_file=_write(out.parent / f"{out.name}.plans", plans), out_dir=out, steps=2, warmup=1,
              allreduce_sizes=SIZES, **kw)
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def studies(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path, dict, str]:
    out = tmp_path_factory.mktemp("study") / "out"
    # bucket_mb= runs plain DDP, which the worker refuses for a ZeRO plan on every rank: the group
    # stops, the error is recorded and the study goes on. The resumed study adds a split= pipeline
    # with recomputation (stages dealt before lowering, run by the IR pipeline runtime).
    first = _study(out, ["dp=2,mb=2", "dp=2,mb=2,zero=1,bucket_mb=1"], rounds=2)
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "runs").iterdir()}
    # resumed through the command line (its all_reduce benchmark is done), its passes timed
    plans = _write(out.parent / "resumed.plans", ["dp=2,mb=2", "dp=2,mb=2,zero=1,bucket_mb=1", SPLIT])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):  # the console's lines too
        assert main(["study", MODEL, "--nproc", "2", "--plans", plans, "--out", str(out), "--steps", "2",
                     "--warmup", "1", "--time-passes"]) == 0
    second = json.loads((out / "results.json").read_text())
    return first, second, out, stamps, printed.getvalue()


def test_results_schema_and_report_files(studies) -> None:
    first, _, out, _, _ = studies
    ok = [p for p in first["plans"] if p["status"] == "ok"]
    assert [p["plan"].split(",")[0] for p in ok] == ["dp=2"]
    p = ok[0]
    for key in ("plan", "measured_step_time_s", "predicted_step_time_s", "measured_peak_memory_bytes",
                "predicted_peak_memory_bytes", "step_time_error", "memory_errors", "ranks"):
        assert key in p, key
    assert len(p["measured_peak_memory_bytes"]) == 2 and len(p["predicted_peak_memory_bytes"]) == 2
    assert p["measured_step_time_s"] > 0 and p["predicted_step_time_s"] > 0
    rank = p["ranks"][0]
    assert rank["measured_memory"]["parameters"] == pytest.approx(rank["predicted_memory"]["parameters"], rel=1e-6)
    assert rank["collectives"]["all_reduce"]["count"] >= 1
    # The whole peak as predicted (nothing of the study's own, such as the speed probe's buffers, counted)
    assert p["max_abs_memory_error"] <= 0.05, p["memory_errors"]
    # The speed probe beside each step: before the first and after each of the 2, on every rank
    assert [len(x) for x in p["speed_probe_s"]] == [3, 3] and 0.2 < p["speed_factor"] < 5
    # The headline is the before-run prediction; the at-speed one is the secondary figure
    assert p["prediction"] == "before-run" and p["predicted_step_time_s"] == p["predicted"]["step_time_s"]
    assert p["predicted_recalibrated"]["speed_factor"] == p["speed_factor"]
    assert p["predicted_step_time_s_at_speed"] == pytest.approx(statistics.median(p["round_predicted_at_speed_s"]))
    # The probe just before the first step, every rank (`PRE_PROBES` readings each): each round's own probed
    # before-run prediction, the plan's their median, and its error against the measured step
    last_round = json.loads((out / "runs" / f"{p['id']}.rank1.json").read_text())
    assert len(last_round["pre_probe_s"]) == PRE_PROBES and 0.2 < p["probed_speed_factor"] < 5
    assert len(p["round_predicted_probed_s"]) == 2
    assert p["predicted_step_time_s_probed"] == pytest.approx(statistics.median(p["round_predicted_probed_s"]))
    assert p["step_time_error_probed"] == pytest.approx((p["predicted_step_time_s_probed"] - p["measured_step_time_s"])
                                                        / p["measured_step_time_s"])
    # Two rounds: both measured, the plan's step time their median, the error against it
    assert len(p["round_step_times_s"]) == 2 and len(first["orders"]) == 2
    assert p["measured_step_time_s"] == pytest.approx(statistics.median(p["round_step_times_s"]))
    # The second round timed the steps only: no profiled or memory-tracked step (the first's are kept)
    last = json.loads((out / "runs" / f"{p['id']}.rank0.json").read_text())
    assert last["details"] is False and last["memory"] == {} and last["profile"] == {}
    assert p["round_warmup_steps"] == [1, 1] and p["compiles"] == {"warmup": 0, "timed": 0}  # eager
    assert p["step_time_error"] == pytest.approx((p["predicted_step_time_s"] - p["measured_step_time_s"])
                                                 / p["measured_step_time_s"])
    # Memory per category on every rank, and the plan's worst category
    cats = {c["category"] for c in rank["memory_categories"]}
    assert cats == {"parameters", "gradients", "optimizer", "activations", "buffers", "working"}
    worst = p["worst_memory_category"]
    assert abs(worst["error"]) == max(abs(c["error"]) for r in p["ranks"] for c in r["memory_categories"]
                                      if c["error"] is not None)
    assert set(rank["time_breakdown"]) >= {"compute_s", "communication_s", "waiting_s", "exposed_communication_s"}
    assert [x["bytes"] for x in first["allreduce"]["2"]["points"]] == list(SIZES)
    assert "summary" in first and "spearman_step_time" in first["summary"]
    text = (out / "report.md").read_text()
    assert "## Targets" in text and "## Findings" in text
    assert "predicted before the run, median error" in text and "worst category error" in text
    assert "at the speed probed just before each plan, median error" in text
    assert first["summary"]["plans_probed"] == 1
    for name in ("time.png", "memory.png", "pipeline_memory.png", "block_size.png", "parallelism.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_failing_plan_is_recorded_and_sweep_goes_on(studies) -> None:
    first, second, _, _, _ = studies
    failed = [p for p in first["plans"] if p["status"] == "error"]
    assert len(failed) == 1 and "bucket_mb" in failed[0]["plan"]
    assert "bucket_mb applies to plain DDP plans" in failed[0]["error"]
    assert any(p["status"] == "ok" and p["plan"].startswith("dp=1,tp=1,pp=2") for p in second["plans"])


def test_resume_runs_only_the_rest(studies) -> None:
    first, second, out, stamps, _ = studies
    before = {p["id"]: p for p in first["plans"]}
    after = {p["id"]: p for p in second["plans"]}
    assert set(after) == set(before) | {parse_study_plan(SPLIT, 4).id}
    for pid, entry in before.items():  # kept as they were, not run again
        assert after[pid]["status"] == entry["status"]
        assert after[pid].get("measured_step_time_s") == entry.get("measured_step_time_s")
    for path in (out / "runs").iterdir():
        if path.name in stamps:
            assert path.stat().st_mtime_ns == stamps[path.name], f"{path.name} was rewritten"
    pipelined = after[parse_study_plan(SPLIT, 4).id]
    assert pipelined["status"] == "ok" and [r["stage"] for r in pipelined["ranks"]] == [0, 1]
    # and it says so: the kept plan's figures are the earlier run's (its code, its machine)
    said = " ".join(studies[4].split())
    assert "resumed" in said and "1 plan(s) kept as an earlier run measured and predicted them" in said, said


def test_the_study_command_times_the_passes_of_each_plan(studies) -> None:
    """Only the resumed plan is partitioned, scored and lowered: one timing table per driver run."""
    printed = studies[4]
    assert printed.count("pass timings") == 3, printed
    for name in ("group-layers", "validate-plan", "apply-plan", "estimate", "lower"):
        assert f"\n│ {name} " in printed or f"\n| {name} " in printed, name


def test_plans_that_do_not_fit_are_not_run(tmp_path: Path) -> None:
    data = _study(tmp_path / "small", ["dp=2,mb=2", "tp=2,mb=4"], memory_limit_bytes=64 * 1024, report=False)
    assert [p["status"] for p in data["plans"]] == ["does_not_fit", "does_not_fit"]
    assert "predicted not to fit" in data["plans"][0]["error"]
    assert not any((tmp_path / "small" / "runs").iterdir())


def test_memory_accounting_by_category_matches_hand_count() -> None:
    """One process, a two-layer MLP: every category against a count made by hand."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(32, 64)

    def step(tracker=None) -> None:
        loss = model(x).square().mean()
        loss.backward()
        if tracker is not None:
            tracker.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()
    with track_memory([model], opt) as tracker:
        step(tracker)
    got = tracker.result()
    params = (64 * 128 + 128 + 128 * 10 + 10) * 4
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a 4-byte `step` tensor per parameter tensor.
    optimizer = 2 * params + 4 * 4
    # Saved for backward: the first linear's input x, the ReLU's output (also the second linear's
    # input: one storage), and square's input (the model output).
    activations = (32 * 64 + 32 * 128 + 32 * 10) * 4
    peak = got["peak_breakdown"]
    assert peak["parameters"] == params
    assert peak["gradients"] == params
    assert peak["optimizer"] == optimizer
    assert got["category_peaks"]["activations"] == activations
    assert got["peak_bytes"] >= params * 2 + optimizer + activations


def test_the_tracker_counts_new_storages_and_takes_the_allocator_peak_on_cuda() -> None:
    """On the CPU a storage made during the body adds its bytes to the peak; on CUDA the
    allocator's peak is the measurement and the accounting's shortfall is `allocator_extra`."""
    with track_memory([], None, device=torch.device("cpu")) as tracker:
        start = tracker.peak
        x = torch.ones(1000)
        del x
    got = tracker.result()
    assert got["peak_bytes"] == start + 4000 and "allocator" not in got
    tracker.allocator = {"peak_allocated_bytes": start + 5000.0}  # what track_memory reads on CUDA
    got = tracker.result()
    assert got["peak_bytes"] == start + 5000 and got["tracked_peak_bytes"] == start + 4000
    assert got["peak_breakdown"]["allocator_extra"] == 1000


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2], [1, 2]) is None


def test_a_storage_resized_in_place_is_counted_once() -> None:
    """FSDP2 frees and re-allocates unsharded parameters with `resize_`: the data pointer moves,
    the storage stays one storage."""
    x = torch.zeros(1024)
    tracker = MemoryTracker({}, {})
    with tracker:
        x.untyped_storage().resize_(0)
        x.untyped_storage().resize_(4096)
        y = x.view(-1) + 0  # dispatches; re-measures x's storage and adds y's
    del y
    assert sum(1 for ref, _ in tracker.live.values() if ref() is x.untyped_storage()) == 1


def test_default_sweep_of_the_tiny_gpt_is_valid_runs_and_is_predicted_before_it_runs(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """`shardc study examples/gpt.py:tiny --nproc 2`: every default plan passes validate-plan
    (none left out), includes selective recomputation, bf16, ring attention (cp), compiled plans
    (dp and tp, torch.compile warmed up before the timed steps), a rotating partition (tp=2 with
    `time k/2 rotate tp` linears, from its plan file) and the solver's plan file, and runs. The
    predictions are fixed before the first
    plan is launched: what run_groups is handed equals the headline recorded after the runs,
    and equals the plan predicted afresh (no run) on the same profile."""
    profile = load_profile()
    handed: dict[str, float] = {}
    real = study_sweep.run_groups

    def recording(jobs, work, store, predictions, *args, **kw):
        for pid, (_, predicted) in predictions.items():
            handed.setdefault(pid, predicted["step_time_s"])
        assert not any(p["status"] == "ok" for p in store.data["plans"])  # nothing has run yet
        return real(jobs, work, store, predictions, *args, **kw)

    monkeypatch.setattr(study_sweep, "run_groups", recording)
    out = tmp_path / "default"
    # the report's plots are the fixture's test; the summary is computed here as write_report does
    run_study("examples/gpt.py:tiny", 2, out_dir=out, steps=1, warmup=1, allreduce_sizes=SIZES, profile=profile,
              report=False)
    data = json.loads((out / "results.json").read_text())
    data["summary"] = summary(data)
    assert data["left_out"] == []
    failed = [(p["plan"], p.get("error")) for p in data["plans"] if p["status"] != "ok"]
    assert not failed, failed
    plans = [p["plan"] for p in data["plans"]]
    assert len(plans) == len(default_sweep(2, 2, 2)) + 2  # and the rotating and the solver's plan files
    for want in ("recompute=selective", "dtype=bf16", "cp=2", "schedule=gpipe", "zero=3", "sp=1", "compile=1"):
        assert any(want in p for p in plans), want
    compiled = {parse_study_plan(p["plan"], 2).label: p for p in data["plans"] if "compile=1" in p["plan"]}
    assert set(compiled) == {"dp=2,mb=1,compile=1", "tp=2,mb=2,compile=1"}
    for label, p in compiled.items():  # compiled in the warm-up (at least once per rank), never while timed
        assert p["compiles"]["warmup"] >= 2 and p["compiles"]["timed"] == 0 and p["warmup_steps"] >= 1, (label, p)
    solver = [p for p in data["plans"] if "solver-2.plan" in p["plan"]]
    assert len(solver) == 1 and (out / "solver-2.plan").is_file()
    rotating = [p for p in data["plans"] if "rotate-2.plan" in p["plan"]]
    assert len(rotating) == 1 and parse_study_plan(rotating[0]["plan"], 2).label.startswith("rotate:tp=2,")
    ir = (out / "rotate-2.plan.ir").read_text()
    assert ir.count("partition<tp:n; time k/2 rotate tp>") == 4  # attn.proj and mlp.fc2 of both blocks
    assert {p["id"]: p["predicted_step_time_s"] for p in data["plans"]} == handed
    sp = parse_study_plan(data["plans"][0]["plan"], 2)
    fresh = predict("examples/gpt.py:tiny", sp, study_cluster(2, profile=profile))[1]["step_time_s"]
    assert data["plans"][0]["predicted_step_time_s"] == pytest.approx(fresh, rel=1e-9)
    assert data["summary"]["targets"]["every_plan_runs"]
    assert all(p["worst_memory_category"] is not None for p in data["plans"])


def test_the_default_sweep_leaves_out_what_validate_plan_refuses() -> None:
    """On a model whose 3 heads tp=2 cannot split, the tp candidates are dropped with the pass's reason."""
    from shardc.driver import open_model
    from shardc.study.predict import validation_problem

    source = open_model("examples/gpt.py:tiny?n_head=3&n_embd=48", device="cpu")
    grouped: dict = {}
    refused = {t: validation_problem(source, parse_study_plan(t, 2), study_cluster(2), grouped)
               for t in default_sweep(2, 2, 2)}
    assert "tp=2 does not divide heads=3" in refused["tp=2,mb=2"]
    assert refused["dp=2,mb=1"] is None and refused["cp=2,mb=2"] is None


def test_rounds_shuffle_by_seed_and_skip_failed_plans(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path / "results.json", {"model": "m"})
    jobs = {2: [{"id": f"p{i}"} for i in range(8)]}
    store.record({"id": "p3", "status": "error"})
    orders = [[j["id"] for j in study_sweep._round_jobs(jobs, store, r, 0)[2]] for r in range(3)]
    assert all(sorted(o) == sorted(f"p{i}" for i in range(8) if i != 3) for o in orders)
    assert len({tuple(o) for o in orders}) == 3  # each round its own order
    assert orders[1] == [j["id"] for j in study_sweep._round_jobs(jobs, store, 1, 0)[2]]  # seeded
    store.record({"id": "p0", "status": "ok", "round_step_times_s": [0.1, 0.1]})
    assert "p0" not in [j["id"] for j in study_sweep._round_jobs(jobs, store, 1, 0)[2]]
    assert "p0" in [j["id"] for j in study_sweep._round_jobs(jobs, store, 2, 0)[2]]


def test_memory_category_errors() -> None:
    """Each category against its own measurement; tiny categories get no relative error, and a
    category measured empty but predicted large is not hidden."""
    measured = {"parameters": 1000, "gradients": 1000, "optimizer": 2000, "activations": 500, "other": 400,
                "model_buffers": 100, "buffers": 0}
    predicted = {"parameters": 1000, "gradients": 1000, "optimizer": 2000, "activations": 900, "working": 250,
                 "recompute_working": 0, "buffers": 300}
    got = {c["category"]: c["error"] for c in category_errors(measured, predicted, 5000)}
    assert got["parameters"] == 0 and got["activations"] == pytest.approx(0.8)
    assert got["working"] == pytest.approx(-0.5)
    assert got["buffers"] == pytest.approx(3.0)  # 300 predicted against the 2% floor of 100 bytes
    assert category_errors({"parameters": 10}, {"parameters": 20}, 5000)[0]["error"] is None


def test_the_readme_sweep_has_compiled_plans_at_every_process_count_and_one_rotating_plan(tmp_path: Path) -> None:
    """The README model's sweep (`plans.DEFAULT_MODEL`, 2 and 4 processes) before validation:
    dp=N compiled at every N, tp=2 compiled on 2; the rotating partition's plan file (made, not
    run) rotates every row-parallel linear over tp and loads back as the study runs it."""
    from shardc.driver import open_model
    from shardc.study.plans import DEFAULT_MODEL
    from shardc.study.rotating import rotating_plan_file

    two, four = default_sweep(2, 8, 4), default_sweep(4, 8, 4)
    assert [p for p in two if "compile=1" in p] == ["tp=2,mb=8,compile=1", "dp=2,mb=4,compile=1"]
    assert [p for p in four if "compile=1" in p] == ["dp=4,mb=2,compile=1"]
    source = open_model(DEFAULT_MODEL, device="cpu")
    text = rotating_plan_file(source, study_cluster(2), 2, 8, tmp_path / "rotate-2.plan")
    sp = parse_study_plan(text, 8)
    assert sp.label == "rotate:tp=2,mb=8,gbs=8" and sp.plan.tp == 2
    ir = (tmp_path / "rotate-2.plan.ir").read_text()
    assert ir.count("partition<tp:n; time k/2 rotate tp>") == 8  # attn.proj and mlp.fc2 of 4 blocks
