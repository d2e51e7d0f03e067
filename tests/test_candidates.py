"""Candidate enumeration: groups, spatial/rotating/ring/vocab partitions, printed IR of a plan."""

from __future__ import annotations

import dataclasses

from traced import PRESETS, transformer_graph

from shardc.analysis.groups import build_groups
from shardc.analysis.roles import dim_roles
from shardc.hardware import parse_cluster
from shardc.ir import Graph, Layer, Location, Mesh, Node, Partition, TensorType, Value
from shardc.search.candidates import Shapes, enumerate_group
from shardc.search.evaluate import Assignment
from shardc.search.planfile import annotate_graph
from shardc.search.problem import MeshShape, build_problem, graph_facts


def mlp_graph(layers: int = 1, opaque: bool = False) -> Graph:
    """x[4,8,16] -> (linear 32, gelu, linear 16, add) per block."""
    g = Graph("mlp")
    x = Value("x", TensorType((4, 8, 16), "bf16"), "input")
    g.inputs.append(x)
    for i in range(layers):
        name = f"blocks.{i}"
        g.layers[name] = Layer(name, "block")
        w1 = Value(f"{name}.fc1.weight", TensorType((32, 16), "bf16"), "parameter", requires_grad=True)
        w2 = Value(f"{name}.fc2.weight", TensorType((16, 32), "bf16"), "parameter", requires_grad=True)
        g.params += [w1, w2]
        h = Value(f"h{i}", TensorType((4, 8, 32), "bf16"))
        a = Value(f"a{i}", TensorType((4, 8, 32), "bf16"))
        y = Value(f"y{i}", TensorType((4, 8, 16), "bf16"))
        z = Value(f"z{i}", TensorType((4, 8, 16), "bf16"))
        g.nodes += [Node("linear", [x, w1], [h], location=Location(f"{name}.fc1"), layer=name),
                    Node("mystery" if opaque else "gelu", [h], [a], location=Location(f"{name}.act"), layer=name),
                    Node("linear", [a, w2], [y], location=Location(f"{name}.fc2"), layer=name),
                    Node("add", [x, y], [z], location=Location(name), layer=name)]
        x = z
    g.outputs.append(x)
    return g


def labels(graph: Graph, mesh: Mesh, group: int = 0) -> list[str]:
    groups = build_groups(graph)
    return [c.label for c in enumerate_group(groups[group], mesh, Shapes(dim_roles(graph)))]


def test_groups_merge_elementwise_and_views():
    g = transformer_graph(dataclasses.replace(PRESETS["tiny"], style="llama", kv_heads=2))
    ops = [[n.op for n in gr.members] for gr in build_groups(g) if gr.layer == "blocks.0"]
    assert ops[1][:3] == ["linear", "reshape", "permute"]
    assert ["linear", "add"] in ops and ["linear", "silu"] in ops and ["linear", "mul"] in ops
    assert ops[4] == ["scaled_dot_product_attention", "permute", "reshape"]


def test_linear_spatial_and_rotating_candidates():
    got = labels(mlp_graph(), Mesh((("tp", 2),)))
    assert got[0] == "partition<>" and "partition<tp:e0>" in got
    assert "partition<; time e1/4>" in got  # sequence chunks of an expanding matmul
    # Megatron's column split, the row split with its all_reduce, and PrimePar's rotation.
    assert "partition<tp:n>" in got
    assert "partition<tp:n; time k/2 rotate tp>" in got
    assert "partition<tp:e1; time k/2 rotate tp>" in got
    row = labels(mlp_graph(), Mesh((("tp", 2),)), group=1)
    assert "partition<tp:k> ->{}" in row and "partition<tp:k> ->{tp:S(1)}" in row


def test_data_axis_always_splits_batch():
    got = labels(mlp_graph(), Mesh((("dp", 2), ("tp", 2))))
    assert all("dp:e0" in label for label in got)


