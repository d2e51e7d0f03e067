"""Mixture-of-Experts: the routed experts of a sparse MoE layer as one registry op, `experts`.

`experts(x, index, weights, gate_up, down)[act]` is transformers' 3-D expert block (Mixtral,
Qwen3-MoE, DeepSeek-V3 `...Experts`): for every token t and each of its top-k slots j, expert
e = index[t, j] computes `down[e] @ (act(g) * u)` with `g, u = (gate_up[e] @ x[t]).chunk(2)`,
scaled by weights[t, j]; the slots' results are summed. Routing is dropless: every routed token
is computed (no capacity factor), so a split run computes exactly what one process does.

Iteration space: tokens `t`, slots `k`, experts `e`, hidden `h`, the expert's intermediate width
`i`, and the gate/up pair `c` (size 2) that the fused gate_up weight stacks, gate rows then up rows:

    x: t h   index: t k   weights: t k   gate_up: e (c i) h   down: e h i   ->   out: t h

`t` splits plainly (each rank routes its own tokens through every expert). `e` carries the rule
"expert" (expert parallelism): a mesh axis splitting it shards the expert weights on dim 0 and
every token operand on its first dim (`registry.operand_layout`), and the op itself exchanges
the routed tokens over that axis: an all-to-all dispatches each token to the rank holding its
expert and another combines the results (`shardc.backends.torch.experts`). `i` splits plainly:
expert tensor parallelism (Megatron's column-parallel gate/up, row-parallel down inside every
expert): a rank keeps rows r of both the gate and the up half of `gate_up` (a strided shard, two
pieces, `Shard(1)` interleaved by 2) and the matching columns of `down`, so `act(gate) * up` is
local and the output is `Partial(sum)` over the axis (all-reduced, or reduce-scattered with
sequence parallelism, like any row-parallel linear). `h`, `k`, `c` stay whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shardc.ir import TensorType
from shardc.ops.registry import IterationSpace, OpDef, register

Types = Sequence[TensorType]

# The activations the op runs between gate and up, by transformers' `hidden_act` names.
ACTIVATIONS: dict[str, Any] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
EXPERT_RULE = "expert"


def experts_space(i: Types, o: Types, a: dict[str, Any]) -> IterationSpace:
    t, h = i[0].shape
    k = i[1].shape[1]
    e = i[3].shape[0]
    inner = i[4].shape[2]
    sizes = (("t", t), ("k", k), ("e", e), ("h", h), ("c", 2), ("i", inner))
    ins = ((("t",), ("h",)), (("t",), ("k",)), (("t",), ("k",)), (("e",), ("c", "i"), ("h",)),
           (("e",), ("h",), ("i",)))
    return IterationSpace(sizes, ins, ((("t",), ("h",)),), unsplittable=frozenset({"k", "h", "c"}),
                          special=(("e", EXPERT_RULE),))


def local_experts(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, act: str = "silu", first: int = 0) -> torch.Tensor:
    """The experts `first .. first + len(gate_up) - 1` applied to their routed tokens of `x`,
    weighted and summed per token (tokens routed elsewhere contribute nothing)."""
    if x.device.type == "meta":  # shape inference: routing is data-dependent, the shape is not
        return torch.empty_like(x)
    fn = ACTIVATIONS[act]
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(index == first + e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(fn(gate) * up, down[e]) * weights[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out


def _flops(i: Types, o: Types, a: dict[str, Any]) -> int:
    """Two matmuls per routed token (balanced routing: t*k of them over all experts) plus the
    activation, the gating product and the weighting."""
    t, h = i[0].shape
    k = i[1].shape[1]
    _, n, _ = i[3].shape
    inner = i[4].shape[2]
    return t * k * (2 * h * n + 2 * inner * h + 6 * inner + h) + t * k * h


def _saves(i: Types, o: Types, a: dict[str, Any]) -> list[tuple[str, int]]:
    """The inputs, plus per routed token what autograd keeps: its gathered hidden state and its
    expert's output (2h: read by the first matmul and the weighting), the gate/up output (n: the
    activation's input and the up half), the activation's output (i, read by the gating product)
    and the gated product (i, read by the second matmul)."""
    t, h = i[0].shape
    k = i[1].shape[1]
    _, n, _ = i[3].shape
    inner = i[4].shape[2]
    per_token = (2 * h + n + 2 * inner) * (i[0].nbytes // max(i[0].numel, 1))
    return [("in", 0), ("in", 1), ("in", 2), ("in", 3), ("in", 4), ("bytes", t * k * per_token)]


register(OpDef(
    "experts", "contraction", experts_space, local_experts, flops=_flops, saves=_saves,
    operands=(0, 3),  # backward: dgrad through x, wgrad of gate_up and down together: 2x forward
    doc="routed experts of a sparse MoE layer: top-k dispatch, gated MLP per expert, weighted combine",
))


def routed_tokens(in_types: Types) -> int:
    """Token-expert pairs the op computes: tokens times top-k."""
    return in_types[0].shape[0] * in_types[1].shape[1]
