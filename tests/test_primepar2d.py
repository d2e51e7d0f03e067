"""PrimePar's 2-D primitive P(2 x 2): IR text, candidates, cost figures and gloo numerics.

The grid runs on two model axes of equal size (tp x tq); `partition<tp:M, tq:N; time k/2 rotate
(tp, tq)>` shards the input on (M, k) and the weight on (k, N) over the grid, moves both between
neighbours each step and accumulates the output locally: no collective, nothing replicated.
"""

from __future__ import annotations

import pytest
from test_backend_numerics import GPT, HF_GPT2, build, check, run_cases
from test_candidates import labels, mlp_graph

from shardc.backends.torch.launch import spawn
from shardc.cost.context import CostContext
from shardc.cost.layer import layer_terms
from shardc.hardware import parse_cluster
from shardc.ir import Mesh, Partition, TemporalSplit, TensorType
from shardc.ir.diagnostics import ShardcError
from shardc.ir.equality import assert_graphs_equal
from shardc.ir.parser import parse
from shardc.ops.registry import get_op
from shardc.ops.verifier import verify
from shardc.search.outer import mesh_shapes

GRID = Partition((("tp", "e1"), ("tq", "n")), (TemporalSplit("k", 2, "tp", "tq"),))

EXPECTED = """\
graph @mlp mesh<tp=2, tq=2> {
  input %x : bf16[4,8,16]
  param %blocks.0.fc1.weight : bf16[32,16]{tp:S(1), tq:S(0)}
  param %blocks.0.fc2.weight : bf16[16,32]{tp:S(1), tq:S(0)}
  layer blocks.0 block=block stage=none recompute=none zero=0
  %h0 = linear(%x, %blocks.0.fc1.weight) : bf16[4,8,32]{tp:S(1), tq:S(2)} partition<tp:e1, tq:n; time k/2 rotate (tp, tq)> layer=blocks.0 @blocks.0.fc1
  %a0 = gelu(%h0) : bf16[4,8,32]{tp:S(1), tq:S(2)} partition<tp:d1, tq:d2> layer=blocks.0 @blocks.0.act
  %y0 = linear(%a0, %blocks.0.fc2.weight) : bf16[4,8,16]{tp:S(1), tq:S(2)} partition<tp:e1, tq:n; time k/2 rotate (tp, tq)> layer=blocks.0 @blocks.0.fc2
  %z0 = add(%x, %y0) : bf16[4,8,16] layer=blocks.0 @blocks.0
  return %z0
}
"""


def grid_mlp():
    """The test MLP (x[4,8,16] -> fc1 32 -> gelu -> fc2 16 -> + x) with both linears on P(2x2)."""
    from shardc.ir import Layout, Shard

    g = mlp_graph()
    g.mesh = Mesh((("tp", 2), ("tq", 2)))
    fc1, act, fc2, _ = g.nodes
    fc1.partition = fc2.partition = GRID
    act.partition = Partition((("tp", "d1"), ("tq", "d2")))
    for w in g.params:
        w.layout = Layout((("tp", Shard(1)), ("tq", Shard(0))))
    for v in (fc1.output, act.output, fc2.output):
        v.layout = Layout((("tp", Shard(1)), ("tq", Shard(2))))
    return g


def test_grid_partition_prints_parses_and_verifies() -> None:
    g = grid_mlp()
    assert str(g) == EXPECTED
    assert_graphs_equal(parse(str(g)), g)
    verify(g)
    bad = EXPECTED.replace("mesh<tp=2, tq=2>", "mesh<tp=2, tq=4>").replace("tq:S(0)}", "tq:S(0)}", 1)
    with pytest.raises(ShardcError, match="grid split needs two mesh axes of equal size"):
        verify(parse(bad))


def test_grid_candidates_need_two_equal_model_axes() -> None:
    fc1 = labels(mlp_graph(), Mesh((("tp", 2), ("tq", 2))))
    assert "partition<tp:e1, tq:n; time k/2 rotate (tp, tq)>" in fc1
    assert "partition<tp:e0, tq:n; time k/2 rotate (tp, tq)>" in fc1
    assert "partition<tp:n, tq:n>" in fc1  # outside grids tq follows tp (one tp of 4)
    with_dp = labels(mlp_graph(), Mesh((("dp", 2), ("tp", 2), ("tq", 2))), group=1)
    assert "partition<dp:e0, tp:e1, tq:n; time k/2 rotate (tp, tq)>" in with_dp
    assert not any("(tp, tq)" in label for label in labels(mlp_graph(), Mesh((("tp", 4),))))
    assert not any("(tp, tq)" in label for label in labels(mlp_graph(), Mesh((("tp", 2), ("tq", 4)))))
    # The outer search offers a square tp as tp x tq when asked (`shardc plan --grid2d`).
    shapes = {str(s) for s in mesh_shapes(8, 8, 4, 8, 1024, grid2d=True)}
    assert "pp=1, dp=2, cp=1, tp=2, tq=2" in shapes and "pp=1, dp=2, cp=1, tp=4" in shapes
    assert not any("tq" in str(s) for s in mesh_shapes(8, 8, 4, 8, 1024))


