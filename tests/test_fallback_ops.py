"""The long tail of ops: calls with no registry entry run as aten ops, split as torch's DTensor
strategies allow (`shardc.ops.fallback`), priced by torch's flop counter; ops torch cannot shard
stay replicated and are listed. Checked by numbers against torch, by printed IR, by iteration
spaces, and by tp=2 training on 2 gloo processes against one process."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardc.backends.reference import model_state, run_graph
from shardc.frontend import coverage, trace_with_state
from shardc.ir import TensorType
from shardc.ir.equality import assert_graphs_equal
from shardc.ir.parser import parse
from shardc.ir.printer import print_graph
from shardc.ops.registry import get_op

GPTJ = ("hf:gptj?n_layer=2&n_embd=64&n_head=4&rotary_dim=8&vocab_size=128&n_positions=32&seq=16&batch=4"
        "&resid_pdrop=0&embd_pdrop=0&attn_pdrop=0")
FLIP_MLP = "tests/test_fallback_ops.py:flip_mlp"


class Tail(nn.Module):
    """Advanced indexing, index_put, gather/scatter, F.pad, torch.max(x, dim), flip."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("table", torch.randn(16, 8))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        z = torch.flip(y, dims=(1,)) + self.table[idx]
        top = torch.max(z, dim=-1).values
        padded = F.pad(z, (1, 1))
        picked = torch.gather(z, 1, idx[None, :, None].expand(2, 5, 8))
        spread = torch.zeros_like(z).scatter(1, idx[None, :, None].expand(2, 5, 8), z)
        put = z.new_zeros(5, 8).index_put((idx[:2],), y[0, :2], accumulate=True)
        return padded.sum() + top.sum() + (picked * spread).sum() + put.square().sum()


TAIL_IR = """\
graph @tail {
  input %x : f32[2,5,8]
  input %idx : i64[5]
  param %fc.weight : f32[8,8]
  param %fc.bias : f32[8]
  buffer %table : f32[16,8]
  %x0 = linear(%x, %fc.weight, %fc.bias) : f32[2,5,8] @fc
  %x1 = aten[target="torch.ops.aten.flip.default", args=("$0", (1,))](%x0) : f32[2,5,8]
  %x2 = aten[target="torch.ops.aten.index.Tensor", args=("$0", ("$1",))](%table, %idx) : f32[5,8]
  %x3 = add(%x1, %x2) : f32[2,5,8]
  %x4, %x5 = aten[target="torch.ops.aten.max.dim", args=("$0", -1), outputs=2](%x3) : f32[2,5], i64[2,5]
  %x6 = aten[target="torch.ops.aten.constant_pad_nd.default", args=("$0", (1, 1), 0.0)](%x3) : f32[2,5,10]
"""


def test_tail_ops_lower_to_aten_nodes_that_compute_what_torch_computes() -> None:
    torch.manual_seed(0)
    model, x, idx = Tail(), torch.randn(2, 5, 8), torch.tensor([3, 1, 0, 2, 4])
    result = trace_with_state(model, (x, idx), name="tail")
    graph = result.graph
    text = print_graph(graph)
    text = re.sub(r' "[^"]*\.py:\d+"$| @$', "", re.sub(r' "[^"]*\.py:\d+"$', "", text, flags=re.M), flags=re.M)
    assert text.startswith(TAIL_IR), text
    targets = {str(n.attrs["target"]) for n in graph.nodes if n.op == "aten"}
    assert {"torch.ops.aten.scatter.src", "torch.ops.aten.index_put.default", "torch.ops.aten.gather.default"} \
        & targets == {"torch.ops.aten.scatter.src", "torch.ops.aten.index_put.default"}  # gather has a rule
    assert_graphs_equal(parse(print_graph(graph)), graph)
    state = model_state(model, graph, result.constants)
    got = run_graph(graph, [x, idx], state)[0]
    want = model(x, idx)
    torch.testing.assert_close(got, want)
    (grad_got,) = torch.autograd.grad(got, [state["fc.weight"]])
    (grad_want,) = torch.autograd.grad(want, [model.fc.weight])
    torch.testing.assert_close(grad_got, grad_want)


