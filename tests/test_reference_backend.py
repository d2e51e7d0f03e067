"""The reference backend runs IR node by node and says clearly what it is missing."""

from __future__ import annotations

import pytest
import torch

from shardc.backends.reference import model_state, run_graph
from shardc.frontend import trace_with_state
from shardc.ir import Graph, Node, TensorType, Value
from shardc.ir.diagnostics import ShardcError


def test_hand_built_graph() -> None:
    x = Value("x", TensorType((2, 3), "f32"), "input")
    w = Value("w", TensorType((4, 3), "f32"), "parameter", requires_grad=True)
    y = Value("y", TensorType((2, 4), "f32"))
    z = Value("z", TensorType((2, 4), "f32"))
    graph = Graph("g", inputs=[x], params=[w], nodes=[Node("linear", [x, w], [y]), Node("mul", [y], [z], {"other": 2.0})],
                  outputs=[z])
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    (out,) = run_graph(graph, [a], {"w": b})
    torch.testing.assert_close(out, 2 * a @ b.T)
    with pytest.raises(ShardcError, match="takes 1 inputs"):
        run_graph(graph, [], {"w": b})
    with pytest.raises(ShardcError, match="traced with f32"):
        run_graph(graph, [torch.randn(5, 3)], {"w": b})
    with pytest.raises(ShardcError, match="parameter %w"):
        run_graph(graph, [a], {})


class MaskFromFlip(torch.nn.Module):
    """A constant whose computation has no rules (flip): it becomes a `const.N` buffer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(x.shape[-1]).flip(0)
        return x * (steps > 2)


def test_constants_come_from_trace_with_state() -> None:
    model, x = MaskFromFlip(), torch.randn(2, 5)
    result = trace_with_state(model, (x,))
    (const,) = result.graph.buffers
    assert const.name.startswith("const.") and set(result.constants) == {const.name}
    torch.testing.assert_close(run_graph(result.graph, [x], model_state(model, result.graph, result.constants))[0],
                               model(x))
    with pytest.raises(ShardcError, match="trace_with_state"):
        model_state(model, result.graph)
