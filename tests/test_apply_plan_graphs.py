"""Hand-built graphs shaped like the torch frontend's output, for the apply-plan and resharding tests.

`GraphBuilder` infers every output type by running the op's registry implementation on the
meta device, so a test graph is a few lines per node. Tests of the builder itself are at the end.
"""

from __future__ import annotations

from typing import Any

import torch

from shardc.ir import Graph, Location, Node, TensorType, Value
from shardc.ir.dtypes import dtype_name, torch_dtype
from shardc.ops.registry import get_op


class GraphBuilder:
    """Adds inputs, parameters, buffers and nodes to a graph in order."""

    def __init__(self, name: str) -> None:
        self.graph = Graph(name)
        self.count = 0

    def input(self, name: str, shape: tuple[int, ...], dtype: str = "i64") -> Value:
        v = Value(name, TensorType(shape, dtype), "input")
        self.graph.inputs.append(v)
        return v

    def param(self, name: str, shape: tuple[int, ...], dtype: str = "f32") -> Value:
        v = Value(name, TensorType(shape, dtype), "parameter", requires_grad=True)
        self.graph.params.append(v)
        return v

    def buffer(self, name: str, shape: tuple[int, ...], dtype: str = "bool") -> Value:
        v = Value(name, TensorType(shape, dtype), "buffer")
        self.graph.buffers.append(v)
        return v

    def __call__(self, op: str, *inputs: Value, module: str = "", **attrs: Any) -> Any:
        """Add `op(*inputs)[attrs]`; returns its output, or the list of outputs of a multi-output op."""
        meta = [torch.empty(v.type.shape, dtype=torch_dtype(v.type.dtype), device="meta") for v in inputs]
        result = get_op(op).impl(*meta, **attrs)
        results = list(result) if isinstance(result, tuple | list) else [result]
        outs = []
        for r in results:
            outs.append(Value(f"x{self.count}", TensorType(tuple(r.shape), dtype_name(r.dtype))))
            self.count += 1
        self.graph.nodes.append(Node(op, list(inputs), outs, dict(attrs), Location(module)))
        return outs if len(outs) > 1 else outs[0]

    def done(self, *outputs: Value) -> Graph:
        self.graph.outputs = list(outputs)
        return self.graph


def mlp_block(batch: int = 4, seq: int = 8, hidden: int = 16, bias: bool = True) -> Graph:
    """x + dropout(fc2(gelu(fc1(layer_norm(x))))) on activations x[batch, seq, hidden]."""
    b = GraphBuilder("mlp")
    x = b.input("x", (batch, seq, hidden), "f32")
    ln = b("layer_norm", x, b.param("ln.weight", (hidden,)), b.param("ln.bias", (hidden,)), module="ln")
    fc1 = [b.param("fc1.weight", (4 * hidden, hidden))] + ([b.param("fc1.bias", (4 * hidden,))] if bias else [])
    fc2 = [b.param("fc2.weight", (hidden, 4 * hidden))] + ([b.param("fc2.bias", (hidden,))] if bias else [])
    h = b("linear", ln, *fc1, module="fc1")
    h = b("gelu", h, module="act")
    h = b("linear", h, *fc2, module="fc2")
    h = b("dropout", h, module="drop", p=0.1)
    return b.done(b("add", x, h))


def attention_block(batch: int = 2, seq: int = 8, hidden: int = 16, heads: int = 4) -> Graph:
    """x + proj(attention(split(qkv(layer_norm(x))))) with a fused qkv and causal sdpa."""
    b = GraphBuilder("attn")
    d = hidden // heads
    x = b.input("x", (batch, seq, hidden), "f32")
    ln = b("layer_norm", x, b.param("ln.weight", (hidden,)), b.param("ln.bias", (hidden,)), module="ln")
    qkv = b("linear", ln, b.param("qkv.weight", (3 * hidden, hidden)), b.param("qkv.bias", (3 * hidden,)),
            module="qkv")
    q, k, v = b("split", qkv, module="", sizes=(hidden, hidden, hidden), dim=2)
    heads_first = []
    for t in (q, k, v):
        t = b("reshape", t, shape=(batch, seq, heads, d))
        heads_first.append(b("permute", t, dims=(0, 2, 1, 3)))
    y = b("scaled_dot_product_attention", *heads_first, module="attn", is_causal=True)
    y = b("permute", y, dims=(0, 2, 1, 3))
    y = b("reshape", y, shape=(batch, seq, hidden))
    y = b("linear", y, b.param("proj.weight", (hidden, hidden)), b.param("proj.bias", (hidden,)), module="proj")
    return b.done(b("add", x, y))


