"""The machine's speed index and what the cost model learnt from the study: the probe's
arithmetic, a plan's speed from its ranks' probes, views that copy at run time, a split's
backward, and pipeline sends priced on the measured point-to-point fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardc.analysis.aliasing import aliasing
from shardc.calibration.profile import AlphaBeta, CollectiveFit, EagerCosts, KernelFit, LocalProfile, at_speed
from shardc.calibration.speed import SpeedIndex, speed_factor
from shardc.cost.comm import collective_time
from shardc.cost.compute import node_compute_time
from shardc.frontend import trace
from shardc.frontend.spec import load_model
from shardc.hardware import DeviceSpec, LinkSpec, local_cluster
from shardc.ir import TensorType
from shardc.ops.registry import get_op
from shardc.study.compare import plan_speed, probed_speed


def test_speed_index_scales_a_time_to_its_reference() -> None:
    speed = SpeedIndex(reference=2e-3)
    assert speed.reference == 2e-3
    assert speed.scale([4e-3, 4e-3, 5e-3]) == pytest.approx(0.5)  # measured while twice as slow: halved
    assert speed.scale([]) == 1.0
    assert 0 < speed.seconds(2) < 1.0  # a real probe call, CPU seconds
    assert speed_factor([3e-3, 3e-3], 2e-3) == pytest.approx(1.5) and speed_factor([], 2e-3) == 1.0
    measured = SpeedIndex()  # no reference given: measured now, in the same units as `seconds`
    assert 0.2 < measured.reference / measured.seconds(3) < 5.0


def test_a_plans_speed_is_the_slowest_rank_around_each_step() -> None:
    ranks = [{"rank": 0, "speed_reference_s": 1e-3, "speed_probe_s": [1e-3, 2e-3, 1e-3]},
             {"rank": 1, "speed_reference_s": 1e-3, "speed_probe_s": [1.5e-3, 1e-3, 1e-3]}]
    # step 1: max(1, 1.5) before, max(2, 1) after -> 1.75; step 2: 2 before, 1 after -> 1.5
    assert plan_speed(ranks) == pytest.approx((1.75 + 1.5) / 2)
    assert plan_speed([{"rank": 0, "speed_probe_s": [1e-3, 1e-3]}]) is None  # no reference: CUDA
    assert plan_speed([{"rank": 0, "speed_reference_s": 1e-3, "speed_probe_s": []}]) is None


def test_the_speed_probed_before_a_plan_is_the_slowest_rank_per_reading() -> None:
    ranks = [{"rank": 0, "speed_reference_s": 1e-3, "pre_probe_s": [1e-3, 2e-3, 1e-3], "speed_probe_s": [9e-3]},
             {"rank": 1, "speed_reference_s": 1e-3, "pre_probe_s": [1.5e-3, 1e-3, 1e-3], "speed_probe_s": [9e-3]}]
    # per reading the slowest rank's: 1.5, 2, 1 -> median 1.5; the plan's own probes (9) play no part
    assert probed_speed(ranks) == pytest.approx(1.5)
    assert probed_speed([{"rank": 0, "pre_probe_s": [1e-3]}]) is None  # no reference: CUDA
    assert probed_speed([{"rank": 0, "speed_reference_s": 1e-3, "speed_probe_s": [1e-3]}]) is None  # recorded before


def test_the_attention_outputs_reshape_copies_and_nothing_else() -> None:
    loaded = load_model("examples/gpt.py:gpt?n_layer=2&n_embd=64&n_head=4&vocab_size=128&seq=16&batch=2")
    graph = trace(loaded.model, loaded.example_inputs)
    copies = [n for n in graph.nodes if n in aliasing(graph).copies]
    # (att @ v).transpose(1, 2).reshape(b, s, h): PyTorch cannot view those strides, once per block
    assert [(n.op, n.location.module_path) for n in copies] == [("reshape", "blocks.0.attn"), ("reshape", "blocks.1.attn")]


def test_a_copying_view_costs_a_copy_and_a_split_backward_a_concatenation() -> None:
    copy = KernelFit(3e-6, 3e-11, 8e-6, 1e-11)
    eager = EagerCosts((("view", KernelFit(4e-6, 0.0, 6e-6, 0.0)), ("elementwise", copy)), 50e-6, 4e-9)
    device = DeviceSpec("cpu", (("fp32", 1e11),), 8 << 30, 5e9, eager=eager)
    x = TensorType((8, 64, 128), "f32")
    reshape = get_op("reshape")
    view = node_compute_time(reshape, [x], [x], {"shape": x.shape}, device, "f32", needs_grad=[True])
    copied = node_compute_time(reshape, [x], [x], {"shape": x.shape}, device, "f32", needs_grad=[True], copies=True)
    assert copied.fwd_s - view.fwd_s == pytest.approx(3e-6 + 2 * x.nbytes * 3e-11)
    assert copied.bwd_s == view.bwd_s  # its gradient is a view of a contiguous tensor
    qkv, piece = TensorType((8, 64, 384), "f32"), TensorType((8, 64, 128), "f32")
    split = node_compute_time(get_op("split"), [qkv], [piece] * 3, {"sizes": (128,) * 3, "dim": 2}, device, "f32",
                              needs_grad=[True])
    assert split.bwd_s == pytest.approx(6e-6 + 3e-6 + 2 * qkv.nbytes * 3e-11)
    roofline = dataclasses.replace(device, eager=None)  # on a GPU preset the copy is a memory-bound kernel
    gpu = node_compute_time(reshape, [x], [x], {"shape": x.shape}, roofline, "f32", needs_grad=[True], copies=True)
    assert gpu.fwd_s == pytest.approx(2 * x.nbytes / roofline.memory_bandwidth + roofline.kernel_latency)


def _profile(sends: bool) -> LocalProfile:
    ring = CollectiveFit("all_reduce", 2, ((1024, 1e-3), (1 << 20, 2e-3)), AlphaBeta(1e-3, 1e-9))
    p2p = CollectiveFit("send_recv", 2, ((1024, 6e-5), (1 << 20, 3e-4)), AlphaBeta(6e-5, 2.5e-10))
    return LocalProfile(4, "now", "cpu", 2, 8 << 30, torch.__version__, True, ((256, 50e9),), 60e9, 1e5,
                        (("bf16", 2.0),), 5e9, 3e-6, ((2, 40e9, 4e9),), (ring, p2p) if sends else (ring,), None, 256)


def test_pipeline_sends_use_the_measured_send_recv_fit_not_a_ring_step() -> None:
    link = local_cluster(2, _profile(True)).intra
    assert link.p2p == pytest.approx((6e-5, 4e9))
    assert collective_time("send_recv", 1 << 16, ((link, 2),)) == pytest.approx(6e-5 + (1 << 16) / 4e9)
    assert link.latency == pytest.approx(1e-3 / 2)  # the all_reduce's ring step, 8x dearer, stays for collectives
    plain = local_cluster(2, _profile(False)).intra  # a profile without send/recv: a message is a ring step
    assert plain.p2p is None
    assert collective_time("send_recv", 1 << 16, ((plain, 2),)) == pytest.approx(plain.latency + (1 << 16) / plain.bandwidth)
    assert local_cluster(2, at_speed(_profile(True), 2.0)).intra.p2p == pytest.approx((1.2e-4, 2e9))
    with pytest.raises(ValueError, match="p2p"):
        LinkSpec("bad", 1e9, 1e-6, p2p=(1e-6, 0.0))


def test_the_profile_is_moved_to_the_speed_the_machine_mostly_ran_at() -> None:
    from shardc.calibration.local import at_typical_speed

    speed = SpeedIndex(reference=6e-3)  # the calibration's first reading: the slow mode
    speed.readings[:] = [6e-3, 4e-3, 4e-3, 4.2e-3, 3.9e-3]
    assert speed.typical() == pytest.approx(4e-3)  # the median: the usual mode
    profile = dataclasses.replace(_profile(True), probe_alone_rate=1.0 / 6e-3)
    moved = at_typical_speed(profile, speed.typical())
    assert moved.probe_alone_rate == pytest.approx(1.0 / 4e-3)
    assert moved.peak_fp32 == pytest.approx(60e9 * 1.5)  # every rate 1.5x faster, every time 1.5x shorter
    assert moved.kernel_latency == pytest.approx(3e-6 / 1.5)
    assert moved.collectives[0].fit.alpha == pytest.approx(1e-3 / 1.5)
    assert at_typical_speed(dataclasses.replace(profile, probe_alone_rate=0.0), 4e-3).peak_fp32 == 60e9


def test_a_process_among_others_is_priced_with_the_cpu_time_it_loses_to_them() -> None:
    base = _profile(True)
    shared = dataclasses.replace(base, contention=((2, 1.12), (4, 1.3)))
    assert shared.contention_factor(1) == 1.0 and base.contention_factor(4) == 1.0
    assert shared.contention_factor(2) == pytest.approx(1.12)
    assert shared.contention_factor(3) == pytest.approx(1.3)  # nearest count, ties to the larger
    alone, among = local_cluster(2, base).device, local_cluster(2, shared).device
    assert alone.peak("fp32") / among.peak("fp32") == pytest.approx(1.12)
    assert among.kernel_latency / alone.kernel_latency == pytest.approx(1.12)
    assert dataclasses.replace(shared, contention=((2, 0.9),)).contention_factor(2) == 1.0  # never faster
    assert LocalProfile.from_json(shared.to_json()).contention == ((2, 1.12), (4, 1.3))
