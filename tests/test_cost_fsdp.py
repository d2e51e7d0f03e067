"""FSDP2's per-step work beyond the optimizer: how often it gathers, the copies around its
collectives, the calibrated per-micro-batch figure (measured with two gloo processes, carried by
the profile, old profiles loading without it) and the step time charging it."""

from __future__ import annotations

import dataclasses

import pytest
from traced import gpt_graph

from shardc.calibration.fit import fit_three_terms
from shardc.calibration.gloo import run_workers
from shardc.calibration.profile import EagerCosts, KernelFit, eager_from_json
from shardc.cost import estimate
from shardc.cost.sync import fsdp_copy_time, fsdp_gathers, fsdp_microbatch_time
from shardc.hardware import Cluster, DeviceSpec, parse_cluster
from shardc.plan.parallel import ParallelPlan

EAGER = EagerCosts((("elementwise", KernelFit(3e-6, 3e-11, 8e-6, 1e-11)),), 50e-6, 4e-9, 200e-6, 6e-9)
MEASURED = dataclasses.replace(EAGER, fsdp_per_tensor=20e-6, fsdp_per_param=5e-9)
CPU = DeviceSpec("cpu", (("fp32", 1e11),), 8 << 30, 5e9, eager=EAGER)


def test_gathers_once_per_step_zero3_once_more_per_micro_batch_with_or_without_a_pipeline() -> None:
    assert fsdp_gathers(1, 1, 4) == 1 and fsdp_gathers(2, 1, 1) == 1
    assert fsdp_gathers(3, 1, 4) == 5  # the first forward, then every backward
    assert fsdp_gathers(1, 2, 4) == 1 and fsdp_gathers(3, 2, 4) == 5


def test_copies_move_the_local_part_in_and_the_whole_buffer_out() -> None:
    # 1 MB gathered over 2: 0.5 MB copied in, 1 MB out, each read and written
    assert fsdp_copy_time(1e6, 2, CPU) == pytest.approx(2 * 1.5e6 / 5e9)


def test_measured_figure_replaces_the_forward_gathers_copies() -> None:
    args = (52, 1e6, 1, 1, 4, 4e6, 2)  # four micro-batches, one gather: the first forward's
    assert fsdp_microbatch_time(CPU, *args) == pytest.approx(fsdp_copy_time(4e6, 2, CPU))
    cpu = dataclasses.replace(CPU, eager=MEASURED)
    per_mb = 52 * 20e-6 + 1e6 * 5e-9
    assert fsdp_microbatch_time(cpu, *args) == pytest.approx(per_mb)
    zero3 = (52, 1e6, 3, 1, 4, 4e6, 2)  # the four backward gathers: their copies on top
    assert fsdp_microbatch_time(cpu, *zero3) == pytest.approx(per_mb + 4 * fsdp_copy_time(4e6, 2, CPU))
    assert MEASURED.scaled(2.0).fsdp_per_tensor == pytest.approx(40e-6)


def test_old_eager_profiles_load_without_the_figure_and_new_ones_keep_it() -> None:
    data = dataclasses.asdict(MEASURED)
    assert eager_from_json(data) == MEASURED
    for key in ("fsdp_per_tensor", "fsdp_per_param"):
        data.pop(key)
    old = eager_from_json(data)
    assert old is not None and not old.fsdp_measured() and old == EAGER


def test_step_time_charges_the_figure_per_gathering_micro_batch() -> None:
    base = parse_cluster("2xH100")
    graph = gpt_graph(layers=2, hidden=128, heads=4, vocab=512, seq=64, batch=8, dropout=0.0, dtype="f32", dp=2,
                      zero=1)

    def extra(gbs: int) -> float:
        """What the measured figure adds to the step (less the copies it replaces)."""
        times = []
        for eager in (EAGER, MEASURED):
            cluster = dataclasses.replace(base, device=dataclasses.replace(CPU, eager=eager))
            assert isinstance(cluster, Cluster)
            times.append(estimate(graph, cluster, ParallelPlan.parse(f"dp=2,mb=4,gbs={gbs},dtype=fp32,zero=1"))
                         .step_time_s)
        return times[1] - times[0]

    one = extra(8)
    assert one > 0
    # two micro-batches, still one gather: the weights stay gathered into the second (ZeRO-1)
    assert extra(16) == pytest.approx(one, rel=1e-6)


def test_fsdp_work_is_measured_with_two_gloo_processes() -> None:
    per_tensor, per_element = run_workers(2, {"measure": "fsdp_overhead"}, timeout=120, entry="_one_worker")["fsdp_overhead"]
    # hooks and bookkeeping per tensor (microseconds to a millisecond), copies per element (sub-ns to tens)
    assert 0 <= per_tensor < 1e-3 and 0 <= per_element < 1e-7 and per_tensor + per_element > 0


