"""The verifier: each broken invariant is reported by a message that names it."""

from __future__ import annotations

import pytest

from shardc.ir import Layout, Shard, TensorType, Value
from shardc.ir.diagnostics import VerificationError
from shardc.ir.parser import parse
from shardc.ops.verifier import verify

BASE = """\
graph @g mesh<dp=2, tp=2> {
  input %x : f32[8,16,32]{dp:S(0)}
  param %w1 : f32[64,32]{tp:S(0)}
  param %w2 : f32[32,64]{tp:S(1)}
  layer blocks.0 block=block0 stage=none
  %h = linear(%x, %w1) : f32[8,16,64]{dp:S(0), tp:S(2)} partition<dp:e0, tp:n> layer=blocks.0 @blocks.0.fc1
  %a = gelu(%h) : f32[8,16,64]{dp:S(0), tp:S(2)} partition<dp:d0, tp:d2> layer=blocks.0 @blocks.0.act
  %y = linear(%a, %w2) : f32[8,16,32]{dp:S(0), tp:P(sum)} partition<dp:e0, tp:k> layer=blocks.0 @blocks.0.fc2
  %z = all_reduce[axis="tp", op="sum"](%y) : f32[8,16,32]{dp:S(0)} layer=blocks.0 @blocks.0
  %p0, %p1 = split[sizes=(16, 16), dim=2](%z) : f32[8,16,16], f32[8,16,16] layer=blocks.0 @blocks.0
  return %p0
}
"""


def failure(text: str, **options: bool) -> str:
    graph = parse(text)
    with pytest.raises(VerificationError) as info:
        verify(graph, **options)
    return str(info.value)


def test_base_graph_verifies() -> None:
    verify(parse(BASE))


@pytest.mark.parametrize(("old", "new", "message"), [
    ("%a = gelu", "%a = geluu", "unknown op 'geluu'"),
    ("f32[8,16,64]{dp:S(0), tp:S(2)} partition<dp:d0", "f32[8,16,32]{dp:S(0), tp:S(2)} partition<dp:d0",
     "output 0 %a has type f32[8,16,32] but gelu gives f32[8,16,64]"),
    ("gelu(%h) : f32[8,16,64]", "gelu(%h) : f16[8,16,64]", "output 0 %a has type f16[8,16,64] but gelu gives f32"),
    ("%y = linear(%a, %w2)", "%y = linear(%x, %w2)", "op linear rejects its operands f32[8,16,32], f32[32,64]"),
    ("sizes=(16, 16)", "sizes=(16, 8, 8)", "op split has 3 outputs in the registry but the node has 2"),
    ("{dp:S(0), tp:P(sum)}", "{tp:S(2)}",  # not a resolution of the partial sum: dp is lost
     "output 0 %y has layout {tp:S(2)} but partition<dp:e0, tp:k> gives {dp:S(0), tp:P(sum)}, nor its partial"),
    ("partition<dp:d0, tp:d2>", "partition<dp:d0, tp:q>",
     "partition<dp:d0, tp:q> splits q, which is not an iteration dim of gelu (its dims: d0, d1, d2)"),
    ("partition<dp:d0, tp:d2>", "partition<dp:d0, pp:d2>", "partition<dp:d0, pp:d2> names mesh axis pp, which"),
    ("{dp:S(0)}\n  param", "{pp:S(0)}\n  param", "layout {pp:S(0)} of %x names mesh axis pp, which mesh<dp=2, tp=2> lacks"),
    ("%w1 : f32[64,32]{tp:S(0)}", "%w1 : f32[64,32]{tp:S(2)}", "shards dim 2 of a rank-2 tensor"),
    ("layer=blocks.0 @blocks.0.act", "layer=blocks.1 @blocks.0.act",
     "node names layer blocks.1, which the graph does not declare"),
    ("partition<dp:e0, tp:k>", "partition<dp:e0, tp:k; time e1/3>",
     "cuts e1 (local size 16) into 3 steps, unevenly"),
    ("partition<dp:e0, tp:k>", "partition<dp:e0, tp:k; time e1/4 rotate pp>", "names mesh axis pp, which"),
])
def test_broken_graphs_are_reported(old: str, new: str, message: str) -> None:
    assert old in BASE
    assert message in failure(BASE.replace(old, new, 1))


