"""The solver's search of pipeline schedules, virtual stages and stage boundaries
(`shardc.search.schedules`): zero-bubble shapes offered beside Megatron's, never in the grid
baseline; stage boundaries moved off the stage holding the head and loss; on a pipeline-bound
case the best zero-bubble plan beats the best 1F1B/interleaved plan by the estimate, spending
memory; its plan file keeps the schedule and loads back to the same estimate."""

from __future__ import annotations

import dataclasses

import pytest
from traced import PRESETS, transformer_graph

from shardc.cost import estimate
from shardc.hardware import parse_cluster
from shardc.plan.file import PlanFile
from shardc.search.bounds import lower_bound
from shardc.search.evaluate import Assignment, balanced_stages, evaluate
from shardc.search.grid import grid_points, layouts
from shardc.search.outer import FAMILIES, search
from shardc.search.planfile import partitioned_graph, plan_file
from shardc.search.problem import MeshShape, build_problem, graph_facts
from shardc.search.schedules import rebalance, schedule_shapes

CLUSTER = "4x1xA100-40GB"  # four one-device nodes: every shape is a pipeline or data parallelism


def _facts(vocab: int = 4096):
    g = transformer_graph(dataclasses.replace(PRESETS["tiny"], layers=8, hidden=256, heads=4, seq=256, vocab=vocab))
    c = parse_cluster(CLUSTER)
    return graph_facts(g, c), c  # priced as run (compile=auto: fused on GPUs), as a plan file loads back


def test_zero_bubble_shapes_are_offered_beside_megatrons():
    flat, tq, single = MeshShape(4, 2, 1, 1), MeshShape(2, 1, 1, 2, 2), MeshShape(1, 8)
    got = schedule_shapes([flat, tq, single, dataclasses.replace(flat, vpp=2)], layers=8, max_vpp=4)
    assert [(s.schedule, s.vpp) for s in got] == [("zbv", 2), ("dualpipev", 2), ("interleaved-zb", 1),
                                                  ("interleaved-zb", 2)]  # pp*vpp <= 8 blocks
    assert all((s.pp, s.dp) == (4, 2) for s in got)
    assert str(got[0]) == "pp=4, dp=2, cp=1, tp=1, vpp=2, schedule=zbv"
    assert got[0].plan(1, 16).schedule == "zbv" and MeshShape.of(got[0].plan(1, 16)) == got[0]


def test_grid_holds_megatrons_schedules_only_and_the_bound_stays_below():
    facts, c = _facts()
    zb = build_problem(facts, c, MeshShape(4, 1, 1, 1, vpp=2, schedule="zbv"), 4, 16)
    assert grid_points(zb, 80e9) == []  # a Megatron user runs 1F1B or interleaved 1F1B
    a = Assignment(layouts(zb)[0][1], balanced_stages(8, 8, "none"), 0)
    assert lower_bound(zb, 80e9) <= evaluate(zb, a, 80e9).step_time_s


def test_boundaries_move_off_the_stage_holding_the_head_and_loss():
    # A 32768-token vocabulary: the last stage's head and loss cost about a block, so 1F1B's
    # even split (2 blocks a stage) waits on it; the search gives it one block and the first three.
    facts, c = _facts(vocab=32768)
    p = build_problem(facts, c, MeshShape(4, 1, 1, 1), 4, 16)
    even = Assignment(layouts(p)[0][1], balanced_stages(8, 4, "none"), 0)
    got, ev = rebalance(p, even, 80e9)
    assert [sum(r) for r in got.stages] == [3, 2, 2, 1]
    assert ev.step_time_s < 0.9 * evaluate(p, even, 80e9).step_time_s


def test_zero_bubble_plan_beats_the_best_1f1b_plan_and_loads_back(tmp_path):
    facts, c = _facts()
    result = search(facts, c, 16, 80e9, 6.0, 0, shapes=[MeshShape(4, 1, 1, 1)])
    assert set(result.families) == set(FAMILIES)
    zb, megatron = result.families["zero-bubble"], result.families["1f1b/interleaved"]
    assert result.best is zb and zb.problem.shape.schedule in ("zbv", "interleaved-zb", "dualpipev")
    # The bubble recovered: 4 micro-batches on 4 stages leave 1F1B idle 3/7 of its time.
    assert zb.step_time_s < 0.85 * megatron.step_time_s
    assert zb.memory_per_device_bytes > megatron.memory_per_device_bytes  # weight gradients held, more in flight
    assert zb.evaluation.step_time_s == pytest.approx(zb.step_time_s, rel=1e-6)  # priced as estimate prices it
    file = plan_file(zb.problem, zb.assignment, zb.estimate, 16)
    file.save(tmp_path / "zb.plan")
    loaded = PlanFile.load(tmp_path / "zb.plan")
    assert loaded.plan.schedule == zb.problem.shape.schedule and loaded.stages == zb.assignment.stages
    again = estimate(partitioned_graph(facts.graph, c, loaded), c)
    assert again.step_time_s == pytest.approx(zb.step_time_s, rel=1e-9)
