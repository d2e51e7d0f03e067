"""The grid baseline: Megatron's layout, every uniform point, plan strings `shardc estimate` reads."""

from __future__ import annotations

from dataclasses import replace

from traced import PRESETS, transformer_graph

from shardc.hardware import parse_cluster
from shardc.plan.parallel import ParallelPlan
from shardc.search.grid import best_grid, grid_assignments, megatron_choice
from shardc.search.problem import MeshShape, build_problem, graph_facts


def _problem(shape: MeshShape, mb: int = 1, graph=None):
    g = graph if graph is not None else transformer_graph(PRESETS["tiny"])
    c = parse_cluster("8xH100")
    return build_problem(graph_facts(g, c), c, shape, mb, 16)


def _megatron_labels(graph) -> dict[str, str]:
    problem = _problem(MeshShape(1, 1, 1, 2), graph=graph)
    return {v.group.name: v.cands[c].label for v, c in zip(problem.groups, megatron_choice(problem))}


def test_megatron_layout_is_column_then_row():
    gpt = _megatron_labels(transformer_graph(PRESETS["tiny"]))
    assert gpt["linear@blocks.1.attn.qkv"] == "partition<tp:n/3>"  # fused q, k, v: each split on its own
    assert gpt["matmul@blocks.1.attn"] == "partition<tp:e1>"  # the heads
    assert gpt["linear@blocks.1.attn.proj"] == "partition<tp:k> ->{}"
    assert gpt["linear@blocks.1.mlp.fc1"] == "partition<tp:n>"
    assert gpt["linear@blocks.1.mlp.fc2"] == "partition<tp:k> ->{}"
    llama = _megatron_labels(transformer_graph(replace(PRESETS["tiny"], style="llama", kv_heads=2)))
    for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
        assert llama[f"linear@blocks.1.{name}"] == "partition<tp:n>"
    assert llama["scaled_dot_product_attention@blocks.1.attn"] == "partition<tp:g>"
    assert llama["linear@blocks.1.attn.wo"] == "partition<tp:k> ->{}"
    assert llama["linear@blocks.1.mlp.w2"] == "partition<tp:k> ->{}"
    for labels in (gpt, llama):
        assert all("rotate" not in label and "time" not in label for label in labels.values())


def test_grid_points_cover_recompute_and_zero():
    problem = _problem(MeshShape(2, 2, 1, 2))
    points = grid_assignments(problem)
    assert {(p.recompute, p.zero) for p, _ in points} == {(r, z) for r in ("none", "selective", "full") for z in (0, 1)}
    for point, a in points:
        assert all(sum(row) == 1 for row in a.stages)  # 2 blocks over 2 stages, evenly
        plan = ParallelPlan.parse(point.plan_string(16))
        assert (plan.dp, plan.tp, plan.pp, plan.mb) == (2, 2, 2, 1)


def test_best_grid_respects_memory():
    problems = [_problem(MeshShape(1, 8, 1, 1)), _problem(MeshShape(1, 1, 1, 8))]
    roomy = best_grid(problems, 80e9)
    assert roomy is not None
    assert best_grid(problems, 1.0) is None
