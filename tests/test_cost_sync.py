"""DDP's bucketing of the gradient sync and the per-call cost of the collective wrappers."""

from __future__ import annotations

from dataclasses import replace

import pytest

import shardc.cost.sync as sync
from shardc.calibration.profile import AlphaBeta, CollectiveFit, LocalProfile
from shardc.cost.comm import call_overhead, collective_time
from shardc.cost.sync import DDP_DEFAULT_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, bucket_tail, ddp_buckets
from shardc.hardware import LinkSpec, local_cluster, make_cluster
from shardc.study.plans import parse_study_plan
from shardc.study.predict import predict

GPT = "examples/gpt.py:gpt?n_layer=4&n_embd=128&n_head=4&vocab_size=512&seq=64&batch=8"


def test_buckets_hold_whole_parameters_and_close_at_the_cap() -> None:
    ready = [(0.1, 5000.0), (0.2, 20000.0), (0.3, 100.0), (0.4, 100.0), (0.5, 30000.0), (0.6, 64.0)]
    # a bucket closes once it holds >= the cap; no parameter is split; the rest is the last bucket
    assert ddp_buckets(ready, 10485) == [(0.2, 25000.0), (0.5, 30200.0), (0.6, 64.0)]
    assert ddp_buckets(ready, 1e9) == [(0.6, 55264.0)]


def test_the_default_cap_has_a_small_first_bucket() -> None:
    mib = float(2**20)
    ready = [(0.0, 0.6 * mib), (0.0, 0.6 * mib), (0.0, 10 * mib), (0.0, 10 * mib), (0.0, 10 * mib)]
    assert [b for _, b in ddp_buckets(ready, DDP_DEFAULT_BUCKET_BYTES)] == [1.2 * mib, 30 * mib]
    assert DDP_FIRST_BUCKET_BYTES == mib
    assert [b for _, b in ddp_buckets(ready, 2 * mib)] == [11.2 * mib, 10 * mib, 10 * mib]  # explicit cap


def test_bucket_tail_serialises_the_buckets_on_the_link() -> None:
    link = LinkSpec("l", 1e9, 1e-4)
    levels = ((link, 2),)
    ready = [(0.0, 4000.0), (0.5, 8000.0)]
    one, two = collective_time("all_reduce", 4000, levels), collective_time("all_reduce", 8000, levels)
    assert bucket_tail(ready, 0.5, levels, "all_reduce", 1000) == pytest.approx(two)  # first one hidden
    assert bucket_tail(ready, 0.0, levels, "all_reduce", 1000) == pytest.approx(0.5 + two)
    assert bucket_tail([(0.0, 4000.0)], 0.0, levels, "all_reduce", 1000) == pytest.approx(one)


def test_gpt_plan_with_tiny_buckets_gets_ddps_bucket_count(monkeypatch) -> None:
    counts: list[int] = []
    real = sync.ddp_buckets
    monkeypatch.setattr(sync, "ddp_buckets", lambda ready, cap: counts.append(len(real(ready, cap))) or real(ready, cap))
    cluster = make_cluster("H100", 1, 2)
    small, _ = predict(GPT, parse_study_plan("dp=2,mb=4,bucket_mb=0.01", 8), cluster)
    assert counts == [18]  # torch DDP's reducer made 18 all_reduces for this plan (study, issue 7)
    default, _ = predict(GPT, parse_study_plan("dp=2,mb=4", 8), cluster)
    assert counts[1] == 2  # 1 MiB first bucket, the rest in the second
    assert small.step_time_s > default.step_time_s


def _profile(overhead: tuple[tuple[int, float], ...]) -> LocalProfile:
    fits = (CollectiveFit("all_reduce", 2, ((64, 2e-4), (1 << 20, 2e-3)), AlphaBeta(2e-4, 1e-9)),)
    return LocalProfile(3, "now", "cpu", 2, 8 << 30, "x", True, ((256, 4e10),), 1e11, 5e5, (("bf16", 1.0),),
                        2e10, 2e-6, ((2, 6e10, 1e10),), fits, wrapper_overhead=overhead)


def test_wrapper_overhead_is_charged_per_tensor_parallel_collective_only() -> None:
    assert call_overhead(((LinkSpec("a", 1e9, 0, call_overhead=3e-4), 2),)) == 3e-4
    assert call_overhead(((LinkSpec("a", 1e9, 0, call_overhead=3e-4), 1),)) == 0.0  # no group, no call
    assert make_cluster("H100", 1, 8).intra.call_overhead == 0.0
    bare, charged = _profile(()), _profile(((2, 4e-4), (4, 1e-3)))
    assert local_cluster(2, charged).intra.call_overhead == 4e-4
    assert local_cluster(3, charged).intra.call_overhead == 1e-3  # nearest count, ties upward
    assert local_cluster(1, charged).intra.call_overhead == 0
    tp = parse_study_plan("tp=2,mb=8", 8)
    t0 = predict(GPT, tp, local_cluster(2, bare))[0].step_time_s
    t1 = predict(GPT, tp, local_cluster(2, charged))[0].step_time_s
    calls = (t1 - t0) / 4e-4  # whole calls: each collective on the step's critical path pays once
    assert calls == pytest.approx(round(calls)) and calls >= 4 * 4  # 4 blocks x attention and MLP, fwd + bwd
    dp = parse_study_plan("dp=2,mb=4", 8)  # DDP's reducer calls gloo directly: no wrapper
    assert predict(GPT, dp, local_cluster(2, bare))[0].step_time_s == pytest.approx(
        predict(GPT, dp, local_cluster(2, charged))[0].step_time_s)
    assert replace(charged, wrapper_overhead=()).call_overhead(2) == 0.0
