"""Transformer graphs built straight in the IR, for planning without tracing a torch model.

`transformer_graph(TransformerDims(...))` returns the forward graph of a decoder-only
Transformer (GPT-2 style: layer norm, GELU MLP, biases; or Llama style: RMS norm, rotary
embeddings, SwiGLU, grouped-query attention) with `node.layer` and `graph.layers` set the way
group-layers sets them (`embed`, `blocks.i` of class `block`, `head`). q, k and v are separate
projections and the LM head is untied. Tests use these graphs, and the planner falls back to
them when a model cannot be traced.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.ir import Graph, Layer, Location, Node, TensorType, Value


@dataclass(frozen=True, slots=True)
class TransformerDims:
    """Sizes of a decoder-only Transformer; `style` is "gpt" or "llama"."""

    name: str = "gpt"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq: int = 32
    batch: int = 2
    ffn: int | None = None
    kv_heads: int | None = None
    style: str = "gpt"
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.style not in ("gpt", "llama"):
            raise ValueError(f"style must be gpt or llama, got {self.style!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")

    @property
    def ffn_size(self) -> int:
        if self.ffn is not None:
            return self.ffn
        return 4 * self.hidden if self.style == "gpt" else 256 * ((8 * self.hidden // 3 + 255) // 256)


# Sizes from the papers and model cards (Llama FFN sizes are the published ones). Batch 2:
# the registry binds a batch of one as a broadcast dim, which no mesh axis can split.
PRESETS: dict[str, TransformerDims] = {
    "tiny": TransformerDims("tiny", 2, 64, 4, 128, 32, 2),
    "gpt2_1.5b": TransformerDims("gpt2_1.5b", 48, 1600, 25, 50257, 1024, 2),
    "gpt3_175b": TransformerDims("gpt3_175b", 96, 12288, 96, 51200, 2048, 2),
    "llama_7b": TransformerDims("llama_7b", 32, 4096, 32, 32000, 4096, 2, 11008, None, "llama"),
    "llama_70b": TransformerDims("llama_70b", 80, 8192, 64, 32000, 4096, 2, 28672, 8, "llama"),
}


class _Builder:
    def __init__(self, graph: Graph, dtype: str) -> None:
        self.graph, self.dtype, self.count = graph, dtype, 0
        self.layer: str | None = None

    def param(self, path: str, shape: tuple[int, ...]) -> Value:
        v = Value(path, TensorType(shape, self.dtype), "parameter", requires_grad=True)
        self.graph.params.append(v)
        return v

    def node(self, op: str, inputs: list[Value], out_shape: tuple[int, ...], path: str, dtype: str | None = None,
             **attrs: object) -> Value:
        out = Value(f"x{self.count}", TensorType(out_shape, dtype or self.dtype))
        self.count += 1
        self.graph.nodes.append(Node(op, inputs, [out], dict(attrs), Location(path), layer=self.layer))
        return out

    def linear(self, x: Value, out_features: int, path: str, bias: bool) -> Value:
        w = self.param(f"{path}.weight", (out_features, x.type.shape[-1]))
        ins = [x, w] + ([self.param(f"{path}.bias", (out_features,))] if bias else [])
        return self.node("linear", ins, x.type.shape[:-1] + (out_features,), path)

    def norm(self, x: Value, path: str, llama: bool) -> Value:
        h = x.type.shape[-1]
        if llama:
            return self.node("rms_norm", [x, self.param(f"{path}.weight", (h,))], x.type.shape, path, eps=1e-6)
        ins = [x, self.param(f"{path}.weight", (h,)), self.param(f"{path}.bias", (h,))]
        return self.node("layer_norm", ins, x.type.shape, path, eps=1e-5)

    def heads(self, x: Value, n: int, d: int, path: str) -> Value:
        b, s, _ = x.type.shape
        x = self.node("reshape", [x], (b, s, n, d), path, shape=(b, s, n, d))
        return self.node("permute", [x], (b, n, s, d), path, dims=(0, 2, 1, 3))

    def rotary(self, x: Value, cos: Value, sin: Value, path: str) -> Value:
        b, n, s, d = x.type.shape
        lo = self.node("slice", [x], (b, n, s, d // 2), path, dim=3, start=0, end=d // 2)
        hi = self.node("slice", [x], (b, n, s, d // 2), path, dim=3, start=d // 2, end=d)
        rot = self.node("concat", [self.node("neg", [hi], hi.type.shape, path), lo], x.type.shape, path, dim=3)
        return self.node("add", [self.node("mul", [x, cos], x.type.shape, path),
                                 self.node("mul", [rot, sin], x.type.shape, path)], x.type.shape, path)


def transformer_graph(dims: TransformerDims) -> Graph:
    """The forward graph (embedding, blocks, final norm, LM head, cross-entropy loss)."""
    llama = dims.style == "llama"
    b, s, h, a = dims.batch, dims.seq, dims.hidden, dims.heads
    d, kv = h // a, dims.kv_heads or dims.heads
    g = Graph(dims.name)
    ids = Value("input_ids", TensorType((b, s), "i64"), "input")
    labels = Value("labels", TensorType((b, s), "i64"), "input")
    g.inputs += [ids, labels]
    bld = _Builder(g, dims.dtype)
    cos = sin = None
    if llama:
        cos = Value("rotary.cos", TensorType((s, d), dims.dtype), "buffer")
        sin = Value("rotary.sin", TensorType((s, d), dims.dtype), "buffer")
        g.buffers += [cos, sin]
    g.layers["embed"] = Layer("embed", "embed")
    bld.layer = "embed"
    x = bld.node("embedding", [ids, bld.param("embed.weight", (dims.vocab, h))], (b, s, h), "embed")
    if not llama:
        pos = bld.param("pos_embed.weight", (s, h))
        x = bld.node("add", [x, pos], (b, s, h), "pos_embed")
    for i in range(dims.layers):
        p = f"blocks.{i}"
        g.layers[p] = Layer(p, "block")
        bld.layer = p
        y = bld.norm(x, f"{p}.norm1", llama)
        q = bld.heads(bld.linear(y, h, f"{p}.attn.q", not llama), a, d, f"{p}.attn")
        k = bld.heads(bld.linear(y, kv * d, f"{p}.attn.k", not llama), kv, d, f"{p}.attn")
        v = bld.heads(bld.linear(y, kv * d, f"{p}.attn.v", not llama), kv, d, f"{p}.attn")
        if llama:
            assert cos is not None and sin is not None
            q, k = bld.rotary(q, cos, sin, f"{p}.attn.rotary"), bld.rotary(k, cos, sin, f"{p}.attn.rotary")
        o = bld.node("scaled_dot_product_attention", [q, k, v], (b, a, s, d), f"{p}.attn",
                     is_causal=True, enable_gqa=kv != a)
        o = bld.node("permute", [o], (b, s, a, d), f"{p}.attn", dims=(0, 2, 1, 3))
        o = bld.node("reshape", [o], (b, s, h), f"{p}.attn", shape=(b, s, h))
        x = bld.node("add", [x, bld.linear(o, h, f"{p}.attn.o", not llama)], (b, s, h), p)
        y = bld.norm(x, f"{p}.norm2", llama)
        f = dims.ffn_size
        if llama:
            gate = bld.linear(y, f, f"{p}.mlp.gate", False)
            up = bld.linear(y, f, f"{p}.mlp.up", False)
            act = bld.node("mul", [bld.node("silu", [gate], (b, s, f), f"{p}.mlp"), up], (b, s, f), f"{p}.mlp")
        else:
            act = bld.node("gelu", [bld.linear(y, f, f"{p}.mlp.fc1", True)], (b, s, f), f"{p}.mlp")
        x = bld.node("add", [x, bld.linear(act, h, f"{p}.mlp.fc2" if not llama else f"{p}.mlp.down", not llama)],
                     (b, s, h), p)
    g.layers["head"] = Layer("head", "head")
    bld.layer = "head"
    x = bld.norm(x, "norm_f", llama)
    logits = bld.linear(x, dims.vocab, "lm_head", False)
    loss = bld.node("cross_entropy", [logits, labels], (), "loss")
    g.outputs.append(loss)
    return g
