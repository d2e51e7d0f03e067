"""The CP-SAT model: optimal against brute force (on the linearised objective it minimises),
deterministic, never worse than the grid (both scored by `shardc.cost.estimate`), bounded in
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
from shardc.search.linear import objective
from shardc.search.outer import mesh_shapes, search
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


def _plan(seed=0, limit=80e9, time_limit=20.0, name="tiny", cluster="8xH100", gbs=16, wall_stop=1.5, **dims):
    g = transformer_graph(dataclasses.replace(PRESETS[name], **dims))
    c = parse_cluster(cluster)
    return search(graph_facts(g, c), c, gbs, limit, time_limit, seed, wall_stop=wall_stop)


def test_deterministic_for_a_fixed_seed():
    # The budget is CP-SAT's deterministic time; only the wall-clock stop for an overloaded
    # machine could differ between runs, so it is off here.
    a, b = _plan(seed=3, time_limit=8, wall_stop=float("inf")), _plan(seed=3, time_limit=8, wall_stop=float("inf"))
    # The gap is global: the best plan against the smallest bound over every mesh shape.
    assert 0.0 <= a.gap == b.gap < 1.0 and a.shapes_solved + a.shapes_pruned > 1
    assert plan_file(a.best.problem, a.best.assignment, a.best.estimate, 16) == \
        plan_file(b.best.problem, b.best.assignment, b.best.estimate, 16)


@pytest.mark.parametrize("kwargs", [
    {},
    {"style": "llama", "kv_heads": 2, "cluster": "4xA100-40GB", "gbs": 8},
    {"layers": 4, "hidden": 256, "seq": 256, "cluster": "8xA100-40GB", "gbs": 32},
])
def test_never_worse_than_the_grid(kwargs):
    # Both plans are scored by `shardc.cost.estimate` on the graph annotated with them.
    result = _plan(**kwargs)
    assert result.grid is not None and result.best is not None
    assert result.best.estimate is not None and result.grid.estimate is not None
    assert result.best.step_time_s == result.best.estimate.step_time_s
    assert result.best.estimate.step_time_s <= result.grid.estimate.step_time_s * (1 + 1e-9)


def test_memory_tight_case_beats_the_grid():
    # 4 blocks of h=1024 on 4 small devices: the grid must recompute everything; the solver
    # mixes recomputation per stage and partitions the activations.
    dims = {"layers": 4, "hidden": 1024, "heads": 16, "seq": 2048, "vocab": 32000}
    roomy = _plan(cluster="4xA100-40GB", gbs=8, time_limit=4, **dims)
    grid_mem = roomy.grid.memory_per_device_bytes
    tight = _plan(cluster="4xA100-40GB", gbs=8, limit=0.6 * grid_mem, time_limit=4, **dims)
    assert tight.best is not None and tight.best.estimate.memory_per_device_bytes <= 0.6 * grid_mem
    if tight.grid is not None:
        assert tight.best.step_time_s <= tight.grid.step_time_s


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
