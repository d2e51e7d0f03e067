"""One model: the solver's own evaluation of a plan equals `shardc.cost.estimate` on the graph
annotated with that plan (within 1% in step time and memory), for the uniform grid plans of a
traced GPT, a traced Llama and a synthetic Llama-7B, and for non-uniform plans with rotating
and chunked partitions, mixed recomputation and ZeRO-3; the CP-SAT linearisation stays close."""

from __future__ import annotations

import dataclasses

import pytest
from traced import PRESETS, transformer_graph

from shardc.cost import estimate
from shardc.driver import load
from shardc.hardware import parse_cluster
from shardc.plan.parallel import plan_of
from shardc.search.evaluate import Assignment, evaluate
from shardc.search.grid import grid_assignments, layouts
from shardc.search.linear import coefficients
from shardc.search.objective import objective
from shardc.search.planfile import annotate_graph
from shardc.search.problem import MeshShape, PricingCache, build_problem, graph_facts, pricing_shape


def _agree(graph, problem, a, cluster, linear_tol: float | None = 0.03) -> None:
    ev = evaluate(problem, a, float("inf"))
    est = estimate(annotate_graph(graph, problem, a), cluster)
    assert ev.step_time_s == pytest.approx(est.step_time_s, rel=0.01)
    assert ev.memory_per_device_bytes == pytest.approx(est.memory_per_device_bytes, rel=0.01)
    for mine, theirs in zip(ev.stages, est.stages):
        assert mine.memory_bytes == pytest.approx(theirs.memory_bytes, rel=0.01)
    if linear_tol is not None:
        lin = objective(problem, a.choice, a.stages, a.zero)
        assert lin.step_time_s == pytest.approx(est.step_time_s, rel=linear_tol)


def test_grid_plans_of_a_synthetic_llama_7b_evaluate_as_estimated():
    graph = transformer_graph(dataclasses.replace(PRESETS["llama_7b"], seq=2048))
    cluster = parse_cluster("8xH100")
    facts = graph_facts(graph, cluster)
    for shape, mb in ((MeshShape(1, 8, 1, 1), 1), (MeshShape(2, 1, 1, 4), 2), (MeshShape(4, 2, 1, 1), 1)):
        problem = build_problem(facts, cluster, shape, mb, 64)
        points = grid_assignments(problem)
        assert len(points) == (12 if shape.tp > 1 else 6)  # recompute x ZeRO (x sp with tp > 1)
        for _, a in points:
            _agree(graph, problem, a, cluster)
    # The estimate reads the plan it scores from the graph, as `shardc estimate` prints it.
    assert str(plan_of(graph)).startswith("dp=2,tp=1,pp=4,vpp=1,cp=1,sp=0,mb=1,gbs=64")


@pytest.mark.parametrize("spec", [
    "examples/gpt.py:tiny?n_layer=4&n_embd=256&n_head=8&seq=128&dropout=0.1",
    "examples/llama.py:tiny?n_layer=4&dim=256&n_head=8&n_kv_head=4&ffn_hidden=512&seq=128",
], ids=["gpt", "llama"])
def test_grid_plans_of_traced_models_evaluate_as_estimated(spec):
    graph = load(spec, batch=2)
    cluster = parse_cluster("8xA100-80GB")
    # Eager prices (compile=0): under the fused prices of the GPU default, dp=8's step is mostly
    # gradient sync and the linearisation is 3.3% off (tests/test_compiled.py checks the rest).
    facts = graph_facts(graph, cluster, compiled=False)
    for shape in (MeshShape(1, 2, 1, 4), MeshShape(2, 2, 1, 2), MeshShape(4, 2, 1, 1), MeshShape(1, 8, 1, 1)):
        problem = build_problem(facts, cluster, shape, 2, 32)
        for _, a in grid_assignments(problem):
            _agree(graph, problem, a, cluster)


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_non_uniform_plans_with_temporal_partitions_evaluate_as_estimated(style):
    # Rotating (PrimePar, ring attention), chunked and sequence-parallel partitions, per-stage
    # recomputation and ZeRO-3: `estimate` scores the annotated IR node by node.
    dims = dataclasses.replace(PRESETS["tiny"], seq=64, layers=4, style=style, kv_heads=2 if style == "llama" else None)
    graph = transformer_graph(dims)
    cluster = parse_cluster("8xH100")
    facts = graph_facts(graph, cluster)
    for shape in (MeshShape(2, 1, 2, 2), MeshShape(1, 2, 1, 4)):
        problem = build_problem(facts, cluster, shape, 2, 16)
        stages = ((1, 1, 0), (0, 0, 2)) if shape.pp == 2 else ((1, 2, 1),)
        for pick in ("rotate", "time", "->{", "tp:S"):
            choice = tuple(next((i for i, c in enumerate(v.cands) if pick in c.label), 0) for v in problem.groups)
            for zero in (0, 3):
                _agree(graph, problem, Assignment(choice, stages, zero), cluster, linear_tol=None)
                if pick in ("rotate", "time"):
                    assert "; time " in str(graph) and (pick != "rotate" or " rotate " in str(graph))