# ---- a whole synchronising step, measured (wall time, the processes sharing the cores) ----------

STEP = dataclasses.replace(MEASURED, sync_step=(("fsdp2", 2, 4e-3, 100e-6, 10e-9), ("fsdp2", 4, 6e-3, 150e-6, 20e-9),
                                                ("ddp", 2, 1e-3, 30e-6, 2e-9)))


def test_three_term_fit_recovers_a_line_and_keeps_costs_non_negative() -> None:
    exact = [(n, e, 2e-3 + 1e-4 * n + 1e-8 * e) for n, e in ((2, 512), (48, 24576), (12, 196608), (3, 393216))]
    assert fit_three_terms(exact) == pytest.approx((2e-3, 1e-4, 1e-8), rel=1e-6)
    # A falling per-tensor trend is noise: the fit keeps it at 0 and fits the rest.
    c, a, b = fit_three_terms([(2, 1000, 5e-3), (48, 1000, 4e-3), (12, 10000, 6e-3)])
    assert a == 0 and c > 0 and b >= 0


def test_step_figure_by_group_size_nearest_measured_and_scaled_with_speed() -> None:
    assert STEP.sync_step_time("fsdp2", 2, 10, 1e6) == pytest.approx(4e-3 + 10 * 100e-6 + 1e6 * 10e-9)
    assert STEP.sync_step_time("fsdp2", 8, 0, 0) == pytest.approx(6e-3)  # nearest measured group: 4
    assert STEP.sync_step_time("fsdp2", 3, 0, 0) == pytest.approx(6e-3)  # ties go to the larger group
    assert STEP.sync_step_time("ddp", 4, 10, 1e6) == pytest.approx(1e-3 + 10 * 30e-6 + 1e6 * 2e-9)  # its own fits
    assert MEASURED.sync_step_time("fsdp2", 2, 10, 1e6) is None
    assert STEP.scaled(2.0).sync_step_time("fsdp2", 2, 0, 0) == pytest.approx(8e-3)
    assert eager_from_json(dataclasses.asdict(STEP)) == STEP


def test_local_cluster_carries_the_steps_measured_with_its_process_count_unscaled(tmp_path, monkeypatch) -> None:
    from test_hardware import _profile

    from shardc.calibration.profile import LocalProfile, write_profile
    from shardc.hardware import local_cluster

    prof = dataclasses.replace(_profile(), eager=EAGER,
                               sync_steps=(("fsdp2", 2, 2, 1e-3, 0.0, 1e-9), ("fsdp2", 4, 2, 3e-3, 0.0, 2e-9),
                                           ("ddp", 4, 4, 5e-3, 0.0, 3e-9)))
    write_profile(prof, tmp_path / "p.json")
    assert LocalProfile.from_json(dataclasses.asdict(prof)) == prof
    four = local_cluster(4, prof).device.eager
    assert four is not None and four.sync_step == (("fsdp2", 2, 3e-3, 0.0, 2e-9), ("ddp", 4, 5e-3, 0.0, 3e-9))
    two = local_cluster(2, prof).device.eager
    assert two is not None and two.sync_step == (("fsdp2", 2, 1e-3, 0.0, 1e-9),)
    assert local_cluster(8, prof).device.eager.sync_step == four.sync_step  # nearest count measured
    old = dataclasses.asdict(prof)
    old.pop("sync_steps")
    assert LocalProfile.from_json(old).sync_step_fits(4) == ()


def _sync(eager: EagerCosts, plan: str):
    zero = ParallelPlan.parse(plan).zero
    graph = gpt_graph(layers=2, hidden=128, heads=4, vocab=512, seq=64, batch=8, dropout=0.0, dtype="f32", dp=2,
                      zero=zero)
    base = parse_cluster("2xH100")
    cluster = dataclasses.replace(base, device=dataclasses.replace(CPU, eager=eager))
    return estimate(graph, cluster, ParallelPlan.parse(plan))


