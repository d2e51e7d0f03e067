"""The attention core of a layer: what selective recomputation (Korthikanti et al. 2022) drops
and runs again in backward. One definition, read by the cost model (`shardc.cost.layer`,
`shardc.cost.timeline`), the solver and the torch backend's codegen, so the recomputation
that is priced is the one that is executed.

Rule. An activation product is a contraction of two operands that both depend on the batch
(`batch_dependent`): the QK^T and PV products of attention written out as matmuls (a linear or
matmul by a parameter is not one). In a layer's nodes, in graph order, a core runs from an
activation product through the next one, both included, with every node between them (the
scale, the mask, softmax, dropout); a layer may hold several (cross-attention); a last
product without its pair is no core. The core's own tensors (scores, probabilities, the
dropout mask) are what it drops; its inputs (q, k, v) and its output (the context) are kept.

A fused attention node (`scaled_dot_product_attention`, kind "attention") is no core: like
FlashAttention, whose backward recomputes the score matrix from q, k, v and the log-sum-exp,
it never stores anything quadratic in the sequence, so there is nothing for selective
recomputation to drop (Megatron-LM's advice: with flash attention, selective recomputation is
unneeded). A layer whose attention is fused therefore recomputes nothing under `selective`,
in the cost model and in execution alike.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from shardc.ir import Graph, Node, Value
from shardc.ops.registry import get_op


def batch_dependent(graph: Graph) -> set[Value]:
    """The values of `graph` that depend on the batch: a value without a producer that is an
    activation (a graph input), and every output of a node reading one. Producers are followed
    past the graph's own nodes, so a pipeline stage's input received from an earlier stage
    counts exactly when it does in the whole graph."""
    known: dict[Value, bool] = {}
    for start in graph.values():
        stack = [start]
        while stack:  # post-order over producers (iterative: graphs are deep)
            v = stack[-1]
            if v in known:
                stack.pop()
            elif v.producer is None:
                known[v] = v.kind in ("input", "activation")
                stack.pop()
            else:
                pending = [u for u in v.producer.inputs if u not in known]
                if pending:
                    stack.extend(pending)
                    continue
                found = any(known[u] for u in v.producer.inputs)
                for out in v.producer.outputs:
                    known[out] = found
                stack.pop()
    return {v for v in graph.values() if known[v]}


def is_activation_product(node: Node, batched: Collection[Value]) -> bool:
    """A contraction of two batch-dependent operands: the QK^T and PV products of attention."""
    return (get_op(node.op).kind == "contraction" and len(node.inputs) >= 2
            and node.inputs[0] in batched and node.inputs[1] in batched)


def attention_cores(nodes: Sequence[Node], batched: Collection[Value]) -> list[list[Node]]:
    """The cores of a layer's `nodes` (graph order), each a list of nodes in graph order (module rule)."""
    cores: list[list[Node]] = []
    current: list[Node] | None = None
    for node in nodes:
        if is_activation_product(node, batched):
            if current is None:
                current = [node]
            else:
                current.append(node)
                cores.append(current)
                current = None
        elif current is not None:
            current.append(node)
    return cores


def attention_core(nodes: Sequence[Node], batched: Collection[Value]) -> frozenset[Node]:
    """Every node of the layer's attention cores (`attention_cores`), as a set."""
    return frozenset(n for core in attention_cores(nodes, batched) for n in core)


def layer_nodes(graph: Graph) -> dict[str | None, list[Node]]:
    """Each layer's nodes in graph order (None: the nodes outside any layer)."""
    out: dict[str | None, list[Node]] = {}
    for node in graph.nodes:
        out.setdefault(node.layer, []).append(node)
    return out


def core_runs(nodes: Iterable[Node], core: Collection[Node]) -> list[list[Node]]:
    """`nodes` cut into maximal runs, alternately outside and inside `core`, in order."""
    runs: list[list[Node]] = []
    inside: bool | None = None
    for node in nodes:
        here = node in core
        if runs and here == inside:
            runs[-1].append(node)
        else:
            runs.append([node])
            inside = here
    return runs
