"""`shardc run` end to end under torchrun: JSON report, losses against one process, failures, bad input."""

from __future__ import annotations

import json
import time

import pytest
import torch

from shardc.cli import main
from shardc.ir.diagnostics import ShardcError
from shardc.run import resolve_plan, run_model
from shardc.train import input_ranges, synthetic_batch, vocab_of

SPEC = "examples/gpt.py:tiny"


def reference_losses(steps: int, seed: int, spec: str = SPEC) -> list[float]:
    """One process, the same seed, data and optimizer as the workers."""
    import shardc
    from shardc.frontend.spec import load_model

    torch.manual_seed(seed)
    loaded = load_model(spec, device="cpu")
    model, example = loaded.model, list(loaded.example_inputs)
    ranges = input_ranges(shardc.compile(spec, plan="dp=1", device="meta").graph, loaded.input_names, vocab_of(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        loss = model(*synthetic_batch(example, ranges, seed, step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_run_json_on_two_processes_pipelined(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", SPEC, "--nproc", "2", "--steps", "3", "--plan", "pp=2", "--seed", "3", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["losses"]) == 3
    for got, want in zip(out["losses"], reference_losses(3, 3)):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert out["measured_step_time_s"] > 0
    assert "predicted_step_time_s" in out
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    for r in out["ranks"]:
        assert r["peak_memory_bytes"] > 0
        assert "predicted_peak_memory_bytes" in r


def test_bert_trains_data_parallel_with_its_token_types_in_range(capsys: pytest.CaptureFixture[str]) -> None:
    """BERT's token_type_ids index a table of two rows: the workers' data stays inside it."""
    spec = "examples/bert.py:tiny?batch=4"
    assert main(["run", spec, "--nproc", "2", "--steps", "2", "--plan", "dp=2", "--seed", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["losses"] == pytest.approx(reference_losses(2, 1, spec), rel=1e-5)


def test_input_ranges_follow_each_integer_input_to_its_embedding() -> None:
    import shardc
    from shardc.frontend.spec import load_model

    loaded = load_model("examples/bert.py:tiny", device="meta")
    graph = shardc.compile("examples/bert.py:tiny", plan="dp=1", device="meta").graph
    assert loaded.input_names == ("input_ids", "token_type_ids", "attention_mask", "labels")
    assert input_ranges(graph, loaded.input_names, 128) == (128, 2, 128, 128)


def test_failing_rank_stops_the_others_in_bounded_time() -> None:
    start = time.monotonic()
    with pytest.raises(ShardcError) as err:
        run_model(SPEC, nproc=2, steps=4, plan="dp=2", timeout_s=150,
                  env={"SHARDC_FAIL_RANK": "1", "SHARDC_FAIL_STEP": "1"})
    assert "rank 1 failed: RuntimeError: injected failure" in str(err.value)
    assert "other ranks were stopped" in str(err.value)
    assert time.monotonic() - start < 150


def test_world_size_must_match_the_plan() -> None:
    with pytest.raises(ShardcError, match=r"uses dp\*tp\*pp\*cp = 4 devices but --nproc is 2"):
        resolve_plan("dp=2,tp=2", 2)
    assert resolve_plan(None, 3).dp == 3


def test_cli_reports_bad_plan_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", SPEC, "--nproc", "2", "--plan", "tp=4"]) == 2
    assert "--nproc is 2" in capsys.readouterr().err


def test_run_takes_the_plan_file_the_solver_wrote(tmp_path, monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`shardc plan -o FILE.plan` then `shardc run --plan FILE.plan`: the solver's plan trains as
    one process does, and the prediction is `shardc estimate --plan FILE.plan`'s."""
    from test_hardware import _profile

    from shardc.calibration.profile import write_profile

    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))  # a fixed profile of `local`: never calibrated here
    write_profile(_profile(), tmp_path / "local-profile.json")
    spec, path = f"{SPEC}?batch=4", tmp_path / "tiny.plan"
    assert main(["plan", spec, "--cluster", "local2", "--gbs", "4", "--time-limit", "1", "--dtype", "fp32",
                 "-o", str(path), "--json"]) == 0
    capsys.readouterr()
    assert main(["estimate", spec, "--cluster", "local2", "--plan", str(path), "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert main(["run", spec, "--nproc", "2", "--steps", "2", "--plan", str(path), "--seed", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan_file"] == str(path) and out["plan"] == str(json_plan(path))
    assert out["predicted_step_time_s"] == est["step_time_s"]
    stages = est["stages"]  # one per rank along the pipeline (the solver's plan may pipeline), else one for both
    assert [r["predicted_peak_memory_bytes"] for r in out["ranks"]] == [stages[i * len(stages) // 2]["memory_bytes"]
                                                                        for i in range(2)]
    for got, want in zip(out["losses"], reference_losses(2, 3, spec)):
        assert abs(got - want) <= 1e-5 * abs(want)


def json_plan(path: object) -> object:
    from shardc.plan.file import PlanFile

    return PlanFile.load(str(path)).plan
