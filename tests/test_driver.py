"""One front door: every command reaches the same prediction through `shardc.driver`.

For one model, plan and cluster, `shardc run`'s prediction, `shardc estimate --json`,
`shardc.compile(...).estimate()` agree exactly, and so do the plan the solver writes and its
partitioned IR re-scored by `shardc estimate`. The batch in the spec never limits a plan. Every
command takes `--pipeline`, `--print-after-all` and `--time-passes`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shardc
from shardc import driver
from shardc.cli import main
from shardc.driver import batch_for, estimate, open_model
from shardc.ir.parser import parse_file
from shardc.plan.parallel import ParallelPlan
from shardc.run import predict, resolve_plan

SPEC = "examples/gpt.py:tiny"
CLUSTER = "2xA100-80GB"


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _figures(data: dict) -> tuple:
    return data["step_time_s"], data["memory_per_device_bytes"], [s["memory_bytes"] for s in data["stages"]]


def test_run_estimate_and_compile_predict_the_same(capsys: pytest.CaptureFixture[str]) -> None:
    plan = resolve_plan("dp=2", 2)  # what `shardc run --plan dp=2` runs: fp32 on CPU
    assert str(plan) == str(ParallelPlan.parse("dp=2,dtype=fp32"))
    run_est, note = predict(SPEC, plan, CLUSTER, 2)
    assert run_est is not None, note
    cli = _json(capsys, ["estimate", SPEC, "--cluster", CLUSTER, "--plan", str(plan), "--json"])
    compiled = shardc.compile(SPEC, plan=plan, cluster=CLUSTER).estimate()
    assert _figures(json.loads(run_est.to_json())) == _figures(cli) == _figures(json.loads(compiled.to_json()))
    assert json.loads(run_est.to_json()) == cli == json.loads(compiled.to_json())


def test_the_plan_the_solver_writes_rescores_to_its_own_figures(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    summary = _json(capsys, ["plan", SPEC, "--cluster", CLUSTER, "--gbs", "4", "--time-limit", "3",
                             "-o", str(out), "--json"])
    written = json.loads(out.read_text())
    rescored = _json(capsys, ["estimate", f"{out}.ir", "--cluster", CLUSTER, "--json"])
    compiled = shardc.compile(SPEC, plan=parse_file(f"{out}.ir"), cluster=CLUSTER).estimate()
    figures = (summary["step_time_s"], summary["memory_per_device_bytes"])
    assert figures == (written["step_time_s"], written["memory_per_device_bytes"])
    assert figures == (rescored["step_time_s"], rescored["memory_per_device_bytes"])
    assert figures == (compiled.step_time_s, compiled.memory_per_device_bytes)


def test_a_batch_in_the_spec_never_limits_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--cluster", "32xA100-80GB", "--plan", "dp=32", "--json"]
    one = _json(capsys, ["estimate", "examples/gpt.py:gpt?n_layer=2&n_embd=64&n_head=4&seq=32&batch=1", *argv])
    many = _json(capsys, ["estimate", "examples/gpt.py:gpt?n_layer=2&n_embd=64&n_head=4&seq=32&batch=32", *argv])
    assert _figures(one) == _figures(many) and one == many
    assert one["global_batch"] == 32


def test_batch_for_keeps_a_batch_the_plan_splits() -> None:
    assert batch_for(ParallelPlan.parse("dp=2"), 8) is None
    assert batch_for(ParallelPlan.parse("dp=4,mb=2"), 2) == 8
    assert batch_for(ParallelPlan.parse("dp=2,gbs=16"), 2) is None  # gbs is given: dp divides 2
    assert open_model(SPEC).trace(5).graph.inputs[0].type.shape[0] == 5  # rows repeated


def test_estimate_takes_a_pipeline_and_prints_and_times_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", SPEC, "--cluster", CLUSTER, "--plan", "dp=2", "--print-after-all", "--time-passes",
            "--pipeline", "group-layers,validate-plan,apply-plan,annotate-cost,estimate", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout stays JSON; the IR and the timings go to stderr
    for name in ("group-layers", "validate-plan", "apply-plan", "annotate-cost", "estimate"):
        assert f"// ----- IR after {name} -----" in captured.err
    assert "pass timings" in captured.err and "mesh<" in captured.err


def test_plan_takes_a_pipeline_and_prints_and_times_it(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", SPEC, "--cluster", CLUSTER, "--gbs", "4", "--print-after-all", "--time-passes",
            "--pipeline", "group-layers,annotate-cost,solve{gbs=4,time-limit=2}"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "// ----- IR after annotate-cost -----" in out and "// ----- IR after solve -----" in out
    assert "pass timings" in out and "plan for @" in out


def test_compile_takes_a_pipeline_and_prints_and_times_it(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compile", SPEC, "--plan", "tp=2", "-o", str(tmp_path / "out"), "--print-after-all", "--time-passes",
            "--pipeline", "group-layers,apply-plan,lower"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "// ----- IR after apply-plan -----" in out and "// ----- IR after lower -----" in out
    assert "// ----- IR after validate-plan -----" not in out and "pass timings" in out
    assert (tmp_path / "out" / "rank1.py").exists()


def test_inspect_takes_a_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", SPEC, "--no-ir", "--print-after-all", "--time-passes",
                 "--pipeline", "group-layers"]) == 0
    out = capsys.readouterr().out
    assert "// ----- IR after group-layers -----" in out and "pass timings" in out


@pytest.mark.parametrize(("pipeline", "message"), [
    ("group-layers,no-such-pass,estimate", "unknown pass 'no-such-pass'"),
    ("group-layers,apply-plan,estimate{buckets=2}", "pass estimate has no option 'buckets'"),
    ("group-layers,apply-plan", "end it with the estimate pass"),
])
def test_a_bad_pipeline_is_a_clear_error_naming_the_pass(pipeline: str, message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", SPEC, "--cluster", CLUSTER, "--plan", "dp=2", "--pipeline", pipeline]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("pipeline", "message"), [
    ("group-layers,no-such-pass,estimate", "unknown pass 'no-such-pass'"),
    ("group-layers,validate-plan,apply-plan", "a study pipeline ends with the estimate pass"),
])
def test_a_bad_study_pipeline_is_a_clear_error_before_anything_runs(pipeline: str, message: str, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["study", f"{SPEC}?batch=4", "--nproc", "2", "--sweep", "dp", "--out", str(tmp_path / "out"),
            "--steps", "2", "--warmup", "1", "--pipeline", pipeline]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_plan_that_does_not_fit_the_cluster_fails_in_validate_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", SPEC, "--cluster", "4xA100-80GB", "--plan", "dp=2"]) == 2
    err = capsys.readouterr().err
    assert "validate-plan" in err and "dp*tp*pp*cp = 1*1*1*1" not in err and "4 devices" in err
    with pytest.raises(shardc.ShardcError, match="not partitioned; give a --plan"):
        estimate(SPEC, CLUSTER, None)


def test_shardc_run_predicts_what_estimate_predicts(capsys: pytest.CaptureFixture[str]) -> None:
    """The one full run: two gloo processes, one step; its prediction is `shardc estimate`'s."""
    ran = _json(capsys, ["run", SPEC, "--nproc", "2", "--steps", "1", "--cluster", CLUSTER, "--json"])  # dp=2
    est = _json(capsys, ["estimate", SPEC, "--cluster", CLUSTER, "--plan", "dp=2,dtype=fp32", "--json"])
    assert ran["predicted_step_time_s"] == est["step_time_s"]
    assert [r["predicted_peak_memory_bytes"] for r in ran["ranks"]] == [est["stages"][0]["memory_bytes"]] * 2