def test_grid_cost_moves_operands_point_to_point_only() -> None:
    g = grid_mlp()
    ctx = CostContext.build(g, parse_cluster("4xA100-80GB"), "bf16")
    terms = layer_terms(ctx, g.nodes[:3])
    kinds = {(when, step.kind, step.axis) for when, step in terms.collectives}
    assert kinds == {("fwd", "rotate", "tp"), ("fwd", "rotate", "tq"), ("bwd", "rotate", "tp"),
                     ("bwd", "rotate", "tq")}  # no all_reduce, no all_gather: nothing replicated
    fwd = {}
    for when, step in terms.collectives:
        if when == "fwd":
            fwd[step.axis] = fwd.get(step.axis, 0) + step.nbytes
    # Per linear: the skew then one shift (2 moves) of the local input along tq and weight along tp.
    x, w1, a, w2 = 4 * 4 * 8 * 2, 16 * 8 * 2, 4 * 4 * 16 * 2, 8 * 16 * 2  # local bf16 bytes
    assert fwd == {"tq": 2 * (x + a), "tp": 2 * (w1 + w2)}
    bwd = sum(step.nbytes for when, step in terms.collectives if when == "bwd")
    assert bwd == 3 * (x + a + w1 + w2)  # operand + gradient once, then the gradients home
    # Local FLOPs are a quarter of the node's: two steps on (1/4 x 1/2 of k) blocks.
    gelu = get_op("gelu").count_flops([TensorType((4, 4, 16), "bf16")], [TensorType((4, 4, 16), "bf16")], {})
    assert terms.fwd_flops == pytest.approx(2 * 4 * 8 * 32 * 16 * 2 / 4 + gelu)
    # Saved: x as held (replicated: the layer's input), the fc1 output and gelu output at 1/4.
    assert terms.saved == pytest.approx(4 * 8 * 16 * 2 + a + a)


# The other orientation: tq splits the rows, tp the columns (the input moves along tp).
GRID_T = Partition((("tp", "n"), ("tq", "e1")), (TemporalSplit("k", 2, "tq", "tp"),))


def grid_edit(graph: object) -> None:
    """The GPT's MLP linears on P(2x2) over tp x tq (tq added to a tp=2 plan's mesh)."""
    _grid_mlp(graph, GRID, GRID)


def mixed_grid_edit(graph: object) -> None:
    """fc1 on P(2x2) with rows on tp, fc2 with rows on tq (an all_to_all between them)."""
    _grid_mlp(graph, GRID, GRID_T)


def conv1d_grid_edit(graph: object) -> None:
    """transformers GPT-2's MLP (Conv1D: `matmul` by a [k, n] weight) on P(2x2)."""
    graph.mesh = Mesh(graph.mesh.axes + (("tq", 2),))  # type: ignore[attr-defined]
    edited = 0
    for node in graph.nodes:  # type: ignore[attr-defined]
        if node.op == "matmul" and node.location.module_path.endswith((".mlp.c_fc", ".mlp.c_proj")):
            node.partition = Partition((("tp", "m"), ("tq", "n")), (TemporalSplit("k", 2, "tp", "tq"),))
            for v in node.inputs[1:]:
                v.layout = None
            edited += 1
    assert edited == 4, "the GPT-2 example no longer has two blocks of c_fc/c_proj"


def _grid_mlp(graph: object, fc1: Partition, fc2: Partition) -> None:
    graph.mesh = Mesh(graph.mesh.axes + (("tq", 2),))  # type: ignore[attr-defined]
    edited = 0
    for node in graph.nodes:  # type: ignore[attr-defined]
        path = node.location.module_path
        if node.op == "linear" and path.endswith((".mlp.fc1", ".mlp.fc2")):
            node.partition = fc1 if path.endswith("fc1") else fc2
            for v in node.inputs[1:]:
                v.layout = None  # held as the grid reads them
            edited += 1
        elif node.op == "gelu" and ".mlp" in path:
            node.partition = Partition((("tp", "d1"), ("tq", "d2")))
    assert edited == 4, "the GPT example no longer has two blocks of fc1/fc2"


