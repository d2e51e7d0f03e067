"""Model dimensions read off an IR graph: layers, heads, kv heads, hidden, vocab, sequence, batch.

`model_dims(graph)` is what plan validation (`shardc.plan.validate_plan`) needs to know about
a Transformer; each figure is None where the graph does not say (rules in its docstring).
`batch_scale` / `graph_batch_scale` say how the batch a graph was traced at relates to a plan's
micro-batch: the one rule the cost model and the solver scale batch-dependent sizes by.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

from shardc.ir import Axis, Graph, Node, Shard, Value
from shardc.ops.registry import get_op, has_op


@dataclass(frozen=True, slots=True)
class ModelDims:
    """What plan validation needs to know about a Transformer; None where the graph does not say."""

    layers: int
    heads: int | None
    kv_heads: int | None
    hidden: int | None
    vocab: int | None
    seq: int | None
    batch: int | None

    def as_kwargs(self) -> dict[str, int | None]:
        """Keyword arguments for `validate_plan`."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class BatchScale:
    """How a graph traced at `traced` sequences stands for a plan's micro-batch.

    Rule: each of the `replicas` data-parallel replicas holds `mb` sequences per micro-batch;
    `model` further mesh axes (tp, cp, ...) that also cut the batch dim (a solver's `tp:e0`)
    leave each device `mb / model` of them. One device holds `local` of the traced sequences
    (ceil division, as every local shape is), so its batch-dependent sizes and FLOPs are
    multiplied by `factor`; the unsplit batch dim, `traced` long, stands for `global_factor`
    times as many sequences (dp*mb)."""

    traced: int
    mb: int
    replicas: int
    local: int
    model: int = 1

    @property
    def factor(self) -> float:
        """From one device's share of the traced batch to its share of the micro-batch."""
        return self.mb / self.model / max(self.local, 1)

    @property
    def global_factor(self) -> float:
        """From the traced batch to the micro-batch of all replicas together (dp*mb sequences)."""
        return self.mb * self.replicas / self.traced


