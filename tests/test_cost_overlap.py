"""What a runtime overlaps, priced as it runs (issue 14): tensor-parallel collectives pipelined
with the GEMMs (Transformer Engine userbuffers), textbook ZeRO-3's gathers and reduce-scatters
sharing one link in backward, and a gradient reduction that waits for the end of backward."""

from __future__ import annotations

import pytest
from traced import gpt_graph

from shardc.cost import estimate
from shardc.cost.comm import collective_time
from shardc.cost.compose import EstimateOptions, overlapped_tp, zero3_exposed
from shardc.cost.layer import LayerCost
from shardc.hardware import LinkSpec, parse_cluster
from shardc.plan.parallel import ParallelPlan


def _cost(fwd: dict[str, float], bwd: dict[str, float]) -> LayerCost:
    return LayerCost(fwd, bwd, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def test_tp_overlap_hides_the_collectives_up_to_the_compute_of_the_same_pass() -> None:
    short = _cost({"compute_fwd": 1.0, "tp_comm": 0.3}, {"compute_bwd": 2.0, "recompute": 1.0, "tp_comm": 0.5})
    assert overlapped_tp(short) == (0.3, 0.5)  # all hidden
    long = _cost({"compute_fwd": 1.0, "tp_comm": 1.4}, {"compute_bwd": 0.5, "recompute": 0.25, "tp_comm": 2.0})
    assert overlapped_tp(long) == (1.0, 0.75)  # only the compute's length


def test_tp_overlap_hides_a_small_tensor_parallel_layers_collectives() -> None:
    g = gpt_graph(layers=2, hidden=512, heads=8, vocab=1024, seq=256, batch=2, tp=2)
    cluster, plan = parse_cluster("2xH100"), ParallelPlan.parse("tp=2,mb=2")
    exposed = estimate(g, cluster, plan)
    hidden = estimate(g, cluster, plan, options=EstimateOptions(tp_comm_overlap=True))
    tp = exposed.stages[0].time["tp_comm"]
    # NVLink all-reduces of a 512-wide layer are shorter than its GEMMs: all of it hides.
    assert tp > 0
    assert hidden.step_time_s == pytest.approx(exposed.step_time_s - tp)
    assert hidden.stages[0].time["tp_comm"] == pytest.approx(0.0, abs=1e-12)


def test_zero3_backward_carries_the_gather_and_the_reduce_scatter_on_one_link() -> None:
    link = LinkSpec("l", 10e9, 1e-5)
    levels = ((link, 4),)
    elements = 1e8
    gather = collective_time("all_gather", 2 * elements, levels)
    reduce = collective_time("reduce_scatter", 4 * elements, levels)
    cost = _cost({"compute_fwd": 0.01}, {"compute_bwd": gather + 0.25 * reduce})
    fwd, bwd = zero3_exposed(cost, elements, 2, levels)
    assert (fwd, bwd) == (pytest.approx(gather - 0.01), 0.0)  # alone, the gather hides in backward
    _, shared = zero3_exposed(cost, elements, 2, levels, grad_bytes=4 * elements)
    assert shared == pytest.approx(0.75 * reduce)  # together they outlast it


def test_textbook_zero3_reduces_per_layer_not_after_backward() -> None:
    g = gpt_graph(layers=2, hidden=512, heads=8, vocab=1024, seq=256, batch=4, dp=4, zero=3)
    cluster, plan = parse_cluster("4xA100-80GB"), ParallelPlan.parse("dp=4,mb=1,zero=3")
    e = estimate(g, cluster, plan, options=EstimateOptions(zero_runtime="zero"))
    stage = e.stages[0]
    assert stage.dp_grad_bytes > 0  # every gradient is still reduced (counted), in the layers' backward
    step = sum(v for k, v in stage.time.items() if k != "bubble")
    assert e.step_time_s == pytest.approx(step)


def test_a_reduction_after_backward_is_exposed_whole() -> None:
    g = gpt_graph(layers=4, hidden=512, heads=8, vocab=1024, seq=256, batch=8, dp=2)
    cluster, plan = parse_cluster("2xA100-80GB"), ParallelPlan.parse("dp=2,mb=4")
    overlapped = estimate(g, cluster, plan).stages[0]
    after = estimate(g, cluster, plan, options=EstimateOptions(overlap_grad_reduce=False)).stages[0]
    whole = collective_time("all_reduce", after.dp_grad_bytes, ((cluster.intra, 2),))
    assert after.time["dp_comm"] == pytest.approx(whole)
    assert overlapped.time.get("dp_comm", 0.0) < whole


def test_fsdp2_units_add_their_copies_to_each_gather_and_reduce() -> None:
    g = gpt_graph(layers=2, hidden=512, heads=8, vocab=1024, seq=256, batch=4, dp=4, zero=3)
    cluster, plan = parse_cluster("4xA100-80GB"), ParallelPlan.parse("dp=4,mb=1,zero=3")
    textbook = estimate(g, cluster, plan, options=EstimateOptions(zero_runtime="zero"))
    fsdp2 = estimate(g, cluster, plan, options=EstimateOptions(zero_runtime="zero", fsdp_copies=True))
    assert fsdp2.step_time_s > textbook.step_time_s
    assert fsdp2.stages[0].time["compute_fwd"] == textbook.stages[0].time["compute_fwd"]
