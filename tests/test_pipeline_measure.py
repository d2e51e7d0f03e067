"""The zero-bubble measurement's plumbing (`benchmarks/pipeline_schedules.py --measure`,
`shardc.study.pipeline_measure`): the plans it runs, how it hands them to the study, and the
figures it reads back. No timing here: the study is stubbed, its results written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import microbatch_problem
from shardc.study import pipeline_measure as pm
from shardc.study.plans import parse_study_plan

MiB = 2**20


def test_the_measured_case_runs_every_schedule_at_the_same_micro_batches() -> None:
    texts = pm.measure_plans()
    assert texts == ["pp=4,mb=1", "pp=4,mb=1,vpp=2,schedule=interleaved", "pp=4,mb=1,vpp=2,schedule=zbv",
                     "pp=4,mb=1,vpp=2,schedule=interleaved-zb", "pp=4,mb=1,vpp=2,schedule=dualpipev"]
    batch = 8  # the case's model: m = 8 micro-batches of 1, DualPipeV's least at pp=4
    assert "batch=8" in pm.measure_model(4) and "n_layer=8" in pm.measure_model(4)  # a block per virtual stage
    assert "batch=4" in pm.measure_model(2) and "n_layer=4" in pm.measure_model(2)
    for text in texts:
        plan = parse_study_plan(text, batch).plan
        assert microbatch_problem(plan, batch // plan.mb) is None, text
    assert [pm.schedule_name(t) for t in texts] == ["1f1b", "interleaved vpp=2", "zbv vpp=2",
                                                   "interleaved-zb vpp=2", "dualpipev vpp=2"]


def _entry(text: str, predicted: float, rounds: list[float], memory: list[tuple[float, float]]) -> dict:
    """A results.json entry with what the measurement reads (canonical plan text as the study writes)."""
    return {"plan": parse_study_plan(text, 8).text, "status": "ok", "predicted_step_time_s": predicted,
            "measured_step_time_s": sorted(rounds)[len(rounds) // 2], "round_step_times_s": rounds,
            "ranks": [{"rank": r, "stage": r, "measured_peak_memory_bytes": m * MiB,
                       "predicted_peak_memory_bytes": q * MiB} for r, (m, q) in enumerate(memory)]}


def _results() -> dict:
    flat = [(10.0, 10.2)] * 4
    return {"plans": [
        _entry("pp=4,mb=1,vpp=2,schedule=zbv", 0.80, [0.90, 1.70, 0.85], [(12.0, 12.3), (12.0, 11.0)] + flat[:2]),
        _entry("pp=4,mb=1", 1.00, [1.00, 2.00, 1.00], flat),
        _entry("pp=4,mb=1,vpp=2,schedule=dualpipev", 0.75, [0.95], flat),  # one round only: medians compared
        {"plan": "pp=4,mb=1,vpp=2,schedule=interleaved", "status": "error", "error": "boom"},
    ]}


def test_ratios_pair_each_round_with_1f1bs_and_say_whether_they_agree() -> None:
    rows = {r.schedule: r for r in pm.schedule_rows(_results())}
    assert list(rows) == ["1f1b", "zbv vpp=2", "dualpipev vpp=2"]  # 1F1B first; the failed plan left out
    zbv = rows["zbv vpp=2"]
    # rounds paired: 0.90/1.00, 1.70/2.00, 0.85/1.00 -> median 0.85 (the slow round 2 cancels)
    assert zbv.measured_ratio == pytest.approx(0.85) and zbv.predicted_ratio == pytest.approx(0.80)
    assert (zbv.measured_s, zbv.measured_min_s, zbv.measured_max_s, zbv.rounds) == (0.90, 0.85, 1.70, 3)
    assert zbv.ratio_error == pytest.approx(0.85 / 0.80 - 1) and zbv.within
    dual = rows["dualpipev vpp=2"]
    assert dual.measured_ratio == pytest.approx(0.95 / 1.00) and not dual.within  # 0.95 vs 0.75: +27%
    assert rows["1f1b"].measured_ratio == rows["1f1b"].predicted_ratio == 1.0


def test_memory_rows_name_each_ranks_virtual_stages() -> None:
    rows = [m for m in pm.memory_rows(_results()) if m.schedule == "zbv vpp=2"]
    assert [(m.rank, m.stages) for m in rows] == [(0, "0+7"), (1, "1+6"), (2, "2+5"), (3, "3+4")]
    assert rows[0].error == pytest.approx(0.3 / 12.0) and rows[0].within
    assert rows[1].error == pytest.approx(-1.0 / 12.0) and not rows[1].within
    text = pm.format_tables(_results())
    assert "zbv vpp=2               0.800" in text and "0.900 [0.850-1.700]" in text
    assert "+6.2%  yes" in text and "+26.7%  NO" in text  # the step ratios' agreement
    assert "   0     0+7     12.00     12.30   +2.5%  yes" in text


def test_without_a_1f1b_run_it_says_what_failed() -> None:
    data = {"plans": [{"plan": "pp=4,mb=1", "status": "error", "error": "rank 2 timed out"}]}
    with pytest.raises(ShardcError, match=r"no 1F1B run to compare with.*rank 2 timed out"):
        pm.schedule_rows(data)


def test_run_measure_hands_the_plans_to_the_study_in_rounds(tmp_path: Path, monkeypatch) -> None:
    """One study, the five plans from a file, `repeats` rounds (each round every plan once, in the
    study's shuffled order), no solver plan and no report; the results come back as written."""
    seen: dict = {}

    def fake_study(model, nproc, **kw):
        seen.update(model=model, nproc=nproc, **kw)
        (Path(kw["out_dir"]) / "results.json").write_text(json.dumps(_results()))
        return 0

    monkeypatch.setattr("shardc.study.run_study", fake_study)
    data = pm.run_measure(tmp_path / "m", repeats=3, steps=4, warmup=1)
    assert seen["model"] == pm.measure_model(4) and seen["nproc"] == 4
    assert (seen["rounds"], seen["steps"], seen["warmup"], seen["solver"], seen["report"]) == (3, 4, 1, False, False)
    assert Path(seen["plans_file"]).read_text().split() == pm.measure_plans()
    assert data == _results()
    with pytest.raises(ShardcError, match="at least one round"):
        pm.run_measure(tmp_path / "n", repeats=0)


# ---- processor sharing: what a CPU with fewer cores than processes makes of the bubble --------

def test_shared_cores_fill_the_bubble_and_leave_enough_cores_alone() -> None:
    from shardc.cost.pipeline import simulate
    from shardc.cost.pipeline_shared import simulate_shared

    # Enough cores: the plain simulation, whatever the schedule.
    for schedule, v, w in (("1f1b", 1, None), ("zbv", 2, [0.5] * 4), ("interleaved", 2, None)):
        fwd, bwd = [1.0 / v] * 2 * v, [2.0 / v] * 2 * v
        plain = simulate(schedule, fwd, bwd, 4, 2, wgrad=w).makespan
        assert simulate_shared(schedule, fwd, bwd, 4, 2, 2, wgrad=w) == pytest.approx(plain)
    # One core for two processes: lengths are at half a core each, so a process alone runs
    # twice as fast; 1F1B (m=2, F=1, B=2) keeps the core busy throughout: 12 units of half a
    # core = 6 s, where one device per process takes (m+p-1)(F+B) = 9 s.
    assert simulate("1f1b", [1.0] * 2, [2.0] * 2, 2, 2).makespan == pytest.approx(9.0)
    assert simulate_shared("1f1b", [1.0] * 2, [2.0] * 2, 2, 2, 1) == pytest.approx(6.0)
    # ZB-V does the same work: on one core it gains nothing over 1F1B.
    assert simulate_shared("zbv", [0.5] * 4, [1.0] * 4, 2, 2, 1, wgrad=[0.5] * 4) == pytest.approx(6.0)
    # A lone micro-batch: every op alone, all twice as fast.
    assert simulate_shared("1f1b", [1.0] * 2, [2.0] * 2, 1, 2, 1) == pytest.approx(3.0)


