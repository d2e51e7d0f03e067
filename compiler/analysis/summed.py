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
When some reader reads it without splitting the axis (its gradient is already whole there) the
parameter keeps its per-use markers (`shardc.analysis.resharding.markers`): a sum of the whole
gradient would count that reader's part once per rank.
"""

from __future__ import annotations

from shardc.analysis.propagate import io_layouts
from shardc.ir import DATA_AXES, Graph, Replicate, Value


def parameter_of(value: Value) -> Value | None:
    """The parameter `value` is (itself, or the output of that parameter's `grad_sync`), else None."""
    if value.kind == "parameter":
        return value
    producer = value.producer
    if producer is not None and producer.op == "grad_sync" and producer.inputs:
        return parameter_of(producer.inputs[0])
    return None


def summed_per_step(graph: Graph, data_axes: tuple[str, ...] = DATA_AXES) -> dict[str, tuple[str, ...]]:
    """Trainable parameter name -> the model axes (mesh order) its gradient is summed over once
    per step (module rule); parameters with none are left out."""
    mesh = graph.mesh
    if mesh is None:
        return {}
    model = [a for a in mesh.names if a not in data_axes and mesh.axis_size(a) > 1]
    if not model:
        return {}
    ok: dict[str, set[str]] = {}
    for node in graph.nodes:
        if node.op == "grad_sync":
            continue
        part = node.partition
        split = ({a for a, _ in part.spatial} | {a for t in part.temporal for a in t.axes}) if part else set()
        ins, _ = io_layouts(node, mesh)
        for v, need in zip(node.inputs, ins):
            param = parameter_of(v)
            if param is None or not param.requires_grad:
                continue
            fits = {a for a in model if a in split and isinstance(need.on(a), Replicate)}
            ok[param.name] = ok[param.name] & fits if param.name in ok else fits
    return {name: tuple(a for a in model if a in axes) for name, axes in ok.items() if axes}
