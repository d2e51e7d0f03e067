"""The solver against every Megatron point on a real memory-tight case: Llama-2-13B at its 4096-token context
on one 8xA100-40GB node, at the device's own usable memory (40 GiB less the CUDA context, NCCL
buffers and fragmentation: 36.5 GiB), no limit of our choosing. Every Megatron point that fits
must recompute (tp=4 x pp=2 with sp holds 37.3 GiB on its first stage without); the solver's plan
is compared with the best grid point computed apart from the search (every shape and
micro-batch the search could pose, no bound pruning), both scored by `shardc.cost.estimate`. The
solver wins by recomputing per stage what that stage's memory needs (`shardc.search.refine`)."""

from __future__ import annotations

import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest
from shared_spawn import apart_context

from shardc.driver import load, solver_batch
from shardc.hardware import parse_cluster
from shardc.search.grid import GridPoint, best_grid, grid_points
from shardc.search.outer import Found, mesh_shapes, micro_batch_sizes, score, search
from shardc.search.problem import MeshShape, PricingCache, build_problem, graph_facts

SPEC = "examples/llama.py:llama_13b?seq=4096"
CLUSTER = "8xA100-40GB"
GBS = 64


@pytest.fixture(scope="module")
def facts():
    cluster = parse_cluster(CLUSTER)
    return graph_facts(load(SPEC, batch=solver_batch(GBS)), cluster), cluster


def _best_grid_point(pickled: bytes) -> tuple[MeshShape, int, GridPoint]:
    """The best grid point over every shape and micro-batch the search could pose, unpruned: its
    shape, micro-batch size and point (what crosses back from its process; a problem holds lambdas).
    Its arguments `(facts, cluster, limit)` come pickled by the caller: the executor pickles a
    call on a thread of its own, which would race with the search filling the facts' caches."""
    facts, cluster, limit = pickle.loads(pickled)
    cache: PricingCache = {}  # its own: shapes of one pricing key share one pricing, as in the search
    problems = [build_problem(facts, cluster, shape, mb, GBS, cache=cache)
                for shape in mesh_shapes(cluster.num_devices, cluster.devices_per_node, facts.layering.count, GBS, 4096)
                for mb in micro_batch_sizes(GBS, shape.dp, shape.pp)]
    problem, point, _, _ = best_grid(problems, limit)
    return problem.shape, problem.mb, point


@pytest.fixture(scope="module")
def solved(facts):
    """(the best grid point computed apart from the search, scored; the search's result). The
    grid scan runs in a process of its own while this one searches (each is single-threaded and
    deterministic, neither reads the other: two cores finish both in the time of the longer)."""
    facts, cluster = facts
    limit = float(cluster.device.usable_memory_bytes)
    assert limit == pytest.approx(36.5 * 2**30)
    with ProcessPoolExecutor(1, mp_context=apart_context()) as apart:
        scan = apart.submit(_best_grid_point, pickle.dumps((facts, cluster, limit)))
        result = search(facts, cluster, GBS, limit, 10.0, seed=0, workers=1, wall_stop=float("inf"))
        shape, mb, best = scan.result()
    problem = build_problem(facts, cluster, shape, mb, GBS)
    a, ev = next((a, ev) for point, a, ev in grid_points(problem, limit) if point == best)
    grid = score(Found(problem, a, ev, "grid", grid_point=best), cluster)
    return grid, result, limit


def test_llama13b_4k_on_a100_40gb_the_solver_is_never_worse_than_every_megatron_point(solved):
    grid, result, limit = solved
    # Megatron's best: tp=4 x pp=2 with sp, 2 of every stage's 20 blocks fully recomputed (10 before
    # sequence parallelism saved the sequence shard rather than the gathered copy, as Megatron does).
    assert grid.grid_point.plan_string(GBS).startswith("dp=1,tp=4,pp=2,vpp=1,cp=1,sp=1,mb=1,")
    assert grid.grid_point.recompute_layers == 2
    assert result.grid.step_time_s == pytest.approx(grid.step_time_s, rel=1e-9)
    assert result.best.estimate.memory_per_device_bytes <= limit
    assert grid.estimate.step_time_s / result.best.estimate.step_time_s >= 1.0 - 1e-9


def test_llama13b_4k_on_a100_40gb_beats_every_megatron_point(solved):
    # Megatron recomputes alike on both stages (2 of 20 blocks each, 16.01 s); 1F1B's last stage
    # holds one micro-batch in flight where the first holds two, so the solver's plan (the local
    # search after CP-SAT, `shardc.search.refine`) recomputes 2 blocks on the first stage and 1 on
    # the last (it holds every micro-batch's logits, 4.2 GiB of torch's output buffers, so not 0),
    # 15.73 s: 1.0176x by the estimate. The ceiling on this shape is recomputing nothing (15.44 s,
    # 1.037x, but 37.3 GiB on the first stage): 1.05x is out of reach in this cost model, and no other shape comes close
    # (tp=8 at mb=8, the next best, 17.0 s).
    grid, result, limit = solved
    best = result.best
    assert best.source == "solver" and best.estimate.memory_per_device_bytes <= limit
    assert grid.estimate.step_time_s / best.estimate.step_time_s >= 1.015
    assert (best.problem.shape, best.problem.mb) == (grid.problem.shape, grid.problem.mb)
    recomputed = [row[1] + row[2] for row in best.assignment.stages]
    assert recomputed[-1] < recomputed[0] and sum(recomputed) < grid.grid_point.recompute_layers * 2
