"""The eager cost model of a calibrated CPU: per-op-class node costs, the optimizer step, the
profile's versions and sharing, and the solver still scoring plans exactly as `estimate` does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardc.calibration.profile import AlphaBeta, CollectiveFit, EagerCosts, KernelFit, LocalProfile, at_speed
from shardc.cost import estimate
from shardc.cost.compute import class_bytes, node_compute_time, op_class, optimizer_step_time
from shardc.hardware import DeviceSpec, local_cluster
from shardc.ir import TensorType
from shardc.ops.registry import get_op

EAGER = EagerCosts(
    (("view", KernelFit(4e-6, 0.0, 6e-6, 0.0)),
     ("matmul", KernelFit(20e-6, 1e-11, 60e-6, 1e-11)),
     ("attention_matmul", KernelFit(30e-6, 2e-11, 90e-6, 2e-11)),
     ("elementwise", KernelFit(3e-6, 3e-11, 8e-6, 1e-11)),
     ("transcendental", KernelFit(20e-6, 1e-10, 40e-6, 2e-10)),
     ("index", KernelFit(5e-6, 4e-11, 20e-6, 1e-10)),
     ("mul", KernelFit(6e-6, 5e-11, 10e-6, 1e-10))),
    50e-6, 4e-9)
DEVICE = DeviceSpec("cpu", (("fp32", 1e11), ("bf16", 4e11)), 8 << 30, 5e9, eager=EAGER)


def _cost(name: str, ins: list[TensorType], outs: list[TensorType], attrs: dict, grads: list[bool],
          dtype: str = "f32"):
    return node_compute_time(get_op(name), ins, outs, attrs, DEVICE, dtype, needs_grad=grads)


def test_vector_ops_cost_their_call_plus_bytes_by_class_or_own_fit() -> None:
    x = TensorType((64, 128), "f32")
    gelu = _cost("gelu", [x], [x], {}, [True])
    units = 2 * x.nbytes
    assert gelu.fwd_s == pytest.approx(20e-6 + units * 1e-10) and gelu.bwd_s == pytest.approx(40e-6 + units * 2e-10)
    add = _cost("add", [x, x], [x], {}, [True, False])
    assert add.fwd_s == pytest.approx(3e-6 + 3 * x.nbytes * 3e-11)
    assert _cost("add", [x, x], [x], {}, [False, False]).bwd_s == 0.0  # nothing needs a gradient
    # mul has a fit of its own; an op without one (layer_norm here) costs as elementwise
    assert _cost("mul", [x], [x], {"other": 0.5}, [True]).fwd_s == pytest.approx(6e-6 + units * 5e-11)
    assert op_class(get_op("layer_norm"), {}) == "norm" and op_class(get_op("exp"), {}) == "transcendental"
    w = TensorType((128,), "f32")
    ln = _cost("layer_norm", [x, w, w], [x], {}, [True, True, True])
    assert ln.fwd_s == pytest.approx(3e-6 + (2 * x.nbytes + 2 * w.nbytes) * 3e-11)


def test_views_cost_a_call_and_an_autograd_node_dropout_p0_a_call() -> None:
    x = TensorType((8, 64, 128), "f32")
    y = TensorType((8, 64, 4, 32), "f32")
    view = _cost("reshape", [x], [y], {"shape": y.shape}, [True])
    assert (view.fwd_s, view.bwd_s) == (pytest.approx(4e-6), pytest.approx(6e-6))
    assert _cost("reshape", [x], [y], {"shape": y.shape}, [False]).bwd_s == 0.0
    drop = _cost("dropout", [x], [x], {"p": 0.0}, [True])
    assert (drop.fwd_s, drop.bwd_s) == (pytest.approx(4e-6), 0.0)
    assert op_class(get_op("dropout"), {"p": 0.1}) == "dropout"
    assert op_class(get_op("concat"), {"dim": 0}) == "elementwise"  # torch.cat copies


def test_matmuls_cost_flops_and_backward_per_input_needing_a_gradient() -> None:
    x, w, out = TensorType((512, 128), "f32"), TensorType((384, 128), "f32"), TensorType((512, 384), "f32")
    flops = 2 * 512 * 128 * 384
    both = _cost("linear", [x, w], [out], {}, [True, True])
    assert both.fwd_s == pytest.approx(20e-6 + flops * 1e-11)
    assert both.bwd_s == pytest.approx(60e-6 + 2 * flops * 1e-11) and both.bwd_flops == 2 * flops
    weight_only = _cost("linear", [x, w], [out], {}, [False, True])
    assert weight_only.bwd_s == pytest.approx(60e-6 + flops * 1e-11)
    # bf16 runs at the device's bf16/fp32 peak ratio (the fits are fp32)
    assert _cost("linear", [x, w], [out], {}, [True, True], "bf16").fwd_s == pytest.approx(20e-6 + flops * 1e-11 / 4)
    q, k = TensorType((8, 4, 64, 32), "f32"), TensorType((8, 4, 32, 64), "f32")
    s = TensorType((8, 4, 64, 64), "f32")
    att = _cost("matmul", [q, k], [s], {}, [True, True])
    assert att.fwd_s == pytest.approx(30e-6 + 2 * s.numel * 32 * 2e-11)


def test_parameters_accumulate_their_gradients_in_backward() -> None:
    acc = dataclasses.replace(DEVICE, eager=dataclasses.replace(
        EAGER, kinds=EAGER.kinds + (("accumulate_grad", KernelFit(0.0, 0.0, 5e-6, 1e-10)),)))
    x, w, out = TensorType((512, 128), "f32"), TensorType((384, 128), "f32"), TensorType((512, 384), "f32")
    op = get_op("linear")
    plain = node_compute_time(op, [x, w], [out], {}, DEVICE, "f32", needs_grad=[True, True], scaled_in=[True, False])
    more = node_compute_time(op, [x, w], [out], {}, acc, "f32", needs_grad=[True, True], scaled_in=[True, False])
    assert more.bwd_s - plain.bwd_s == pytest.approx(5e-6 + w.nbytes * 1e-10)  # the weight, not the activation
    assert more.fwd_s == plain.fwd_s


def test_lookup_is_charged_by_the_rows_it_reads_not_the_table() -> None:
    ids, table, out = TensorType((8, 64), "i64"), TensorType((50000, 128), "f32"), TensorType((8, 64, 128), "f32")
    assert class_bytes("index", [ids.nbytes, table.nbytes], out.nbytes) == ids.nbytes + 2 * out.nbytes
    emb = _cost("embedding", [ids, table], [out], {}, [False, True])
    assert emb.fwd_s == pytest.approx(5e-6 + (ids.nbytes + 2 * out.nbytes) * 4e-11)


def test_optimizer_step_per_tensor_and_element_sharded_by_zero() -> None:
    params = ((1000.0, 0), (3000.0, 0))
    assert optimizer_step_time(DEVICE, params, 1) == pytest.approx(2 * 50e-6 + 4000 * 4e-9)
    assert optimizer_step_time(DEVICE, ((1000.0, 1), (3000.0, 1)), 2) == pytest.approx(2 * 50e-6 + 2000 * 4e-9)
    # FSDP2 keeps ZeRO-sharded parameters as DTensors: their own (dearer) per-tensor cost
    fsdp = dataclasses.replace(DEVICE, eager=dataclasses.replace(EAGER, sharded_optimizer_per_tensor=400e-6,
                                                                 sharded_optimizer_per_param=5e-9))
    assert optimizer_step_time(fsdp, ((1000.0, 1), (3000.0, 0)), 2, fsdp2=True) == pytest.approx(
        400e-6 + 500 * 5e-9 + 50e-6 + 3000 * 4e-9)
    assert optimizer_step_time(fsdp, params, 2, fsdp2=True) == optimizer_step_time(DEVICE, params, 2)


def test_a_device_without_eager_costs_keeps_the_roofline() -> None:
    plain = dataclasses.replace(DEVICE, eager=None)
    x = TensorType((64, 128), "f32")
    view = node_compute_time(get_op("reshape"), [x], [x], {"shape": x.shape}, plain, "f32", needs_grad=[True])
    assert view.fwd_s == 0.0 and view.bwd_s == 0.0
    gelu = node_compute_time(get_op("gelu"), [x], [x], {}, plain, "f32", needs_grad=[True])
    assert gelu.fwd_s == pytest.approx(plain.kernel_latency + 2 * x.nbytes / plain.memory_bandwidth)


def _profile(eager: EagerCosts | None, version: int = 2) -> LocalProfile:
    fit = CollectiveFit("all_reduce", 2, ((1024, 1e-4), (1 << 20, 1e-3)), AlphaBeta(1e-4, 1e-9))
    return LocalProfile(version, "now", "cpu", 2, 8 << 30, torch.__version__, True, ((256, 50e9),), 60e9, 1e5,
                        (("bf16", 2.0),), 5e9, 3e-6, ((2, 40e9, 4e9), (4, 20e9, 2e9)), (fit,), eager, 256)


def test_eager_costs_scale_with_sharing_and_round_trip_through_json() -> None:
    prof = _profile(EAGER)
    assert LocalProfile.from_json(prof.to_json()) == prof
    # 4 processes at 20 GFLOP/s each against 50 alone at the same matmul size: 2.5x slower
    assert prof.eager_slowdown(4) == pytest.approx(2.5)
    dev = local_cluster(4, prof).device
    assert dev.eager is not None and dev.eager.optimizer_per_tensor == pytest.approx(50e-6 * 2.5)
    assert local_cluster(2, prof).device.eager.fit("view").fwd_call == pytest.approx(4e-6 * 1.25)
    slow = at_speed(prof, 1.5)  # the machine 1.5x slower than the profile's reference speed
    assert local_cluster(2, slow).device.eager.fit("view").fwd_call == pytest.approx(4e-6 * 1.25 * 1.5)
    assert local_cluster(4, slow).device.eager.optimizer_per_tensor == pytest.approx(50e-6 * 2.5 * 1.5)
    old = _profile(None, version=1).to_json()
    old.pop("eager")
    old.pop("concurrent_matmul_n")
    v1 = LocalProfile.from_json(old)  # a version 1 cache still loads, on the roofline
    assert v1.eager is None and local_cluster(2, v1).device.eager is None
    with pytest.raises(ValueError, match="version 7"):
        LocalProfile.from_json({**prof.to_json(), "version": 7})


def test_search_evaluates_plans_on_a_calibrated_cpu_as_estimate_does() -> None:
    from shardc.driver import load
    from shardc.search.evaluate import evaluate
    from shardc.search.grid import grid_assignments
    from shardc.search.planfile import annotate_graph
    from shardc.search.problem import MeshShape, build_problem, graph_facts

    graph = load("examples/gpt.py:tiny?n_layer=2&n_embd=64&n_head=4&seq=32", batch=2)
    cluster = local_cluster(4, _profile(EAGER))
    facts = graph_facts(graph, cluster)
    for shape in (MeshShape(2, 2, 1, 1),):
        problem = build_problem(facts, cluster, shape, 2, 8)
        for _, a in grid_assignments(problem)[:2]:
            ev = evaluate(problem, a, float("inf"))
            est = estimate(annotate_graph(graph, problem, a), cluster)
            assert ev.step_time_s == pytest.approx(est.step_time_s, rel=0.01)
            assert est.time_breakdown().get("optimizer", 0) > 0
