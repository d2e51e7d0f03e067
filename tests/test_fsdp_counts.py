"""FSDP2's collectives per step as the runtime runs them and as the model counts them (issue 13).

Rules checked (`shardc.cost.fsdp`): per stage module and step, ZeRO-1/2 all-gather once and
ZeRO-3 m + 1 times (once plus once per op that follows a forward), with one reduce-scatter after
the last backward, in a pipeline (torch's stage keeps the weights unsharded after a backward)
and without one (`Microbatched` sets `set_reshard_after_backward(False)` but for the last
micro-batch); the model lists the same collectives with the same bytes (`StageEstimate.
dp_collectives`) as the ranks of a real gloo run record (`shardc run`'s memory-tracked step),
and ZeRO-3's later gathers block the pipeline ops they run in.
"""

from __future__ import annotations

from collections import Counter

import pytest
from test_backend_numerics import GPT, LLAMA
from test_pipeline_numerics import run_and_check

from shardc.cost.fsdp import fsdp_gathers, gather_ops, gathers_by_phase, runtime_order
from shardc.cost.pipeline import device_order, simulate
from shardc.ir.diagnostics import ShardcError
from shardc.run import launch_all, predict, resolve_plan

TINY = "examples/llama.py:tiny?batch={batch}&seq=32"


@pytest.mark.parametrize("schedule,pp,vpp", [("1f1b", 2, 1), ("1f1b", 4, 1), ("gpipe", 2, 1),
                                             ("interleaved", 2, 2), ("1f1b", 1, 1)])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_zero3_gathers_once_plus_once_per_op_after_a_forward_zero1_once(schedule: str, pp: int, vpp: int,
                                                                          m: int) -> None:
    assert fsdp_gathers(1, pp, m, schedule, vpp) == fsdp_gathers(2, pp, m, schedule, vpp) == 1
    assert fsdp_gathers(3, pp, m, schedule, vpp) == m + 1
    for d in range(pp):
        order = runtime_order(pp, d, m, vpp, schedule)
        for unit in {s for _, _, s in order}:
            assert sum(gathers_by_phase(order, 3, unit)) == m + 1
            assert gathers_by_phase(order, 1, unit) == (1, 0)


def test_the_walk_follows_the_schedule_order() -> None:
    # 1F1B, two stages, two micro-batches: stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1
    assert gather_ops(device_order("1f1b", 2, 0, 2, 1), 3) == [("F", 0, 0), ("F", 1, 0), ("B", 0, 0)]
    assert gather_ops(device_order("1f1b", 2, 1, 2, 1), 3) == [("F", 0, 1), ("B", 0, 1), ("B", 1, 1)]
    # without a pipeline each micro-batch runs forward then backward; ZeRO-3 regathers every backward
    assert gather_ops(runtime_order(1, 0, 3, 1, "1f1b"), 3) == [("F", 0, 0), ("B", 0, 0), ("B", 1, 0), ("B", 2, 0)]
    assert gather_ops(runtime_order(1, 0, 3, 1, "1f1b"), 2) == [("F", 0, 0)]


def test_gathers_inside_the_schedule_lengthen_the_ops_they_block() -> None:
    plain = simulate("1f1b", [1.0, 1.0], [2.0, 2.0], 2, 2)
    extra = {("F", 1, 0): 0.5, ("B", 0, 1): 0.25}
    slower = simulate("1f1b", [1.0, 1.0], [2.0, 2.0], 2, 2, extra=extra)
    assert slower.busy == pytest.approx((plain.busy[0] + 0.5, plain.busy[1] + 0.25))
    assert slower.makespan > plain.makespan


def test_zero3_in_a_pipeline_prices_its_gathers_in_the_schedule() -> None:
    spec = TINY.format(batch=4)
    est = {}
    for zero in (1, 3):
        est[zero], note = predict(spec, resolve_plan(f"pp=2,dp=2,mb=1,gbs=4,zero={zero}", 4, on_gpus=False),
                                  "4xA100-80GB", 4)
        assert est[zero] is not None, note
    assert est[3].pipeline.extra and all(op[0] in "FB" for op, _ in est[3].pipeline.extra)
    assert not est[1].pipeline.extra
    for one, three in zip(est[1].stages, est[3].stages):
        assert three.time["dp_comm"] > one.time["dp_comm"]
    assert est[3].step_time_s > est[1].step_time_s


def _recorded(report: dict) -> Counter:
    return Counter((c["kind"], float(c["bytes"])) for c in report["collectives"]
                   if c["kind"] in ("all_gather", "reduce_scatter"))


