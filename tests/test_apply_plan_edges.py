"""edge_steps on partitioned graphs: Megatron's collectives, sequence parallel pairs, stage cuts
and Korthikanti et al.'s TP traffic per layer."""

from __future__ import annotations

from collections import Counter

import pytest
from test_apply_plan_graphs import attention_block, mlp_block, tiny_lm

from shardc.analysis.resharding import ReshardStep, backward_step, edge_steps
from shardc.analysis.summed import summed_per_step
from shardc.ir import Graph
from shardc.passes.apply_plan import apply_plan
from shardc.plan.parallel import ParallelPlan


def kinds(graph: Graph, backward: bool = False, activations_only: bool = True) -> Counter[str]:
    """Communicating steps of all edges (or of their backward), activations only by default."""
    params = {p.name for p in graph.params}
    out: Counter[str] = Counter()
    for edge, steps in edge_steps(graph).items():
        if activations_only and edge.value in params:
            continue
        for s in steps:
            step = backward_step(s, graph.mesh) if backward else s  # type: ignore[arg-type]
            if step is not None and step.communicates:
                out[step.kind] += 1
    return out


def test_tp_mlp_has_one_all_reduce_per_row_parallel_output() -> None:
    g = apply_plan(mlp_block(), ParallelPlan(dp=2, tp=2))
    edges = edge_steps(g)
    reduces = [(e, s) for e, steps in edges.items() for s in steps if s.kind == "all_reduce"]
    assert len(reduces) == 1
    edge, step = reduces[0]
    assert edge.value == g.nodes[3].output.name and g.nodes[3].location.module_path == "fc2"
    # [4,8,16] f32 with the batch split over dp: 1024 bytes per device, reduced over tp=2.
    assert (step.axis, step.bytes_in_per_device, step.group_size, step.backward) == ("tp", 1024, 2, "identity")
    # No Megatron f before the column-parallel fc1 here: the norm reads the graph input (no
    # gradient), so it passes fc1's partial gradient through to its weights, whose gradient is
    # summed over tp once per step (`shardc.analysis.summed`), as the cost model prices it.
    assert not [e for e in edges if e.value == "x0"]
    assert summed_per_step(g) == {"x0": ("tp",), "ln.weight": ("tp",), "ln.bias": ("tp",)}
    # The row-parallel bias is added on one rank only.
    bias = [s for e, steps in edges.items() if e.value == "fc2.bias" for s in steps]
    assert [s.kind for s in bias] == ["to_partial"]
    assert kinds(g) == Counter({"all_reduce": 1}) and kinds(g, backward=True) == Counter()


def test_sequence_parallel_uses_gather_and_scatter_pairs() -> None:
    g = apply_plan(attention_block(), ParallelPlan(tp=2, sp=True))
    assert kinds(g) == Counter({"all_gather": 2, "reduce_scatter": 1})  # qkv input, graph output; proj output
    assert kinds(g, backward=True) == Counter({"reduce_scatter": 1, "all_gather": 1})
    gathers = [e for e, steps in edge_steps(g).items() if any(s.kind == "all_gather" for s in steps) and e.consumers]
    assert [g.nodes[e.consumers[0][0]].location.module_path for e in gathers] == ["qkv"]


def test_two_all_reduces_per_layer_and_the_embedding() -> None:
    layers = 3
    g = apply_plan(tiny_lm(layers=layers), ParallelPlan(tp=2))
    assert kinds(g) == Counter({"all_reduce": 2 * layers + 1})
    assert kinds(g, backward=True) == Counter({"all_reduce": 2 * layers + 1})  # ln1, ln2 outputs and ln_f


def test_stage_cut_sends_the_residual_stream_once() -> None:
    g = apply_plan(tiny_lm(layers=2), ParallelPlan(pp=2, tp=2, sp=True, gbs=2))
    cuts = [(e, s) for e, steps in edge_steps(g).items() for s in steps if s.kind == "send_recv"]
    assert len(cuts) == 1
    edge, step = cuts[0]
    assert (edge.src_stage, edge.dst_stage, len(edge.consumers)) == (0, 1, 2)  # ln1 and the residual add
    # b*s*h/t elements with sequence parallelism: 2*8*16/2 f32.
    assert step.bytes_in_per_device == 2 * 8 * 16 // 2 * 4


def block_traffic(graph: Graph, layer: str) -> tuple[int, int]:
    """Elements one device sends for one layer's activations, forward and backward (f32)."""
    params = {p.name for p in graph.params}
    members = {id(v) for n in graph.layer_nodes(layer) for v in n.outputs}
    fwd = bwd = 0
    for edge, steps in edge_steps(graph).items():
        if edge.value in params or id(graph.value(edge.value)) not in members:
            continue
        for s in steps:
            back: ReshardStep | None = backward_step(s, graph.mesh)  # type: ignore[arg-type]
            fwd += s.wire_bytes // 4
            bwd += back.wire_bytes // 4 if back is not None else 0
    return fwd, bwd


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("t", [2, 4])
def test_korthikanti_tp_traffic_per_layer(t: int, sp: bool) -> None:
    # Korthikanti et al. 2022: 2 all-reduces of b*s*h per layer forward and 2 backward (with SP,
    # all-gather + reduce-scatter pairs of the same volume): 8*b*s*h*(t-1)/t elements per device.
    b, s, h = 2, 8, 16
    g = apply_plan(tiny_lm(layers=2, batch=b, seq=s, hidden=h), ParallelPlan(tp=t, sp=sp))
    # The first block's input comes from the embedding layer; count blocks.0's outputs and the
    # edges that feed blocks.1 from it.
    fwd, bwd = block_traffic(g, "blocks.0")
    per_direction = 4 * b * s * h * (t - 1) // t
    assert (fwd, bwd) == (per_direction, per_direction)
