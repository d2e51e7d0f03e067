"""The CP-SAT model: optimal against brute force (on the linearised objective it minimises),
deterministic, tying the grid where the grid is optimal and beating every Megatron point where
per-stage recomputation pays (both scored by `shardc.cost.estimate`), bounded in
time, warm-startable from a plan file, and clear when nothing fits."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from test_candidates import mlp_graph
from traced import PRESETS, transformer_graph

from shardc.cli import main
from shardc.cost import estimate
from shardc.driver import load, solver_batch
from shardc.driver import solve as solve_spec
from shardc.hardware import parse_cluster
from shardc.ir.diagnostics import ShardcError
from shardc.ir.parser import parse
from shardc.ir.printer import print_graph
from shardc.ops.verifier import verify
from shardc.plan.file import PlanFile
from shardc.search.cpsat import solve
from shardc.search.grid import best_grid
from shardc.search.objective import objective
from shardc.search.outer import Found, mesh_shapes, micro_batch_sizes, score, search
from shardc.search.planfile import annotate_graph, assignment_from_plan, partitioned_graph, plan_file
from shardc.search.problem import MeshShape, build_problem, graph_facts


def _splits(layers: int, stages: int):
    """Every way to give each stage block counts (none, selective, full) summing to `layers`."""
    rows = [r for r in itertools.product(range(layers + 1), repeat=3) if sum(r) <= layers]
    for combo in itertools.product(rows, repeat=stages):
        if sum(sum(r) for r in combo) == layers and all(sum(r) >= 1 for r in combo[1:-1]):
            yield combo


def _linear(problem, a):
    return objective(problem, a.choice, a.stages, a.zero, a.stage_choice)


def brute_force(problem, limit):
    """The best linearised objective (what CP-SAT minimises) over every point that fits."""
    best = None
    for choice in itertools.product(*[range(len(v.cands)) for v in problem.groups]):
        for stages in _splits(problem.layers, problem.shape.pp):
            for z in (0, 1, 2, 3):
                lin = objective(problem, choice, stages, z)
                if max(lin.memory_bytes) <= limit and (best is None or lin.step_time_s < best):
                    best = lin.step_time_s
    return best


@pytest.mark.parametrize("shape,limit", [(MeshShape(1, 1, 1, 2), 80e9), (MeshShape(2, 1, 1, 2), 80e9),
                                         (MeshShape(1, 2, 1, 2), 80e9), (MeshShape(2, 1, 1, 2), 40e3)])
def test_optimal_against_brute_force(shape, limit):
    g = mlp_graph(layers=2)
    cluster = parse_cluster("8xH100")
    problem = build_problem(graph_facts(g, cluster), cluster, shape, 2, 8, rotate=False, chunk=False)
    want = brute_force(problem, limit)
    got = solve(problem, limit, 20.0)
    if want is None:
        assert got.assignment is None or max(_linear(problem, got.assignment).memory_bytes) > limit
        return
    assert got.status == "OPTIMAL"
    lin = _linear(problem, got.assignment)
    assert max(lin.memory_bytes) <= limit * (1 + 1e-3)
    assert lin.step_time_s == pytest.approx(want, rel=2e-3)
    assert got.objective_s == pytest.approx(lin.step_time_s, rel=2e-3)
    assert got.bound_s <= got.objective_s and got.gap < 2e-3  # optimal: the bound meets the plan


def test_memory_limit_changes_the_plan():
    g = mlp_graph(layers=3)
    cluster = parse_cluster("8xH100")
    problem = build_problem(graph_facts(g, cluster), cluster, MeshShape(2, 1, 1, 2), 2, 8, rotate=False, chunk=False)
    free = _linear(problem, solve(problem, 80e9, 10).assignment)
    tight_limit = 0.8 * max(free.memory_bytes)
    tight = solve(problem, tight_limit, 10)
    assert tight.assignment is not None
    lin = _linear(problem, tight.assignment)
    assert max(lin.memory_bytes) <= tight_limit * (1 + 1e-3) and lin.step_time_s >= free.step_time_s


def _plan(seed=0, limit=80e9, time_limit=20.0, name="tiny", cluster="8xH100", gbs=16, wall_stop=1.5, schedules=True,
          **dims):
    g = transformer_graph(dataclasses.replace(PRESETS[name], **dims))
    c = parse_cluster(cluster)
    # Priced eager (compile=0), as these cases were set up: the auto default on GPUs prices fused
    # kernels, under which e.g. selective recomputation is nearly free (tests/test_compiled.py).
    return search(graph_facts(g, c, compiled=False), c, gbs, limit, time_limit, seed, wall_stop=wall_stop,
                  schedules=schedules)


def test_deterministic_for_a_fixed_seed():
    # The budget is CP-SAT's deterministic time; only the wall-clock stop for an overloaded
    # machine could differ between runs, so it is off here.
    a, b = _plan(seed=3, time_limit=8, wall_stop=float("inf")), _plan(seed=3, time_limit=8, wall_stop=float("inf"))
    # The gap is global: the best plan against the smallest bound over every mesh shape.
    assert 0.0 <= a.gap == b.gap < 1.0 and a.shapes_solved + a.shapes_pruned > 1
    assert plan_file(a.best.problem, a.best.assignment, a.best.estimate, 16) == \
        plan_file(b.best.problem, b.best.assignment, b.best.estimate, 16)


def _grid_best(result, limit, cluster):
    """The best grid point computed apart from the search's result: every grid point of every
    problem the search could pose (same shapes, micro-batches), scored by `estimate`."""
    facts = result.best.problem.facts
    c = parse_cluster(cluster)
    gbs = result.best.problem.gbs
    seq = max(v.type.shape[1] for v in facts.graph.inputs if v.type.rank >= 2)
    problems = [build_problem(facts, c, shape, mb, gbs)
                for shape in mesh_shapes(c.num_devices, c.devices_per_node, facts.layering.count, gbs, seq)
                for mb in micro_batch_sizes(gbs, shape.dp, shape.pp)]
    found = best_grid(problems, limit)
    assert found is not None
    problem, point, a, ev = found
    return score(Found(problem, a, ev, "grid", grid_point=point), c)


def test_ties_the_grid_where_the_grid_is_optimal():
    # Two one-device nodes: tp and cp cannot cross nodes, so the shapes are dp=2 or pp=2 and a
    # stage has no intra-stage axis (one partition per op, the grid's); the tiny model fits
    # everywhere, so no recomputation can save time. The grid's best (dp=2: a pp=2 pipeline
    # needs at least 2 micro-batches, as torch's 1F1B refuses fewer) is optimal: the solver must
    # return a plan of the same predicted time, proven optimal on its shape; the overall gap
    # also holds the other shapes' lower bounds (interleaved shapes have no CP-SAT proof). The
    # zero-bubble shapes are left out: their bound is the bubble-free ideal (no proof either),
    # 2.2% under the grid here, which would widen the gap this test is about.
    result = _plan(cluster="2x1xA100-40GB", gbs=8, time_limit=4, schedules=False)
    grid = _grid_best(result, 80e9, "2x1xA100-40GB")
    assert grid.grid_point.plan_string(8).startswith("dp=2,tp=1,pp=1,vpp=1,cp=1,sp=0,mb=4,")
    assert result.best.estimate.step_time_s == pytest.approx(grid.estimate.step_time_s, rel=1e-9)
    assert "OPTIMAL" in result.log[0] and result.gap < 1e-2


def test_memory_tight_case_beats_every_megatron_point():
    # 4 blocks of h=512 with an 8192-token vocabulary on two one-device nodes (pp=2 or dp=2), at
    # 58% of the roomy grid plan's memory. The last stage holds the head's logits and the loss's
    # working memory (unfused: torch's schedule calls the loss apart from the last stage's module);
    # Megatron recomputes alike on every stage (its best: one block of each stage in full, 8.64
    # ms); the solver recomputes only what the last stage's memory needs, one block selectively,
    # and nothing on the first (7.96 ms), and wins. (65% until session 7's memory rules; 60% until
    # session 9, where the pipelined head and loss were still priced fused and the solver's plan
    # cut them into token chunks, which no pipelined plan runs. From 55% to 59% Megatron's best is
    # the same; the solver's plan 7.96-8.53 ms.)
    dims = {"layers": 4, "hidden": 512, "heads": 8, "seq": 1024, "vocab": 8192}
    # Megatron's schedules only, so the plan is CP-SAT's (with the zero-bubble ones the best is
    # interleaved-zb on the same stages, its last recomputing 1 selective + 1 full block).
    roomy = _plan(cluster="2x1xA100-40GB", gbs=4, time_limit=4, schedules=False, **dims)
    limit = 0.58 * _grid_best(roomy, 80e9, "2x1xA100-40GB").memory_per_device_bytes
    tight = _plan(cluster="2x1xA100-40GB", gbs=4, limit=limit, time_limit=4, schedules=False, **dims)
    grid = _grid_best(tight, limit, "2x1xA100-40GB")
    assert grid.grid_point.recompute != "none"  # Megatron's best here recomputes on every stage
    best = tight.best
    assert best.source == "solver" and best.estimate.memory_per_device_bytes <= limit
    assert best.estimate.step_time_s < 0.99 * grid.estimate.step_time_s
    # What the grid lacks: recomputation per stage (the first stage recomputes nothing, the last
    # no block in full).
    assert best.assignment.stages[0] == (2, 0, 0) and best.assignment.stages[1][2] == 0


def test_no_plan_fits_names_the_smallest_memory_and_category():
    with pytest.raises(ShardcError, match=r"smallest per-device memory any plan reached is .* category that overflows"):
        solve_spec(PRESETS["tiny"].spec, "8xH100", 16, memory_limit_gb=1e-6, time_limit=2)


def test_bad_time_limit_and_mesh():
    with pytest.raises(ShardcError, match="time-limit must be positive"):
        solve_spec(PRESETS["tiny"].spec, "8xH100", 16, time_limit=0)
    with pytest.raises(ShardcError, match="cannot factor"):
        mesh_shapes(0, 8, 2, 16, 32)
    with pytest.raises(ShardcError, match="no mesh shape"):
        mesh_shapes(16, 8, 1, 1, 32)  # one block, batch 1: 16 devices would need tp=16 across nodes


def test_plan_file_round_trip_and_warm_start(tmp_path, capsys):
    out = tmp_path / "plan.json"
    plan = ["plan", PRESETS["tiny"].spec, "--cluster", "8xH100", "--gbs", "16", "--time-limit", "2", "--json"]
    assert main([*plan, "-o", str(out)]) == 0
    first = capsys.readouterr().out
    data = PlanFile.load(out)
    ir = (tmp_path / "plan.json.ir").read_text()
    assert ir.count("partition<") > 10
    verify(parse(ir))  # traced at the global batch, so that every dp divides it
    g = transformer_graph(dataclasses.replace(PRESETS["tiny"], batch=16))  # traced at the global batch, as plan
    c = parse_cluster("8xH100")
    problem = build_problem(graph_facts(g, c), c, MeshShape.of(data.plan, data.tq), data.plan.mb, 16)
    a = assignment_from_plan(data, problem)
    assert estimate(annotate_graph(g, problem, a), c).step_time_s == pytest.approx(data.step_time_s)
    # The file alone (with the spec and cluster) rebuilds the partitioned IR written beside it.
    again = partitioned_graph(load(PRESETS["tiny"].spec, batch=solver_batch(16)), c, data)
    assert print_graph(again) == ir
    assert PlanFile.from_json(json.loads(out.read_text())) == data and data.plan.gbs == 16
    assert main([*plan, "--warm-start", str(out)]) == 0
    assert '"step_time_s"' in first and '"optimality_gap"' in first and '"grid_best_step_time_s"' in first