def test_unsplittable_and_ring_dims() -> None:
    text = BASE.replace("  return %p0", """\
  %n = layer_norm(%p0) : f32[8,16,16]{tp:S(2)} partition<tp:h> layer=blocks.0 @blocks.0.ln
  return %n""")
    assert "partition<tp:h> splits h, which layer_norm cannot split" in failure(text)
    text = BASE.replace("  return %p0", """\
  %q = reshape[shape=(8, 2, 16, 8)](%p0) : f32[8,2,16,8] @
  %o = scaled_dot_product_attention(%q, %q, %q) : f32[8,2,16,8]{tp:S(1)} partition<tp:t> @
  return %o""")
    message = failure(text)
    assert "splits t in space, but scaled_dot_product_attention allows t only in time with rotation" in message
    assert "hint: write it as 'time t/N rotate AXIS'" in message
    verify(parse(text.replace("{tp:S(1)} partition<tp:t>", " partition<; time t/2 rotate tp>")))


def test_uneven_shards() -> None:
    text = BASE.replace("mesh<dp=2, tp=2>", "mesh<dp=3, tp=2>")
    assert "%x : f32[8,16,32]{dp:S(0)} splits dim 0 of size 8 3 ways, unevenly" in failure(text)
    verify(parse(text), allow_uneven=True)


def test_input_layouts_after_lowering() -> None:
    text = BASE.replace("%x : f32[8,16,32]{dp:S(0)}", "%x : f32[8,16,32]")
    verify(parse(text))
    assert "operand 0 %x has layout {} but partition<dp:e0, tp:n> needs {dp:S(0)}" in failure(
        text, check_input_layouts=True)


def test_ssa_violations() -> None:
    graph = parse(BASE)
    graph.nodes[1], graph.nodes[2] = graph.nodes[2], graph.nodes[1]
    assert "operand 0 %a of linear is used before its definition" in failure_of(graph)
    graph = parse(BASE)
    graph.nodes[1].inputs[0] = Value("h", graph.nodes[0].outputs[0].type)
    assert "operand 0 %h of gelu is not the value of that name defined in the graph" in failure_of(graph)
    graph = parse(BASE)
    graph.nodes[1].outputs[0].name = "h"
    assert "value %h is defined twice" in failure_of(graph)
    graph = parse(BASE)
    graph.nodes[1].outputs[0].producer = graph.nodes[0]
    assert "output %a does not name its node as producer" in failure_of(graph)
    graph = parse(BASE)
    graph.outputs = [Value("ghost", TensorType((1,), "f32"))]
    assert "returned value %ghost is not defined in the graph" in failure_of(graph)
    graph = parse(BASE)
    graph.params[0].kind = "buffer"
    assert "%w1 is declared as parameter but has kind buffer" in failure_of(graph)
    graph = parse(BASE)
    graph.mesh = None
    graph.inputs[0].layout = Layout((("dp", Shard(0)),))
    assert "%x has layout {dp:S(0)} but the graph has no mesh" in failure_of(graph)


def failure_of(graph) -> str:
    with pytest.raises(VerificationError) as info:
        verify(graph)
    return str(info.value)


STAGED = """\
graph @s mesh<pp=2> {
  input %x : f32[4,8]
  layer a block=a stage=0
  layer b block=b stage=1
  %y = relu(%x) : f32[4,8] layer=a @a
  %z = relu(%y) : f32[4,8] layer=b @b
  return %z
}
"""


def test_pipeline_stages() -> None:
    verify(parse(STAGED))
    assert "layer b has no pipeline stage while other layers have one" in failure(STAGED.replace("stage=1", ""))
    assert "pipeline stages run 0..2 but no layer is on stage 1" in failure(STAGED.replace("stage=1", "stage=2"))
    assert "3 pipeline stages do not fill mesh<pp=2>" in failure(
        STAGED.replace("layer b block=b stage=1", "layer b block=b stage=1\n  layer c block=c stage=2"))
    swapped = STAGED.replace("stage=0", "stage=X").replace("stage=1", "stage=0").replace("stage=X", "stage=1")
    assert "layer b is on stage 0 but comes after layer a on stage 1" in failure(swapped)


def test_error_carries_node_and_location() -> None:
    graph = parse(BASE.replace("%a = gelu", "%a = geluu"))
    with pytest.raises(VerificationError) as info:
        verify(graph)
    assert info.value.node is graph.nodes[1]
    assert "at module blocks.0.act" in str(info.value)
    assert "hint: register it with shardc.ops.registry.register" in str(info.value)
