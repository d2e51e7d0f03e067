"""Parameters whose gradient is summed over a model axis once per step, not once per use.

Rule. A trainable parameter replicated on a model axis (tp, ep, ...: not a data axis) and read
by nodes that split that axis (the solver's favourite: `partition<tp:e0>`, the tp axis used as a
batch split with the weights replicated) gets a partial gradient on every rank of the axis. When
*every* reader of the parameter needs it replicated on the axis and splits the axis, the
parameter's whole gradient is partial there, and, gradients accumulating linearly over uses and
micro-batches, one all_reduce(sum) of the accumulated gradient after the step's last backward
gives what one all_reduce per use per micro-batch gives: the runtime does that, bucketed
(`shardc.backends.torch.gradsum`), the lowering puts the axis in the parameter's `grad_sync`
(`sum_axes`) instead of a `grad_all_reduce` marker per use, and the cost model prices it with
the step's gradient sync (`shardc.cost.sync`: "other axes ... all-reduced after backward").
A node that differentiates only into parameters and does not split the axis (a position
embedding whose output every reader splits) passes its output's partial gradient on: its output
gets no marker and its parameters join the sum (`passes_through`), as the cost model prices it.
A reader that takes its own shard of the replicated parameter (a `chunk`, as the head's rotating
shard of a tied embedding) joins too: its chunk's backward zero-pads the shard's gradient (`pad`,
partial) instead of all-gathering it, and the sum assembles it. When some reader reads it
replicated without splitting the axis (its gradient is already whole there) the parameter keeps
its per-use markers (`shardc.analysis.resharding.markers`): a sum of the whole
gradient would count that reader's part once per rank.
"""

from __future__ import annotations

from shardc.analysis.propagate import io_layouts, requires_grad
from shardc.ir import DATA_AXES, Graph, Layout, Node, Replicate, Shard, Value


def parameter_of(value: Value) -> Value | None:
    """The parameter `value` is (itself, or the output of that parameter's `grad_sync`), else None."""
    if value.kind == "parameter":
        return value
    producer = value.producer
    if producer is not None and producer.op == "grad_sync" and producer.inputs:
        return parameter_of(producer.inputs[0])
    return None


def summed_per_step(graph: Graph, data_axes: tuple[str, ...] = DATA_AXES) -> dict[str, tuple[str, ...]]:
    """Value name -> the model axes (mesh order) its gradient is summed over once per step
    (module rule): trainable parameters, and the outputs of nodes that differentiate only into
    parameters (`passes_through`); values with none are left out."""
    mesh = graph.mesh
    if mesh is None:
        return {}
    model = [a for a in mesh.names if a not in data_axes and mesh.axis_size(a) > 1]
    if not model:
        return {}
    grads = requires_grad(graph)
    readers: dict[Value, list[tuple[set[str], Layout, Node]]] = {}
    for node in graph.nodes:
        if node.op == "grad_sync":
            continue
        part = node.partition
        split = ({a for a, _ in part.spatial} | {a for t in part.temporal for a in t.axes}) if part else set()
        ins, _ = io_layouts(node, mesh)
        for v, need in zip(node.inputs, ins):
            key = parameter_of(v) or v
            if grads.get(key, False):
                readers.setdefault(key, []).append((split, need, node))

    def whole(v: Value) -> set[str]:  # the axes every reader splits, reading v replicated there
        out = set(model)
        for split, need, _ in readers.get(v, []):
            out &= {a for a in split if isinstance(need.on(a), Replicate)}
        return out if v in readers else set()

    out: dict[str, set[str]] = {}
    through: dict[Node, set[str]] = {}
    for v in list(readers):
        if v.kind == "activation" and v.producer is not None and passes_through(v.producer, grads):
            through[v.producer] = whole(v)
            if through[v.producer]:
                out[v.name] = through[v.producer]
    for v in graph.params:
        if v not in readers:
            continue
        held = v.layout or Layout()
        axes = {a for a in model if isinstance(held.on(a), Replicate)}
        for split, need, node in readers[v]:
            reader = {a for a in split if isinstance(need.on(a), Replicate)}
            reader |= {a for a in through.get(node, set()) if a not in split and isinstance(need.on(a), Replicate)}
            reader |= {a for a in model if isinstance(need.on(a), Shard)}  # chunked: its gradient zero-padded
            axes &= reader
        if axes:
            out[v.name] = axes
    return {name: tuple(a for a in model if a in axes) for name, axes in out.items()}


def passes_through(node: Node, grads: dict[Value, bool]) -> bool:
    """A single-output node whose only inputs needing a gradient are parameters (a position
    embedding): its weight gradient is linear in its output gradient, so where that is partial on
    an axis the node does not split, the weight gradient is partial there too and is summed once
    per step with the others, instead of the output gradient once per micro-batch
    (`shardc.cost.edges.passthrough_axes` prices it so)."""
    return len(node.outputs) == 1 and all(v.kind == "parameter" or parameter_of(v) is not None
                                          or not grads.get(v, False) for v in node.inputs)
