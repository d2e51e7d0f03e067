"""Bad input to the torch frontend: an op without a rule, opaque nodes, untraceable models; and
the lowering rules on a zoo of torch calls, checked by numbers against torch itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardc.backends.reference import model_state, run_graph
from shardc.frontend import coverage, trace, trace_with_state
from shardc.ir.diagnostics import ShardcError
from shardc.ir.equality import assert_graphs_equal
from shardc.ir.parser import parse
from shardc.ir.printer import print_graph

_NOISE = torch.linspace(0.0, 1.0, 8)


@torch.fx.wrap
def add_noise(x: torch.Tensor) -> torch.Tensor:
    """No rule, and no aten form either: it reads a tensor of its own that no op of the call makes."""
    return x + _NOISE.to(x.device)


class Scan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_noise(self.fc(x))  # (an op without a rule that torch dispatches, torch.flip, is an aten node)


class WithScan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Scan()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x).relu())


def test_unsupported_op_names_op_module_line_and_remedy() -> None:
    with pytest.raises(ShardcError) as info:
        trace(WithScan(), (torch.randn(2, 5, 8),))
    text = str(info.value)
    assert "test_frontend_errors.add_noise" in text and "reads a tensor made inside the call" in text
    assert "module inner" in text
    assert "test_frontend_errors.py:" in text
    assert "register(OpDef(" in text and "compiler/ops.py" in text and "allow_opaque" in text


def test_allow_opaque_keeps_the_call_runs_it_and_reports_it() -> None:
    model, x = WithScan(), torch.randn(2, 5, 8)
    result = trace_with_state(model, (x,), allow_opaque=True)
    graph = result.graph
    (node,) = [n for n in graph.nodes if n.op == "opaque"]
    assert node.attrs["target"] == "test_frontend_errors.add_noise" and node.location.module_path == "inner"
    report = coverage(graph)
    assert not report.complete and report.opaque_count == 1
    assert report.opaque[0].target == "test_frontend_errors.add_noise" and report.opaque[0].module_paths == ("inner",)
    assert "test_frontend_errors.add_noise x1 in inner" in str(report)
    from shardc.ops.registry import get_op

    space = get_op("opaque").iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs], node.attrs)
    assert space.splittable() == ()
    got = run_graph(graph, [x], model_state(model, graph, result.constants))[0]
    torch.testing.assert_close(got, model(x))
    assert_graphs_equal(parse(print_graph(graph)), graph)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # Python control flow on a tensor value
            return y * 2
        return y


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = DataDependent()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_untraceable_model_names_both_tracers_and_the_module() -> None:
    with pytest.raises(ShardcError) as info:
        trace(Holder(), (torch.randn(2, 8),))
    text = str(info.value)
    assert "symbolic trace failed" in text and "torch.export failed" in text
    assert "module block (DataDependent)" in text


class Zoo(nn.Module):
    """Calls the lowering rules must cover: views, indexing, split/stack, casts, scalars."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))
        self.register_buffer("table", torch.arange(24.0).view(4, 6))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        a, c = x.chunk(2, dim=-1)
        y = torch.stack([a, c], dim=1).flatten(1, 2)[:, ::2]  # [b, s, h/2]
        y = torch.cat([y, y.unsqueeze(-1).squeeze(-1)], dim=-1) @ self.w
        y = torch.where(mask[..., None], y, 0.0).clamp(min=-1.0, max=1.0)
        y = 2.0 - y / 3 + (1 - y) ** 2 + y.float().to(torch.float64).to(x.dtype)
        y = y + self.table[None, :s].expand(b, -1, -1) + x.new_ones(()) * torch.tensor(0.5)
        z = y.transpose(0, 1).contiguous().view(s, b * h).t().reshape(b, h, s).permute(0, 2, 1)
        z = z.masked_fill(~mask.unsqueeze(-1), -1.0) * (h ** -0.5)
        pieces = z.split([2, 4], dim=-1)
        tail = z[:, -1, 1:5:2].sum(dim=-1, keepdim=True).mean() + z.amax(dim=(0, 1)).sum()
        return ((pieces[0].sigmoid() * pieces[1][..., :2].tanh()).exp().log().abs().sqrt() + 1).rsqrt() + tail


def test_lowering_rules_agree_with_torch() -> None:
    torch.manual_seed(0)
    model = Zoo()
    x, mask = torch.randn(2, 4, 6), torch.rand(2, 4) > 0.3
    result = trace_with_state(model, (x, mask))
    graph = result.graph
    assert result.tracer == "fx"
    ops = {n.op for n in graph.nodes}
    assert {"split", "concat", "slice", "select", "where", "masked_fill", "matmul", "permute", "reshape",
            "expand", "maximum", "minimum", "logical_not"} <= ops
    assert [n.attrs["dtype"] for n in graph.nodes if n.op == "cast"] == ["f64", "f32"]  # .float() is a no-op
    got = run_graph(graph, [x, mask], model_state(model, graph, result.constants))[0]
    torch.testing.assert_close(got, model(x, mask))
    assert_graphs_equal(parse(print_graph(graph)), graph)


class Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True, enable_gqa=True)


def test_attention_dropout_is_written_out() -> None:
    """The fused op has no dropout: attention with dropout_p becomes matmul, softmax, dropout, matmul."""
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    graph = trace(Attention(), (q, k, v))
    ops = [n.op for n in graph.nodes]
    assert "scaled_dot_product_attention" not in ops and ops.count("matmul") == 2
    (drop,) = [n for n in graph.nodes if n.op == "dropout"]
    assert drop.attrs == {"p": 0.3, "training": True}
    drop.attrs["p"] = 0.0  # the rest of the math must equal torch's attention without dropout
    got = run_graph(graph, [q, k, v], {})[0]
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
