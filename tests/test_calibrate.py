"""Local calibration: a real quick run into a temp dir, the alpha-beta fit, atomic caching."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest
from rich.console import Console

from shardc.calibration import local as calibrate
from shardc.calibration import profile as profile_file
from shardc.calibration.fit import fit_affine, fit_linear, fit_two_terms
from shardc.calibration.gloo import COLLECTIVES
from shardc.calibration.local import load_profile, run_calibration
from shardc.calibration.profile import (
    PROFILE_VERSION,
    AlphaBeta,
    CollectiveFit,
    LocalProfile,
    at_speed,
    median_profile,
    read_profile,
    write_profile,
)
from shardc.hardware import local_cluster, parse_cluster
from shardc.ir import files
from shardc.ir.diagnostics import ShardcError


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalProfile, object, str]:
    folder = tmp_path_factory.mktemp("cache")
    out = io.StringIO()
    # busy="record": this test measures whatever else runs (CI: nothing); the refusal is tested apart
    profile = run_calibration(folder / "local-profile.json", quick=True, nprocs=(2,),
                              console=Console(file=out, width=120), summary=True, busy="record", wait_s=5.0)
    return profile, folder, out.getvalue()


def test_quick_calibration_writes_a_profile_that_loads_back(measured) -> None:
    profile, folder, printed = measured
    assert sorted(p.name for p in folder.iterdir()) == ["local-profile.json"]  # no temp file left
    assert load_profile(folder / "local-profile.json", calibrate_if_missing=False) == profile
    assert "local profile" in printed and "gloo collectives" in printed and "all_reduce" in printed
    assert profile.quick and profile.cores >= 1 and profile.memory_bytes > 0
    seen = profile.conditions  # how busy the machine was, recorded
    assert seen is not None and seen.cores == profile.cores and seen.others_before >= 0 and seen.attempts >= 1


def test_measured_numbers_are_positive_and_fits_sane(measured) -> None:
    profile, _, _ = measured
    assert all(rate > 0 for _, rate in profile.matmul_points)
    assert 1e8 < profile.peak_fp32 < 1e13 and profile.matmul_half_flops >= 0
    assert 1e8 < profile.memory_bandwidth < 1e12 and 0 < profile.kernel_latency < 1e-3
    assert [n for n, _, _ in profile.concurrent] == [2]
    assert {c.op for c in profile.collectives} == set(COLLECTIVES)
    for c in profile.collectives:
        assert c.nprocs == 2 and all(t > 0 for _, t in c.points)
        assert 0 <= c.fit.alpha < 0.1 and c.fit.beta >= 0
        biggest, seconds = max(c.points)
        assert c.fit.time(biggest) < 20 * seconds  # the fit stays within reach of the data
    eager = profile.eager
    assert eager is not None and profile.version == PROFILE_VERSION and profile.concurrent_matmul_n == 256
    kinds = dict(eager.kinds)
    assert {"view", "matmul", "linear", "attention_matmul", "elementwise", "transcendental", "norm", "softmax",
            "loss", "index", "dropout", "accumulate_grad"} <= set(kinds)
    assert all(0 < f.fwd_call + f.fwd_per_unit < 1e-3 for k, f in kinds.items() if k != "accumulate_grad")
    assert 1e-13 < kinds["linear"].fwd_per_unit < 1e-9 and kinds["transcendental"].fwd_per_unit > 0  # s/FLOP, s/B
    assert 0 < eager.optimizer_per_tensor < 1e-3 and 0 < eager.optimizer_per_param < 1e-6
    assert 0 < eager.sharded_optimizer_per_tensor < 1e-2  # FSDP2's DTensor parameters, from the gloo run
    assert 1 < profile.probe_alone_rate < 1e6  # the study's eager-workload probe, calls/s alone
    assert [n for n, _ in profile.contention] == [2] and 0.3 < profile.contention[0][1] < 5  # probe among 2 / alone
    cluster = local_cluster(2, profile)
    assert cluster.device.eager is not None
    assert cluster.num_devices == 2 and cluster.device.peak("fp32") > 0 and cluster.device.peak("bf16") > 0
    assert cluster.device.memory_bytes == profile.memory_bytes // 2
    assert 1e5 < cluster.intra.bandwidth < 1e12 and 0 <= cluster.intra.latency < 0.1


def test_fit_affine_recovers_alpha_beta() -> None:
    sizes = [4, 256, 4096, 65536, 1 << 20, 1 << 24]
    fit = fit_affine(sizes, [50e-6 + b / 2e9 for b in sizes])
    assert fit.alpha == pytest.approx(50e-6, rel=1e-6) and fit.beta == pytest.approx(1 / 2e9, rel=1e-6)
    flat = fit_affine(sizes, [1e-3] * len(sizes))
    assert flat.alpha == pytest.approx(1e-3) and flat.beta == pytest.approx(0, abs=1e-15)
    # a negative intercept is refitted with alpha >= 0
    neg = fit_affine([1, 2, 3], [0.5, 2.0, 3.5])
    assert neg.alpha >= 0 and neg.beta > 0
    # errors relative to `scale`: a tiny difference (a backward less the engine) cannot dominate
    diffs = [1e-7, 21e-6, 126e-6, 416e-6]
    raw = [d + 26e-6 for d in diffs]
    xs = [32768, 262144, 1048576, 4194304]
    assert fit_affine(xs, diffs).beta < 1e-11 < fit_affine(xs, diffs, raw).beta


def _normal_equations(xs: list[float], ys: list[float], w: list[float]) -> tuple[float, float]:
    """The weighted least-squares line written out (the closed form the calibration used before numpy)."""
    sw, sx, sy = sum(w), sum(a * x for a, x in zip(w, xs)), sum(a * y for a, y in zip(w, ys))
    sxx, sxy = sum(a * x * x for a, x in zip(w, xs)), sum(a * x * y for a, x, y in zip(w, xs, ys))
    det = sw * sxx - sx * sx
    return (sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det


def test_one_fit_agrees_with_the_normal_equations() -> None:
    xs = [64.0, 4096.0, 65536.0, 1 << 20, 1 << 22]
    ys = [3e-5, 4.1e-5, 9e-5, 7.9e-4, 2.2e-3]
    w = [1 / (y * y) for y in ys]
    assert fit_linear(xs, ys, w) == pytest.approx(_normal_equations(xs, ys, w), rel=1e-9)
    assert fit_linear(xs, ys) == pytest.approx(_normal_equations(xs, ys, [1.0] * 5), rel=1e-9)
    through = sum(a * x * y for a, x, y in zip(w, xs, ys)) / sum(a * x * x for a, x in zip(w, xs))
    assert fit_linear(xs, ys, w, intercept=False) == pytest.approx((0.0, through), rel=1e-9)
    with pytest.raises(ValueError, match="do not determine a line"):
        fit_linear([2.0, 2.0], [1.0, 3.0])
    # t = a * x + b * y in relative error: the optimizer's per-tensor and per-element costs
    samples = [(64, 64 * 512, 64 * 3e-6 + 64 * 512 * 2e-9), (16, 16 * 16384, 16 * 3e-6 + 16 * 16384 * 2e-9),
               (4, 4 * 262144, 4 * 3e-6 + 4 * 262144 * 2e-9)]
    assert fit_two_terms(samples) == pytest.approx((3e-6, 2e-9), rel=1e-9)
    # a negative coefficient is refitted with that coefficient at 0 (the better of the two boundaries)
    a, b = fit_two_terms([(1, 10, 1e-3), (1, 1000, 2e-3), (1, 100000, 1e-3)])
    assert min(a, b) == 0.0 and max(a, b) > 0


def _profile(collectives: tuple[CollectiveFit, ...] = ()) -> LocalProfile:
    fits = collectives or (CollectiveFit("all_reduce", 2, ((64, 2e-4), (1 << 20, 2e-3)), AlphaBeta(2e-4, 1e-9)),)
    return LocalProfile(2, "now", "cpu", 2, 8 << 30, "x", True, ((256, 4e10),), 1e11, 5e5, (("bf16", 1.0),),
                        2e10, 2e-6, ((2, 6e10, 1e10),), fits)


def test_sharing_model_and_link() -> None:
    p = _profile()
    assert p.per_process_flops(1) == 1e11 and p.per_process_flops(2) == 6e10
    # 8 processes on 2 cores: the measured 2-process scaling (1.2 / 2 = 0.6) over 2 cores, / 8
    assert p.per_process_flops(8) == pytest.approx(1e11 * 2 * 0.6 / 8)
    c = local_cluster(8, p)
    assert c.device.kernel_latency == pytest.approx(2e-6 * p.slowdown(8))
    assert c.intra.latency == pytest.approx(2e-4 / 2) and c.intra.bandwidth == pytest.approx(1e9)
    flat = _profile((CollectiveFit("all_reduce", 2, ((64, 1e-3), (1 << 20, 1e-3)), AlphaBeta(1e-3, 0.0)),))
    assert local_cluster(2, flat).intra.bandwidth == pytest.approx((1 << 20) / 1e-3)  # all time counted as transfer


def test_write_is_atomic(tmp_path, monkeypatch) -> None:
    target = tmp_path / "local-profile.json"
    write_profile(_profile(), target)
    before = target.read_text()

    def dies(fd):  # the temporary file written but not yet synced and renamed: the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "fsync", dies)
    with pytest.raises(KeyboardInterrupt):
        write_profile(_profile(), target)
    assert target.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["local-profile.json"]
    target.unlink()
    with pytest.raises(KeyboardInterrupt):
        write_profile(_profile(), target)
    assert list(tmp_path.iterdir()) == []


def test_missing_or_bad_profile(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDC_CACHE_DIR", str(tmp_path))
    assert profile_file.default_profile_path() == tmp_path / "local-profile.json"
    with pytest.raises(ShardcError, match="(?s)no local profile at .*local-profile.json.*shardc calibrate"):
        load_profile(calibrate_if_missing=False)
    (tmp_path / "local-profile.json").write_text('{"version": 0}')
    with pytest.raises(ShardcError, match="(?s)unreadable or out of date.*version 0"):
        load_profile(calibrate_if_missing=False)
    write_profile(_profile(), tmp_path / "local-profile.json")
    assert parse_cluster("local2").device.name == "local-cpu/2"


def test_missing_profile_is_measured_once(tmp_path, monkeypatch) -> None:
    calls = []

    def fake_run(path, **kw):  # stands in for the real (minute-long) default calibration
        calls.append(path)
        write_profile(_profile(), path)
        return _profile()

    monkeypatch.setattr(calibrate, "run_calibration", fake_run)
    target = tmp_path / "sub" / "local-profile.json"
    assert load_profile(target) == _profile() and calls == [target]
    assert load_profile(target) == _profile() and calls == [target]  # cached now


# ---- a busy machine: waited for, measured again, refused, or recorded and reported ---------------

def _busy_world(monkeypatch, looks: list[float]) -> list[str]:
    """`conditions.look` returns `looks` in turn (other processes' cores), the measurement is a
    stand-in (`_profile()`); returns what was measured, one entry per measurement."""
    measured: list[str] = []
    seq = iter(looks)
    monkeypatch.setattr(calibrate.conditions, "look", lambda window=1.0: (next(seq), 3.0))
    monkeypatch.setattr(calibrate, "_measure", lambda *a, **k: measured.append("profile") or _profile())
    return measured


def test_a_busy_machine_is_refused_and_nothing_is_written(tmp_path, monkeypatch) -> None:
    measured = _busy_world(monkeypatch, [1.5, 1.5, 1.5])
    target = tmp_path / "local-profile.json"
    with pytest.raises(ShardcError, match=r"(?s)busy: other processes used 1\.5 cores.*--allow-busy"):
        run_calibration(target, wait_s=0.0, show=False)
    assert measured == [] and not target.exists()


def test_busy_during_the_measurement_measures_again_then_refuses(tmp_path, monkeypatch) -> None:
    target = tmp_path / "local-profile.json"
    measured = _busy_world(monkeypatch, [0.0, 1.0, 0.1, 0.0])  # quiet, busy after; quiet, quiet after
    out = io.StringIO()
    profile = run_calibration(target, wait_s=0.0, show=False, console=Console(file=out, width=200), draws=1)
    assert measured == ["profile", "profile"] and "measuring again" in out.getvalue()
    assert profile.conditions is not None and profile.conditions.attempts == 2 and not profile.busy
    assert LocalProfile.from_json(profile.to_json()) == profile
    measured = _busy_world(monkeypatch, [0.0, 1.0, 0.0, 1.2])
    with pytest.raises(ShardcError, match="while it was measured, twice"):
        run_calibration(tmp_path / "other.json", wait_s=0.0, show=False, console=Console(file=io.StringIO()),
                        draws=1)
    assert measured == ["profile", "profile"] and not (tmp_path / "other.json").exists()


def test_a_recorded_busy_profile_is_reported_and_measured_again_once_quiet(tmp_path, monkeypatch) -> None:
    target = tmp_path / "local-profile.json"
    measured = _busy_world(monkeypatch, [1.5, 1.5])
    out = io.StringIO()
    profile = run_calibration(target, wait_s=0.0, show=False, busy="record", console=Console(file=out, width=200),
                              draws=1)
    assert profile.busy and "measured on a busy machine" in out.getvalue()
    assert load_profile(target, calibrate_if_missing=False).conditions == profile.conditions
    # Used while still busy: a warning, the profile as it is; once quiet: measured again.
    measured = _busy_world(monkeypatch, [1.4])
    monkeypatch.setattr(calibrate, "_WARNED", {})
    with monkeypatch.context() as m:
        warned = io.StringIO()
        m.setattr("rich.console.Console", lambda **kw: Console(file=warned, width=200))
        assert load_profile(target) == profile and "warning" in warned.getvalue() and measured == []
        assert load_profile(target) == profile and warned.getvalue().count("warning") == 1  # once per process
    monkeypatch.setattr(calibrate, "_WARNED", {})
    measured = _busy_world(monkeypatch, [0.0, 0.0, 0.0])
    again = load_profile(target)
    assert measured == ["profile"] and not again.busy and load_profile(target) == again


def test_other_processes_cpu_is_the_machines_busy_time_less_our_own(monkeypatch) -> None:
    from shardc.calibration import conditions

    busy, own = iter([100.0, 101.5]), iter([10.0, 10.5])
    monkeypatch.setattr(conditions, "_busy_seconds", lambda: next(busy))
    monkeypatch.setattr(conditions, "_own_seconds", lambda: next(own))
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(conditions.time, "perf_counter", lambda: next(clock))
    assert conditions.others_busy(1.0, sleep=lambda _: None) == pytest.approx(1.0)  # 1.5 busy - 0.5 ours
    assert conditions._busy_seconds is not None


def test_quick_calibration_times_the_collectives_under_a_training_load(measured) -> None:
    from shardc.calibration.busy import LOADED_OPS

    profile, folder, printed = measured
    rows = profile.loaded_collectives
    assert {r.op for r in rows} == set(LOADED_OPS) and {(r.running, r.group) for r in rows} == {(2, 2)}
    for r in rows:  # the quick sizes, each a median of its trials with their spread beside it
        assert [b for b, *_ in r.points] == [64, 65536]
        assert all(step >= 0 and idle > 0 and spread >= 0 for _, step, idle, spread in r.points)
    assert load_profile(folder / "local-profile.json", calibrate_if_missing=False).loaded_collectives == rows
    wait = profile.step_wait(2, 2)
    assert 0 <= wait < 0.1 and "in-step wait, group of 2" in printed
    # the cluster prices every time at the probe's slowdown among its processes (`local_cluster`),
    # the wait included (it was == wait only where the quick calibration measured no contention)
    scaled = at_speed(profile, profile.contention_factor(2)).step_wait(2, 2)
    assert scaled == pytest.approx(wait * profile.contention_factor(2))
    assert local_cluster(2, profile).intra.step_wait == ((2, scaled),)


def test_a_calibration_is_the_median_of_its_draws(tmp_path, monkeypatch) -> None:
    """Three draws, one of them taken in an odd moment (everything 3x): every figure written is
    the median of its draws, not the odd one's nor their mean; one draw is the draw itself."""
    scale = iter((1.0, 3.0, 1.2))
    monkeypatch.setattr(calibrate.conditions, "look", lambda window=1.0: (0.0, 0.5))

    def measure(*args, **kwargs) -> LocalProfile:
        return at_speed(_profile(), next(scale))

    monkeypatch.setattr(calibrate, "_measure", measure)
    target = tmp_path / "local-profile.json"
    said = io.StringIO()
    profile = run_calibration(target, wait_s=0.0, show=False, console=Console(file=said, width=300))
    assert replace(profile, conditions=None) == at_speed(_profile(), 1.2)  # the default: 3 draws
    # The odd draw is reported: the draws disagree 3x on the compute rate (and the rest).
    assert "the 3 draws disagree on the fp32 matmul rate (GFLOP/s): 33.3 to 100 (3.00x)" in said.getvalue()
    assert calibrate.draws_disagree([_profile(), at_speed(_profile(), 1.1)]) == []
    assert read_profile(target) == profile
    fit = profile.collectives[0].fit
    assert fit.alpha == pytest.approx(2e-4 * 1.2) and profile.peak_fp32 == pytest.approx(1e11 / 1.2)
    scale = iter((3.0,))
    one = run_calibration(target, wait_s=0.0, show=False, draws=1, console=Console(file=io.StringIO()))
    assert replace(one, conditions=None) == at_speed(_profile(), 3.0)
    with pytest.raises(ShardcError, match="at least one draw"):
        run_calibration(target, wait_s=0.0, show=False, draws=0)
    other = replace(_profile(), concurrent=((2, 6e10, 1e10), (4, 3e10, 5e9)))
    with pytest.raises(ValueError, match=r"differ in shape at profile\.concurrent"):
        median_profile([_profile(), other])
