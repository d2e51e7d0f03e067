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
"""

from __future__ import annotations

from collections.abc import Sequence

from shardc.cost.comm import CommStep
from shardc.ir import Graph, TensorType
from shardc.ir.diagnostics import ShardcError

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


def expert_steps(axis: str, nbytes: float) -> list[tuple[str, CommStep]]:
    """The all-to-alls of one `experts` node split over `axis`: (phase, step), dispatch and
    combine in the forward, their gradients in the backward."""
    step = CommStep("all_to_all", axis, nbytes)
    return [("fwd", step), ("fwd", step), ("bwd", step), ("bwd", step)]