def test_shapes_with_one_pricing_key_share_candidates_and_prices():
    # The pp degree beyond pipelining or not and the dp size do not change a candidate's price
    # (`pricing_shape`): the search prices each (pp > 1, dp > 1, cp, tp, micro-batch) once;
    # per-shape terms (sends, sync) stay per shape. Pipelining itself does: the pipelined head and
    # loss run unfused (session 9: priced fused, a plan chunked them and ran them unfused).
    graph = transformer_graph(dataclasses.replace(PRESETS["tiny"], layers=4, seq=64))
    cluster = parse_cluster("32xH100")
    facts = graph_facts(graph, cluster)
    cache: PricingCache = {}
    a = build_problem(facts, cluster, MeshShape(2, 4, 1, 4), 2, 32, cache=cache)
    b = build_problem(facts, cluster, MeshShape(4, 2, 1, 4), 2, 32, cache=cache)
    fresh = build_problem(facts, cluster, MeshShape(4, 2, 1, 4), 2, 32)
    assert len(cache) == 1 and a.groups is b.groups and pricing_shape(facts, b.shape) == MeshShape(2, 2, 1, 4)
    c = build_problem(facts, cluster, MeshShape(1, 8, 1, 4), 2, 32, cache=cache)
    assert len(cache) == 2 and pricing_shape(facts, MeshShape(1, 8, 1, 4)) == MeshShape(1, 2, 1, 4)
    assert coefficients(b).cand == coefficients(fresh).cand
    assert coefficients(a).send != coefficients(c).send  # pipeline sends are the shape's own
    for _, plan in grid_assignments(b):
        assert evaluate(b, plan, float("inf")).step_time_s == pytest.approx(
            evaluate(fresh, plan, float("inf")).step_time_s, rel=1e-9)


def test_linearised_memory_follows_the_zero_runtime():
    # The CP-SAT model's memory is `estimate`'s for every ZeRO stage: DDP's flat gradient copy at
    # ZeRO-0, FSDP2 on the whole module above (states all sharded, the weights gathered), and
    # torch pipelining's send and receive buffers (blocks kept or selectively recomputed; under
    # full recomputation the peak moves into backward, where the linearisation is looser).
    graph = transformer_graph(dataclasses.replace(PRESETS["llama_7b"], seq=2048, layers=8))
    cluster = parse_cluster("8xA100-40GB")
    facts = graph_facts(graph, cluster)
    for shape in (MeshShape(2, 2, 1, 2), MeshShape(1, 4, 1, 2)):
        problem = build_problem(facts, cluster, shape, 1, 64)
        for _, plan in grid_assignments(problem)[:4:2]:
            for zero in (0, 1, 2, 3):
                a = Assignment(plan.choice, plan.stages, zero)
                lin = objective(problem, a.choice, a.stages, zero)
                ev = evaluate(problem, a, float("inf"))
                for mine, theirs in zip(lin.memory_bytes, ev.memory_bytes):
                    assert mine == pytest.approx(theirs, rel=0.02)
                assert lin.step_time_s == pytest.approx(ev.step_time_s, rel=0.01)


def test_linearised_memory_counts_no_gathered_copy_for_column_parallel_readers():
    # Sequence parallelism gathers the norm's output for wq, wk, wv (and w1, w3); the backend runs
    # them through one `gather_linears`, which saves the sequence shard, not a gathered copy per
    # reader (Megatron). The CP-SAT model once added a copy per later reader (3 GiB over `evaluate`
    # here once the shard was saved), then still counted the first reader's gathered view (+3.7%
    # here; +2.5 GiB on the 13B memory-tight case's first stage, where it made Megatron's own plan
    # look overfull to CP-SAT); the value now counts at its producer's layout (`linear._edge_root`).
    # What was left then was 0.2% under `evaluate` (its backward working peak, 197 against the largest
    # transient's 125 MiB, and the rope tables). Re-applied after the session's merges it is 1.3%
    # under (5.768 against 5.846 GB; +2.5% without `_edge_root`): `evaluate` grew 1.1% more than the
    # linearisation since. Isolated in session 8 (1.9% under at main 3e4914e: 5.834 against 5.945 GB):
    # the loss's working memory. Session 7's rules have `evaluate` hold the loss's fp32 logits and,
    # in backward, their gradient beside the compute-dtype one (`cost.op_memory.loss_extra`: 239 MB
    # of working memory here), where the linearisation takes the largest node transient (the head's
    # 66 MB logits shard). On GPT-2 XL at dp=4 x tp=2 under DDP it is 0.77 GiB (working 1.53 against
    # 0.77 GiB), so CP-SAT's DDP plan there evaluates at 37.37 GiB against 36.5 usable and is re-solved.
    # Not fixed: adding it to the suffix's rows moves CP-SAT's plans near every tuned closed-loop limit.
    # A solved plan that overflows by evaluation is solved
    # again below its overshoot (`outer.search`), and no plan is returned that does not fit by the
    # estimate.
    graph = transformer_graph(dataclasses.replace(PRESETS["llama_7b"], seq=4096, layers=4))
    cluster = parse_cluster("4xA100-40GB")
    problem = build_problem(graph_facts(graph, cluster), cluster, MeshShape(1, 1, 1, 4), 1, 64)
    choice = layouts(problem)[1][1]  # Megatron's layout with sp
    assert "partition<tp:k> ->{tp:S(1)}" in {v.cands[c].label for v, c in zip(problem.groups, choice)}
    lin = objective(problem, choice, ((4, 0, 0),), 0).memory_bytes[0]
    ev = evaluate(problem, Assignment(choice, ((4, 0, 0),), 0), float("inf")).memory_bytes[0]
    copies = 4 * 3 * 4096 * 4096 * 2  # per block, three readers' gathered copies beyond the first (32 MiB each)
    assert 0.98 * ev <= lin < ev + copies
    assert lin == pytest.approx(ev, rel=0.02)
    mixed = objective(problem, choice, ((2, 0, 2),), 0)
    assert mixed.memory_bytes[0] >= evaluate(problem, Assignment(choice, ((2, 0, 2),), 0), float("inf")).memory_bytes[0]


