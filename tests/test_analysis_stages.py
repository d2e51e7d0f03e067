"""One layering and one stage rule (`shardc.analysis.stages`), as apply-plan, the cost model,
the solver and the study read them."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardc.analysis.stages import layer_stages, layering, stage_sizes
from shardc.ir import Layer
from shardc.ir.diagnostics import ShardcError
from shardc.ir.parser import parse_file

HERE = Path(__file__).parent / "ir"


def test_extra_blocks_go_to_the_middle_stages_first() -> None:
    assert stage_sizes(8, 4) == (2, 2, 2, 2)
    assert stage_sizes(10, 4) == (2, 3, 3, 2)
    assert stage_sizes(11, 4) == (3, 3, 3, 2)
    assert stage_sizes(5, 2) == (3, 2)
    assert stage_sizes(3, 1) == (3,)


def test_layering_and_stages_of_three_blocks() -> None:
    graph = parse_file(HERE / "three_blocks.grouped.ir")
    lay = layering(graph)
    assert (lay.pre, lay.blocks, lay.post) == (("embed",), ("blocks.0", "blocks.1", "blocks.2"), ("head",))
    assert lay.count == 3
    # The solver represents one class's run by one copy: the odd last block joins the suffix.
    run = lay.uniform()
    assert (run.pre, run.blocks, run.post) == (("embed",), ("blocks.0", "blocks.1"), ("blocks.2", "head"))
    assert layer_stages(graph, 2) == {"embed": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "head": 1}
    assert layer_stages(graph, 2, (1, 2)) == {"embed": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "head": 1}
    with pytest.raises(ShardcError, match="every stage needs one"):
        layer_stages(graph, 4)
    with pytest.raises(ShardcError, match="deals 2 blocks"):
        layer_stages(graph, 2, (1, 1))


def test_a_layer_between_blocks_keeps_the_stage_of_the_block_before_it() -> None:
    graph = parse_file(HERE / "three_blocks.grouped.ir")
    graph.layers = {name: graph.layers[name] for name in ("embed", "blocks.0", "blocks.1")} | {
        "bridge": Layer("bridge", "bridge")} | {name: graph.layers[name] for name in ("blocks.2", "head")}
    for node in graph.nodes:
        if node.layer == "blocks.1" and node.op == "add":
            node.layer = "bridge"
    stages = layer_stages(graph, 3)
    assert stages["bridge"] == stages["blocks.1"] == 1 and stages["blocks.2"] == stages["head"] == 2
    assert layering(graph).uniform().post == ("bridge", "blocks.2", "head")