def test_solve_options_read_back_from_the_pipeline_text() -> None:
    from shardc.driver import solve_pipeline
    from shardc.passmanager import parse_pipeline

    text = solve_pipeline(16, time_limit=2, warm_start="/tmp/a plan, v2.json", grid2d=True)
    solve = parse_pipeline(text)[-1]
    assert text.startswith("group-layers,solve{")
    assert (solve.gbs, solve.time_limit, solve.warm_start, solve.grid2d) == (16, 2.0, "/tmp/a plan, v2.json", True)


def test_a_padded_vocabulary_estimates_and_plans(capsys: pytest.CaptureFixture[str]) -> None:
    """apply-plan pads a vocabulary tp does not divide; the driver's verification lets it pass."""
    spec = "examples/gpt.py:tiny?vocab_size=127"
    est = _json(capsys, ["estimate", spec, "--cluster", CLUSTER, "--plan", "tp=2", "--json"])
    assert est["step_time_s"] > 0
    with pytest.raises(shardc.ShardcError, match="unevenly"):
        shardc.compile(spec, plan="tp=2")  # the backend's graph stays strict


def test_a_local_cluster_is_calibrated_once_when_never_measured(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """`--cluster local` on a fresh machine: the driver measures the profile (here: a stand-in
    that writes the cached one) before building the cluster; an explicit preset never does."""
    from test_hardware import _profile

    import shardc.calibration.local as local
    from shardc.calibration.profile import write_profile

    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))
    measured: list[bool] = []

    def measure(*args: object, **kwargs: object) -> object:
        measured.append(True)
        write_profile(_profile(), tmp_path / "local-profile.json")
        return local.read_profile()

    monkeypatch.setattr(local, "run_calibration", measure)
    assert driver.as_cluster("8xA100-80GB").num_devices == 8 and not measured
    assert driver.as_cluster("local2").num_devices == 2 and measured == [True]
    assert driver.as_cluster("local2").num_devices == 2 and measured == [True]  # cached from now on
