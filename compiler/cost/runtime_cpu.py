"""The pipeline runtime's own CPU on the local CPU: what torch.distributed.pipelining spends beyond a stage's ops.

Why: the cost model prices a stage's ops; torch's schedule runtime adds its own Python around every
action (a stage's forward, backward, input- or weight-gradient call with its sends and receives,
`EagerCosts.pipeline_action`), and a zero-bubble schedule's split backward
(`torch.distributed.pipelining._backward`: `stage_backward_input`, then `stage_backward_weight`)
walks the stage's autograd graph per parameter tensor (`EagerCosts.split_backward_per_tensor`) and,
keeping the graph and the gradients captured for the weight pass alive while it runs, allocates on
pages the allocator had returned to the system (`EagerCosts.split_backward_per_byte`, per byte the
stage saved for backward). On this machine's recorded pp=4 runs the ZB-V and interleaved zero-bubble
ranks spent ~45-50 ms of main-thread CPU per step beyond the model's ops and actions, ~3 ms per split
backward of a GPT block; one process alone measures ~2 ms more per split backward of that block than
its plain backward, ~350 page faults against none (`calibration.pipeline_steps.split_refill`).
All of it is measured by `shardc calibrate` (`calibration.pipeline_steps`); accelerator devices have
no eager costs, so nothing here applies to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from shardc.cost.memory import compute_bytes
from shardc.cost.pipeline import Op, device_order
from shardc.hardware import DeviceSpec
from shardc.plan.parallel import ParallelPlan

if TYPE_CHECKING:
    from shardc.calibration.profile import EagerCosts
    from shardc.cost.layer_work import LayerWork


def schedule_actions(layers: Sequence[LayerWork], plan: ParallelPlan, device: DeviceSpec, times: list[dict[str, float]],
                     fwd: list[float], bwd: list[float], wgrad: list[float] | None, m: int) -> dict[Op, float]:
    """Add torch's pipeline runtime's own CPU work where it was measured (the local CPU,
    `EagerCosts.action`: more on a stage holding more bytes, `calibration.pipeline_steps`), in place: per virtual stage and
    micro-batch one action for the forward and one for the backward (a whole one, or the weight
    pass of a split one), counted as the forward's and backward's compute. Returns what each input-
    gradient pass of a split backward (an "I" op of the schedule's order) costs beyond its share of
    the ops: its own action and, on every stage but the first (torch runs the first stage's backward
    whole, in its weight pass), `split_backward_cpu`; the caller adds them as single ops' extra."""
    eager = device.eager
    if eager is None or not (eager.pipeline_action or eager.split_backward_per_tensor or eager.split_backward_per_byte
                             or eager.pipeline_action_per_byte):
        return {}
    tensors, saved, weights = [0] * len(fwd), [0.0] * len(fwd), [0.0] * len(fwd)
    for layer in layers:
        tensors[layer.stage] += len(layer.params)
        saved[layer.stage] += layer.cost.saved_bytes if layer.cost is not None else 0.0
        weights[layer.stage] += sum(n for n, _ in layer.params.values()) * compute_bytes(plan.dtype)
    action = [eager.action(weights[s] + saved[s]) for s in range(len(fwd))]  # `EagerCosts.action`
    for s in range(len(fwd)):
        fwd[s] += action[s]
        bwd[s] += action[s]
        if wgrad is not None:
            wgrad[s] += action[s]
        times[s]["compute_fwd"] = times[s].get("compute_fwd", 0.0) + action[s] * m
        times[s]["compute_bwd"] = times[s].get("compute_bwd", 0.0) + action[s] * m
    if wgrad is None:
        return {}
    split = [action[s] + (split_backward_cpu(eager, tensors[s], saved[s]) if s > 0 else 0.0) for s in range(len(fwd))]
    extra: dict[Op, float] = {}
    for d in range(plan.pp):
        for op in device_order(plan.schedule, plan.pp, d, m, plan.vpp):
            if op[0] == "I" and split[op[2]]:
                extra[op] = split[op[2]]
                times[op[2]]["compute_bwd"] += split[op[2]]
    return extra


def split_backward_cpu(eager: EagerCosts, tensors: int, saved_bytes: float) -> float:
    """CPU seconds torch's split backward of one stage and micro-batch costs beyond its ops and
    actions: the walk of the graph per parameter tensor (`EagerCosts.split_backward_per_tensor`)
    and the refill per byte the stage saved for backward (`EagerCosts.split_backward_per_byte`:
    while the split keeps the graph, what it allocates meets pages the allocator gave back)."""
    return eager.split_backward_per_tensor * tensors + eager.split_backward_per_byte * saved_bytes
