"""What other frameworks' runtimes do that the cost model prices for their published runs
(`benchmarks/published_runs.py`): DeepSpeed's pipeline TrainSchedule with blocking exchanges,
pipeline activations scattered over tensor parallelism, and ZeRO-1 summing gradients by all-reduce."""

from __future__ import annotations

import pytest
from traced import traced

from shardc.cost import collective_time, estimate
from shardc.cost.compose import EstimateOptions
from shardc.cost.lockstep import simulate_lockstep, step_work
from shardc.cost.pipeline import simulate
from shardc.cost.report import timeline
from shardc.hardware import make_cluster
from shardc.ir import Graph
from shardc.ir.diagnostics import ShardcError
from shardc.passes.apply_plan import apply_plan
from shardc.plan.parallel import ParallelPlan

MEGATRON = EstimateOptions(pipeline_runtime="none", zero_runtime="zero", overlap_grad_reduce=False)
DEEPSPEED = EstimateOptions(pipeline_runtime="deepspeed", zero_runtime="zero", overlap_grad_reduce=False)
SEQ, HIDDEN = 64, 128


def gpt(plan: ParallelPlan) -> Graph:
    """A 4-block GPT with an untied head (no embedding gradient shared between stages), one
    micro-batch across the data-parallel group, partitioned under `plan`."""
    spec = (f"examples/gpt.py:gpt?n_layer=4&n_embd={HIDDEN}&n_head=4&vocab_size=512&seq={SEQ}"
            f"&batch={plan.dp * plan.mb}&tie=false")
    return apply_plan(traced(spec), plan)


@pytest.mark.parametrize("p,m", [(2, 3), (3, 2), (4, 8), (5, 7)])
def test_deepspeed_train_schedule_runs_each_micro_batch_once_per_stage(p: int, m: int) -> None:
    # DeepSpeed's TrainSchedule: F(j) on stage s at step 2j+s, B(j) at 2j+2p-1-s, in 2(m+p-1) steps.
    for s in range(p):
        ops = [(t, *step_work(t, s, p)) for t in range(2 * (m + p - 1))]
        valid = [(t, j, f) for t, j, f in ops if 0 <= j < m]
        assert [(t, j) for t, j, f in valid if f] == [(2 * j + s, j) for j in range(m)]
        assert [(t, j) for t, j, f in valid if not f] == [(2 * j + 2 * p - 1 - s, j) for j in range(m)]
        assert all(f == (t % 2 == s % 2) for t, _, f in ops)  # neighbours always in opposite phases


def test_lockstep_exchanges_hold_both_stages_for_every_transfer() -> None:
    # p=2, m=1 by hand: F0 | exchange | F1 B1 | exchange | B0: the sends on the critical path.
    run = simulate_lockstep([1.0, 1.0], [2.0, 2.0], [0.5, 0.0], 1)
    assert run.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    # p=3, m=2, no sends, F=1, B=2, by hand: the same makespan as Megatron's 1F1B here.
    run = simulate_lockstep([1.0] * 3, [2.0] * 3, [0.0] * 3, 2)
    assert run.makespan == pytest.approx(12.0) == simulate("1f1b", [1.0] * 3, [2.0] * 3, 2, 3).makespan
    assert run.busy == (6.0, 6.0, 6.0)


def test_a_deepspeed_pipeline_pays_each_exchange_on_both_stages() -> None:
    cluster = make_cluster("A100-80GB", 2, 1)
    plan = ParallelPlan(pp=2, mb=2, gbs=8)
    graph = gpt(plan)
    megatron, deepspeed = (estimate(graph, cluster, plan, options=o) for o in (MEGATRON, DEEPSPEED))
    one = megatron.stages[0].time["pp_comm"]
    assert one > 0 and megatron.stages[1].time["pp_comm"] == pytest.approx(one)
    # Megatron: the sender pays each transfer; DeepSpeed: both stages wait for both directions.
    assert [s.time["pp_comm"] for s in deepspeed.stages] == pytest.approx([2 * one, 2 * one])
    events = timeline(deepspeed)  # the plotted timeline is the lockstep simulation's
    assert len(events) == 2 * 2 * 4 and max(e[5] for e in events) <= deepspeed.step_time_s
    interleaved = ParallelPlan(pp=2, vpp=2, mb=2, gbs=8)
    with pytest.raises(ShardcError, match="runs its own TrainSchedule"):
        estimate(gpt(interleaved), cluster, interleaved, options=DEEPSPEED)


