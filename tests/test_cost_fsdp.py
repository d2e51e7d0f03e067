"""FSDP2's per-step work beyond the optimizer: how often it gathers, the copies around its
collectives, the calibrated per-micro-batch figure (measured with two gloo processes, carried by
the profile, old profiles loading without it) and the step time charging it."""

from __future__ import annotations

import dataclasses

import pytest
from traced import gpt_graph

from shardc.calibration.gloo import run_workers
from shardc.calibration.profile import EagerCosts, KernelFit, eager_from_json
from shardc.cost import estimate
from shardc.cost.sync import fsdp_copy_time, fsdp_gathers, fsdp_microbatch_time
from shardc.hardware import Cluster, DeviceSpec, parse_cluster
from shardc.plan.parallel import ParallelPlan

EAGER = EagerCosts((("elementwise", KernelFit(3e-6, 3e-11, 8e-6, 1e-11)),), 50e-6, 4e-9, 200e-6, 6e-9)
MEASURED = dataclasses.replace(EAGER, fsdp_per_tensor=20e-6, fsdp_per_param=5e-9)
CPU = DeviceSpec("cpu", (("fp32", 1e11),), 8 << 30, 5e9, eager=EAGER)


def test_gathers_once_per_micro_batch_twice_with_zero3_once_in_a_pipeline() -> None:
    assert fsdp_gathers(1, 1, 4) == 4 and fsdp_gathers(2, 1, 1) == 1
    assert fsdp_gathers(3, 1, 4) == 8
    assert fsdp_gathers(1, 2, 4) == fsdp_gathers(3, 2, 4) == 1


def test_copies_move_the_local_part_in_and_the_whole_buffer_out() -> None:
    # 1 MB gathered over 2: 0.5 MB copied in, 1 MB out, each read and written
    assert fsdp_copy_time(1e6, 2, CPU) == pytest.approx(2 * 1.5e6 / 5e9)


def test_measured_figure_replaces_the_forward_gathers_copies() -> None:
    args = (52, 1e6, 1, 1, 4, 4e6, 2)
    assert fsdp_microbatch_time(CPU, *args) == pytest.approx(4 * fsdp_copy_time(4e6, 2, CPU))
    cpu = dataclasses.replace(CPU, eager=MEASURED)
    per_mb = 52 * 20e-6 + 1e6 * 5e-9
    assert fsdp_microbatch_time(cpu, *args) == pytest.approx(4 * per_mb)
    zero3 = (52, 1e6, 3, 1, 4, 4e6, 2)  # the backward gathers: their copies on top
    assert fsdp_microbatch_time(cpu, *zero3) == pytest.approx(4 * per_mb + 4 * fsdp_copy_time(4e6, 2, CPU))
    assert MEASURED.scaled(2.0).fsdp_per_tensor == pytest.approx(40e-6)


def test_old_eager_profiles_load_without_the_figure_and_new_ones_keep_it() -> None:
    data = dataclasses.asdict(MEASURED)
    assert eager_from_json(data) == MEASURED
    for key in ("fsdp_per_tensor", "fsdp_per_param"):
        data.pop(key)
    old = eager_from_json(data)
    assert old is not None and not old.fsdp_measured() and old == EAGER


def test_step_time_charges_the_figure_per_micro_batch() -> None:
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
    assert extra(16) == pytest.approx(2 * one, rel=1e-6)  # two micro-batches: two gathers, twice the work


def test_fsdp_work_is_measured_with_two_gloo_processes() -> None:
    per_tensor, per_element = run_workers(2, {}, timeout=120, entry="_fsdp_worker")["fsdp_overhead"]
    # hooks and bookkeeping per tensor (microseconds to a millisecond), copies per element (sub-ns to tens)
    assert 0 <= per_tensor < 1e-3 and 0 <= per_element < 1e-7 and per_tensor + per_element > 0
