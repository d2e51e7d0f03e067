"""Per-stage block partitions: the CP-SAT model chooses the blocks' partitions per stage class,
optimally against brute force over per-stage choices, writes them into the IR stage by stage,
scores them as `shardc.cost.estimate` does, and keeps them in plan files."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from test_candidates import mlp_graph
from traced import PRESETS, transformer_graph

from shardc.cost import estimate
from shardc.hardware import parse_cluster
from shardc.plan.file import PlanFile
from shardc.search.cpsat import solve
from shardc.search.evaluate import evaluate, per_stage
from shardc.search.grid import grid_points, layouts
from shardc.search.interleave import interleaved
from shardc.search.objective import objective
from shardc.search.outer import Found, score
from shardc.search.planfile import annotate_graph, assignment_from_plan, plan_file, plan_problem
from shardc.search.problem import MeshShape, build_problem, graph_facts
from shardc.search.sections import stage_classes

# Two blocks of an MLP on pp=2 x tp=2 with 4 micro-batches: the first stage holds two in flight,
# the last one, so under 80% of the unconstrained plan's memory the first stage splits its
# activations over tp where the last keeps the cheaper replicated partition.
EXPECTED = """\
  %h0 = linear(%x, %blocks.0.fc1.weight) : bf16[4,8,32]{tp:S(2)} partition<tp:n> layer=blocks.0 @blocks.0.fc1
  %a0 = gelu(%h0) : bf16[4,8,32]{tp:S(2)} partition<tp:d2> layer=blocks.0 @blocks.0.act
  %y0 = linear(%a0, %blocks.0.fc2.weight) : bf16[4,8,16]{} partition<> layer=blocks.0 @blocks.0.fc2
  %z0 = add(%x, %y0) : bf16[4,8,16]{} partition<> layer=blocks.0 @blocks.0
  %h1 = linear(%z0, %blocks.1.fc1.weight) : bf16[4,8,32]{} partition<> layer=blocks.1 @blocks.1.fc1
  %a1 = gelu(%h1) : bf16[4,8,32]{} partition<> layer=blocks.1 @blocks.1.act
  %y1 = linear(%a1, %blocks.1.fc2.weight) : bf16[4,8,16]{tp:S(2)} partition<tp:n> layer=blocks.1 @blocks.1.fc2
  %z1 = add(%z0, %y1) : bf16[4,8,16]{tp:S(2)} partition<tp:d2> layer=blocks.1 @blocks.1"""


def _mlp():
    g = mlp_graph(layers=2)
    cluster = parse_cluster("8xH100")
    problem = build_problem(graph_facts(g, cluster), cluster, MeshShape(2, 1, 1, 2), 2, 8, rotate=False, chunk=False)
    return g, problem


def _linear(problem, a):
    return objective(problem, a.choice, a.stages, a.zero, a.stage_choice)


def _brute(problem, limit, stages_differ):
    """The best linearised objective over every plan without recomputation at ZeRO 0."""
    vecs = list(itertools.product(*[range(len(v.cands)) for v in problem.groups]))
    splits = [((2, 0, 0), (0, 0, 0)), ((1, 0, 0), (1, 0, 0)), ((0, 0, 0), (2, 0, 0))]
    best = None
    for first in vecs:
        for last in vecs if stages_differ else [first]:
            for stages in splits:
                a = per_stage(problem, first, [first, last], stages, 0)
                lin = _linear(problem, a)
                if max(lin.memory_bytes) <= limit and (best is None or lin.step_time_s < best):
                    best = lin.step_time_s
    return best


def _tight_limit(problem):
    free = solve(problem, 80e9, 10, zeros=(0,), recomputes=(0,))
    return 0.8 * max(_linear(problem, free.assignment).memory_bytes)


def test_stages_pick_different_partitions_optimally():
    _, problem = _mlp()
    limit = _tight_limit(problem)
    uniform, per = _brute(problem, limit, False), _brute(problem, limit, True)
    assert per < uniform * (1 - 1e-3)  # the case is one where stages should differ
    got = solve(problem, limit, 10, zeros=(0,), recomputes=(0,))
    assert got.status == "OPTIMAL" and got.assignment.at(0) != got.assignment.at(1)
    lin = _linear(problem, got.assignment)
    assert max(lin.memory_bytes) <= limit * (1 + 1e-3)
    assert lin.step_time_s == pytest.approx(per, rel=2e-3) and got.objective_s == pytest.approx(per, rel=2e-3)
    one = solve(problem, limit, 10, zeros=(0,), recomputes=(0,), stage_limit=1)
    assert one.assignment.uniform and one.objective_s == pytest.approx(uniform, rel=2e-3)


def test_per_stage_plan_prints_stage_by_stage():
    g, problem = _mlp()
    got = solve(problem, _tight_limit(problem), 10, zeros=(0,), recomputes=(0,))
    text = str(annotate_graph(g, problem, got.assignment))
    assert "\n".join(line for line in text.splitlines() if line.startswith("  %")) == EXPECTED
    assert "layer blocks.0 block=block stage=0" in text and "layer blocks.1 block=block stage=1" in text


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_per_stage_plans_evaluate_as_estimated(style):
    # Stages with rotating, chunked, sequence-parallel and replicated blocks: the boundary
    # between them is priced across the two partitions; a rotary table read by both is kept whole.
    dims = dataclasses.replace(PRESETS["tiny"], seq=64, layers=4, style=style, kv_heads=2 if style == "llama" else None)
    graph = transformer_graph(dims)
    cluster = parse_cluster("8xH100")
    problem = build_problem(graph_facts(graph, cluster), cluster, MeshShape(2, 2, 1, 2), 2, 16)
    vecs = [tuple(next((i for i, c in enumerate(v.cands) if pick in c.label), 0) for v in problem.groups)
            for pick in ("tp:S", "rotate", "time", "")]
    for first, last in ((vecs[0], vecs[3]), (vecs[1], vecs[2]), (vecs[3], vecs[0])):
        a = per_stage(problem, first, [first, last], ((1, 1, 0), (0, 0, 2)), 0)
        assert not a.uniform
        ev = evaluate(problem, a, float("inf"))
        est = estimate(annotate_graph(graph, problem, a), cluster)
        assert ev.step_time_s == pytest.approx(est.step_time_s, rel=0.01)
        for mine, theirs in zip(ev.stages, est.stages):
            assert mine.memory_bytes == pytest.approx(theirs.memory_bytes, rel=0.01)
        assert _linear(problem, a).step_time_s == pytest.approx(est.step_time_s, rel=0.05)
        data = plan_file(problem, a, est, 16)
        assert len(data.stage_groups) == 2 and assignment_from_plan(data, problem) == a
        assert PlanFile.from_json(data.to_json()) == data


def test_stage_classes_bound_the_model():
    assert stage_classes(3) == [0, 1, 2]
    assert stage_classes(16) == [0] + [1] * 7 + [2] * 7 + [3]
    assert stage_classes(8, 1) == [0] * 8 and stage_classes(5, 2) == [0, 1, 1, 1, 1]
    _, problem = _mlp()
    # A stage without blocks runs its neighbour's partitions (no boundary to price).
    a = per_stage(problem, (3, 0), [(3, 0), (0, 3)], ((0, 0, 0), (2, 0, 0)), 0)
    assert a.uniform and a.choice == (0, 3)


def test_interleaved_shapes_recompute_per_device():
    # pp=2 x vpp=2 with one block per model chunk at 85% of the roomy grid plan's memory (80% until
    # the pipeline memory walked each device's schedule order: the first device's two chunks in
    # flight now cost it more, and at 80% both devices recompute fully, as the grid does): the
    # last device holds the head's logits and must recompute fully; the first has room for
    # selective recomputation. Megatron recomputes alike everywhere (its best here: full), the
    # interleaved search chooses per device, and `estimate` agrees with its evaluation.
    g = transformer_graph(dataclasses.replace(PRESETS["tiny"], layers=4, hidden=512, heads=8, seq=1024, vocab=8192))
    cluster = parse_cluster("2x1xA100-40GB")
    problem = build_problem(graph_facts(g, cluster), cluster, MeshShape(2, 1, 1, 1, 1, 2), 1, 4)
    roomy = min((ev for _, _, ev in grid_points(problem, 80e9)), key=lambda ev: ev.step_time_s)
    limit = 0.85 * roomy.memory_per_device_bytes
    grid = min((ev.step_time_s, point.recompute) for point, _, ev in grid_points(problem, limit) if ev.fits)
    assert grid[1] == "full"
    got = interleaved(problem, [choice for _, choice in layouts(problem)], limit)
    assert got is not None
    a, ev = got
    assert a.stages == ((0, 1, 0), (0, 0, 1), (0, 1, 0), (0, 0, 1))  # chunk s on device s % 2
    assert ev.fits and ev.step_time_s < 0.995 * grid[0]
    found = score(Found(problem, a, ev, "solver"), cluster)
    assert found.estimate.step_time_s == pytest.approx(ev.step_time_s, rel=1e-9)
    assert found.estimate.memory_per_device_bytes <= limit
    # The plan file carries vpp and the four chunks' block counts, and reads back to the same point.
    data = PlanFile.from_json(plan_file(problem, a, found.estimate, 4).to_json())
    assert (data.plan.pp, data.plan.vpp, data.plan.schedule, data.stages) == (2, 2, "interleaved", a.stages)
    back = plan_problem(g, cluster, data)
    assert back.shape == problem.shape and assignment_from_plan(data, back) == a
