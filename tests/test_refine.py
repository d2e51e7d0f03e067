"""The local search after CP-SAT (`shardc.search.refine`): from a grid point that recomputes alike
on every 1F1B stage, it cuts each stage's recomputation to what that stage's memory needs (the
last stage holds one micro-batch in flight, the first p of them), scored by `evaluate`; its
moves never empty a stage; it is bounded by a count of evaluations."""

from __future__ import annotations

import dataclasses

import pytest
from traced import PRESETS, transformer_graph

from shardc.hardware import parse_cluster
from shardc.search.evaluate import Assignment, balanced_stages, evaluate
from shardc.search.grid import layouts
from shardc.search.problem import MeshShape, build_problem, graph_facts
from shardc.search.refine import _Budget, least_recompute, moves, refine

CLUSTER = "4x1xA100-40GB"  # one-device nodes: a pipeline without intra-stage axes


@pytest.fixture(scope="module")
def pipeline():
    """A 4-stage 1F1B problem of 8 blocks (long sequence, small vocabulary: activations dominate),
    its Megatron vector, and the uniform points with nothing and everything fully recomputed."""
    g = transformer_graph(dataclasses.replace(PRESETS["tiny"], layers=8, hidden=256, heads=4, seq=1024, vocab=512))
    c = parse_cluster(CLUSTER)
    problem = build_problem(graph_facts(g, c), c, MeshShape(4, 1, 1, 1), 1, 8)
    vec = layouts(problem)[0][1]
    none = Assignment(vec, balanced_stages(8, 4, "none"), 0)
    full = Assignment(vec, balanced_stages(8, 4, "full"), 0)
    return problem, none, full


def test_moves_keep_every_stage_a_block_and_recompute_more_only_when_over():
    rows = ((1, 0, 1), (2, 0, 0))
    fitting, over = moves(rows, True), moves(rows, False)
    assert all(min(sum(r) for r in m) >= 1 and sum(map(sum, m)) == 4 for m in fitting + over)
    assert ((0, 0, 2), (2, 0, 0)) in over and ((0, 0, 2), (2, 0, 0)) not in fitting
    assert ((2, 0, 0), (2, 0, 0)) in fitting  # less recomputation is always a move
    assert ((0, 0, 1), (2, 0, 1)) in fitting  # the one-block stage gives its none block away...
    assert ((1, 0, 0), (1, 0, 2)) in fitting  # ...or its full one, the receiver recomputing one more in full
    assert all(m != rows for m in fitting + over)


def test_each_stage_recomputes_only_what_its_memory_needs(pipeline):
    problem, none, full = pipeline
    plain, redone = evaluate(problem, none, float("inf")), evaluate(problem, full, float("inf"))
    first, last = plain.stages[0].memory_bytes, plain.stages[-1].memory_bytes
    assert first > last  # 1F1B: the first stage holds 4 micro-batches in flight, the last one
    # A limit every stage meets recomputing all its blocks, and the last meets recomputing none:
    # Megatron's uniform choice recomputes everywhere, this search only where memory needs it.
    limit = max(max(redone.memory_bytes), last)
    assert limit < first
    uniform = evaluate(problem, full, limit)
    assert uniform.fits
    lean = least_recompute(problem, full, limit, _Budget(100, float("inf")))
    assert lean.stages[-1] == (2, 0, 0) and lean.stages[0][2] >= 1
    assert evaluate(problem, lean, limit).fits
    got = refine([(problem, full, uniform)], limit, 200)
    assert len(got) == 1
    _, a, ev = got[0]
    assert ev.fits and ev.step_time_s < uniform.step_time_s
    assert sum(a.stages[-1][1:]) < 2  # the last stage recomputes less than Megatron's uniform plan
    assert ev.step_time_s == evaluate(problem, a, limit).step_time_s


def test_bounded_by_its_evaluations(pipeline, monkeypatch):
    problem, _, full = pipeline
    ev = evaluate(problem, full, float("inf"))
    limit = ev.memory_per_device_bytes
    assert refine([(problem, full, ev)], limit, 0) == []
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr("shardc.search.refine.evaluate", counted)
    refine([(problem, full, ev)], limit, 7)
    assert 0 < len(calls) <= 7
