"""Cost-model primitives: collectives, model-state bytes, communication volumes, pipelines."""

from __future__ import annotations

import pytest
from traced import gpt_graph

from shardc.cost import CostContext, collective_time, group_levels, in_flight, layer_costs, model_state_bytes
from shardc.cost.pipeline import bubble_fraction, makespan_closed_form, simulate
from shardc.hardware import LinkSpec, parse_cluster
from shardc.ir import Mesh
from shardc.ops.collectives import ring_traffic

LINK = LinkSpec("test", 100e9, 10e-6)


def test_ring_all_reduce_is_alpha_beta() -> None:
    n, nbytes = 8, 1e9
    expected = 2 * (n - 1) * 10e-6 + 2 * (n - 1) / n * nbytes / 100e9
    assert collective_time("all_reduce", nbytes, LINK, "ring", group_size=n) == pytest.approx(expected)
    ag = (n - 1) * 10e-6 + (n - 1) / n * nbytes / 100e9
    assert collective_time("all_gather", nbytes, LINK, "ring", group_size=n) == pytest.approx(ag)



@pytest.mark.parametrize("kind, steps, sent", [
    ("all_reduce", 14, 1750), ("all_gather", 7, 875), ("reduce_scatter", 7, 875), ("all_to_all", 7, 875),
    ("broadcast", 7, 875), ("send_recv", 1, 1000), ("send", 1, 1000), ("recv", 1, 0),
])
def test_one_traffic_table_for_every_collective(kind: str, steps: int, sent: int) -> None:
    """Ring steps and bytes one rank sends of a 1000-byte buffer over 8 ranks; one rank sends nothing."""
    traffic = ring_traffic(kind, 8)
    assert (traffic.steps, traffic.sent_bytes(1000), traffic.fraction * 1000) == (steps, sent, sent)
    assert ring_traffic(kind, 1).sent_bytes(1000) == (1000 if kind in ("send_recv", "send") else 0)
def test_small_messages_are_latency_bound_and_block_size_matters() -> None:
    small = collective_time("all_reduce", 1024, LINK, "ring", group_size=8)
    assert small == pytest.approx(14 * 10e-6, rel=0.01)
    # The same 100 MB in 1 KB blocks costs far more than in one block.
    one = collective_time("all_reduce", 100e6, LINK, "ring", group_size=8)
    many = 100e6 / 1024 * collective_time("all_reduce", 1024, LINK, "ring", group_size=8)
    assert many > 50 * one
    # Tree beats ring on latency for small messages at scale; auto picks the faster.
    assert collective_time("all_reduce", 1024, LINK, "tree", group_size=64) < \
        collective_time("all_reduce", 1024, LINK, "ring", group_size=64)
    assert collective_time("all_reduce", 1024, LINK, "auto", group_size=64) == \
        collective_time("all_reduce", 1024, LINK, "tree", group_size=64)


def test_mesh_axes_map_to_link_levels() -> None:
    cluster = parse_cluster("32xA100-80GB")  # 4 nodes of 8
    mesh = Mesh((("pp", 2), ("dp", 2), ("tp", 8)))
    assert group_levels(mesh, ["tp"], cluster) == ((cluster.intra, 8),)
    assert group_levels(mesh, ["dp"], cluster) == ((cluster.inter, 2),)
    wide = Mesh((("dp", 16), ("tp", 2)))
    assert group_levels(wide, ["dp"], cluster) == ((cluster.intra, 4), (cluster.inter, 4))
    flat = collective_time("all_reduce", 1e9, group_levels(wide, ["dp"], cluster), "ring")
    hier = collective_time("all_reduce", 1e9, group_levels(wide, ["dp"], cluster), "hierarchical")
    assert hier < flat


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_state_bytes_exact_per_zero_stage(zero: int) -> None:
    n, d = 1_000_000, 8
    got = model_state_bytes(n, "bf16", zero, d)
    # Megatron's 18 B/param as the backend holds them: fp32 master + bf16 copy, fp32 gradients, Adam.
    assert got["parameters"] == n * (4 + 2) / (d if zero >= 3 else 1)
    assert got["gradients"] == n * 4 / (d if zero >= 2 else 1)
    assert got["optimizer"] == n * 8 / (d if zero >= 1 else 1)
    assert model_state_bytes(n, "bf16", zero, d, copies=False)["parameters"] == n * 4 / (d if zero >= 3 else 1)
    fp32 = model_state_bytes(n, "fp32", zero, d)
    assert fp32["optimizer"] == n * 8 / (d if zero >= 1 else 1)


def test_tp_communication_per_layer_exact() -> None:
    s, b, h = 1024, 2, 2048
    g = gpt_graph(layers=1, hidden=h, heads=16, vocab=1024, seq=s, batch=b, tp=4)
    ctx = CostContext.build(g, parse_cluster("8xA100-80GB"), "bf16")
    cost = layer_costs(ctx, g.layer_nodes("blocks.0"))
    fwd = [st for ph, st in cost.collectives if ph == "fwd"]
    bwd = [st for ph, st in cost.collectives if ph == "bwd"]
    for steps in (fwd, bwd):
        assert [(st.kind, st.axis, st.nbytes) for st in steps] == [("all_reduce", "tp", b * s * h * 2)] * 2


def test_dp_gradient_sync_volume_exact() -> None:
    from shardc.cost import estimate
    from shardc.plan.parallel import ParallelPlan

    g = gpt_graph(layers=2, hidden=512, heads=8, vocab=1024, seq=128, batch=8, dp=4, tp=2)
    e = estimate(g, parse_cluster("8xA100-80GB"), ParallelPlan.parse("dp=4,tp=2,mb=2,gbs=16"))
    local = 0
    for p in g.params:
        n = 1
        for dim in p.layout.local_shape(p.type.shape, g.mesh) if p.layout else p.type.shape:
            n *= dim
        local += n
    # bf16 mixed precision: fp32 gradients on the fp32 master weights, reduced in fp32
    assert e.stages[0].dp_grad_bytes == local * 4
    assert e.stages[0].dp_comm_bytes == local * 4 * 2 * 3 / 4  # ring all_reduce volume
    assert e.stages[0].memory["gradients"] == local * 4


@pytest.mark.parametrize("p,m", [(4, 8), (8, 8), (2, 32)])
def test_1f1b_bubble_fraction(p: int, m: int) -> None:
    run = simulate("1f1b", [1.0] * p, [2.0] * p, m, p)
    assert (run.makespan - m * 3.0) / run.makespan == pytest.approx((p - 1) / (m + p - 1))
    assert bubble_fraction(p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert makespan_closed_form([1.0] * p, [2.0] * p, m) == pytest.approx(run.makespan)


def test_interleaved_bubble_is_divided_by_virtual_stages() -> None:
    p, m, v = 4, 8, 2
    run = simulate("interleaved", [1.0 / v] * (p * v), [2.0 / v] * (p * v), m, p)
    assert (run.makespan - m * 3.0) / (m * 3.0) == pytest.approx((p - 1) / (v * m))


def test_unbalanced_stages_wait_and_hold_unbalanced_memory() -> None:
    run = simulate("1f1b", [1.0, 2.0], [2.0, 4.0], 8, 2)
    assert run.makespan == pytest.approx(7 * 6.0 + 9.0)
    assert run.busy[0] < run.busy[1]
    assert [in_flight("1f1b", 4, i, 16) for i in range(4)] == [4, 3, 2, 1]
    assert in_flight("gpipe", 4, 0, 16) == 16
    assert in_flight("interleaved", 4, 0, 16, 2) == 3 * 2 + 4 + 1
