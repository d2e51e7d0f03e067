"""The study's pipeline sweep (`shardc study --sweep pipeline`): its candidates, their validation,
its report (schedules, point-to-point block size), and pipeline buffers measured as the model
defines them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardc.study import pipeline_report, run_study
from shardc.study import sweep as study_sweep
from shardc.study.plans import parse_study_plan, pipeline_sweep, sweep_plans
from shardc.train.memory import pipeline_buffers, track_memory

MODEL = "examples/gpt.py:tiny?batch=8&n_layer=4"


def test_the_pipeline_sweep_covers_the_seed_findings() -> None:
    texts = pipeline_sweep(2, 8, 4)
    assert texts[:2] == ["dp=2,mb=4", "pp=2,mb=2"]  # pp vs dp at equal devices
    assert "pp=2,mb=2,split=3+1" in texts and "pp=2,mb=2,split=1+3" in texts  # balanced vs unbalanced
    for schedule in ("interleaved", "interleaved-zb", "zbv", "dualpipev"):
        assert f"pp=2,mb=2,vpp=2,schedule={schedule}" in texts
    assert "pp=2,mb=2,schedule=gpipe" in texts
    assert [t for t in texts if t.startswith("pp=2,mb=") and "," not in t[len("pp=2,mb="):]] == \
        ["pp=2,mb=2", "pp=2,mb=1", "pp=2,mb=4", "pp=2,mb=8"]  # p2p block sizes
    assert pipeline_sweep(1, 8, 4) == []
    with pytest.raises(Exception, match="--sweep pipeline alone"):
        sweep_plans(["pipeline", "dp"], [2], 8)


def test_the_pipeline_sweep_is_validated_before_it_is_predicted(tmp_path: Path, monkeypatch) -> None:
    """`--sweep pipeline` goes through validate-plan like the default sweep: what torch's schedules
    or the model refuse is listed with the reason, the rest goes on to be predicted and run
    (`_prepare_jobs`, stubbed here: the default sweep's test runs that part)."""
    handed: list[str] = []

    def prepare(study, texts, store, nprocs, rounds=1):
        handed.extend(texts)
        return {}, {}

    monkeypatch.setattr(study_sweep, "_prepare_jobs", prepare)
    run_study(MODEL, 2, sweep="pipeline", out_dir=tmp_path, steps=1, warmup=1, report=False)
    data = json.loads((tmp_path / "results.json").read_text())
    left = {x["plan"]: x["reason"] for x in data["left_out"]}
    assert set(left) == {"pp=2,mb=8"}
    assert "the 1F1B schedule needs at least as many micro-batches as stages" in left["pp=2,mb=8"]
    assert handed == [t for t in pipeline_sweep(2, 8, 4) if t != "pp=2,mb=8"]  # no solver plan
    assert not any("plan_file=" in t for t in handed)


def _plan(text: str, step: float, predicted: float, memory: list[float], wait: float = 0.0, send: int = 0,
          bubble: float = 0.0) -> dict:
    """A results.json entry with the fields the pipeline report reads."""
    sp = parse_study_plan(text, 8)
    ranks = [{"rank": r, "measured_peak_memory_bytes": m, "predicted_peak_memory_bytes": m * 1.1,
              "time_breakdown": {"waiting_s": wait * (r + 1) / 2},
              "collectives": {"send": {"message_bytes": {"median": send}}} if send else {}}
             for r, m in enumerate(memory)]
    return {"plan": sp.text, "nproc": 2, "status": "ok", "split": None, "bucket_mb": None, "ranks": ranks,
            "measured_step_time_s": step, "predicted_step_time_s": predicted,
            "step_time_error": predicted / step - 1, "measured_peak_memory_bytes": memory,
            "predicted_peak_memory_bytes": [m * 1.1 for m in memory],
            "predicted": {"bubble_fraction": bubble, "micro_batches": 8 // sp.plan.mb,
                          "time_breakdown": {"bubble": bubble * predicted, "pp_comm": 0.001}}}


def test_the_pipeline_report_compares_schedules_and_block_sizes(tmp_path: Path) -> None:
    data = {"plans": [
        _plan("pp=2,mb=2", 0.040, 0.030, [2e6, 1e6], wait=0.010, send=8192, bubble=0.2),
        _plan("pp=2,mb=2,vpp=2,schedule=zbv", 0.030, 0.027, [3e6, 2e6], bubble=0.04),
        _plan("pp=2,mb=2,schedule=gpipe", 0.050, 0.030, [4e6, 4e6], bubble=0.2),
        _plan("pp=2,mb=1", 0.060, 0.050, [1e6, 1e6], wait=0.020, send=4096, bubble=0.1),
        _plan("dp=2,mb=4", 0.020, 0.020, [5e6, 5e6]),  # not a pipeline: in neither group
    ]}
    groups = pipeline_report.schedule_groups(data)
    assert [[pipeline_report._name(plan) for plan, _ in g] for g in groups] == [["zbv vpp=2", "1f1b", "gpipe"]]
    text = pipeline_report.schedule_findings(data)
    # zbv against 1F1B: 30/40 measured, 27/30 predicted; gpipe 50/40 and 30/30
    assert "zbv vpp=2 30.0 ms measured / 27.0 ms predicted (bubble 4%, 0.75x 1F1B measured / 0.90x predicted" in text
    assert "gpipe 50.0 ms measured / 30.0 ms predicted (bubble 20%, 1.25x 1F1B measured / 1.00x predicted" in text
    assert "Measured order zbv vpp=2, 1f1b, gpipe" in text
    p2p = pipeline_report.p2p_findings(data)
    # the slowest rank's waiting (rank 1: wait * 2 / 2) against bubble * predicted + pp_comm
    assert "mb=1 (4 KiB per message, 8 micro-batches): step 60.0 ms measured / 50.0 ms predicted, " \
           "waiting 20.0 ms measured / 6.0 ms predicted" in p2p
    assert "mb=2 (8 KiB per message, 4 micro-batches)" in p2p
    for name, plot in (("s.png", pipeline_report.plot_schedules), ("p.png", pipeline_report.plot_p2p)):
        plot(data, tmp_path / name)
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Not measured" in pipeline_report.schedule_findings({"plans": data["plans"][3:]})


def test_pipeline_receive_buffers_and_kept_outputs_are_buffers_even_when_saved() -> None:
    """The model prices torch.distributed.pipelining's receive buffers and the outputs it keeps
    as `buffers`: the tracker files them so, though the stage's first op saves the received
    input for backward, and they stay buffers after that backward."""
    received = torch.randn(256, requires_grad=True)  # a receive buffer: a leaf the stage reads
    grad_in = torch.zeros(256)
    stage = SimpleNamespace(args_recv_info={0: (SimpleNamespace(buffer=received),)},
                            grad_recv_info={0: (SimpleNamespace(buffer=grad_in), SimpleNamespace(buffer=None))},
                            fwd_cache={}, output_chunks=[])
    with track_memory([], None, held=pipeline_buffers([stage])) as tracker:
        hidden = received.sin()  # saves `received` for backward
        out = hidden.cos()  # saves `hidden`: an activation
        stage.fwd_cache[0] = ((out,), [received])
        stage.output_chunks.append(out)
        out.sum().backward()
        del hidden
        after = torch.ones(1)  # one more op: the tracker samples again
    peak = tracker.result()["peak_breakdown"]
    assert peak["buffers"] == 3 * 256 * 4  # received, grad_in, out (kept by the stage)
    assert peak["activations"] == 256 * 4  # hidden only
    assert after.sum() == 1


def test_storages_alive_before_a_run_are_not_its_memory() -> None:
    """A study worker runs many plans in one process: what it held before a plan began (earlier
    plans' leftovers) is left out of that plan's memory, but the plan's own state is counted even
    when it was made before."""
    from shardc.train.memory import storages_now

    leftover = torch.zeros(64 * 1024)  # 256 KiB an earlier plan left behind
    model = torch.nn.Linear(32, 32)
    before = storages_now()
    with track_memory([model], None) as counted, torch.no_grad():
        model(torch.ones(4, 32))
    with track_memory([model], None, ignore=before) as fresh, torch.no_grad():
        model(torch.ones(4, 32))
    got, baseline = fresh.result()["peak_breakdown"], counted.result()["peak_breakdown"]
    assert baseline["other"] - got["other"] >= leftover.nbytes  # the leftover (and others like it) left out
    assert got["parameters"] == baseline["parameters"] == (32 * 32 + 32) * 4  # the run's own, made before
    assert got["other"] >= 2 * 4 * 32 * 4  # the run's own input and output are counted
