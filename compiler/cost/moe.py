"""What expert parallelism costs: the all-to-all dispatch and combine, and routing skew.

Rule. An `experts` node whose expert dim is split over mesh axis A (`shardc.ops.moe`) exchanges
its routed tokens twice per forward (dispatch, combine) and twice per backward (their gradients),
each an `all_to_all` over A of `tokens x top-k x hidden` elements per device (the rank's own
routed tokens), priced per link level like every collective (`shardc.cost.comm`: A's group crosses
whichever levels the mesh places it on; (n-1)/n of the buffer leaves the rank).

Routing skew `s` (>= 1): the busiest rank of A receives `s` times the balanced share of routed
tokens, and every rank waits for it, so the node's compute and the exchanged bytes are charged `s`
times. Set per graph (attribute `routing_skew`: the pipeline option `estimate{routing-skew=1.3}`,
or `plan.estimate(routing_skew=1.3)`); 1.0 is balanced routing, what runs that pad every expert to
its capacity (capacity factor 1.0) or force-balance the router have by construction.

Unset, it is the measured default for the ep degree (`MEASURED_ROUTING_SKEW`, from
`benchmarks/routing_skew.py`): small transformers MoE models (mixtral, qwen3_moe, deepseek_v3;
8 experts, top-2) with freshly initialised routers, on uniformly random tokens (the synthetic data
throughput benchmarks train on), 32768 tokens per ep group, mean of the busiest rank's share over
the balanced one across models, layers and 4 batches. It is an untrained router's imbalance: a
trained router with a load-balancing loss on real text may sit lower; the first few hundred steps
of real training higher (Megatron-Core's MoE README). For scale, Megatron-MoE-ModelZoo
(best_practice/qwen3/readme.md) measures dropless Qwen3-235B 1.09-1.25x slower than the same runs
force-balanced on 256 H100. Degrees above the largest measured take its figure.

Expert tensor parallelism (the op's intermediate dim `i` split over tp beside `e` over ep): the
torch backend gives every tp rank the tp group's tokens (all-gathered on the op's input edge
under sequence parallelism, its `Partial` output reduced after), and each tp rank dispatches all
of them, so the all-to-alls carry the tp group's routed tokens. Megatron-Core's alltoall
dispatcher (`EstimateOptions.expert_dispatch="megatron"`; megatron/core/transformer/moe/
token_dispatcher.py, "permute -> A2A(EP) -> AG(TP)", "RS(TP) -> A2A(EP) -> unpermute", which
requires sequence parallelism) keeps the tokens split over tp: each tp rank dispatches its own
1/tp of them, the rows received are all-gathered over tp before the experts and their results
reduce-scattered over tp after, then sent back. Priced so (`dispatcher_axes`): the all-to-alls
at 1/tp, an all-gather and a reduce-scatter of the routed rows over tp in each pass (charged to
`ep_comm`: they are the dispatch's, not a GEMM's, so userbuffers' tp overlap does not hide
them), no gather or reduction on the op's own token edges over tp, the input gradients
returned split as the tokens came, and what the op saves per routed row kept by the
reduce-scatter's 1/tp (`dispatcher_saves`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardc.cost.comm import CommStep
from shardc.ir import Graph, Node, TensorType
from shardc.ir.diagnostics import ShardcError

if TYPE_CHECKING:
    from shardc.cost.context import CostContext

DISPATCHES = ("replicated", "megatron")
TOKEN_OPERANDS = (0, 1, 2)  # x, index, weights: what the dispatcher splits over tp (`dispatcher_axes`)

# ep degree -> measured skew (module docstring; `python benchmarks/routing_skew.py --batches 4`).
MEASURED_ROUTING_SKEW: dict[int, float] = {2: 1.03, 4: 1.06, 8: 1.13}


def default_routing_skew(ranks: int) -> float:
    """The measured skew of an ep group of `ranks` ranks: 1.0 for one, the largest measured
    degree's figure beyond it."""
    if ranks <= 1:
        return 1.0
    measured = [n for n in MEASURED_ROUTING_SKEW if n <= ranks]
    return MEASURED_ROUTING_SKEW[max(measured)] if measured else 1.0


def routing_skew(graph: Graph, ranks: int) -> float:
    """The graph's routing skew (`routing_skew` attribute) or, unset, the measured default for
    an ep group of `ranks` ranks; checked: a number >= 1."""
    skew = float(graph.attrs.get("routing_skew", default_routing_skew(ranks)))
    if skew < 1.0:
        raise ShardcError(f"routing skew {skew} < 1: it is the busiest expert rank's tokens over the balanced "
                          "share", hint="use 1.0 for balanced routing, e.g. 1.3 for 30% more on the busiest rank")
    return skew


