"""Structural equality names the first difference by its path."""

from __future__ import annotations

import pytest

from shardc.ir import Layout, Location, Partition, Replicate, Shard, TensorType
from shardc.ir.equality import assert_graphs_equal, first_difference, graphs_equal
from shardc.ir.parser import parse

TEXT = """\
graph @g mesh<tp=2> {
  input %x : f32[2,8,32]
  param %blocks.0.mlp.fc1.weight : f32[64,32]
  layer blocks.0 block=block0 stage=none
  %x1 = relu(%x) : f32[2,8,32] layer=blocks.0 @blocks.0
  %x2 = linear(%x1, %blocks.0.mlp.fc1.weight) : f32[2,8,64] layer=blocks.0 ann[flops=1] @blocks.0.mlp.fc1 "m.py:9"
  return %x2
}
"""


def pair():
    return parse(TEXT), parse(TEXT)


def test_equal_graphs() -> None:
    a, b = pair()
    assert graphs_equal(a, b) and first_difference(a, b) is None
    assert_graphs_equal(a, b)


@pytest.mark.parametrize(("change", "message"), [
    (lambda g: setattr(g.nodes[1].outputs[0], "type", TensorType((2, 8, 32), "f32")),
     "node 1 (%x2 = linear @blocks.0.mlp.fc1 \"m.py:9\"): output 0 type f32[2,8,64] != f32[2,8,32]"),
    (lambda g: setattr(g.nodes[1].outputs[0], "name", "y"), "node 1 (%x2 = linear @blocks.0.mlp.fc1 \"m.py:9\"): "
     "output 0 name %x2 != %y"),
    (lambda g: setattr(g.nodes[1].outputs[0], "layout", Layout((("tp", Shard(2)),))), "output 0 layout None != {tp:S(2)}"),
    (lambda g: setattr(g.nodes[0].outputs[0], "layout", Layout((("tp", Replicate()),))), "layout None != {tp:R}"),
    (lambda g: g.nodes[1].attrs.update(bias=1.0), "attribute bias only in the second graph (bias=1.0)"),
    (lambda g: g.nodes[1].annotations.update(flops=1.0), "annotation flops: 1 != 1.0"),
    (lambda g: g.nodes[1].annotations.update(flops=True), "annotation flops: 1 != true"),
    (lambda g: setattr(g.nodes[1], "partition", Partition((("tp", "n"),))), "partition None != partition<tp:n>"),
    (lambda g: setattr(g.nodes[1], "layer", None), "layer blocks.0 != None"),
    (lambda g: setattr(g.nodes[1], "location", Location("blocks.0.mlp.fc1", "m.py:10")),
     'location @blocks.0.mlp.fc1 "m.py:9" != @blocks.0.mlp.fc1 "m.py:10"'),
    (lambda g: g.nodes[1].inputs.reverse(), "operand 0 %x1 != %blocks.0.mlp.fc1.weight"),
    (lambda g: setattr(g.nodes[0], "op", "gelu"), "node 0 (%x1 = relu @blocks.0): op relu != gelu"),
    (lambda g: g.nodes.pop(), "2 nodes != 1 (first unmatched: node 1 (%x2 = linear"),
    (lambda g: setattr(g.params[0], "requires_grad", False),
     "param 0 (%blocks.0.mlp.fc1.weight): requires_grad True != False"),
    (lambda g: g.params.clear(), "1 params != 0 (first unmatched: %blocks.0.mlp.fc1.weight)"),
    (lambda g: setattr(g.layers["blocks.0"], "block", "block1"),
     "layer 0: layer blocks.0 block=block0 stage=none recompute=none zero=0 != "
     "layer blocks.0 block=block1"),
    (lambda g: setattr(g, "mesh", None), "mesh mesh<tp=2> != None"),
    (lambda g: g.attrs.update(microbatches=2), "graph attribute microbatches only in the second graph"),
    (lambda g: setattr(g, "name", "h"), "graph name @g != @h"),
    (lambda g: g.outputs.append(g.nodes[0].outputs[0]), "outputs %x2 != %x2, %x1"),
])
def test_first_difference(change, message: str) -> None:
    a, b = pair()
    change(b)
    found = first_difference(a, b)
    assert found is not None and message in found, found
    with pytest.raises(AssertionError, match="graphs differ: "):
        assert_graphs_equal(a, b)


def test_lists_and_tuples_print_alike() -> None:
    a, b = pair()
    a.nodes[0].attrs["dims"] = [1, 2]
    b.nodes[0].attrs["dims"] = (1, 2)
    assert graphs_equal(a, b)
    b.nodes[0].attrs["dims"] = (1, 2.0)
    assert not graphs_equal(a, b)
