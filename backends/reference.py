"""The reference backend: run an unpartitioned IR graph with torch on one device, node by node.

Every node runs its registry `impl` with its attributes, so executing a traced graph checks the
frontend by numbers: the IR of a model must reproduce the model's own output. Layouts and
partitions are ignored; the graph is executed as if on a single device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardc.ir import Graph, Value
from shardc.ir.diagnostics import ShardcError
from shardc.ops.registry import get_op


def model_state(model: torch.nn.Module, graph: Graph,
                constants: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors a graph's parameters and buffers name: the model's parameters and buffers by
    their `named_parameters()`/`named_buffers()` paths, and the `const.N` buffers from
    `constants` (`shardc.frontend.trace_with_state(...).constants`)."""
    from shardc.frontend.constants import runnable_constants

    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    extra = runnable_constants(constants or {})  # a planned broadcast constant is a view
    state: dict[str, torch.Tensor] = {}
    for value in graph.params + graph.buffers:
        if value.name in own:
            state[value.name] = own[value.name]
        elif value.name in extra:
            state[value.name] = extra[value.name]
        else:
            hint = ("constants come from shardc.frontend.trace_with_state(...).constants"
                    if value.name.startswith("const.") else "is this graph traced from this model?")
            raise ShardcError(f"graph @{graph.name} needs {value.kind} %{value.name}, which the model does not have",
                              hint=hint)
    return state


def run_graph(graph: Graph, inputs: Sequence[torch.Tensor], state: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Execute `graph` on `inputs` (in `graph.inputs` order) with parameters and buffers from
    `state` (by IR name); returns the values of `graph.outputs`."""
    if len(inputs) != len(graph.inputs):
        raise ShardcError(f"graph @{graph.name} takes {len(graph.inputs)} inputs "
                          f"({', '.join(v.name for v in graph.inputs)}), got {len(inputs)}")
    env: dict[Value, Any] = {}
    for value, tensor in zip(graph.inputs, inputs):
        if tuple(tensor.shape) != value.type.shape:
            raise ShardcError(f"input %{value.name} has shape {tuple(tensor.shape)}, the graph was traced with "
                              f"{value.type}", hint="trace again with example inputs of this shape")
        env[value] = tensor
    for value in graph.params + graph.buffers:
        if value.name not in state:
            raise ShardcError(f"no tensor for {value.kind} %{value.name} in the state given to run_graph")
        env[value] = state[value.name]
    for node in graph.nodes:
        try:
            result = get_op(node.op).impl(*[env[v] for v in node.inputs], **node.attrs)
        except Exception as err:
            raise ShardcError(f"running {node.op} failed: {type(err).__name__}: {err}", node=node) from err
        results = list(result) if isinstance(result, tuple | list) else [result]
        if len(results) != len(node.outputs):
            raise ShardcError(f"{node.op} gave {len(results)} results for {len(node.outputs)} outputs", node=node)
        for value, tensor in zip(node.outputs, results):
            env[value] = tensor
    return [env[v] for v in graph.outputs]