def batch_scale(traced: int, mb: int, replicas: int = 1) -> BatchScale:
    """A graph traced at `traced` sequences, not yet partitioned, priced for `replicas`
    data-parallel replicas of `mb` sequences each, which split the traced batch evenly."""
    return BatchScale(traced, mb, replicas, -(-traced // replicas))


def graph_batch_scale(graph: Graph, mb: int) -> BatchScale:
    """A graph as partitioned, at a micro-batch of `mb` sequences per data-parallel replica.
    The traced batch is dim 0 of the first graph input; the split is that input's layout (the
    axes that shard its dim 0; those besides dp are model axes). A graph without a batched
    input is taken as traced at the micro-batch (a factor of 1)."""
    if not graph.inputs or not graph.inputs[0].type.shape:
        return BatchScale(mb, mb, 1, mb)
    first = graph.inputs[0]
    traced = first.type.shape[0]
    local, model, replicas = traced, 1, 1
    if graph.mesh is not None and first.layout is not None:
        local = first.layout.local_shape(first.type.shape, graph.mesh)[0]
        for axis, p in first.layout.placements:
            if isinstance(p, Shard) and p.dim == 0:
                if axis == Axis.DP:
                    replicas *= graph.mesh.axis_size(axis)
                else:
                    model *= graph.mesh.axis_size(axis)
    return BatchScale(traced, mb, replicas, local, model)


def _attention_nodes(graph: Graph) -> list[tuple[Node, int, int, int, int]]:
    """(node, batch, heads, kv_heads, seq) of every attention: fused sdpa, or a softmax over
    square `[b, heads, s, s]` scores (explicit attention). KV heads are the fewest heads the
    keys had before GQA's repeat (expand + reshape) made them as many as the queries."""
    found: list[tuple[Node, int, int, int, int]] = []
    for node in graph.nodes:
        if node.op == "scaled_dot_product_attention" and len(node.inputs) >= 2:
            q, k = node.inputs[0].type.shape, node.inputs[1].type.shape
            if len(q) >= 3:
                b = q[0] if len(q) == 4 else 1
                found.append((node, b, q[-3], _source_heads(node.inputs[1], b, k[-3], set(k[-2:])), q[-2]))
        elif node.op == "softmax" and node.inputs:
            s = node.inputs[0].type.shape
            if len(s) == 4 and s[-1] == s[-2]:
                mm = _producer_through(node.inputs[0], ("elementwise", "view"), "matmul")
                kv = s[1]
                if mm is not None and len(mm.inputs) == 2 and mm.inputs[1].type.rank == 4:
                    kv = _source_heads(mm.inputs[1], s[0], s[1], set(mm.inputs[1].type.shape[-2:]))
                found.append((node, s[0], s[1], kv, s[-1]))
    return found


def _kind(node: Node) -> str:
    return get_op(node.op).kind if has_op(node.op) else ""


def _producer_through(value: Value, kinds: tuple[str, ...], op: str, depth: int = 8) -> Node | None:
    """The nearest `op` node `value` comes from, following same-shaped operands of `kinds` ops."""
    for _ in range(depth):
        node = value.producer
        if node is None or node.op == op:
            return node
        same = [v for v in node.inputs if v.type.shape == value.type.shape]
        if _kind(node) not in kinds or not same:
            return None
        value = same[0]
    return None


def _source_heads(value: Value, batch: int, heads: int, tail: set[int], depth: int = 8) -> int:
    """The fewest heads h of a `[batch, h, *tail]` tensor that `value` is a view of."""
    best, frontier = heads, [value]
    for _ in range(depth):
        nodes = [v.producer for v in frontier if v.producer is not None and _kind(v.producer) == "view"]
        frontier = [v for n in nodes for v in n.inputs]
        for v in frontier:
            sh = v.type.shape
            if len(sh) == 4 and sh[0] == batch and set(sh[2:]) == tail and 0 < sh[1] < best and heads % sh[1] == 0:
                best = sh[1]
    return best


def _layer_key(node: Node) -> str:
    if node.layer:
        return node.layer
    parts = node.location.module_path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return node.location.module_path


def _most_common(values: list[int]) -> int | None:
    """The most frequent value; the largest among equally frequent ones."""
    counts = Counter(values)
    return max(counts, key=lambda v: (counts[v], v)) if counts else None


def model_dims(graph: Graph) -> ModelDims:
    """Read layers, heads, kv heads, hidden, vocab, sequence and batch off an IR graph.

    Layers: distinct layers (the group-layers annotation, else the module path up to its first
    index, `blocks.3`) holding an attention; without attention, the indexed layers of
    `graph.layers` (else the most repeated block), else of indexed module paths. Heads, batch and sequence: from attention shapes. Hidden: the
    layer_norm/rms_norm width (the embedding's when both occur). Vocab: the largest embedding fed
    by a graph input (token ids), else the cross-entropy class count, else the largest embedding.
    """
    attn = _attention_nodes(graph)
    if attn:
        layers = len({_layer_key(n) for n, *_ in attn})
    elif graph.layers:
        # Indexed layers (`layers.3`) count even when their shapes differ (an MLP's first layer).
        indexed = [name for name in graph.layers if any(p.isdigit() for p in name.split("."))]
        layers = len(indexed) or Counter(layer.block for layer in graph.layers.values()).most_common(1)[0][1]
    else:  # not grouped yet: indexed module paths (`layers.3`) under their most common prefix
        keys = {_layer_key(n) for n in graph.nodes if any(p.isdigit() for p in n.location.module_path.split("."))}
        prefixes = Counter(k.rsplit(".", 1)[0] for k in keys)
        layers = prefixes.most_common(1)[0][1] if prefixes else 0
    heads = _most_common([a[2] for a in attn])
    kv = _most_common([a[3] for a in attn])
    inputs = set(graph.inputs)
    embeddings = [n for n in graph.nodes if n.op == "embedding" and len(n.inputs) == 2]
    # Norm widths: prefer the embedding width (qk-norms over the head dim are as frequent).
    widths = [n.inputs[1].type.shape[-1] if len(n.inputs) > 1 else n.inputs[0].type.shape[-1]
              for n in graph.nodes if n.op in ("layer_norm", "rms_norm") and n.inputs]
    emb_width = [n.inputs[1].type.shape[-1] for n in embeddings]
    hidden = next((w for w in emb_width if w in widths), _most_common(widths) or (emb_width[0] if emb_width else None))
    token = [n.inputs[1].type.shape[0] for n in embeddings if n.inputs[0] in inputs]
    losses = [n.inputs[0].type.shape[-1] for n in graph.nodes if n.op == "cross_entropy" and n.inputs]
    vocab = max(token or losses or [n.inputs[1].type.shape[0] for n in embeddings] or [0]) or None
    batch, seq = _most_common([a[1] for a in attn]), _most_common([a[4] for a in attn])
    if batch is None or seq is None:
        ids = [v.type.shape for v in graph.inputs if v.type.rank == 2 and not v.type.is_float]
        if ids:
            batch, seq = batch or ids[0][0], seq or ids[0][1]
    return ModelDims(layers, heads, kv, hidden, vocab, seq, batch)
