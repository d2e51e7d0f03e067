"""The analytical performance and memory model: compute, communication, pipeline, memory.

Entry point: `estimate(graph, cluster, plan) -> Estimate`. Primitives for the solver, all
pure functions of their arguments: `node_compute_time` (one op on local shapes),
`collective_time` (one collective on a group's link levels), `group_levels` (which links a
mesh axis crosses), `layer_costs` (one layer per micro-batch, by category), `simulate` and
`bubble_fraction` (pipeline schedules), `model_state_bytes` and `in_flight` (memory).
"""

from shardc.cost.comm import collective_time, group_levels, reshard_steps
from shardc.cost.compute import node_compute_time
from shardc.cost.context import CostContext
from shardc.cost.estimate import Estimate, StageEstimate
from shardc.cost.layer import LayerCost, layer_costs
from shardc.cost.memory import in_flight, model_state_bytes
from shardc.cost.model import EstimateOptions, estimate
from shardc.cost.pipeline import bubble_fraction, simulate

__all__ = [
    "CostContext", "Estimate", "EstimateOptions", "LayerCost", "StageEstimate", "bubble_fraction",
    "collective_time", "estimate", "group_levels", "in_flight", "layer_costs", "model_state_bytes",
    "node_compute_time", "reshard_steps", "simulate",
]