def test_ring_attention_and_vocab_parallel_loss():
    g = transformer_graph(dataclasses.replace(PRESETS["tiny"], seq=64, style="llama", kv_heads=2))
    groups = build_groups(g)
    roles = dim_roles(g)
    mesh = Mesh((("cp", 2), ("tp", 2)))
    attn = next(gr for gr in groups if gr.anchor.op == "scaled_dot_product_attention")
    got = [c.label for c in enumerate_group(attn, mesh, Shapes(roles))]
    assert "partition<cp:s; time t/2 rotate cp>" in got
    assert not any("cp:t" in label or "tp:t" in label for label in got)  # t splits only by its ring rule
    # Priced by the cost model: the vocab-parallel loss all-reduces its row max and sum over tp,
    # the ring attention's rotation runs over cp.
    cluster = parse_cluster("8xH100")
    problem = build_problem(graph_facts(g, cluster), cluster, MeshShape(1, 1, 2, 2), 2, 8)
    # the loss follows the LM head in its group (`build_groups`): vocab-parallel where the head splits n
    loss = next(v for v in problem.groups if v.group.members[-1].op == "cross_entropy")
    vocab = [cost for c, cost in zip(loss.cands, loss.costs) if ("tp", "v") in (c.partitions[-1] or Partition()).spatial]
    assert vocab and all(cost.terms.fwd.get("tp_comm", 0.0) > 0 for cost in vocab)
    assert all(any(s.kind == "all_reduce" and s.axis == "tp" for _, s in cost.terms.collectives) for cost in vocab)
    attn = next(v for v in problem.groups if v.group.anchor.op == "scaled_dot_product_attention")
    ring = [cost for c, cost in zip(attn.cands, attn.costs) if "rotate cp" in c.label]
    assert ring and all(any(s.kind == "rotate" for _, s in cost.terms.collectives) for cost in ring)


def test_op_without_rule_is_replicated():
    g = mlp_graph(opaque=True)
    groups = build_groups(g)
    opaque = next(gr for gr in groups if gr.anchor.op == "mystery")
    cands = enumerate_group(opaque, Mesh((("tp", 2),)), Shapes(dim_roles(g)))
    assert [c.label for c in cands] == ["replicated"]


EXPECTED_IR = """\
graph @mlp mesh<pp=1, dp=1, cp=1, tp=2> [plan="dp=1,tp=2,pp=1,vpp=1,cp=1,sp=0,mb=4,gbs=4,schedule=1f1b,\
recompute=none,zero=1,dtype=bf16", microbatch_size=4, microbatches=1, global_batch=4, traced_batch=4, \
schedule="1f1b", virtual_stages=1, dtype="bf16"] {
  input %x : bf16[4,8,16]{}
  param %blocks.0.fc1.weight : bf16[32,16]{tp:S(0)}
  param %blocks.0.fc2.weight : bf16[16,32]{tp:S(1)}
  layer blocks.0 block=block stage=0 recompute=none zero=1
  %h0 = linear(%x, %blocks.0.fc1.weight) : bf16[4,8,32]{tp:S(2)} partition<tp:n> layer=blocks.0 @blocks.0.fc1
  %a0 = gelu(%h0) : bf16[4,8,32]{tp:S(2)} partition<tp:d2> layer=blocks.0 @blocks.0.act
  %y0 = linear(%a0, %blocks.0.fc2.weight) : bf16[4,8,16]{} partition<tp:k> layer=blocks.0 @blocks.0.fc2
  %z0 = add(%x, %y0) : bf16[4,8,16]{} partition<> layer=blocks.0 @blocks.0
  return %z0
}
"""


def test_printed_ir_of_a_chosen_plan():
    g = mlp_graph()
    cluster = parse_cluster("2xH100")
    problem = build_problem(graph_facts(g, cluster), cluster, MeshShape(1, 1, 1, 2), 4, 4)
    choice = []
    for var, want in zip(problem.groups, ["partition<tp:n>", "partition<tp:k> ->{}"]):
        choice.append([c.label for c in var.cands].index(want))
    annotate_graph(g, problem, Assignment(tuple(choice), ((0, 0, 0),), 1))
    assert str(g) == EXPECTED_IR