def test_measured_step_replaces_the_reduce_scatter_and_first_gather() -> None:
    one, four = "dp=2,mb=4,gbs=8,dtype=fp32,zero=1", "dp=2,mb=4,gbs=32,dtype=fp32,zero=1"

    def comm(eager: EagerCosts, plan: str = one) -> float:
        return _sync(eager, plan).stages[0].time["dp_comm"]

    def fit(c: float, a: float, b: float) -> EagerCosts:
        return dataclasses.replace(MEASURED, sync_step=(("fsdp2", 2, c, a, b),))

    # dp_comm is the measured step, term by term: per step, per parameter tensor, per element
    base = comm(fit(1e-3, 0.0, 0.0))
    assert base == pytest.approx(1e-3, rel=1e-9)
    tensors = (comm(fit(1e-3, 1e-6, 0.0)) - base) / 1e-6
    elements = (comm(fit(1e-3, 0.0, 1e-12)) - base) / 1e-12
    graph = gpt_graph(layers=2, hidden=128, heads=4, vocab=512, seq=64, batch=8, dropout=0.0, dtype="f32")
    assert tensors == pytest.approx(len(graph.params), rel=1e-6)
    assert elements == pytest.approx(sum(p.type.numel for p in graph.params), rel=1e-6)
    # Without the figure, the reduce-scatter and its copies are priced instead.
    assert comm(MEASURED) != pytest.approx(base)
    # Every further micro-batch gathers again (flat runtime): the same extra as without the figure.
    extra = _sync(STEP, four).step_time_s - _sync(STEP, one).step_time_s
    assert extra == pytest.approx(_sync(MEASURED, four).step_time_s - _sync(MEASURED, one).step_time_s, rel=1e-6)


def test_measured_ddp_step_is_its_exposed_sync() -> None:
    # DDP (ZeRO-0) where its step was measured: the figure, exposed, in place of the buckets.
    plan = "dp=2,mb=4,gbs=8,dtype=fp32,zero=0"

    def comm(c: float, a: float, b: float) -> float:
        eager = dataclasses.replace(MEASURED, sync_step=(("ddp", 2, c, a, b),))
        return _sync(eager, plan).stages[0].time["dp_comm"]

    graph = gpt_graph(layers=2, hidden=128, heads=4, vocab=512, seq=64, batch=8, dropout=0.0, dtype="f32")
    base = comm(0.0, 0.0, 0.0)  # what else the layers charge to dp_comm
    assert comm(2e-3, 0.0, 0.0) - base == pytest.approx(2e-3, rel=1e-6)
    assert comm(0.0, 1e-6, 0.0) - base == pytest.approx(1e-6 * len(graph.params), rel=1e-6)
    assert comm(0.0, 0.0, 1e-12) - base == pytest.approx(1e-12 * sum(p.type.numel for p in graph.params), rel=1e-6)
    assert _sync(MEASURED, plan).stages[0].time["dp_comm"] != pytest.approx(base)  # buckets without it


def test_sync_steps_are_measured_with_two_gloo_processes() -> None:
    fits = run_workers(2, {"measure": "sync_steps"}, timeout=120, entry="_one_worker")["sync_steps"]
    assert [(f[0], f[1]) for f in fits] == [("fsdp2", 2), ("ddp", 2)]
    for _, _, per_step, per_tensor, per_element in fits:
        assert min(per_step, per_tensor, per_element) >= 0 and per_step + per_tensor + per_element > 0
        assert per_step < 0.5 and per_tensor < 1e-2 and per_element < 1e-6


def test_each_stage_module_is_its_own_fsdp2_unit() -> None:
    # The backend wraps each stage module a device holds with its own fully_shard: under interleaved
    # 1F1B (vpp=2) a device pays two measured steps' fixed part, one per model chunk, where pp=2
    # without interleaving pays one; the per-tensor and per-element parts follow the parameters alone.
    def comm(vpp: int, c: float, a: float = 0.0) -> float:
        eager = dataclasses.replace(MEASURED, sync_step=(("fsdp2", 2, c, a, 0.0),))
        graph = gpt_graph(layers=4, hidden=128, heads=4, vocab=512, seq=64, batch=8, dropout=0.0, dtype="f32",
                          dp=2, pp=2, vpp=vpp, zero=1)
        cluster = dataclasses.replace(parse_cluster("4xH100"), device=dataclasses.replace(CPU, eager=eager))
        schedule = ",schedule=interleaved" if vpp > 1 else ""
        plan = ParallelPlan.parse(f"pp=2,dp=2,vpp={vpp},mb=2,gbs=8,dtype=fp32,zero=1{schedule}")
        return estimate(graph, cluster, plan).stages[0].time["dp_comm"]

    for vpp, units in ((1, 1), (2, 2)):
        assert comm(vpp, 3e-3) - comm(vpp, 0.0) == pytest.approx(units * 3e-3, rel=1e-6)
    assert comm(2, 0.0, 1e-6) - comm(2, 0.0) == pytest.approx(comm(1, 0.0, 1e-6) - comm(1, 0.0), rel=1e-6)
