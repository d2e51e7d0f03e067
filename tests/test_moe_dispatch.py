"""Megatron-Core's MoE runtime as the cost model prices it for published runs (issue 15,
`benchmarks/published_moe.py`): its alltoall token dispatcher under expert tensor parallelism
(`EstimateOptions.expert_dispatch="megatron"`, `shardc.cost.moe`) and its distributed optimizer
as textbook ZeRO-1 (`zero_runtime="zero"`: master weights sharded, dense weights over the ranks
that replicate them, ep included; `shardc.cost.sync.zero_width`).

A small mixtral (8 experts, top-2) traced on the meta device and partitioned by apply-plan; the
figures asserted are computed here from the model's own sizes."""

from __future__ import annotations

import pytest

from shardc.cost import estimate
from shardc.cost.options import EstimateOptions
from shardc.frontend import trace
from shardc.frontend.spec import load_model
from shardc.hardware import make_cluster
from shardc.ir import Graph
from shardc.passes.apply_plan import apply_plan
from shardc.passes.group_layers import group_layers
from shardc.plan.parallel import ParallelPlan

HIDDEN, SEQ, TOP_K = 64, 32, 2
MIXTRAL = (f"hf:mixtral?hidden_size={HIDDEN}&num_attention_heads=4&num_key_value_heads=2&vocab_size=128"
           f"&intermediate_size=128&num_hidden_layers=2&num_local_experts=8&num_experts_per_tok={TOP_K}&seq={SEQ}")


def _graph(plan: ParallelPlan) -> Graph:
    loaded = load_model(f"{MIXTRAL}&batch={plan.dp * plan.mb}", device="meta")
    graph = group_layers(trace(loaded.model, loaded.example_inputs, name=loaded.name,
                               input_names=loaded.input_names))
    return apply_plan(graph, plan)


def _collectives(e, kind: str, axis: str) -> dict[tuple[str, float], int]:
    """(phase, bytes) -> calls per step of `kind` on `axis`, the first pipeline device's."""
    out: dict[tuple[str, float], int] = {}
    for phase, k, a, nbytes, calls in e.stages[0].collectives:
        if k == kind and a == axis:
            out[(phase, nbytes)] = out.get((phase, nbytes), 0) + calls
    return out


def test_megatron_dispatch_sends_each_tp_ranks_share_over_ep_and_gathers_the_rows_over_tp() -> None:
    """ep=2 across two nodes, tp=2 with sequence parallelism inside each. The torch backend's
    ranks hold the tp group's tokens and each dispatches all of them; Megatron's dispatcher sends
    each tp rank's half over ep and all-gathers the received rows over tp (reduce-scatters the
    results), and gathers nothing on the experts' token edges: half the inter-node all-to-all
    bytes and fewer activations saved (at these sizes the exchanges are latency-bound, so the
    dispatcher's extra collectives cost more time than the bytes save: not asserted)."""
    plan = ParallelPlan.parse("ep=2,tp=2,sp=1,mb=2,gbs=4,dtype=bf16")
    graph = _graph(plan)
    graph.attrs["routing_skew"] = 1.0  # balanced: the bytes below are the routed rows' own
    cluster = make_cluster("H100-SXM", 2, 2)
    torch_runtime = estimate(graph, cluster, plan, options=EstimateOptions(zero_runtime="zero"))
    megatron = estimate(graph, cluster, plan, options=EstimateOptions(zero_runtime="zero", expert_dispatch="megatron"))
    routed = SEQ * TOP_K * HIDDEN * 2  # one sequence per ep rank, whole over tp, top-2 rows of bf16
    m = torch_runtime.micro_batches
    layers = 2
    calls = 2 * layers * m  # dispatch and combine per layer and micro-batch, in each pass
    assert _collectives(torch_runtime, "all_to_all", "ep") == {("fwd", routed): calls, ("bwd", routed): calls}
    assert _collectives(megatron, "all_to_all", "ep") == {("fwd", routed / 2): calls, ("bwd", routed / 2): calls}
    for kind in ("all_gather", "reduce_scatter"):
        rows = {key: n for key, n in _collectives(megatron, kind, "tp").items() if key[1] == routed}
        assert rows == {("fwd", routed): layers * m, ("bwd", routed): layers * m}, kind
        assert not any(b == routed for _, b in _collectives(torch_runtime, kind, "tp"))
    # the experts' token gather (one sequence of hidden states over tp) is gone: one fewer per layer
    tokens = SEQ * HIDDEN * 2
    gathers = [_collectives(e, "all_gather", "tp").get(("fwd", tokens), 0) for e in (torch_runtime, megatron)]
    assert gathers[0] - gathers[1] == layers * m
    assert megatron.stages[0].activation_bytes_per_microbatch < torch_runtime.stages[0].activation_bytes_per_microbatch


def test_the_default_dispatch_is_the_torch_backends_and_a_wrong_one_is_refused() -> None:
    from shardc.ir.diagnostics import ShardcError

    assert EstimateOptions().expert_dispatch == "replicated"
    with pytest.raises(ShardcError, match="expert_dispatch='deepep'.*megatron"):
        EstimateOptions(expert_dispatch="deepep")


@pytest.mark.parametrize("gradient_reduce,grad_bytes", [("fp32", 4), ("compute", 2)])
def test_textbook_zero1_shards_master_weights_and_dense_weights_over_ep(gradient_reduce: str, grad_bytes: int) -> None:
    """dp=2 x ep=2 under ZeRO-1 as Megatron's distributed optimizer: the fp32 master weights and
    Adam's moments (12 bytes) of a dense weight sharded over all 4 ranks, of an expert weight over
    the 2 that hold the same experts; bf16 weights (2) whole; gradients in the dtype reduced in.
    The torch backend's FSDP2 shards everything over dp alone."""
    plan = ParallelPlan.parse("dp=2,ep=2,zero=1,mb=2,gbs=8,dtype=bf16")
    graph = _graph(plan)
    experts = sum(p.type.numel for p in graph.params if ".experts." in p.name) / 2  # 4 of 8 experts per rank
    dense = sum(p.type.numel for p in graph.params if ".experts." not in p.name)
    assert experts > 0 and dense > 0
    cluster = make_cluster("H100-SXM", 1, 4)
    e = estimate(graph, cluster, plan, options=EstimateOptions(zero_runtime="zero", gradient_reduce=gradient_reduce))
    memory = e.stages[0].memory
    assert memory["optimizer"] == pytest.approx(12 * (dense / 4 + experts / 2))
    assert memory["parameters"] == pytest.approx(2 * (dense + experts))
    assert memory["gradients"] == pytest.approx(grad_bytes * (dense + experts))