def test_mlps_on_a_2x2_grid_train_like_one_process() -> None:
    import shardc

    model, inputs, names = build(GPT)
    compiled = shardc.compile(model, inputs, plan="tp=2,dtype=fp32", input_names=names, before_lower=grid_edit)
    text = str(compiled)
    assert "partition<tp:e1, tq:n; time k/2 rotate (tp, tq)>" in text
    assert "fc1.weight : f32[256,64]{tp:S(1), tq:S(0)}" in text
    code = compiled.code(0)  # type: ignore[attr-defined]
    assert "grid_contraction" in code and "skew_start" in code  # weights skewed at the layer's start
    mixed = shardc.compile(model, inputs, plan="tp=2,dtype=fp32", input_names=names, before_lower=mixed_grid_edit)
    assert "fc2.weight : f32[64,256]{tp:S(0), tq:S(1)}" in str(mixed)
    model, inputs, names = build(HF_GPT2)
    conv1d = shardc.compile(model, inputs, plan="tp=2,dtype=fp32", input_names=names, before_lower=conv1d_grid_edit)
    cases = [(GPT, compiled, ""), (GPT, mixed, ""), (HF_GPT2, conv1d, "")]
    results = spawn(run_cases, 4, cases, timeout_s=400)[0]
    for (spec, _, _), name, result in zip(cases, ("rows on tp", "fc2 rows on tq", "Conv1D matmuls"), results):
        assert not isinstance(result, str), result
        check(spec, f"tp=2 x tq=2 grid MLP, {name}", *result)


def wide_mlp(layers: int = 2, b: int = 8, s: int = 2048, h: int = 2048, f: int = 8192) -> object:
    """Residual MLP blocks (fc1 h->f, gelu, fc2 f->h, add) big enough to be compute-bound."""
    from shardc.ir import Graph, Layer, Location, Node, Value

    g = Graph("wide_mlp")
    x = Value("x", TensorType((b, s, h), "bf16"), "input")
    scale = Value("scale", TensorType((h,), "bf16"), "parameter", requires_grad=True)
    scaled = Value("scaled", TensorType((b, s, h), "bf16"))
    g.inputs.append(x)
    g.params.append(scale)
    g.layers["scale"] = Layer("scale", "scale")  # a trainable prefix: every block's input needs a gradient
    g.nodes.append(Node("mul", [x, scale], [scaled], location=Location("scale"), layer="scale"))
    x = scaled
    for i in range(layers):
        name = f"blocks.{i}"
        g.layers[name] = Layer(name, "block")
        w1 = Value(f"{name}.fc1.weight", TensorType((f, h), "bf16"), "parameter", requires_grad=True)
        w2 = Value(f"{name}.fc2.weight", TensorType((h, f), "bf16"), "parameter", requires_grad=True)
        g.params += [w1, w2]
        hid, act = Value(f"h{i}", TensorType((b, s, f), "bf16")), Value(f"a{i}", TensorType((b, s, f), "bf16"))
        y, z = Value(f"y{i}", TensorType((b, s, h), "bf16")), Value(f"z{i}", TensorType((b, s, h), "bf16"))
        g.nodes += [Node("linear", [x, w1], [hid], location=Location(f"{name}.fc1"), layer=name),
                    Node("gelu", [hid], [act], location=Location(f"{name}.act"), layer=name),
                    Node("linear", [act, w2], [y], location=Location(f"{name}.fc2"), layer=name),
                    Node("add", [x, y], [z], location=Location(name), layer=name)]
        x = z
    g.outputs.append(x)
    return g


def test_solver_picks_the_grid_on_a_tp_x_tq_mesh_because_it_is_faster() -> None:
    """On a tp x tq mesh at 1.2 GB per device (the replicated-weight plans do not fit), the solver
    puts both MLP linears on P(2x2), and its plan beats the best one without grids (the same
    space with rotate=False) by the solver's evaluation and by `shardc.cost.estimate`."""
    from shardc.search.cpsat import solve
    from shardc.search.evaluate import evaluate
    from shardc.search.grid import grid_assignments
    from shardc.search.outer import Found, score
    from shardc.search.problem import MeshShape, build_problem, graph_facts

    cluster, limit = parse_cluster("4xA100-40GB"), 1.2e9
    facts = graph_facts(wide_mlp(), cluster)  # type: ignore[arg-type]
    results = {}
    for grids in (True, False):  # rotate=False: the same space without grids (the ablation)
        problem = build_problem(facts, cluster, MeshShape(1, 1, 1, 2, 2), 8, 8, rotate=grids)
        hint = min((a for _, a in grid_assignments(problem)), key=lambda a: evaluate(problem, a, limit).step_time_s)
        result = solve(problem, limit, 2.0, 0, 1, hint)
        assert result.assignment is not None
        found = score(Found(problem, result.assignment, evaluate(problem, result.assignment, limit), "solver"), cluster)
        assert found.evaluation.step_time_s == pytest.approx(found.step_time_s, rel=0.01)  # solver == estimate
        labels = [v.cands[k].label for v, k in zip(problem.groups, result.assignment.choice)]
        results[grids] = (found.step_time_s, found.evaluation.step_time_s, labels)
    (with_estimate, with_evaluation, labels), (without_estimate, without_evaluation, _) = results[True], results[False]
    assert sum("time k/2 rotate (" in label for label in labels) == 2, labels  # fc1 and fc2 on P(2x2)
    assert with_estimate < 0.99 * without_estimate and with_evaluation < 0.99 * without_evaluation
