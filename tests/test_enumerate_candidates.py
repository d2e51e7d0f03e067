"""The enumerate-candidates pass hands its candidates to solve: the same plan, nothing enumerated twice."""

from __future__ import annotations

from collections import Counter

import pytest

import shardc.search.table as table_module
from shardc.driver import open_model, solve, solver_batch
from shardc.ir import Graph
from shardc.passmanager import PassContext, run_pipeline
from shardc.search.table import CandidateTable

SPEC = "examples/gpt.py:tiny"
CLUSTER = "2xA100-80GB"
GBS = 4
SOLVE = f"solve{{gbs={GBS},time-limit=2}}"


def _counted(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count `enumerate_group` calls by key (members, mesh, batch scale, rotate, chunk)."""
    calls: Counter = Counter()
    real = table_module.enumerate_group

    def counting(group, mesh, shapes, rotate=True, chunk=True):  # type: ignore[no-untyped-def]
        calls[(tuple(group.members), mesh, shapes.batch_scale, rotate, chunk)] += 1
        return real(group, mesh, shapes, rotate, chunk)

    monkeypatch.setattr(table_module, "enumerate_group", counting)
    return calls


def _solved(pipeline: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Graph, PassContext, Counter]:
    calls = _counted(monkeypatch)
    graph, ctx = solve(SPEC, CLUSTER, GBS, pipeline=pipeline)
    monkeypatch.undo()
    return graph, ctx, calls


def test_solve_uses_the_enumerated_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    # tp=2 at mb=2 and the one-device mesh at mb=1 are among the shapes the solver prices for
    # 2 devices and a global batch of 4.
    graph, ctx, calls = _solved(f"group-layers,enumerate-candidates{{tp=2,mb=2}},enumerate-candidates,{SOLVE}",
                                monkeypatch)
    alone, alone_ctx, alone_calls = _solved(f"group-layers,{SOLVE}", monkeypatch)
    for node in graph.nodes:  # the counts enumerate-candidates annotates
        node.annotations.pop("candidates", None)
        node.annotations.pop("replicated", None)
    assert str(graph) == str(alone)  # the same plan, written alike
    assert ctx.options["search"].best.step_time_s == alone_ctx.options["search"].best.step_time_s
    assert max(calls.values()) == 1  # nothing enumerated twice
    passes_ctx = PassContext()
    enumerated = run_pipeline(open_model(SPEC).trace(solver_batch(GBS)).graph,
                              "group-layers,enumerate-candidates{tp=2,mb=2},enumerate-candidates", passes_ctx)
    table = passes_ctx.options["candidates"]
    assert isinstance(table, CandidateTable) and table.fits(enumerated)
    # What the passes enumerated the solver did not enumerate again.
    assert sum(calls.values()) < sum(alone_calls.values()) + len(table.found)
    assert isinstance(alone_ctx.options["candidates"], CandidateTable)


def test_annotations_count_the_stored_candidates() -> None:
    ctx = PassContext()
    graph = run_pipeline(open_model(SPEC).trace(4).graph, "group-layers,enumerate-candidates{tp=2}", ctx)
    table = ctx.options["candidates"]
    counts = [n.annotations["candidates"] for n in graph.nodes if "candidates" in n.annotations]
    assert counts and sum(counts) == sum(len(c) for c in table.found.values())
    assert max(counts) > 1  # tp=2 splits something


def test_a_rewritten_graph_gets_a_fresh_table() -> None:
    ctx = PassContext()
    graph = run_pipeline(open_model(SPEC).trace(4).graph, "group-layers,enumerate-candidates", ctx)
    table = ctx.options["candidates"]
    other = open_model(SPEC).trace(4).graph
    assert table.fits(graph) and not table.fits(other)
