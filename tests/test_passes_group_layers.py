"""group-layers: repeated blocks by module path and structure; printed IR compared with text."""

from __future__ import annotations

import io
from pathlib import Path

from shardc.ir import LayerAnnotation
from shardc.ir.equality import assert_graphs_equal
from shardc.ir.parser import parse, parse_file
from shardc.ir.printer import print_graph
from shardc.passes.group_layers import assign_layers, group_layers, layer_of_path, structural_hash
from shardc.passmanager import run_pipeline

HERE = Path(__file__).parent / "ir"


def test_three_blocks_after_the_pass() -> None:
    out = io.StringIO()
    graph = run_pipeline(parse_file(HERE / "three_blocks.ir"), "group-layers", print_after_all=True, out=out)
    expected = (HERE / "three_blocks.grouped.ir").read_text()
    assert out.getvalue() == "// ----- IR after group-layers -----\n" + expected
    assert print_graph(graph) == expected
    assert_graphs_equal(parse(expected), graph)


def test_layer_of_path() -> None:
    assert layer_of_path("blocks.3.attn.qkv") == "blocks.3"
    assert layer_of_path("transformer.h.11.mlp.c_fc") == "transformer.h.11"
    assert layer_of_path("model.layers.0.self_attn.q_proj") == "model.layers.0"
    assert layer_of_path("bert.encoder.layer.2.attention.self.query") == "bert.encoder.layer.2"
    assert layer_of_path("blocks.3.moe.experts.5.fc") == "blocks.3"
    assert layer_of_path("lm_head") is None and layer_of_path("") is None


def test_structure_decides_the_block_class() -> None:
    graph = group_layers(parse_file(HERE / "three_blocks.ir"))
    blocks = [graph.layer_nodes(f"blocks.{i}") for i in range(3)]
    hashes = [structural_hash(graph, f"blocks.{i}", nodes) for i, nodes in enumerate(blocks)]
    assert hashes[0] == hashes[1] != hashes[2]
    # a different attribute makes a different class
    text = (HERE / "three_blocks.ir").read_text().replace(
        "%x4 = rms_norm[eps=1e-06]", "%x4 = rms_norm[eps=1e-05]")
    graph = group_layers(parse(text))
    assert [graph.layers[f"blocks.{i}"].block for i in range(3)] == ["block0", "block1", "block2"]


def test_annotations_survive_regrouping() -> None:
    graph = group_layers(parse_file(HERE / "three_blocks.ir"))
    graph.layers["blocks.1"].annotation = LayerAnnotation(stage=None, recompute="full")
    again = group_layers(graph)
    assert again.layers["blocks.1"].annotation.recompute == "full"
    assert list(again.layers) == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]


BETWEEN = """\
graph @encdec {
  input %x : f32[2,8]
  %a = relu(%x) : f32[2,8] @encoder.layer.0
  %b = relu(%a) : f32[2,8] @encoder.layer.1
  %c = mul[other=2.0](%b) : f32[2,8] @
  %d = tanh(%c) : f32[2,8] @bridge.proj
  %e = tanh(%d) : f32[2,8] @bridge.act
  %f = relu(%e) : f32[2,8] @decoder.layer.0
  %g = tanh(%f) : f32[2,8] @
  %h = relu(%g) : f32[2,8] @decoder.layer.0
  %i = relu(%h) : f32[2,8] @decoder.layer.1
  %j = sum(%i) : f32[] @
  return %j
}
"""


def test_nodes_between_layers() -> None:
    graph = parse(BETWEEN)
    # the run from encoder to decoder is a layer named after its module, the root-level tanh
    # sits inside decoder.layer.0, the final sum is the head.
    assert assign_layers(graph) == ["encoder.layer.0", "encoder.layer.1", "bridge", "bridge", "bridge",
                                    "decoder.layer.0", "decoder.layer.0", "decoder.layer.0", "decoder.layer.1",
                                    "head"]
    grouped = group_layers(graph)
    assert {n: layer.block for n, layer in grouped.layers.items()} == {
        "encoder.layer.0": "block0", "encoder.layer.1": "block0", "bridge": "bridge",
        "decoder.layer.0": "block1", "decoder.layer.1": "block0", "head": "head"}  # all but one are a lone relu


LOOP_BODY = """\
graph @mlp {
  input %x : f32[2,8]
  param %layers.0.weight : f32[8,8]
  param %layers.1.weight : f32[8,8]
  param %layers.2.weight : f32[8,8]
  %a0 = linear(%x, %layers.0.weight) : f32[2,8] @layers.0
  %r0 = relu(%a0) : f32[2,8] @
  %d0 = dropout[p=0.1](%r0) : f32[2,8] @drop
  %a1 = linear(%d0, %layers.1.weight) : f32[2,8] @layers.1
  %r1 = relu(%a1) : f32[2,8] @
  %d1 = dropout[p=0.1](%r1) : f32[2,8] @drop
  %a2 = linear(%d1, %layers.2.weight) : f32[2,8] @layers.2
  %r2 = relu(%a2) : f32[2,8] @
  %d2 = dropout[p=0.1](%r2) : f32[2,8] @drop
  %s = sum(%d2) : f32[] @
  return %s
}
"""


def test_loop_body_in_the_parent_joins_every_layer() -> None:
    graph = group_layers(parse(LOOP_BODY))
    assert [n.layer for n in graph.nodes] == ["layers.0"] * 3 + ["layers.1"] * 3 + ["layers.2"] * 3 + ["head"]
    assert {layer.block for layer in graph.layers.values()} == {"block0", "head"}


def test_a_model_without_indexed_modules_is_one_layer() -> None:
    graph = group_layers(parse(BETWEEN.replace(".layer.", ".layer")))
    assert list(graph.layers) == ["model"] and {n.layer for n in graph.nodes} == {"model"}


HOIST = """\
graph @hoist {
  input %x : f32[2,8]
  input %m : f32[2,8]
  %a = relu(%x) : f32[2,8] @blocks.0.fc
  %k = neg(%m) : f32[2,8] @model
  %b = add(%a, %k) : f32[2,8] @blocks.0
  %c = relu(%b) : f32[2,8] @blocks.1.fc
  %d = add(%c, %k) : f32[2,8] @blocks.1
  return %d
}
"""


def test_foreign_nodes_inside_a_layer_move_before_it() -> None:
    graph = group_layers(parse(HOIST))
    assert [(n.outputs[0].name, n.layer) for n in graph.nodes] == [
        ("k", "embed"), ("a", "blocks.0"), ("b", "blocks.0"), ("c", "blocks.1"), ("d", "blocks.1")]
    assert graph.layers["blocks.0"].block == graph.layers["blocks.1"].block == "block0"
    # a node that reads the layer's values stays where it is
    graph = group_layers(parse(HOIST.replace("%k = neg(%m)", "%k = neg(%a)")))
    assert [n.outputs[0].name for n in graph.nodes] == ["a", "k", "b", "c", "d"]
    assert graph.nodes[1].layer == "blocks.0"
