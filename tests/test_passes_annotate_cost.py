"""annotate-cost on hand-built graphs, every number worked out by hand in the comments."""

from __future__ import annotations

from shardc.analysis.aliasing import aliasing
from shardc.cost.context import CostContext
from shardc.cost.layer import layer_terms
from shardc.hardware import parse_cluster
from shardc.ir.parser import parse
from shardc.passes.annotate_cost import LayerCost, annotate_cost, cost_table, node_costs
from shardc.passmanager import run_pipeline

MLP = """\
graph @mlp {
  input %x : f32[4,8,16]
  param %fc1.weight : f32[32,16]
  param %fc1.bias : f32[32]
  param %fc2.weight : f32[16,32]
  layer mlp.0 block=block0
  layer head block=head
  %h = linear(%x, %fc1.weight, %fc1.bias) : f32[4,8,32] layer=mlp.0 @mlp.0.fc1
  %a = gelu(%h) : f32[4,8,32] layer=mlp.0 @mlp.0.act
  %y = linear(%a, %fc2.weight) : f32[4,8,16] layer=mlp.0 @mlp.0.fc2
  %r = reshape[shape=(32, 16)](%y) : f32[32,16] layer=head @head
  %w = linear(%r, %fc1.weight) : f32[32,32] layer=head @head
  return %w
}
"""


def test_mlp_numbers() -> None:
    graph = annotate_cost(parse(MLP))
    ann = [n.annotations for n in graph.nodes]
    # fc1: 2 * (4*8*32 outputs) * 16 + bias 4*8*32; reads x 2048 B, w 2048 B, b 128 B, writes 4096 B;
    # saves x (the weight is a parameter, not an activation); brings in w and b (512 + 32 elements).
    assert ann[0] == {"flops": 2 * 1024 * 16 + 1024, "bytes": 2048 + 2048 + 128 + 4096, "saved_bytes": 2048,
                      "param_bytes": 2176, "params": 544}
    # gelu: 8 flops per element, reads and writes 4096 B, saves its input h.
    assert ann[1] == {"flops": 8 * 1024, "bytes": 8192, "saved_bytes": 4096, "param_bytes": 0, "params": 0}
    # fc2: no bias; saves a.
    assert ann[2] == {"flops": 2 * 512 * 32, "bytes": 4096 + 2048 + 2048, "saved_bytes": 4096,
                      "param_bytes": 2048, "params": 512}
    # a view: nothing moved, nothing saved.
    assert ann[3] == {"flops": 0, "bytes": 0, "saved_bytes": 0, "param_bytes": 0, "params": 0}
    # the tied fc1.weight counts once, at its first user; r is a view of y (2048 B), saved once.
    assert ann[4] == {"flops": 2 * 1024 * 16, "bytes": 2048 + 2048 + 4096, "saved_bytes": 2048,
                      "param_bytes": 0, "params": 0}


def test_dtype_option_counts_float_activations_at_that_size() -> None:
    graph = run_pipeline(parse(MLP), "annotate-cost{dtype=bf16}")
    ann = [n.annotations for n in graph.nodes]
    assert ann[0]["saved_bytes"] == 1024 and ann[1]["saved_bytes"] == 2048
    assert ann[0]["bytes"] == (2048 + 2048 + 128 + 4096) // 2
    assert ann[0]["param_bytes"] == 2176  # parameters keep their own dtype


def test_cost_table_sums_per_layer() -> None:
    rows = cost_table(parse(MLP))
    assert rows == [
        LayerCost("mlp.0", "block0", nodes=3, params=1056, param_bytes=4224, flops=33792 + 8192 + 32768,
                  bytes=8320 + 8192 + 8192, saved_bytes=2048 + 4096 + 4096),
        LayerCost("head", "head", nodes=2, params=0, param_bytes=0, flops=32768, bytes=8192, saved_bytes=2048),
    ]
    assert rows[0].to_json()["saved_bytes"] == 10240


ATTENTION = """\
graph @attn {
  input %x : f32[2,4,8]
  param %qkv.weight : f32[24,8]
  param %proj.weight : f32[8,8]
  %qkv = linear(%x, %qkv.weight) : f32[2,4,24] @qkv
  %q, %k, %v = split[sizes=(8, 8, 8), dim=2](%qkv) : f32[2,4,8], f32[2,4,8], f32[2,4,8] @
  %q4 = reshape[shape=(2, 4, 2, 4)](%q) : f32[2,4,2,4] @
  %k4 = reshape[shape=(2, 4, 2, 4)](%k) : f32[2,4,2,4] @
  %v4 = reshape[shape=(2, 4, 2, 4)](%v) : f32[2,4,2,4] @
  %qt = permute[dims=(0, 2, 1, 3)](%q4) : f32[2,2,4,4] @
  %kt = permute[dims=(0, 2, 1, 3)](%k4) : f32[2,2,4,4] @
  %vt = permute[dims=(0, 2, 1, 3)](%v4) : f32[2,2,4,4] @
  %o = scaled_dot_product_attention[is_causal=true](%qt, %kt, %vt) : f32[2,2,4,4] @attn
  %ot = permute[dims=(0, 2, 1, 3)](%o) : f32[2,4,2,4] @
  %y = reshape[shape=(2, 4, 8)](%ot) : f32[2,4,8] @
  %z = linear(%y, %proj.weight) : f32[2,4,8] @proj
  %again = mul(%qt, %kt) : f32[2,2,4,4] @
  return %z, %again
}
"""


