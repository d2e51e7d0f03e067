"""A Megatron GPT written directly as partitioned IR, without tracing: for checking the cost model
against the literature and for quick what-ifs at any size (a 1T-parameter graph builds in
milliseconds).

The graph mirrors `examples/gpt.py` (learned positions, pre-LN, explicit attention with scale,
causal masked_fill, softmax and dropout, GELU MLP, tied head, cross entropy), with Megatron's
partitions on a `pp x dp x tp` mesh: vocab-parallel embedding and head, column-parallel qkv and
fc1, row-parallel proj and fc2 (biases added after the reduction), heads split over tp,
and with `sequence_parallel` the norms, dropouts and residual adds split over the sequence.
Layers are `embed`, `blocks.i` (block class `block`) and `head`, staged evenly over pp*vpp.
"""

from __future__ import annotations

import math
from typing import Any

from shardc.ir import (
    Axis,
    Graph,
    Layer,
    LayerAnnotation,
    Layout,
    Location,
    Mesh,
    Node,
    Partition,
    Shard,
    TensorType,
    Value,
)
from shardc.ops.registry import get_op, node_layouts


class _Builder:
    def __init__(self, graph: Graph, mesh: Mesh, dtype: str) -> None:
        self.graph, self.mesh, self.dtype = graph, mesh, dtype
        self.count = 0

    def param(self, name: str, shape: tuple[int, ...]) -> Value:
        v = Value(name, TensorType(shape, self.dtype), "parameter", requires_grad=True)
        self.graph.params.append(v)
        return v

    def node(self, op: str, inputs: list[Value], shapes: list[tuple[int, ...]], split: dict[str, str],
             layer: str, path: str, dtype: str | None = None, **attrs: Any) -> list[Value]:
        self.count += 1
        outs = [Value(f"v{self.count}_{i}", TensorType(s, dtype or self.dtype)) for i, s in enumerate(shapes)]
        spatial = tuple((a, d) for a, d in split.items() if self.mesh.axis_size(a) > 1)
        node = Node(op, inputs, outs, dict(attrs), Location(path), Partition(spatial) if spatial else None, layer)
        if spatial:
            space = get_op(op).iteration_space([v.type for v in inputs], [v.type for v in outs], node.attrs)
            ins, produced = node_layouts(space, node.partition, self.mesh)
            for v, lay in zip(outs, produced):
                v.layout = lay
            for v, lay in zip(inputs, ins):
                if v.kind == "parameter" and v.layout is None:
                    v.layout = lay
        self.graph.nodes.append(node)
        return outs


