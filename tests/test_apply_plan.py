"""apply-plan on hand-built graphs: printed IR against expected text, stages, plan facts, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_apply_plan_graphs import GraphBuilder, attention_block, mlp_block, tiny_lm

from shardc.analysis.resharding import node_rotations
from shardc.ir import Graph, Layout, Mesh, Partition, Shard, TemporalSplit, TensorType
from shardc.ir.diagnostics import ShardcError
from shardc.ir.equality import assert_graphs_equal
from shardc.ir.parser import parse
from shardc.ir.printer import print_graph
from shardc.passes.apply_plan import ApplyPlan, apply_plan
from shardc.passmanager import PassContext, run_pipeline
from shardc.plan.parallel import ParallelPlan

HERE = Path(__file__).parent / "ir"


def assert_ir(graph: Graph, expected_file: str) -> None:
    """Printed IR equals the expected file; the first differing line is reported."""
    got = print_graph(graph).splitlines()
    want = (HERE / expected_file).read_text().splitlines()
    for k, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"{expected_file}:{k + 1}:\n  got:  {a}\n  want: {b}"
    assert len(got) == len(want), f"{expected_file}: {len(got)} lines, expected {len(want)}"


@pytest.mark.parametrize(("build", "plan", "expected"), [
    (mlp_block, "dp=2,tp=2", "apply_plan.mlp.dp2_tp2.ir"),
    (attention_block, "tp=2", "apply_plan.attn.tp2.ir"),
    (attention_block, "tp=2,sp=1", "apply_plan.attn.tp2_sp.ir"),
    (attention_block, "cp=2", "apply_plan.attn.cp2.ir"),
])
def test_printed_ir(build: object, plan: str, expected: str) -> None:
    graph = apply_plan(build(), ParallelPlan.parse(plan))  # type: ignore[operator]
    assert_ir(graph, expected)
    assert_graphs_equal(parse(print_graph(graph)), graph)


def node(graph: Graph, module: str, op: str | None = None):  # noqa: ANN201
    return next(n for n in graph.nodes if n.location.module_path == module and (op is None or n.op == op))


def test_megatron_pattern_in_a_language_model() -> None:
    g = apply_plan(tiny_lm(), ParallelPlan(tp=2))
    assert node(g, "wte").partition == Partition((("tp", "v"),))  # vocab-parallel embedding
    assert node(g, "wpe").partition == Partition()  # positions: ids from arange, not the input
    for name in ("q", "k", "v"):
        assert node(g, f"blocks.1.attn.{name}").partition == Partition((("tp", "n"),))
    assert node(g, "blocks.1.attn.o").partition == Partition((("tp", "k"),))
    assert node(g, "blocks.1.attn", "scaled_dot_product_attention").partition == Partition((("tp", "g"),))
    assert node(g, "blocks.1.mlp.fc1").partition == Partition((("tp", "n"),))
    assert node(g, "blocks.1.mlp.fc2").partition == Partition((("tp", "k"),))
    assert node(g, "lm_head").partition == Partition((("tp", "n"),))
    assert g.nodes[-1].op == "cross_entropy" and g.nodes[-1].partition == Partition((("tp", "v"),))
    assert g.outputs[0].layout == Layout()  # vocab-parallel loss is whole on every tp rank
    assert g.value("wte.weight").layout == Layout((("tp", Shard(0)),))  # tied: embedding and head agree


def test_strided_qkv_shard() -> None:
    g = apply_plan(attention_block(), ParallelPlan(tp=2))
    qkv = node(g, "qkv")
    assert qkv.partition == Partition((("tp", "n"),), (), (("tp", 3),))
    assert qkv.output.layout == Layout((("tp", Shard(2, 3)),))
    assert str(qkv.output.layout) == "{tp:S(2/3)}"
    # Each device holds its half of q, of k and of v: 3 blocks of 8 columns.
    assert qkv.output.layout.local_shape(qkv.output.type.shape, g.mesh) == (2, 8, 24)  # type: ignore[arg-type]


def test_flattened_loss_keeps_sequence_shards() -> None:
    # logits.view(-1, V): the sequence is a minor factor of the flattened dim (a strided shard),
    # so context parallelism reaches the loss without gathering the logits.
    g = apply_plan(tiny_lm(batch=4, flatten_loss=True), ParallelPlan(dp=2, cp=2, tp=2))
    loss = g.nodes[-1]
    assert str(loss.partition) == "partition<dp:d0, cp:d0/2, tp:v>"
    assert str(loss.inputs[0].layout) == "{dp:S(0), cp:S(0/2), tp:S(1)}"
    assert str(loss.output.layout) == "{dp:P(avg), cp:P(avg)}"


def test_ring_attention_rotates_keys_and_values() -> None:
    g = apply_plan(tiny_lm(), ParallelPlan(cp=2))
    attn = node(g, "blocks.0.attn", "scaled_dot_product_attention")
    assert attn.partition is not None and attn.partition.temporal == (TemporalSplit("t", 2, "cp"),)
    rotations = node_rotations(attn, g.mesh)  # type: ignore[arg-type]
    # k and v [2,4,8,4] f32 = 1024 bytes, half on each cp rank; one shift each for two steps.
    assert [(s.kind, s.axis, s.bytes_in_per_device) for s in rotations] == [("rotate", "cp", 512)] * 2
    assert all(s.backward == "rotate_reverse" for s in rotations)


def test_stages_with_virtual_stages() -> None:
    g = apply_plan(tiny_lm(layers=4), ParallelPlan(pp=2, vpp=2, recompute="full", zero=1, gbs=4))
    stages = {name: layer.annotation.stage for name, layer in g.layers.items()}
    assert stages == {"embed": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 2, "blocks.3": 3, "head": 3}
    for name, layer in g.layers.items():  # blocks recompute; the embedding and the head never do
        a = layer.annotation
        assert (a.recompute, a.zero) == ("full" if name.startswith("blocks.") else "none", 1)
    assert g.attrs["virtual_stages"] == 2 and g.attrs["schedule"] == "interleaved"
    assert str(g.mesh) == "mesh<pp=2, dp=1, cp=1, tp=1>"


def test_uneven_stages_give_extra_blocks_to_the_middle() -> None:
    g = apply_plan(tiny_lm(layers=7), ParallelPlan(pp=3, gbs=6))  # 1F1B: at least 3 micro-batches
    blocks = [g.layers[f"blocks.{i}"].annotation.stage for i in range(7)]
    assert blocks == [0, 0, 1, 1, 1, 2, 2]


def test_plan_facts_on_the_graph() -> None:
    g = apply_plan(tiny_lm(batch=4), ParallelPlan(dp=2, mb=1, gbs=16, sp=True, tp=2, dtype="fp16"))
    assert g.attrs == {
        "plan": "dp=2,tp=2,pp=1,vpp=1,cp=1,sp=1,mb=1,gbs=16,schedule=1f1b,recompute=none,zero=0,dtype=fp16",
        "microbatch_size": 1, "microbatches": 8, "global_batch": 16, "traced_batch": 4, "schedule": "1f1b",
        "virtual_stages": 1, "sequence_parallel": True, "dtype": "f16",
    }


def test_pass_options_and_context_plan() -> None:
    direct = print_graph(apply_plan(tiny_lm(), ParallelPlan(tp=2, sp=True)))
    assert print_graph(run_pipeline(tiny_lm(), "apply-plan{tp=2,sp=true}")) == direct
    assert print_graph(run_pipeline(tiny_lm(), "apply-plan", PassContext(plan="tp=2,sp=1"))) == direct
    assert print_graph(run_pipeline(tiny_lm(), [ApplyPlan()], PassContext(plan=ParallelPlan(tp=2, sp=True)))) == direct


def test_applying_twice_gives_the_same_ir() -> None:
    g = apply_plan(tiny_lm(), ParallelPlan(dp=2, tp=2))
    first = print_graph(g)
    assert print_graph(apply_plan(g, ParallelPlan(dp=2, tp=2))) == first


def test_tp_not_dividing_heads() -> None:
    with pytest.raises(ShardcError, match=r"tp=8 does not divide heads=4"):
        apply_plan(tiny_lm(hidden=32, heads=4), ParallelPlan(tp=8))


def test_tp_not_dividing_a_split_dim_names_the_module() -> None:
    b = GraphBuilder("odd")
    x = b.input("x", (4, 8), "f32")
    y = b("linear", x, b.param("fc.weight", (6, 8)), module="fc")
    with pytest.raises(ShardcError) as err:
        apply_plan(b.done(y), ParallelPlan(tp=4))
    text = str(err.value)
    assert "mesh axis tp=4 does not divide iteration dim n (size 6) of linear at module fc" in text
    assert "hint: choose tp dividing 6" in text


def test_batch_not_divisible_by_dp() -> None:
    with pytest.raises(ShardcError, match=r"traced with a batch of 3, which dp=2 does not divide"):
        apply_plan(tiny_lm(batch=3), ParallelPlan(dp=2, gbs=4))


def test_more_stages_than_blocks() -> None:
    with pytest.raises(ShardcError, match=r"pp=3 stages for 2 layers"):
        apply_plan(tiny_lm(layers=2), ParallelPlan(pp=3))


def test_interleaved_type_is_local_shape() -> None:
    # S(d/k) keeps k blocks and splits each: 3 blocks of 12 over 4 devices leave 3 of 3.
    layout = Layout((("tp", Shard(1, 3)),))
    assert layout.local_shape(TensorType((2, 36), "f32").shape, Mesh((("tp", 4),))) == (2, 9)
