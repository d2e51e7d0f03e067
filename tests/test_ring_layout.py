"""The zig-zag sequence layout of causal context parallelism: plan syntax, printed IR, the layout
helpers, and the estimate of balanced against contiguous causal ring attention."""

from __future__ import annotations

import pytest
import torch
from test_apply_plan_graphs import attention_block, tiny_lm

from shardc.backends.torch.collectives import _assemble
from shardc.backends.torch.ring import (
    causal_work,
    natural_order,
    segments,
    visibility,
    zigzag_assemble,
    zigzag_order,
    zigzag_take,
)
from shardc.cost.ring import causal_ring_blocks, causal_ring_cost
from shardc.ir import Layout, Partition, Shard
from shardc.ir.diagnostics import ShardcError
from shardc.ir.equality import assert_graphs_equal
from shardc.ir.parser import parse
from shardc.ir.printer import print_graph
from shardc.passes.apply_plan import apply_plan
from shardc.passes.lower import lower
from shardc.plan.parallel import ParallelPlan

EXPECTED_ATTN_CP2_ZIGZAG = """\
graph @attn mesh<pp=1, dp=1, cp=2, tp=1> [plan="dp=1,tp=1,pp=1,vpp=1,cp=2:zigzag,sp=0,mb=1,gbs=auto,schedule=1f1b,\
recompute=none,zero=0,dtype=bf16", microbatch_size=1, microbatches=2, global_batch=2, traced_batch=2, \
schedule="1f1b", virtual_stages=1, sequence_parallel=false, dtype="bf16"] {
  input %x : f32[2,8,16]{cp:S(1, zigzag)}
  param %ln.weight : f32[16]{}
  param %ln.bias : f32[16]{}
  param %qkv.weight : f32[48,16]{}
  param %qkv.bias : f32[48]{}
  param %proj.weight : f32[16,16]{}
  param %proj.bias : f32[16]{}
  layer model block=model stage=0 recompute=none zero=0
  %x0 = layer_norm(%x, %ln.weight, %ln.bias) : f32[2,8,16]{cp:S(1, zigzag)} partition<cp:e1 zigzag> layer=model @ln
  %x1 = linear(%x0, %qkv.weight, %qkv.bias) : f32[2,8,48]{cp:S(1, zigzag)} partition<cp:e1 zigzag> layer=model @qkv
  %x2, %x3, %x4 = split[sizes=(16, 16, 16), dim=2](%x1) : f32[2,8,16]{cp:S(1, zigzag)}, f32[2,8,16]{cp:S(1, zigzag)}, \
f32[2,8,16]{cp:S(1, zigzag)} partition<cp:d1 zigzag> layer=model @
  %x5 = reshape[shape=(2, 8, 4, 4)](%x2) : f32[2,8,4,4]{cp:S(1, zigzag)} partition<cp:r1 zigzag> layer=model @
  %x6 = permute[dims=(0, 2, 1, 3)](%x5) : f32[2,4,8,4]{cp:S(2, zigzag)} partition<cp:d1 zigzag> layer=model @
  %x7 = reshape[shape=(2, 8, 4, 4)](%x3) : f32[2,8,4,4]{cp:S(1, zigzag)} partition<cp:r1 zigzag> layer=model @
  %x8 = permute[dims=(0, 2, 1, 3)](%x7) : f32[2,4,8,4]{cp:S(2, zigzag)} partition<cp:d1 zigzag> layer=model @
  %x9 = reshape[shape=(2, 8, 4, 4)](%x4) : f32[2,8,4,4]{cp:S(1, zigzag)} partition<cp:r1 zigzag> layer=model @
  %x10 = permute[dims=(0, 2, 1, 3)](%x9) : f32[2,4,8,4]{cp:S(2, zigzag)} partition<cp:d1 zigzag> layer=model @
  %x11 = scaled_dot_product_attention[is_causal=true](%x6, %x8, %x10) : f32[2,4,8,4]{cp:S(2, zigzag)} \
partition<cp:s zigzag; time t/2 rotate cp> layer=model @attn
  %x12 = permute[dims=(0, 2, 1, 3)](%x11) : f32[2,8,4,4]{cp:S(1, zigzag)} partition<cp:d2 zigzag> layer=model @
  %x13 = reshape[shape=(2, 8, 16)](%x12) : f32[2,8,16]{cp:S(1, zigzag)} partition<cp:r1 zigzag> layer=model @
  %x14 = linear(%x13, %proj.weight, %proj.bias) : f32[2,8,16]{cp:S(1, zigzag)} partition<cp:e1 zigzag> layer=model @proj
  %x15 = add(%x, %x14) : f32[2,8,16]{cp:S(1, zigzag)} partition<cp:d1 zigzag> layer=model @
  return %x15
}"""


def test_plan_syntax() -> None:
    plan = ParallelPlan.parse("dp=2,cp=4:zigzag")
    assert (plan.cp, plan.cp_layout, plan.devices) == (4, "zigzag", 8)
    assert "cp=4:zigzag," in str(plan) and ParallelPlan.parse(str(plan)) == plan
    assert "cp_layout" not in str(ParallelPlan.parse("cp=4")) and ParallelPlan.parse("cp=4").cp_layout == "contiguous"
    with pytest.raises(ShardcError, match="valid values are contiguous, zigzag"):
        ParallelPlan.parse("cp=2:spiral")
    with pytest.raises(ShardcError, match=r"cp=4:zigzag cuts the sequence 12 into 2\*cp = 8 chunks"):
        apply_plan(attention_block(seq=12), ParallelPlan.parse("cp=4:zigzag"))