def _counted(stage) -> Counter:
    out: Counter = Counter()
    for kind, count, nbytes in stage.dp_collectives:
        out[(kind, float(nbytes))] += count
    return out


FLAT_AND_PIPELINED = [(TINY.format(batch=4), f"pp=2,dp=2,mb=1,gbs=4,zero={z}") for z in (1, 3)] + \
    [(TINY.format(batch=8), f"dp=4,mb=1,gbs=8,zero={z}") for z in (1, 3)]
INTERLEAVED = {zero: ("examples/llama.py:tiny?batch=4&seq=32&n_layer=8", f"pp=2,vpp=4,dp=2,mb=1,gbs=4,zero={zero}")
               for zero in (1, 3)}


@pytest.fixture(scope="module")
def recorded_runs() -> dict[tuple[str, str], list[dict] | ShardcError]:
    """Every run of the recording tests in one torchrun of 4 workers (`launch_all`: a fresh
    model and tracker per run), per (spec, plan) each rank's report; when that launch fails,
    each run alone, so that a failure lands on its test."""
    runs = FLAT_AND_PIPELINED + list(INTERLEAVED.values())
    plans = [(spec, resolve_plan(text, 4, on_gpus=False)) for spec, text in runs]
    try:
        return dict(zip(runs, launch_all(plans, nproc=4, steps=1, seed=0, timeout_s=600)))
    except ShardcError:
        out: dict[tuple[str, str], list[dict] | ShardcError] = {}
        for run, plan in zip(runs, plans):
            try:
                out[run] = launch_all([plan], nproc=4, steps=1, seed=0, timeout_s=300)[0]
            except ShardcError as err:
                out[run] = err
        return out


def _reports(recorded_runs: dict, run: tuple[str, str]) -> list[dict]:
    got = recorded_runs[run]
    if isinstance(got, ShardcError):
        raise got
    return got


def test_model_counts_the_collectives_a_pipelined_and_a_flat_zero_run_records(recorded_runs: dict) -> None:
    """dp2 x pp2 with 2 micro-batches, ZeRO-1 and ZeRO-3, and dp4 without a pipeline with 2
    micro-batches: each rank's recorded all-gathers and reduce-scatters (count and bytes) are
    what the model lists for its pipeline stage."""
    for spec, text in FLAT_AND_PIPELINED:
        plan = resolve_plan(text, 4, on_gpus=False)
        est, note = predict(spec, plan, "4xA100-80GB", 4)
        assert est is not None, note
        zero3 = text.endswith("zero=3")
        for report in _reports(recorded_runs, (spec, text)):
            pp_rank = report["rank"] // 2 if plan.pp == 2 else 0
            stage = est.stages[pp_rank]
            assert _recorded(report) == _counted(stage), (text, report["rank"])
            gathers = sum(n for (kind, _), n in _counted(stage).items() if kind == "all_gather")
            assert gathers == (3 if zero3 else 1), (text, stage.dp_collectives)


@pytest.mark.parametrize("zero", [1, 3])
def test_interleaved_stage_modules_each_gather_as_counted(zero: int, recorded_runs: dict) -> None:
    """Interleaved 1F1B, four virtual stages per device (four FSDP2 units each), 2 micro-batches:
    torch's runtime keeps only the next three units a device runs unsharded (`runtime_window`),
    so even ZeRO-1 regathers a unit; every unit's gathers and its one reduce-scatter are as the
    model lists them."""
    spec, text = INTERLEAVED[zero]
    plan = resolve_plan(text, 4, on_gpus=False)
    ranks = _reports(recorded_runs, (spec, text))
    est, note = predict(spec, plan, "4xA100-80GB", 4)
    assert est is not None, note
    for report in ranks:
        stage = est.stages[report["rank"] // 2]
        assert len(stage.dp_collectives) == 8  # four units, a gather and a reduce-scatter entry each
        assert _recorded(report) == _counted(stage), (text, report["rank"])
    gathers = [n for kind, n, _ in est.stages[0].dp_collectives if kind == "all_gather"]
    if zero == 1:
        assert sum(gathers) > 4  # more than one per unit
    else:
        assert gathers == [3, 3, 3, 3]  # m + 1 per unit: resharded after every forward anyway


def test_micro_batches_without_a_pipeline_keep_the_weights_gathered_and_train_like_one_process() -> None:
    run_and_check(2, [(GPT, "dp=2,mb=1,gbs=4,zero=1"), (LLAMA, "dp=2,mb=1,gbs=4,zero=3")])
