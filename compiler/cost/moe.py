"""What expert parallelism costs: the all-to-all dispatch and combine, and routing skew.

Rule. An `experts` node whose expert dim is split over mesh axis A (`shardc.ops.moe`) exchanges
its routed tokens twice per forward (dispatch, combine) and twice per backward (their gradients),
each an `all_to_all` over A of `tokens x top-k x hidden` elements per device (the rank's own
routed tokens), priced per link level like every collective (`shardc.cost.comm`: A's group crosses
whichever levels the mesh places it on; (n-1)/n of the buffer leaves the rank).

Routing skew `s` (>= 1; graph attribute `routing_skew`, default `DEFAULT_ROUTING_SKEW`): the busiest
rank of A receives `s` times the balanced share of routed tokens, and every rank waits for it, so
the node's compute and the exchanged bytes are charged `s` times. The default 1.0 is balanced
routing (what an auxiliary load-balancing loss aims for); shardc has not measured skew on real
MoE training runs, so it assumes none unless told (the pipeline option `estimate{routing-skew=1.3}`,
or `plan.estimate(routing_skew=1.3)`).
"""

from __future__ import annotations

from collections.abc import Sequence

from shardc.cost.comm import CommStep
from shardc.ir import Graph, TensorType
from shardc.ir.diagnostics import ShardcError

DEFAULT_ROUTING_SKEW = 1.0


def routing_skew(graph: Graph) -> float:
    """The graph's routing skew (`routing_skew` attribute), checked: a number >= 1."""
    skew = float(graph.attrs.get("routing_skew", DEFAULT_ROUTING_SKEW))
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