class Shift(nn.Module):
    """In-place writes into slices and selects (BART's shift_tokens_right writes so)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = x.clone()
        z[:, 1:] = y[:, :-1]
        z[:, 0] = 0.5
        return z * 2


def test_in_place_writes_into_views_are_written_back_to_their_base() -> None:
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    result = trace_with_state(Shift(), (x, y))
    targets = [str(n.attrs["target"]).split(".")[-2] for n in result.graph.nodes if n.op == "aten"]
    assert targets == ["copy", "slice_scatter", "fill", "select_scatter"]
    got = run_graph(result.graph, [x, y], model_state(Shift(), result.graph, result.constants))[0]
    torch.testing.assert_close(got, Shift()(x, y))


def _space(target: str, ins: list[TensorType], outs: list[TensorType], args: tuple) -> Any:
    return get_op("aten").iteration_space(ins, outs, {"target": target, "args": args})


def test_iteration_spaces_come_from_torch_dtensor_strategies() -> None:
    f32, i64 = (lambda *s: TensorType(s, "f32")), (lambda *s: TensorType(s, "i64"))
    # x[:, idx]: batch and hidden split with x, the picked dim with the index; x's dim 1 never.
    space = _space("torch.ops.aten.index.Tensor", [f32(2, 8, 16), i64(4)], [f32(2, 4, 16)], ("$0", (None, "$1")))
    assert space.inputs == ((("s0",), ("o1_1",), ("s1",)), (("s2",),))
    assert space.outputs == ((("s0",), ("s2",), ("s1",)),)
    assert space.splittable() == ("s0", "s1", "s2") and "o1_1" in space.unsplittable
    # max over dim 1: the other dims split, both outputs alike.
    space = _space("torch.ops.aten.max.dim", [f32(2, 8, 16)], [f32(2, 16), i64(2, 16)], ("$0", 1))
    assert space.outputs == ((("s0",), ("s1",)),) * 2 and space.splittable() == ("s0", "s1")
    # sum over dim 1 (a registry op has a rule, but the fallback knows reductions): s1 is reduced.
    space = _space("torch.ops.aten.sum.dim_IntList", [f32(2, 8, 16)], [f32(2, 16)], ("$0", (1,)))
    assert space.reductions == ("s1",) and space.partial_op == "sum"
    # expand has a shape argument DTensor rewrites: run on local shards it would be wrong, so no split.
    space = _space("torch.ops.aten.expand.default", [f32(2, 1, 16)], [f32(2, 8, 16)], ("$0", (2, 8, 16)))
    assert space.splittable() == ()


def test_costs_come_from_torch_flop_counter_and_autograd() -> None:
    f32 = lambda *s: TensorType(s, "f32")  # noqa: E731
    op, attrs = get_op("aten"), {"target": "torch.ops.aten.bmm.default", "args": ("$0", "$1")}
    ins, outs = [f32(2, 8, 16), f32(2, 16, 4)], [f32(2, 8, 4)]
    assert op.count_flops(ins, outs, attrs) == 2 * 2 * 8 * 16 * 4
    assert sorted(op.saved_for_backward(ins, outs, attrs)) == [("in", 0), ("in", 1)]
    flip = {"target": "torch.ops.aten.flip.default", "args": ("$0", (1,))}
    assert op.count_flops([f32(4, 4)], [f32(4, 4)], flip) == 0 and op.saved_for_backward([f32(4, 4)], [f32(4, 4)], flip) == []


class Repeats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(self.fc(x), repeats, dim=1, output_size=10).sum()


def test_an_op_torch_cannot_shard_stays_replicated_and_is_listed() -> None:
    model, x, repeats = Repeats(), torch.randn(2, 5, 8), torch.tensor([1, 2, 3, 2, 2])
    result = trace_with_state(model, (x, repeats))
    # torch dispatches repeat_interleave(x, tensor) as two aten ops: the repeated positions, then a gather.
    counts, select = [n for n in result.graph.nodes if n.op == "aten"]
    assert counts.attrs["target"] == "torch.ops.aten.repeat_interleave.Tensor"
    assert select.attrs["target"] == "torch.ops.aten.index_select.default"
    for node, splittable in ((counts, ()), (select, ("s0", "s1", "s2"))):
        space = get_op("aten").iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs],
                                               node.attrs)
        assert space.splittable() == splittable
    report = coverage(result.graph)
    assert [op.target for op in report.replicated] == ["torch.ops.aten.repeat_interleave.Tensor"]
    assert "torch cannot shard these; they stay replicated:\n    torch.ops.aten.repeat_interleave.Tensor x1 in <root>" \
        in str(report)
    got = run_graph(result.graph, [x, repeats], model_state(model, result.graph, result.constants))[0]
    torch.testing.assert_close(got, model(x, repeats))


def test_inspect_hf_gptj_lists_its_fallback_ops(capsys: pytest.CaptureFixture[str]) -> None:
    from shardc.cli import main
    from shardc.frontend.spec import load_model

    assert main(["inspect", GPTJ, "--json", "--no-ir"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = load_model(GPTJ, device="meta").model
    assert out["params"] == sum(p.numel() for p in model.parameters())
    assert out["fallback_ops"] == ["torch.ops.aten.index.Tensor", "torch.ops.aten.repeat_interleave.self_int"]
    assert out["replicated_ops"] == ["torch.ops.aten.repeat_interleave.self_int"]
    assert out["opaque_ops"] == []


class FlipMLP(nn.Module):
    """An MLP whose hidden activations pass through ops without registry entries: under tp=2 the
    flip and the pad run on column-parallel shards (torch's strategies split the hidden dim)."""

    def __init__(self, vocab: int = 128, hidden: int = 32, ops: str = "ln,flip,pad,max") -> None:
        super().__init__()
        self.ops = ops.split(",")
        self.wte = nn.Embedding(vocab, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        h = self.fc1(self.ln(x)) if "ln" in self.ops else self.fc1(x)
        if "flip" in self.ops:
            h = torch.flip(h, dims=(1,))
        if "pad" in self.ops:
            h = F.pad(h, (0, 0, 1, 0))[:, :-1]  # shift the sequence by one
        x = x + self.fc2(F.gelu(h))
        if "max" in self.ops:
            x = x + torch.max(x, dim=-1, keepdim=True).values
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def flip_mlp(batch: int = 4, seq: int = 16, ops: str = "ln,flip,pad,max") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    ids = torch.randint(0, 128, (batch, seq))
    return FlipMLP(ops=ops), (ids, ids.roll(-1, 1))


def test_fallback_ops_train_under_tp2_like_one_process() -> None:
    from test_backend_numerics import compile_case, run_and_check

    compiled = compile_case(FLIP_MLP, "tp=2", "")
    ir = compiled.partitioned_ir  # type: ignore[attr-defined]
    flip = next(line for line in ir.splitlines() if "aten.flip" in line)
    assert "partition<tp:s" in flip and "{tp:S(2)}" in flip, flip  # the flip runs on hidden shards
    assert run_and_check(2, [(FLIP_MLP, "tp=2", ""), (GPTJ, "tp=2", "")]) == []