def test_printed_ir_and_round_trip() -> None:
    graph = apply_plan(attention_block(), ParallelPlan.parse("cp=2:zigzag"))
    got, want = print_graph(graph).splitlines(), EXPECTED_ATTN_CP2_ZIGZAG.splitlines()
    for k, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"line {k + 1}:\n  got:  {a}\n  want: {b}"
    assert len(got) == len(want)
    assert_graphs_equal(parse(print_graph(graph)), graph)
    assert parse(print_graph(graph)).nodes[-5].partition == Partition((("cp", "s"),), graph.nodes[-5].partition.temporal,
                                                                      (), ("cp",))


def test_lowered_language_model_keeps_the_order_once_permuted() -> None:
    """dp x cp x tp on a small LM: inputs split zig-zag, the position table chunked zig-zag,
    the loss reads the flattened (batch seq) logits as an interleaved zig-zag shard; no other
    collective on cp than those, and printed IR parses back."""
    g = lower(apply_plan(tiny_lm(batch=4, flatten_loss=True), ParallelPlan.parse("dp=2,cp=2:zigzag,tp=2")))
    assert str(g.value("idx").layout) == "{dp:S(0), cp:S(1, zigzag)}"
    on_cp = [(n.op, str(n.output.layout)) for n in g.nodes if n.attrs.get("axis") == "cp"]
    assert on_cp == [("chunk", "{cp:S(0, zigzag)}")]
    loss = g.nodes[-1]
    assert str(loss.partition) == "partition<dp:d0, cp:d0/2 zigzag, tp:v>"
    assert str(loss.inputs[0].layout) == "{dp:S(0), cp:S(0/2, zigzag), tp:S(1)}"
    assert_graphs_equal(parse(print_graph(g)), g)
    assert Layout((("cp", Shard(0, 2, True)),)).local_shape((16, 3), g.mesh) == (8, 3)  # type: ignore[arg-type]


def test_zigzag_pieces() -> None:
    x = torch.arange(16).view(1, 16)
    assert zigzag_take(x, 2, 0, 1).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert zigzag_take(x, 2, 1, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert zigzag_take(x, 2, 1, 1, interleave=2).tolist() == [[2, 3, 4, 5, 10, 11, 12, 13]]
    for n, k in ((2, 1), (4, 1), (2, 2)):
        parts = [zigzag_take(x, n, c, 1, k) for c in range(n)]
        assert torch.equal(zigzag_assemble(parts, 1, k), x)
        assert torch.equal(zigzag_order(x, n, 1, k), _assemble(parts, 1, k))  # contiguous pieces of it
        assert torch.equal(natural_order(zigzag_order(x, n, 1, k), n, 1, k), x)
    assert segments(4, 2, 1, True) == [(2, 0, 2), (4, 2, 2)]
    assert [visibility((4, 0, 2), k) for k in ((0, 0, 2), (4, 0, 2), (6, 0, 2))] == ["full", "diagonal", "none"]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_cost_model_counts_the_blocks_the_backend_computes(n: int) -> None:
    """The cost model's per-rank blocks are the (query, key) segment pairs the backend's ring
    attention computes (4 units of chunk x chunk per block)."""
    for zigzag in (False, True):
        assert [4 * b for b in causal_ring_blocks(n, zigzag)] == causal_work(n, zigzag)
    assert max(causal_ring_blocks(n, True)) == (2 * n + 1) / 4 < max(causal_ring_blocks(n, False)) == n


def test_estimate_balanced_against_contiguous_causal_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Causal Llama, cp=4 on 4xH100 at 8k tokens: contiguous, the last rank computes every key
    shard, so attention costs what non-causal attention costs; zig-zag, every rank computes
    (2n+1)/4 = 9/16 of the n shards, and that is the whole difference in compute time."""
    import shardc.cost.ring as ring
    from shardc.cost.model import estimate
    from shardc.driver import partition
    from shardc.hardware import parse_cluster

    cluster = parse_cluster("4xH100")
    spec = "examples/llama.py:llama?n_layer=1&dim=256&n_head=4&ffn_hidden=512&vocab_size=512&seq=8192&batch=1"
    scaled: list[tuple[float, float]] = []  # (before, after) of each attention node's compute

    def record(cost, node, part):  # noqa: ANN001, ANN202
        out = causal_ring_cost(cost, node, part)
        if node.op == "scaled_dot_product_attention":
            scaled.append((cost.fwd_s + cost.bwd_s, out.fwd_s + out.bwd_s))
        return out

    monkeypatch.setattr(ring, "causal_ring_cost", record)

    def compute(plan: str, causal: bool = True) -> float:
        parsed = ParallelPlan.parse(plan)
        graph, _ = partition(spec, cluster, parsed)
        for node in graph.nodes:
            if node.op == "scaled_dot_product_attention":
                node.attrs["is_causal"] = causal
        scaled.clear()
        e = estimate(graph, cluster, parsed)
        return e.stages[0].time["compute_fwd"] + e.stages[0].time["compute_bwd"]

    full, full_zigzag = compute("cp=4", causal=False), compute("cp=4:zigzag", causal=False)
    contiguous = compute("cp=4")
    assert contiguous == pytest.approx(full, rel=1e-9) and full_zigzag == pytest.approx(full, rel=1e-9)
    zigzag = compute("cp=4:zigzag")
    assert scaled and all(after == pytest.approx(before * 9 / 16) for before, after in scaled)
    assert contiguous - zigzag == pytest.approx(sum(b - a for b, a in scaled), rel=1e-6)
    assert zigzag < 0.9 * contiguous