def test_views_alias_their_source_where_torch_makes_views() -> None:
    graph = parse(ATTENTION)
    storage = aliasing(graph)
    root_of = {v.name: storage.root(v).name for v in graph.values()}
    # split, the reshapes that split the last dim and the permutes are views of qkv ...
    assert {root_of[n] for n in ("q", "k", "v", "q4", "k4", "v4", "qt", "kt", "vt")} == {"qkv"}
    # ... but reshaping the permuted attention output must copy, as torch's reshape does.
    assert root_of["ot"] == "o" and root_of["y"] == "y"
    assert [n.outputs[0].name for n in storage.copies] == ["y"]


def test_saved_bytes_count_each_storage_once() -> None:
    costs = node_costs(parse(ATTENTION))
    saved = [c.saved_bytes for c in costs]
    # qkv linear saves x (2*4*8*4 B). Attention saves q, k, v (256 B each, together all of qkv's
    # 768 B), its output (256 B) and a fp32 log-sum-exp per query row (2*2*4 rows * 4 B).
    # proj saves y, a fresh copy (256 B). The mul saves qt and kt again: already counted.
    assert saved == [256, 0, 0, 0, 0, 0, 0, 0, 768 + 256 + 64, 0, 0, 256, 0]
    # attention flops: q k^T and p v, 2 * (2*2*4*4) * 4 each
    assert costs[8].flops == 2 * 64 * 4 + 2 * 64 * 4


def test_a_saved_view_costs_the_storage_it_aliases() -> None:
    # As the cost model charges it (`layer_terms`): q is a view of qkv, so saving q keeps all
    # of qkv's 768 B alive; kt, another view of it, then costs nothing more.
    text = ATTENTION.replace("%o = scaled_dot_product_attention[is_causal=true](%qt, %kt, %vt)",
                             "%o = mul(%qt, %qt)")
    saved = [c.saved_bytes for c in node_costs(parse(text))]
    assert saved[8] == 768
    assert saved[12] == 0


def test_the_figures_are_the_cost_models() -> None:
    # Per layer, what inspect shows is what the model charges: forward FLOPs and saved bytes of
    # `layer_terms` at the traced batch, at the same dtype.
    graph = run_pipeline(parse(MLP), "annotate-cost{dtype=bf16}")
    ctx = CostContext.build(graph, parse_cluster("1xH100"), "bf16")
    for row in cost_table(graph):
        terms = layer_terms(ctx, [n for n in graph.nodes if n.layer == row.layer])
        assert (row.flops, row.saved_bytes) == (terms.fwd_flops, terms.saved)


def test_cost_table_reads_the_annotations() -> None:
    graph = annotate_cost(parse(MLP))
    graph.nodes[1].annotations["flops"] = 1
    assert cost_table(graph)[0].flops == 33792 + 1 + 32768


PARTITIONED = """\
graph @tp mesh<dp=2, tp=2> {
  input %x : f32[8,16,32]{dp:S(0)}
  param %w1 : f32[64,32]{tp:S(0)}
  param %w2 : f32[32,64]{tp:S(1)}
  %h = linear(%x, %w1) : f32[8,16,64]{dp:S(0), tp:S(2)} partition<dp:e0, tp:n> @fc1
  %y = linear(%h, %w2) : f32[8,16,32]{dp:S(0), tp:P(sum)} partition<dp:e0, tp:k> @fc2
  %z = all_reduce[axis="tp", op="sum"](%y) : f32[8,16,32]{dp:S(0)} @
  return %z
}
"""


def test_partitioned_graphs_cost_local_shards() -> None:
    ann = [n.annotations for n in annotate_cost(parse(PARTITIONED)).nodes]
    # fc1 on one device: x[4,16,32] @ w1[32,32]^T -> h[4,16,32]; the global count split 4 ways.
    assert ann[0]["flops"] == 2 * 8 * 16 * 64 * 32 // 4
    assert ann[0]["saved_bytes"] == 4 * 16 * 32 * 4 and ann[0]["param_bytes"] == 32 * 32 * 4
    # fc2 reduces over its local half of k: the output is a full-size partial sum.
    assert ann[1]["flops"] == 2 * 4 * 16 * 32 * 32
    assert ann[1]["bytes"] == (4 * 16 * 32 + 32 * 32 + 4 * 16 * 32) * 4
    assert ann[1]["saved_bytes"] == 4 * 16 * 32 * 4 and ann[1]["params"] == 32 * 32
    assert ann[2]["flops"] == 0 and ann[2]["saved_bytes"] == 0