def test_scatter_gather_sends_one_tp_share_and_gathers_it_on_arrival() -> None:
    cluster = make_cluster("A100-80GB", 2, 2)  # pp across the two nodes, tp inside each
    plan = ParallelPlan(tp=2, pp=2, mb=2, gbs=4)
    graph = gpt(plan)
    m, size = 2, plan.mb * SEQ * HIDDEN * 2  # the residual stream in bf16, replicated over tp
    whole = estimate(graph, cluster, plan, options=MEGATRON).stages[0].time["pp_comm"]
    assert whole == pytest.approx(m * collective_time("send_recv", size, ((cluster.inter, 2),)))
    sg = EstimateOptions(pipeline_runtime="none", zero_runtime="zero", pipeline_scatter_gather=True)
    split = estimate(graph, cluster, plan, options=sg).stages[0].time["pp_comm"]
    expected = m * (collective_time("send_recv", size / 2, ((cluster.inter, 2),))
                    + collective_time("all_gather", size, ((cluster.intra, 2),)))
    assert split == pytest.approx(expected)  # (at 32 KiB the gather's latency outweighs the halved send)


def test_zero1_can_sum_gradients_by_all_reduce_as_deepspeeds_bf16_optimizer() -> None:
    cluster = make_cluster("A100-80GB", 1, 2)
    plan = ParallelPlan(dp=2, mb=2, gbs=4, zero=1)
    graph = gpt(plan)
    textbook = estimate(graph, cluster, plan, options=MEGATRON)
    bf16 = estimate(graph, cluster, plan, options=EstimateOptions(
        pipeline_runtime="none", zero_runtime="zero", overlap_grad_reduce=False, zero_gradient_collective="all_reduce"))
    grads = textbook.stages[0].dp_grad_bytes
    levels = ((cluster.intra, 2),)
    extra = collective_time("all_reduce", grads, levels) - collective_time("reduce_scatter", grads, levels)
    assert extra > 0
    assert bf16.stages[0].time["dp_comm"] - textbook.stages[0].time["dp_comm"] == pytest.approx(extra)
    assert bf16.step_time_s - textbook.step_time_s == pytest.approx(extra)
    with pytest.raises(ShardcError, match="zero_gradient_collective='scatter'"):
        EstimateOptions(zero_gradient_collective="scatter")


@pytest.mark.parametrize("p,m", [(4, 16), (12, 128), (35, 240)])
def test_with_free_transfers_deepspeeds_order_costs_what_1f1b_costs(p: int, m: int) -> None:
    # Equal stages, F=1 and B=3 (a recomputing backward): the lockstep order adds no bubble.
    run = simulate_lockstep([1.0] * p, [3.0] * p, [0.0] * p, m)
    assert run.makespan == pytest.approx(simulate("1f1b", [1.0] * p, [3.0] * p, m, p).makespan)
    assert run.makespan == pytest.approx((m + p - 1) * 4.0)


def test_bf16_optimizer_adds_each_micro_batchs_gradients_into_fp32_in_its_backward() -> None:
    import math

    cluster = make_cluster("A100-80GB", 1, 1)
    plan = ParallelPlan(mb=2, gbs=6)  # three micro-batches
    graph = gpt(plan)
    plain = estimate(graph, cluster, plan, options=MEGATRON)
    accumulating = estimate(graph, cluster, plan, options=EstimateOptions(
        pipeline_runtime="none", zero_runtime="zero", fp32_grad_accumulation=True))
    params = sum(math.prod(p.type.shape) for p in graph.params)
    # per micro-batch: the bf16 gradient read, an fp32 temporary written and read, the fp32 sum read and written
    expected = 3 * params * (2 + 16) / cluster.device.memory_bandwidth
    assert accumulating.stages[0].time["compute_bwd"] - plain.stages[0].time["compute_bwd"] == pytest.approx(expected)
    assert accumulating.step_time_s - plain.step_time_s == pytest.approx(expected)
