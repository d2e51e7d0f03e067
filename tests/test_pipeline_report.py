"""What `shardc plan` and `shardc estimate --plot` show of a pipeline: the schedule's timeline as
the estimate simulated it (every op once, the bubble where 1F1B's formula puts it), the plot
drawn from it, and per stage its time, memory and why its boundaries fell where they did."""

from __future__ import annotations

import dataclasses

import pytest
from traced import PRESETS, transformer_graph

from shardc.cost import estimate
from shardc.cost.report import plot, timeline
from shardc.hardware import parse_cluster
from shardc.search.evaluate import Assignment, balanced_stages, evaluate
from shardc.search.grid import layouts
from shardc.search.outer import Found, score
from shardc.search.planfile import annotate_graph
from shardc.search.problem import MeshShape, build_problem, graph_facts
from shardc.search.report import boundary_reasons, stage_rows
from shardc.search.schedules import rebalance

CLUSTER = "4x1xA100-40GB"


def _found(schedule: str = "", vpp: int = 1, rebalanced: bool = True) -> Found:
    g = transformer_graph(dataclasses.replace(PRESETS["tiny"], layers=8, hidden=256, heads=4, seq=256, vocab=32768))
    c = parse_cluster(CLUSTER)
    p = build_problem(graph_facts(g, c), c, MeshShape(4, 1, 1, 1, vpp=vpp, schedule=schedule), 4, 16)
    a = Assignment(layouts(p)[0][1], balanced_stages(8, 4 * vpp, "none"), 0)
    a, ev = rebalance(p, a, 80e9) if rebalanced else (a, evaluate(p, a, 80e9))
    return score(Found(p, a, ev, "solver"), c)


def test_timeline_runs_every_op_once_and_1f1b_idles_as_its_formula_says():
    f = _found(rebalanced=False)
    events = timeline(f.estimate)
    assert sorted((k, j, s) for _, k, j, s, _, _ in events) == sorted(
        (k, j, s) for k in "FB" for j in range(4) for s in range(4))
    assert all(d == s for d, _, _, s, _, _ in events)  # 1F1B: stage s on device s
    zb = timeline(_found("zbv", 2, rebalanced=False).estimate)
    assert sorted(k for _, k, _, _, _, _ in zb) == sorted("FIW" * 4 * 8)  # backward split into I and W
    # The balanced 1F1B idle share is (p-1)/(m+p-1); the head and loss make this one unequal,
    # so the busiest device idles less than that and the others more.
    end = max(e[5] for e in events)
    busy = [sum(e[5] - e[4] for e in events if e[0] == d) for d in range(4)]
    assert min(1 - b / end for b in busy) < 3 / 7 < max(1 - b / end for b in busy)


def test_plot_draws_the_timeline_beside_the_stages(tmp_path):
    out = tmp_path / "zbv.png"
    plot(_found("zbv", 2, rebalanced=False).estimate, str(out))
    assert out.stat().st_size > 20_000  # three panels at 110 dpi


def test_plan_report_says_why_the_boundaries_fell_where_they_did():
    f = _found()
    rows = stage_rows(f)
    assert [r["blocks"] for r in rows] == [3, 2, 2, 1] and rows[-1]["holds"] == ["the head and loss"]
    assert rows[0]["holds"] == ["the embedding"] and rows[0]["in_flight"] == 4
    assert sum(r["fwd_s"] + r["bwd_s"] for r in rows) == pytest.approx(
        sum(sum(r) for r in zip(f.estimate.pipeline.fwd, f.estimate.pipeline.bwd)))
    reasons = boundary_reasons(f)
    assert any(line.startswith("stage 3 (device 3) holds the head and loss: 1 blocks vs 2 (even split)")
               for line in reasons), reasons
    assert any(line.startswith("stage 0 (device 0) takes the blocks others gave up: 3 vs 2") for line in reasons)
    annotate_graph(f.problem.facts.graph, f.problem, f.assignment)  # the estimate of the same plan agrees
    assert estimate(f.problem.facts.graph, parse_cluster(CLUSTER)).step_time_s == pytest.approx(f.step_time_s)
