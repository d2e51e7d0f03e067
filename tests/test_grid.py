"""The grid baseline: Megatron's layouts (tp, sp, cp), every uniform point (vpp, partial recomputation,
ZeRO-1), plan strings `shardc estimate` reads."""

from __future__ import annotations

from dataclasses import replace

import pytest
from traced import PRESETS, transformer_graph

from shardc.hardware import parse_cluster
from shardc.plan.parallel import ParallelPlan
from shardc.search.evaluate import Assignment, evaluate
from shardc.search.grid import best_grid, grid_assignments, grid_points, megatron_choice, partial_stages
from shardc.search.outer import Found, mesh_shapes, score
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


def test_grid_points_cover_recompute_zero_and_sp():
    problem = _problem(MeshShape(2, 2, 1, 2))
    points = grid_assignments(problem)
    assert {(p.recompute, p.zero, p.sp) for p, _ in points} == \
        {(r, z, sp) for r in ("none", "selective", "full") for z in (0, 1) for sp in (False, True)}
    for point, a in points:
        assert all(sum(row) == 1 for row in a.stages)  # 2 blocks over 2 stages, evenly
        plan = ParallelPlan.parse(point.plan_string(16))
        assert (plan.dp, plan.tp, plan.pp, plan.mb, plan.sp) == (2, 2, 2, 1, point.sp)


def test_sequence_parallel_layout_reduce_scatters_onto_the_sequence():
    # Megatron's sp: the row-parallel linears (and the embedding) reduce-scatter onto the
    # sequence (dim 1) instead of all-reducing; the norms between them run on that split; the
    # column-parallel linears stay column-parallel (their input all-gathered).
    problem = _problem(MeshShape(1, 1, 1, 2))
    labels = {v.group.name: v.cands[c].label for v, c in zip(problem.groups, megatron_choice(problem, sp=True))}
    assert labels["embedding@wte"] == "partition<tp:v> ->{tp:S(1)}"
    assert labels["linear@blocks.1.attn.proj"] == labels["linear@blocks.1.mlp.fc2"] == "partition<tp:k> ->{tp:S(1)}"
    assert labels["layer_norm@blocks.1.ln1"] == labels["layer_norm@blocks.1.ln2"] == "partition<tp:e1>"
    assert labels["linear@blocks.1.attn.qkv"] == "partition<tp:n/3>"
    assert labels["linear@blocks.1.mlp.fc1"] == "partition<tp:n>"


def test_context_parallel_layout_splits_every_op_on_the_sequence():
    g = transformer_graph(replace(PRESETS["tiny"], style="llama", kv_heads=2))
    problem = _problem(MeshShape(1, 1, 2, 2), graph=g)
    labels = {v.group.name: v.cands[c].label for v, c in zip(problem.groups, megatron_choice(problem))}
    for name in ("rms_norm@blocks.1.attn_norm", "linear@blocks.1.attn.wq", "linear@blocks.1.mlp.w2"):
        assert "cp:" in labels[name], (name, labels[name])
    assert labels["linear@blocks.1.attn.wq"].startswith("partition<cp:e1, tp:n")
    assert "tp:g" in labels["scaled_dot_product_attention@blocks.1.attn"]
    assert all("rotate tp" not in label and "time e" not in label for label in labels.values())


def test_partial_recomputation_is_the_smallest_count_that_fits():
    # 8 blocks over pp=2: at a limit just above the peak with 2 of each stage's 4 blocks fully
    # recomputed, recompute=none overflows, so the grid adds Megatron's --recompute-num-layers N
    # with the smallest N that fits: 2 (1 overflows).
    problem = _problem(MeshShape(2, 1, 1, 2), graph=transformer_graph(replace(PRESETS["tiny"], layers=8)))
    roomy_points = [p for p, _, _ in grid_points(problem, 80e9)]
    roomy = {(p.recompute, p.sp, p.zero): (a, ev) for p, a, ev in grid_points(problem, 80e9)}
    choice = roomy[("none", False, 0)][0].choice
    limit = evaluate(problem, Assignment(choice, partial_stages(8, 2, 2), 0), 80e9).memory_per_device_bytes * (1 + 1e-9)
    assert not evaluate(problem, Assignment(choice, partial_stages(8, 2, 1), 0), limit).fits
    tight = grid_points(problem, limit)
    partial = [(p, a, ev) for p, a, ev in tight if p.recompute_layers and not p.sp and p.zero == 0]
    assert len(partial) == 1
    point, a, ev = partial[0]
    assert point.recompute_layers == 2 and ev.fits and a.stages == ((2, 0, 2), (2, 0, 2))
    assert point.plan_string(16).endswith("recompute=full,recompute_layers=2,zero=0,dtype=bf16")
    full = next(e for p, _, e in tight if (p.recompute, p.recompute_layers, p.sp, p.zero) == ("full", 0, False, 0))
    assert ev.step_time_s < full.step_time_s  # cheaper than recomputing every block
    # Where none fits, no recomputation is evaluated at all (it could only be slower).
    assert {p.recompute for p in roomy_points} == {"none"}


def test_interleaved_points_are_scored_as_estimate_scores_their_plan():
    # vpp=2 on pp=2 with 4 blocks: one block per model chunk, chunk s on device s % 2; the plan
    # string carries vpp and the interleaved schedule, and `estimate` on the annotated graph
    # gives the evaluation's step time and memory.
    graph = transformer_graph(replace(PRESETS["tiny"], layers=4))
    problem = _problem(MeshShape(2, 1, 1, 2, 1, 2), graph=graph)
    points = grid_points(problem, 80e9)
    assert points and all(len(a.stages) == 4 for _, a, _ in points)
    point, a, ev = points[0]
    plan = ParallelPlan.parse(point.plan_string(16))
    assert (plan.pp, plan.vpp, plan.schedule) == (2, 2, "interleaved")
    found = score(Found(problem, a, ev, "grid", grid_point=point), parse_cluster("8xH100"))
    assert found.estimate.step_time_s == pytest.approx(ev.step_time_s, rel=1e-9)
    assert found.estimate.memory_per_device_bytes == pytest.approx(ev.memory_per_device_bytes, rel=1e-9)
    assert graph.attrs["virtual_stages"] == 2 and graph.attrs["schedule"] == "interleaved"
    # Megatron deals equal chunks: 4 blocks do not interleave 3 ways over pp=2 ...
    assert not grid_points(_problem(MeshShape(2, 1, 1, 2, 1, 3), graph=graph), 80e9)
    # ... and the outer search offers vpp only where they divide.
    shapes = mesh_shapes(4, 4, 4, 16, 32)
    assert {(s.pp, s.vpp) for s in shapes if s.vpp > 1} == {(2, 2)}


def test_best_grid_respects_memory():
    problems = [_problem(MeshShape(1, 8, 1, 1)), _problem(MeshShape(1, 1, 1, 8))]
    roomy = best_grid(problems, 80e9)
    assert roomy is not None
    assert best_grid(problems, 1.0) is None
