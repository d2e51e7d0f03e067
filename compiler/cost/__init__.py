"""The analytical performance and memory model: compute, communication, pipeline, memory.

Entry point: `estimate(graph, cluster, plan=None) -> Estimate` on any partitioned IR. The
solver (`shardc.search`) prices its candidates with the same pieces and composes its plans
with the same `compose`: `node_compute_time` (one op on local shapes), `collective_time` (one
collective on a group's link levels), `reshard_steps` (layout to layout), `edges` (forward
and gradient redistribution on an edge), `group_levels` (which links a mesh axis crosses),
`layer_costs`/`layer_terms`/`finish_layer` (one layer per micro-batch, by category, and the
recomputation rules), `compose` (pipeline schedule, gradient
sync, optimizer, memory per device), `simulate` and `bubble_fraction` (pipeline schedules),
`model_state_bytes` and `in_flight` (memory), `layer_memory` (one layer's live bytes op by op,
what the peak per device is stacked from, `peak.device_memory`).
"""

from shardc.cost.comm import collective_time, group_levels, reshard_steps
from shardc.cost.compose import EstimateOptions, LayerWork, Links, compose
from shardc.cost.compute import node_compute_time
from shardc.cost.context import CostContext
from shardc.cost.estimate import Estimate, StageEstimate
from shardc.cost.layer import LayerCost, LayerTerms, finish_layer, layer_costs, layer_terms
from shardc.cost.memory import in_flight, model_state_bytes
from shardc.cost.model import estimate
from shardc.cost.pipeline import bubble_fraction, simulate
from shardc.cost.timeline import LayerMemory, layer_memory

__all__ = [
    "CostContext", "Estimate", "EstimateOptions", "LayerCost", "LayerMemory", "LayerTerms", "LayerWork", "Links",
    "StageEstimate", "layer_memory",
    "bubble_fraction", "collective_time", "compose", "estimate", "finish_layer", "group_levels", "in_flight",
    "layer_costs", "layer_terms", "model_state_bytes", "node_compute_time", "reshard_steps", "simulate",
]