def tiny_lm(layers: int = 2, batch: int = 2, seq: int = 8, hidden: int = 16, heads: int = 4,
            vocab: int = 32, flatten_loss: bool = False) -> Graph:
    """A GPT-like language model with separate q/k/v, learned positions and a tied head; with
    `flatten_loss` the loss reads `logits.view(-1, vocab)` and `targets.view(-1)` (nanoGPT)."""
    b = GraphBuilder("lm")
    d = hidden // heads
    idx = b.input("idx", (batch, seq))
    targets = b.input("targets", (batch, seq))
    wte = b.param("wte.weight", (vocab, hidden))
    pos = b("arange", start=0, end=seq)
    x = b("add", b("embedding", idx, wte, module="wte"),
          b("embedding", pos, b.param("wpe.weight", (seq, hidden)), module="wpe"))
    for i in range(layers):
        p = f"blocks.{i}"
        ln = b("layer_norm", x, b.param(f"{p}.ln1.weight", (hidden,)), b.param(f"{p}.ln1.bias", (hidden,)),
               module=f"{p}.ln1")
        qkv = []
        for name in ("q", "k", "v"):
            t = b("linear", ln, b.param(f"{p}.attn.{name}.weight", (hidden, hidden)), module=f"{p}.attn.{name}")
            t = b("reshape", t, shape=(batch, seq, heads, d), module=f"{p}.attn")
            qkv.append(b("permute", t, dims=(0, 2, 1, 3), module=f"{p}.attn"))
        y = b("scaled_dot_product_attention", *qkv, module=f"{p}.attn", is_causal=True)
        y = b("reshape", b("permute", y, dims=(0, 2, 1, 3), module=f"{p}.attn"), shape=(batch, seq, hidden),
              module=f"{p}.attn")
        y = b("linear", y, b.param(f"{p}.attn.o.weight", (hidden, hidden)), module=f"{p}.attn.o")
        x = b("add", x, y, module=p)
        ln = b("layer_norm", x, b.param(f"{p}.ln2.weight", (hidden,)), b.param(f"{p}.ln2.bias", (hidden,)),
               module=f"{p}.ln2")
        h = b("gelu", b("linear", ln, b.param(f"{p}.mlp.fc1.weight", (4 * hidden, hidden)), module=f"{p}.mlp.fc1"),
              module=f"{p}.mlp")
        h = b("linear", h, b.param(f"{p}.mlp.fc2.weight", (hidden, 4 * hidden)), module=f"{p}.mlp.fc2")
        x = b("add", x, h, module=p)
    x = b("layer_norm", x, b.param("ln_f.weight", (hidden,)), b.param("ln_f.bias", (hidden,)), module="ln_f")
    logits = b("linear", x, wte, module="lm_head")
    if flatten_loss:
        logits = b("reshape", logits, shape=(batch * seq, vocab))
        targets = b("reshape", targets, shape=(batch * seq,))
    return b.done(b("cross_entropy", logits, targets, module=""))


def test_builder_infers_types() -> None:
    g = attention_block()
    assert [n.op for n in g.nodes][:3] == ["layer_norm", "linear", "split"]
    assert g.outputs[0].type == TensorType((2, 8, 16), "f32")
    lm = tiny_lm()
    assert lm.outputs[0].type == TensorType((), "f32")
    assert len(lm.params) == 2 + 2 * 10 + 2  # wte, wpe, 10 per block, ln_f
