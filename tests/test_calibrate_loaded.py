"""Collectives under a training load (`calibration.busy`): the trials' summary, the profile's
`step_wait` and its file, and the local cluster pricing a blocking collective with it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from shardc.calibration.busy import summarize
from shardc.calibration.profile import (
    PROFILE_VERSION,
    AlphaBeta,
    CollectiveFit,
    LoadedCollective,
    LocalProfile,
    at_speed,
    read_profile,
    write_profile,
)
from shardc.cost.comm import call_overhead
from shardc.hardware import local_cluster

MODEL = "examples/gpt.py:gpt?n_layer=2&n_embd=64&n_head=2&vocab_size=128&seq=32&batch=4"


def _base() -> LocalProfile:
    fits = tuple(CollectiveFit(op, n, ((64, 2e-4 * n), (1 << 20, 2e-3 * n)), AlphaBeta(2e-4 * n, 1e-9 * n))
                 for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv") for n in (2, 4))
    return LocalProfile(PROFILE_VERSION, "now", "cpu", 2, 8 << 30, "x", True, ((256, 4e10),), 1e11, 5e5,
                        (("bf16", 1.0),), 2e10, 2e-6, ((2, 6e10, 1e10), (4, 3e10, 5e9)), fits)


def _row(op: str, running: int, group: int, in_step: list[float], idle: float = 1e-4) -> LoadedCollective:
    return LoadedCollective(op, running, group, tuple((64 << i, t, idle, 0.5) for i, t in enumerate(in_step)))


def test_summary_takes_the_median_of_the_trials_and_records_their_spread() -> None:
    middle, spread = summarize([1e-3, 2e-3, 9e-3])  # one slow trial does not move the figure
    assert middle == pytest.approx(2e-3) and spread == pytest.approx((9e-3 - 1e-3) / 2e-3)
    assert summarize([-1e-4, 3e-4, 4e-4])[0] == pytest.approx(3e-4)  # a negative reading counts as 0
    assert summarize([0.0, 0.0, 0.0]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="at least one trial"):
        summarize([])


def test_step_wait_is_the_median_beyond_the_idle_call() -> None:
    rows = tuple(_row(op, 2, 2, [4e-4, 6e-4, 3e-3]) for op in ("all_reduce", "all_gather"))
    profile = replace(_base(), loaded_collectives=rows)
    assert profile.step_wait(2, 2) == pytest.approx(6e-4 - 1e-4)  # in-step less the idle call beside it
    assert profile.step_wait(2, 4) == 0.0 and profile.step_wait(2, 1) == 0.0  # not measured / no group
    assert _base().step_wait(2, 2) == 0.0  # profiles without the measurement price as before
    # a group of 2 among 4 running is measured against the fit the model prices 2 ranks by
    among = replace(profile, loaded_collectives=rows + (_row("all_reduce", 4, 2, [2e-3, 2e-3, 2e-3]),))
    fit = among.nearest("all_reduce", 2).fit
    assert among.step_wait(4, 2) == pytest.approx(2e-3 - fit.time(128))


def test_a_busier_peer_never_prices_a_call_cheaper() -> None:
    calm = _row("all_reduce", 2, 2, [2e-3, 2e-3, 2e-3])
    busy = _row("all_reduce", 4, 2, [1e-4, 1e-4, 1e-4])  # noise read 4 running as cheaper than 2
    profile = replace(_base(), loaded_collectives=(calm, busy))
    assert profile.step_wait(4, 2) >= profile.step_wait(2, 2) > 0
    cheap = replace(_base(), loaded_collectives=(_row("all_gather", 2, 2, [0.0, 0.0, 0.0], idle=5e-4),))
    assert cheap.step_wait(2, 2) == 0.0  # never below the idle call
    link = local_cluster(2, profile).intra
    assert call_overhead(((link, 2),)) >= call_overhead(((local_cluster(2, _base()).intra, 2),))


def test_the_profile_file_keeps_the_loaded_rows_and_old_versions_load(tmp_path) -> None:
    rows = (_row("all_reduce", 2, 2, [4e-4, 6e-4]), _row("send_recv", 4, 2, [1e-3, 2e-3]))
    profile = replace(_base(), loaded_collectives=rows)
    write_profile(profile, tmp_path / "p.json")
    back = read_profile(tmp_path / "p.json")
    assert back == profile and back.loaded_collectives[1].points[0] == (64, 1e-3, 1e-4, 0.5)
    old = profile.to_json()
    old.pop("loaded_collectives")
    old["version"] = 4
    assert LocalProfile.from_json(json.loads(json.dumps(old))).step_wait(2, 2) == 0.0
    slower = at_speed(profile, 2.0)  # every figure a process times scales with the machine's speed
    assert slower.step_wait(2, 2) == pytest.approx(2 * profile.step_wait(2, 2))
    with pytest.raises(ValueError, match="group <= running"):
        LoadedCollective("all_reduce", 2, 4, ())


def test_the_local_cluster_prices_each_blocking_collective_with_the_wait() -> None:
    from shardc.study.plans import parse_study_plan
    from shardc.study.predict import predict

    wait = 5e-4
    rows = tuple(_row(op, 2, 2, [wait + 1e-4] * 3) for op in ("all_reduce", "all_gather", "reduce_scatter"))
    loaded = replace(_base(), loaded_collectives=rows)
    link = local_cluster(2, loaded).intra
    assert link.step_wait == ((2, pytest.approx(wait)),) and link.wait(2) == pytest.approx(wait)
    assert local_cluster(2, _base()).intra.step_wait == ()

    def step(plan: str, profile: LocalProfile) -> dict:
        return predict(MODEL, parse_study_plan(plan), local_cluster(2, profile))[1]

    tp = "dp=1,tp=2,pp=1,mb=2"
    before, after = step(tp, _base()), step(tp, loaded)
    extra = after["time_breakdown"]["tp_comm"] - before["time_breakdown"]["tp_comm"]
    calls = extra / wait
    assert extra > 0 and calls == pytest.approx(round(calls), abs=1e-6)  # a whole number of waits
    assert after["step_time_s"] > before["step_time_s"]
    dp = "dp=2,tp=1,pp=1,mb=2"  # DDP's buckets are launched asynchronously: no wait priced on them
    assert step(dp, loaded)["step_time_s"] == pytest.approx(step(dp, _base())["step_time_s"])


def test_a_link_refuses_a_negative_wait() -> None:
    from shardc.hardware import LinkSpec

    with pytest.raises(ValueError, match="step_wait >= 0"):
        LinkSpec("gloo", 1e9, 1e-5, step_wait=((2, -1e-4),))
    assert LinkSpec("gloo", 1e9, 1e-5, step_wait=((2, 1e-4), (4, 3e-4))).wait(3) == 3e-4  # ties: the larger