def gpt_graph(*, layers: int, hidden: int, heads: int, vocab: int, seq: int, batch: int, dropout: float = 0.1,
              dp: int = 1, tp: int = 1, pp: int = 1, vpp: int = 1, sequence_parallel: bool = False,
              recompute: str = "none", zero: int = 0, dtype: str = "bf16") -> Graph:
    """The GPT above with `batch` sequences per micro-batch across the dp group (see module doc)."""
    mesh = Mesh(((Axis.PP, pp), (Axis.DP, dp), (Axis.TP, tp)))
    g = Graph("gpt", mesh=mesh)
    b = _Builder(g, mesh, dtype)
    h, a, s, d = hidden, heads, seq, hidden // heads
    sp = {Axis.TP: "d1"} if sequence_parallel else {}
    idx = Value("idx", TensorType((batch, s), "i64"), "input", layout=Layout(((Axis.DP, Shard(0)),)) if dp > 1 else None)
    labels = Value("labels", TensorType((batch, s), "i64"), "input",
                   layout=Layout(((Axis.DP, Shard(0)),)) if dp > 1 else None)
    g.inputs += [idx, labels]
    mask = Value("mask", TensorType((1, 1, s, s), "bool"), "buffer")
    g.buffers.append(mask)
    wte, wpe = b.param("wte.weight", (vocab, h)), b.param("wpe.weight", (s, h))
    (tok,) = b.node("embedding", [idx, wte], [(batch, s, h)], {Axis.DP: "e0", Axis.TP: "v"}, "embed", "wte")
    (pos,) = b.node("arange", [], [(s,)], {}, "embed", "", dtype="i64", start=0, end=s)
    (pe,) = b.node("embedding", [pos, wpe], [(s, h)], {}, "embed", "wpe")
    (x,) = b.node("add", [tok, pe], [(batch, s, h)], {Axis.DP: "d0", **sp}, "embed", "")
    (x,) = b.node("dropout", [x], [(batch, s, h)], {Axis.DP: "d0", **sp}, "embed", "drop", p=dropout)
    for i in range(layers):
        L = f"blocks.{i}"

        def p(name: str, shape: tuple[int, ...], L: str = L) -> Value:
            return b.param(f"{L}.{name}", shape)

        def ln(x: Value, name: str, L: str = L) -> Value:
            return b.node("layer_norm", [x, p(f"{name}.weight", (h,)), p(f"{name}.bias", (h,))], [(batch, s, h)],
                          {Axis.DP: "e0", **({Axis.TP: "e1"} if sequence_parallel else {})}, L, f"{L}.{name}")[0]

        res = x
        (y,) = [ln(x, "ln1")]
        (qkv,) = b.node("linear", [y, p("attn.qkv.weight", (3 * h, h)), p("attn.qkv.bias", (3 * h,))],
                        [(batch, s, 3 * h)], {Axis.DP: "e0", Axis.TP: "n"}, L, f"{L}.attn.qkv")
        (r,) = b.node("reshape", [qkv], [(batch, s, a, 3 * d)], {Axis.DP: "r0", Axis.TP: "r2"}, L, f"{L}.attn",
                      shape=(batch, s, a, 3 * d))
        q, k, v = b.node("split", [r], [(batch, s, a, d)] * 3, {Axis.DP: "d0", Axis.TP: "d2"}, L, f"{L}.attn",
                         sizes=(d, d, d), dim=3)
        (q,) = b.node("permute", [q], [(batch, a, s, d)], {Axis.DP: "d0", Axis.TP: "d2"}, L, f"{L}.attn", dims=(0, 2, 1, 3))
        (k,) = b.node("permute", [k], [(batch, a, d, s)], {Axis.DP: "d0", Axis.TP: "d2"}, L, f"{L}.attn", dims=(0, 2, 3, 1))
        (v,) = b.node("permute", [v], [(batch, a, s, d)], {Axis.DP: "d0", Axis.TP: "d2"}, L, f"{L}.attn", dims=(0, 2, 1, 3))
        heads_split = {Axis.DP: "d0", Axis.TP: "d1"}
        (att,) = b.node("matmul", [q, k], [(batch, a, s, s)], {Axis.DP: "e0", Axis.TP: "e1"}, L, f"{L}.attn")
        (att,) = b.node("mul", [att], [(batch, a, s, s)], heads_split, L, f"{L}.attn", other=1.0 / math.sqrt(d))
        (att,) = b.node("masked_fill", [att, mask], [(batch, a, s, s)], heads_split, L, f"{L}.attn",
                        value=float("-inf"))
        (att,) = b.node("softmax", [att], [(batch, a, s, s)], heads_split, L, f"{L}.attn", dim=-1)
        (att,) = b.node("dropout", [att], [(batch, a, s, s)], heads_split, L, f"{L}.attn.attn_drop", p=dropout)
        (o,) = b.node("matmul", [att, v], [(batch, a, s, d)], {Axis.DP: "e0", Axis.TP: "e1"}, L, f"{L}.attn")
        (o,) = b.node("permute", [o], [(batch, s, a, d)], {Axis.DP: "d0", Axis.TP: "d1"}, L, f"{L}.attn", dims=(0, 2, 1, 3))
        (o,) = b.node("reshape", [o], [(batch, s, h)], {Axis.DP: "r0", Axis.TP: "r2"}, L, f"{L}.attn", shape=(batch, s, h))
        (o,) = b.node("linear", [o, p("attn.proj.weight", (h, h))], [(batch, s, h)], {Axis.DP: "e0", Axis.TP: "k"}, L,
                      f"{L}.attn.proj")
        (o,) = b.node("add", [o, p("attn.proj.bias", (h,))], [(batch, s, h)], {Axis.DP: "d0", **sp}, L, f"{L}.attn.proj")
        (o,) = b.node("dropout", [o], [(batch, s, h)], {Axis.DP: "d0", **sp}, L, f"{L}.attn.resid_drop", p=dropout)
        (x,) = b.node("add", [res, o], [(batch, s, h)], {Axis.DP: "d0", **sp}, L, L)
        res = x
        (y,) = [ln(x, "ln2")]
        (f,) = b.node("linear", [y, p("mlp.fc1.weight", (4 * h, h)), p("mlp.fc1.bias", (4 * h,))],
                      [(batch, s, 4 * h)], {Axis.DP: "e0", Axis.TP: "n"}, L, f"{L}.mlp.fc1")
        (f,) = b.node("gelu", [f], [(batch, s, 4 * h)], {Axis.DP: "d0", Axis.TP: "d2"}, L, f"{L}.mlp")
        (f,) = b.node("linear", [f, p("mlp.fc2.weight", (h, 4 * h))], [(batch, s, h)], {Axis.DP: "e0", Axis.TP: "k"}, L,
                      f"{L}.mlp.fc2")
        (f,) = b.node("add", [f, p("mlp.fc2.bias", (h,))], [(batch, s, h)], {Axis.DP: "d0", **sp}, L, f"{L}.mlp.fc2")
        (f,) = b.node("dropout", [f], [(batch, s, h)], {Axis.DP: "d0", **sp}, L, f"{L}.mlp.drop", p=dropout)
        (x,) = b.node("add", [res, f], [(batch, s, h)], {Axis.DP: "d0", **sp}, L, L)
    lnf = [b.param("ln_f.weight", (h,)), b.param("ln_f.bias", (h,))]
    (y,) = b.node("layer_norm", [x, *lnf], [(batch, s, h)], {Axis.DP: "e0", **({Axis.TP: "e1"} if sequence_parallel else {})},
                  "head", "ln_f")
    (logits,) = b.node("linear", [y, wte], [(batch, s, vocab)], {Axis.DP: "e0", Axis.TP: "n"}, "head", "lm_head")
    (loss,) = b.node("cross_entropy", [logits, labels], [()], {Axis.DP: "d0", Axis.TP: "v"}, "head", "loss", dtype="f32")
    g.outputs.append(loss)
    stages = pp * vpp
    g.layers["embed"] = Layer("embed", "embed", LayerAnnotation(stage=0, zero=zero))
    for i in range(layers):
        stage = i * stages // layers
        g.layers[f"blocks.{i}"] = Layer(f"blocks.{i}", "block", LayerAnnotation(stage, recompute, zero))
    g.layers["head"] = Layer("head", "head", LayerAnnotation(stage=stages - 1, zero=zero))
    return g