def test_estimate_agrees_when_a_model_axis_cuts_the_batch() -> None:
    """A solver plan may split the batch input on tp (`tp:d0`, `tp:e0`): each device then holds
    mb / tp sequences. `estimate` used to scale every batched tensor by tp again (33 ms vs the
    solver's 9.9 ms here)."""
    from test_primepar2d import wide_mlp

    from shardc.search.outer import Found, score

    cluster = parse_cluster("4xA100-40GB")
    problem = build_problem(graph_facts(wide_mlp(), cluster), cluster, MeshShape(1, 1, 1, 4, 1), 8, 8,  # type: ignore[arg-type]
                            rotate=False)
    base = next(a for _, a in grid_assignments(problem))
    batch_on_tp = ("partition<tp:d0>", "partition<tp:e0>")
    choice = tuple(next((i for i, c in enumerate(g.cands) if c.label in batch_on_tp), k)
                   for g, k in zip(problem.groups, base.choice))
    assert [problem.groups[i].cands[k].label for i, k in enumerate(choice)] == [
        "partition<tp:d0>", "partition<tp:e0>", "partition<tp:e0>"]
    assignment = dataclasses.replace(base, choice=type(base.choice)(choice))
    evaluation = evaluate(problem, assignment, 1e12)
    found = score(Found(problem, assignment, evaluation, "solver"), cluster)
    assert found.step_time_s == pytest.approx(evaluation.step_time_s, rel=0.01)


def test_measured_sync_steps_are_priced_alike_by_the_linearisation() -> None:
    # A device whose profile measured the whole synchronising step under FSDP2 and DDP and the eager
    # optimizer (the local CPU processes): the CP-SAT coefficients charge them as `estimate` does,
    # flat and pipelined, ZeRO-0 (DDP), 1 and 3 (FSDP2).
    from shardc.calibration.profile import EagerCosts, KernelFit
    from shardc.hardware import Cluster, DeviceSpec

    eager = EagerCosts((("elementwise", KernelFit(3e-6, 3e-11, 8e-6, 1e-11)),), 50e-6, 4e-9, 200e-6, 6e-9,
                       20e-6, 5e-9, (("fsdp2", 2, 4e-3, 100e-6, 10e-9), ("fsdp2", 4, 6e-3, 150e-6, 20e-9),
                                     ("ddp", 2, 1e-3, 30e-6, 2e-9), ("ddp", 4, 2e-3, 40e-6, 3e-9)))
    base = parse_cluster("4xH100")
    cluster = dataclasses.replace(base, device=DeviceSpec("cpu", (("fp32", 1e11), ("bf16", 2e11)), 8 << 30, 5e9, eager=eager))
    assert isinstance(cluster, Cluster)
    graph = load("examples/llama.py:tiny?n_layer=4&dim=256&n_head=8&n_kv_head=4&ffn_hidden=512&seq=128", batch=2)
    facts = graph_facts(graph, cluster)
    for shape, mb in ((MeshShape(2, 2, 1, 1), 1), (MeshShape(1, 4, 1, 1), 2)):
        problem = build_problem(facts, cluster, shape, mb, 16)
        for _, plan in grid_assignments(problem)[:2]:
            for zero in (0, 1, 3):
                a = Assignment(plan.choice, plan.stages, zero)
                # ZeRO-3 in a pipeline gathers m more times per step: serial in the linearisation, on
                # the schedule's ops in the simulation (`cost.fsdp.pipeline_gathers`), where the
                # lighter stage's gathers hide in its waiting (here 3.2% of the step, 8 micro-batches)
                pipelined_zero3 = zero == 3 and shape.pp > 1
                _agree(graph, problem, a, cluster, linear_tol=0.05 if pipelined_zero3 else 0.005)