def routed_bytes(in_types: Sequence[TensorType]) -> float:
    """Bytes of one exchange: the rank's tokens x top-k rows of hidden states."""
    x, index = in_types[0], in_types[1]
    return float(x.nbytes * index.shape[1])


def expert_steps(axis: str, nbytes: float, gathers: Sequence[tuple[str, int]] = ()) -> list[tuple[str, CommStep]]:
    """The exchanges of one `experts` node split over `axis`, `nbytes` the rank's routed rows
    as the op holds its tokens: (phase, step). Dispatch and combine in the forward, their
    gradients in the backward. With `gathers` ((tp axis, size), Megatron's dispatcher: module
    rules) each all-to-all carries 1/size of the rows, the dispatch all-gathers the received
    rows over the axis and the combine reduce-scatters them (backward: the conjugates)."""
    share = math.prod(n for _, n in gathers)
    a2a = CommStep("all_to_all", axis, nbytes / share)
    gather = [CommStep("all_gather", a, nbytes) for a, _ in gathers]
    scatter = [CommStep("reduce_scatter", a, nbytes) for a, _ in gathers]
    forward = [a2a, *gather, *scatter, a2a]
    backward = [a2a, *gather, *scatter, a2a]  # combine's gradient (all-gather), dispatch's (reduce-scatter)
    return [("fwd", s) for s in forward] + [("bwd", s) for s in backward]


def dispatcher_axes(ctx: CostContext, node: Node) -> tuple[str, ...]:
    """The mesh axes splitting an `experts` node's intermediate dim `i` (expert tensor
    parallelism) beside an axis splitting its experts, when the runtime priced runs
    Megatron-Core's dispatcher there (`ctx.expert_dispatch == "megatron"`, module rules): the
    dispatcher, not the op's token edges, moves the tokens over them. () otherwise."""
    if ctx.expert_dispatch != "megatron" or node.op != "experts":
        return ()
    part = ctx.partition(node)
    if part is None or not any(dim == "e" for _, dim in part.spatial):
        return ()
    return tuple(axis for axis, dim in part.spatial if dim == "i")


def dispatcher_saves(ctx: CostContext, node: Node,
                     saves: list[tuple[str, int, float]]) -> list[tuple[str, int, float]]:
    """What an `experts` node saves for backward when the runtime priced is Megatron-Core's
    (`ctx.expert_dispatch == "megatron"`; else `saves` as they are): its fused bias-GLU
    (`bias_swiglu_impl`, `bias_geglu_impl`) keeps only its input and recomputes the activation in
    backward, so no activation output per routed row (`shardc.ops.moe._saves`' second `i`); and
    under its dispatcher (`dispatcher_axes`) no copy of the gathered tokens, and of the two
    hidden-state rows per routed token (the gathered input, the expert's output) the output only
    as reduce-scattered, 1/size of it."""
    if ctx.expert_dispatch != "megatron" or node.op != "experts":
        return saves
    local = ctx.local(node)
    x, index, down = local.in_types[0], local.in_types[1], local.in_types[4]
    fused = x.shape[0] * index.shape[1] * down.shape[2] * (x.nbytes // max(x.numel, 1))
    axes = dispatcher_axes(ctx, node) if ctx.mesh is not None else ()
    share = math.prod(ctx.mesh.axis_size(a) for a in axes) if ctx.mesh is not None else 1
    output_rows = routed_bytes(local.in_types) * (1 - 1 / share)
    return [(kind, idx, nbytes - output_rows - fused if kind == "bytes" else nbytes) for kind, idx, nbytes in saves
            if not (axes and kind == "in" and idx == 0)]


def weight_gradient_copies(ctx: CostContext, node: Node, operand: int) -> float:
    """How many local-size gradients of operand `operand` a node's backward holds at once: 1, but
    2 for an `experts` node's `gate_up` (operand 3) with two local experts or more. The backend
    (`local_experts`, `backends.torch.experts`) runs one expert at a time on `gate_up[e]` and
    `down[e]`, whose backward (a select) gives each expert's gradient as a full local-size tensor,
    and autograd adds each into the running sum as it arrives: the last expert's and the sum are
    live together, for the larger weight while the smaller one's sum is already one tensor.
    Megatron-Core's runtime (`expert_dispatch="megatron"`): 1."""
    if node.op != "experts" or operand != 3 or ctx.expert_dispatch == "megatron":
        return 1.0  # Megatron's grouped GEMMs write every expert's weight gradient in place
    return 2.0 if ctx.local(node).in_types[3].shape[0] > 1 else 1.0
