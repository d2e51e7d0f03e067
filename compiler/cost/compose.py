"""Step time and per-device memory from per-layer costs: the composition `estimate` and the solver share.

Rules:
- Per virtual stage and micro-batch, forward and backward times are sums over its layers
  (`LayerCost`, recomputation included) plus the send of the activations leaving the stage
  (forward) and of their gradients back (backward). ZeRO-3 all-gathers each layer's weights
  before its forward and its backward, prefetched behind the previous layer's compute, so only
  the excess is charged. On the local CPU, torch's pipeline runtime's own work per schedule
  action, as `shardc calibrate` measured it, comes on top (`schedule_actions`).
  `pipeline.simulate` turns these into the schedule's makespan (bubble and waiting between
  stages included; where the processes share fewer cores than there are of them, the local
  CPU, `pipeline_shared.simulate_schedule` runs it with a rank idle in a bubble lending its core
  to the busy ones); under DeepSpeed's pipeline runtime
  (`pipeline_runtime="deepspeed"`) `lockstep.simulate_lockstep` does, the sends kept apart as
  exchanges both stages of a pair wait for. Virtual stage s sits on pp device
  `analysis.stages.stage_device(s)` (round robin; the V schedules zbv and dualpipev: device r
  holds r and 2pp-1-r, and the turn of the V sends nothing). The zero-bubble schedules split
  each backward into input- and weight-gradient passes (`weight_gradients`, by
  `pipeline.weight_gradient_share`); their micro-batches in flight count from a forward to its
  weight-gradient pass, in torch's order (`pipeline.in_flight_order`).
- Gradient sync, the post-optimizer gather and the optimizer step per pipeline device are
  `sync.gradient_sync`'s; FSDP2's gathers after a unit's first (ZeRO-3, torch's resharding of
  interleaved units) lengthen the pipeline ops they block (`fsdp.pipeline_gathers`); a parameter held on several pipeline devices (a tied embedding and
  LM head) has its gradient all-reduced between them after backward (`shared_gradients`). The step ends when the slowest device has finished its last backward
  and its exposed sync, plus the slowest device's gather and optimizer step.
- Bytes by dtype (`memory`): gradients are synchronised in fp32, weights gathered in the
  compute dtype.
- Memory per device at its peak (`peak.device_memory`): model states by ZeRO stage over the
  data-parallel group (dp x cp) (mixed precision: the compute-dtype weight copies, once per
  parameter; under FSDP2 they are its unsharded parameters, a buffer), the saved activations of the micro-batches in flight on that
  device (`in_flight`) stacked under the live timeline of the one in progress
  (`timeline.layer_memory`: saved, recomputed and gradient bytes op by op), and the runtime's
  buffers (DDP buckets, FSDP2's gathered parameters, pipeline receive buffers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from shardc.analysis.stages import device_stages, stage_device
from shardc.cost.comm import LinkLevels, collective_time, group_levels, neighbour_link
from shardc.cost.compute import optimizer_step_time
from shardc.cost.estimate import StageEstimate
from shardc.cost.fsdp import pipeline_gathers
from shardc.cost.layer import LayerCost
from shardc.cost.layer_work import LayerWork
from shardc.cost.lockstep import LOCKSTEP, simulate_lockstep
from shardc.cost.memory import (
    GRADIENT_BYTES,
    buffer_bytes,
    compute_bytes,
    in_flight,
    model_state_bytes,
    weight_copy_bytes,
)
from shardc.cost.options import EstimateOptions
from shardc.cost.peak import device_memory, pipeline_buffers
from shardc.cost.pipeline import ZB_SCHEDULES, Op, PipelineTimes, device_order, weight_gradient_share
from shardc.cost.pipeline_shared import CoreSharing, core_sharing, simulate_schedule
from shardc.cost.runtime_cpu import schedule_actions
from shardc.cost.sync import DeviceSync, fsdp_copy_time, gradient_sync, model_axis_collectives
from shardc.hardware import Cluster, DeviceSpec
from shardc.ir import DATA_AXES, Axis, Mesh
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan


@dataclass
class Links:
    """The link levels of groups along mesh axes on a cluster (cached): what the composition
    needs of a cost context when it has no graph."""

    mesh: Mesh | None
    cluster: Cluster
    algorithm: str = "auto"
    _levels: dict[tuple[str, ...], LinkLevels] = field(default_factory=dict)

    @property
    def device(self) -> DeviceSpec:
        return self.cluster.device

    def levels(self, axes: tuple[str, ...]) -> LinkLevels:
        if self.mesh is None:
            return ()
        found = self._levels.get(axes)
        if found is None:
            found = self._levels[axes] = group_levels(self.mesh, axes, self.cluster)
        return found


@dataclass(frozen=True, slots=True)
class Composition:
    step_time_s: float
    stages: tuple[StageEstimate, ...]
    pipe: PipelineTimes
    schedule: PipelineInputs | None = None  # what the simulation ran on (a timeline redraws from it)


@dataclass(frozen=True)
class PipelineInputs:
    """What the pipeline simulation was given (`pipeline_shared.simulate_schedule`): the schedule,
    pp devices, micro-batches, virtual stages per device, and per virtual stage one micro-batch's
    forward, backward (sends included) and weight-gradient seconds (all zero unless the schedule
    splits the backward); `extra`: seconds single ops spend beyond that (FSDP2's ZeRO-3 gathers,
    `fsdp.pipeline_gathers`; on the local CPU a split backward's own work, `runtime_cpu.schedule_actions`); `sharing`: how its processes share the cores (None: a device each)."""

    schedule: str
    pp: int
    micro_batches: int
    vpp: int
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    wgrad: tuple[float, ...]
    extra: tuple[tuple[tuple[str, int, int], float], ...] = ()
    sends: tuple[float, ...] = ()  # per stage, the exchange transfer (the lockstep schedule's; else in fwd/bwd)
    sharing: CoreSharing | None = None  # processes sharing cores (`pipeline_shared.simulate_schedule`)


# Bytes per parameter of an fp32 gradient accumulation pass beyond reading the compute-dtype gradient:
# the fp32 temporary written and read, the accumulator read and written
# (`EstimateOptions.fp32_grad_accumulation`).
FP32_ACCUMULATE_BYTES = 4 * GRADIENT_BYTES


def zero_group(mesh: Mesh | None) -> tuple[tuple[str, ...], int]:
    """The axes ZeRO shards over (the data axes, `DATA_AXES`) and the group's size."""
    if mesh is None:
        return (), 1
    axes = tuple(a for a in DATA_AXES if a in mesh.names)
    return axes, math.prod(mesh.degree(a) for a in axes)


def zero3_exposed(cost: LayerCost, param_elements: float, elem_bytes: int, levels: LinkLevels,
                  algorithm: str = "auto", grad_bytes: float = 0.0) -> tuple[float, float]:
    """Exposed forward and backward seconds of a ZeRO-3 layer's weight all-gathers. The backward
    gather hides behind the backward's compute, recomputation included: the one gather serves
    the recomputed forward and the gradients, and runs while the neighbour recomputes too.
    `grad_bytes`: the layer's gradients, reduce-scattered during the same backward on the same
    link (textbook ZeRO-3 and torchtitan's per-block FSDP reduce every micro-batch's gradients
    block by block): in backward the link carries the gather and the reduce-scatter together."""
    t = collective_time("all_gather", param_elements * elem_bytes, levels, algorithm)
    reduce = collective_time("reduce_scatter", grad_bytes, levels, algorithm) if grad_bytes > 0 else 0.0
    backward = cost.bwd.get("compute_bwd", 0.0) + cost.bwd.get("recompute", 0.0)
    return max(0.0, t - cost.fwd.get("compute_fwd", 0.0)), max(0.0, t + reduce - backward)


def overlapped_tp(cost: LayerCost) -> tuple[float, float]:
    """Forward and backward seconds of a layer's tensor-parallel collectives that overlap its
    GEMMs when the runtime pipelines them with the GEMMs (`EstimateOptions.tp_comm_overlap`):
    each pass's tp_comm hides behind that pass's compute (backward: gradients and
    recomputation), up to the compute's length; the rest stays exposed."""
    fwd = min(cost.fwd.get("tp_comm", 0.0), cost.fwd.get("compute_fwd", 0.0))
    bwd = min(cost.bwd.get("tp_comm", 0.0), cost.bwd.get("compute_bwd", 0.0) + cost.bwd.get("recompute", 0.0))
    return fwd, bwd


def shared_gradients(layers: Sequence[LayerWork], links, p: int, g_elem: int, schedule: str = "1f1b") -> list[float]:
    """Per pipeline device, the exposed all_reduce of gradients of parameters that layers on
    several pipeline devices share (a tied embedding and LM head), after backward, over the
    pipeline link between the devices holding them (Megatron's embedding all-reduce)."""
    out = [0.0] * p
    if p <= 1 or links.mesh is None or Axis.PP not in links.mesh.names:
        return out
    holders: dict[str, dict[int, float]] = {}
    for layer in layers:
        for name, (numel, _) in layer.params.items():
            holders.setdefault(name, {})[stage_device(layer.stage, p, schedule)] = numel
    link = neighbour_link(links.mesh, Axis.PP, links.cluster)
    for devices in holders.values():
        if len(devices) > 1:
            for d, numel in devices.items():
                out[d] += collective_time("all_reduce", numel * g_elem, link, links.algorithm, len(devices))
    return out


def zero3_reduces_per_layer(options: EstimateOptions, zero: int, shard: int) -> bool:
    """Whether a layer runs textbook ZeRO-3 here: its weights gathered before its forward and
    its backward, its gradients reduce-scattered as its backward ends (`zero3_exposed`), not
    in `sync.gradient_sync`'s buckets after the last backward."""
    return options.zero_runtime == "zero" and zero >= 3 and shard > 1


def fsdp2(options: EstimateOptions, zero: int, shard: int) -> bool:
    """Whether ZeRO runs as the torch backend's FSDP2 on the whole module here."""
    return options.zero_runtime == "fsdp2" and zero >= 1 and shard > 1


def compose(layers: Sequence[LayerWork], sends: Sequence[float], links, plan: ParallelPlan, m: int,
            options: EstimateOptions, send_bytes: Sequence[float] | None = None,
            output_bytes: float = 0.0) -> Composition:
    """Step time and per-device breakdowns (see the module rules). `sends[s]`: seconds to send
    the activations leaving virtual stage s for one micro-batch (`send_bytes[s]` their bytes);
    `output_bytes`: the last stage's output per micro-batch (the loss's input); `links`: a
    `Links` or a `CostContext`; `plan` gives pp, vpp, schedule and dtype."""
    p = plan.pp
    zero_axes, shard = zero_group(links.mesh)
    w_elem = compute_bytes(plan.dtype)
    g_elem = GRADIENT_BYTES if options.gradient_reduce == "fp32" else w_elem
    # Stages on one device (the turn of a V) hand their activations over without a send.
    sends = [0.0 if s + 1 < len(sends) and stage_device(s, p, plan.schedule) == stage_device(s + 1, p, plan.schedule)
             else t for s, t in enumerate(sends)]
    lockstep = options.pipeline_runtime == LOCKSTEP and p > 1
    if lockstep and plan.schedule != "1f1b":
        raise ShardcError(f"the {LOCKSTEP} pipeline runtime runs its own TrainSchedule (1F1B order), not "
                          f"schedule={plan.schedule} with vpp={plan.vpp}", hint="use schedule=1f1b and vpp=1")
    # DeepSpeed's exchanges hold both stages of a pair (`lockstep`): the simulation charges them.
    times, fwd, bwd = stage_times(layers, [0.0] * len(sends) if lockstep else sends, links, plan, m, options,
                                  links.levels(zero_axes), shard)
    wgrad = weight_gradients(layers, plan) if plan.schedule in ZB_SCHEDULES else None
    split: dict[Op, float] = {}
    if p > 1 and options.pipeline_runtime == "torch":
        split = schedule_actions(layers, plan, links.device, times, fwd, bwd, wgrad, m)
    gathers = pipeline_gathers(layers, plan, m, links, zero_axes, shard, w_elem) if options.zero_runtime == "fsdp2" else {}
    extra = {op: gathers.get(op, 0.0) + split.get(op, 0.0) for op in gathers.keys() | split.keys()}
    sharing = None if lockstep else core_sharing(links.cluster, p)
    if lockstep:
        pipe = simulate_lockstep(fwd, bwd, sends, m)
        for s in range(p):  # per micro-batch: activation in and gradient out, activation out and gradient in
            exchanged = 2 * ((sends[s - 1] if s > 0 else 0.0) + sends[s]) * m
            if exchanged:
                times[s]["pp_comm"] = times[s].get("pp_comm", 0.0) + exchanged
    else:
        pipe = simulate_schedule(plan.schedule if p > 1 else "1f1b", fwd, bwd, m, p, wgrad=wgrad, extra=extra,
                                 sharing=sharing)
    syncs = gradient_sync(links, layers, plan, options, zero_axes, shard, pipe, bwd, g_elem, w_elem, m)
    if links.device.eager is not None:  # a CPU's measured eager optimizer step
        dtensors = options.zero_runtime == "fsdp2"
        syncs = [replace(s, optimizer=optimizer_step_time(links.device, s.params, shard, dtensors)) for s in syncs]
    shared = shared_gradients(layers, links, p, g_elem, plan.schedule)
    end = max(pipe.last_end[d] + syncs[d].tail + shared[d] for d in range(p))
    step = end + max(s.after for s in syncs)
    by_device: list[list[LayerWork]] = [[] for _ in range(p)]
    for layer in layers:
        by_device[stage_device(layer.stage, p, plan.schedule)].append(layer)
    stages: list[StageEstimate] = []
    for d, mine in enumerate(by_device):
        # Time by category: the device's virtual stages, its exposed sync and gather, the
        # optimizer step, and what is left of the step waiting (the bubble).
        cat: dict[str, float] = {}
        for part in (times[s] for s in device_stages(d, p, plan.vpp, plan.schedule)):
            for key, val in part.items():
                cat[key] = cat.get(key, 0.0) + val
        in_schedule = sum(t for (_, _, s), t in gathers.items() if stage_device(s, p, plan.schedule) == d)
        cat["dp_comm"] = cat.get("dp_comm", 0.0) + syncs[d].tail + syncs[d].gather + in_schedule
        if shared[d]:
            cat["pp_comm"] = cat.get("pp_comm", 0.0) + shared[d]
        cat["optimizer"] = syncs[d].optimizer
        cat["bubble"] = max(0.0, step - sum(cat.values()))
        flight = in_flight(plan.schedule, p, d, m, plan.vpp)
        memory = _device_memory(mine, d, syncs[d], plan, options, m, flight, shard, w_elem, send_bytes,
                                output_bytes)
        saved = sum(l.cost.saved_bytes for l in mine if l.cost is not None)
        experts = sum(state_bytes(syncs[d], plan, options, shard, w_elem,
                                  fsdp2(options, max((l.annotation.zero for l in mine), default=0), shard),
                                  experts_only=True).values()) if syncs[d].experts else 0.0
        stages.append(StageEstimate(d, tuple(l.name for l in mine), cat, memory, flight, saved,
                                    syncs[d].grad_bytes, syncs[d].comm_bytes, dp_collectives=syncs[d].collectives,
                                    collectives=model_axis_collectives(mine, m, syncs[d]), expert_state_bytes=experts))
    inputs = PipelineInputs(LOCKSTEP if lockstep else plan.schedule if p > 1 else "1f1b", p, m, plan.vpp,
                            tuple(fwd), tuple(bwd), tuple(wgrad or [0.0] * len(fwd)), tuple(sorted(extra.items())),
                            tuple(sends) if lockstep else (), sharing)
    return Composition(step, tuple(stages), pipe, inputs)


def weight_gradients(layers: Sequence[LayerWork], plan: ParallelPlan) -> list[float]:
    """Per virtual stage, one micro-batch's weight-gradient seconds (W of a split backward): each
    layer's backward compute times its `pipeline.weight_gradient_share`; the rest of the
    backward (input gradients, recomputation, collectives, sends) is the I pass."""
    out = [0.0] * (plan.pp * plan.vpp)
    for layer in layers:
        if layer.cost is not None and layer.nodes:
            out[layer.stage] += layer.cost.bwd.get("compute_bwd", 0.0) * weight_gradient_share(layer.nodes)
    return out


def stage_times(layers: Sequence[LayerWork], sends: Sequence[float], links, plan: ParallelPlan, m: int,
                options: EstimateOptions, shard_levels: LinkLevels,
                shard: int) -> tuple[list[dict[str, float]], list[float], list[float]]:
    """Per virtual stage: seconds by category over the step (`m` micro-batches), and one
    micro-batch's forward and backward seconds (the layers' costs, textbook ZeRO-3's exposed
    weight gathers, the sends to the next stage and the gradients back)."""
    S = plan.pp * plan.vpp
    w_elem = compute_bytes(plan.dtype)
    g_elem = GRADIENT_BYTES if options.gradient_reduce == "fp32" else w_elem
    times = [dict[str, float]() for _ in range(S)]
    fwd, bwd = [0.0] * S, [0.0] * S
    for layer in layers:
        cost = layer.cost
        assert cost is not None
        s = layer.stage
        for part in (cost.fwd, cost.bwd):
            for key, val in part.items():
                times[s][key] = times[s].get(key, 0.0) + val * m
        fwd[s] += cost.fwd_s
        bwd[s] += cost.bwd_s
        if options.tp_comm_overlap:
            hf, hb = overlapped_tp(cost)
            fwd[s] -= hf
            bwd[s] -= hb
            times[s]["tp_comm"] = times[s].get("tp_comm", 0.0) - (hf + hb) * m
        if options.fp32_grad_accumulation:  # every micro-batch, after its backward (`EstimateOptions`)
            numel = sum(n for n, _ in layer.params.values())
            extra = numel * (w_elem + FP32_ACCUMULATE_BYTES) / links.device.memory_bandwidth
            bwd[s] += extra
            times[s]["compute_bwd"] = times[s].get("compute_bwd", 0.0) + extra * m
        if zero3_reduces_per_layer(options, layer.annotation.zero, shard):
            numel = sum(n for n, axes in layer.params.values())
            ef, eb = zero3_exposed(cost, numel, w_elem, shard_levels, links.algorithm, numel * g_elem)
            if options.fsdp_copies:  # the gather's copies before forward and backward, the reduce's after
                gather_copy = fsdp_copy_time(numel * w_elem, shard, links.device)
                ef += gather_copy
                eb += gather_copy + fsdp_copy_time(numel * g_elem, shard, links.device)
            fwd[s] += ef
            bwd[s] += eb
            times[s]["dp_comm"] = times[s].get("dp_comm", 0.0) + (ef + eb) * m
    for s in range(S):
        back = sends[s - 1] if s > 0 else 0.0
        fwd[s] += sends[s]
        bwd[s] += back
        if sends[s] or back:
            times[s]["pp_comm"] = times[s].get("pp_comm", 0.0) + (sends[s] + back) * m
    return times, fwd, bwd


def state_bytes(sync: DeviceSync, plan: ParallelPlan, options: EstimateOptions, shard: int, w_elem: int,
                sharded: bool, experts_only: bool = False) -> dict[str, float]:
    """A device's model states at rest by category (parameters, gradients, optimizer), each of its
    parameters by its ZeRO stage over its group (`memory.model_state_bytes`); `sharded`: FSDP2
    holds them (`fsdp2`); `experts_only`: the expert weights' alone (`DeviceSync.experts`)."""
    states = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0}
    textbook = options.zero_runtime == "zero"
    grad_elem = GRADIENT_BYTES if options.gradient_reduce == "fp32" else w_elem
    flags = sync.experts or (False,) * len(sync.params)
    for (numel, z), group, expert in zip(sync.params, sync.shards(shard), flags):
        if experts_only and not expert:
            continue
        for key, val in model_state_bytes(numel, plan.dtype, 3 if sharded and z else z, group, copies=not sharded,
                                          textbook=textbook, gradient_bytes=grad_elem).items():
            states[key] += val
    return states


def _device_memory(mine: Sequence[LayerWork], d: int, sync: DeviceSync, plan: ParallelPlan, options: EstimateOptions, m: int,
                   flight: int, shard: int, w_elem: int, send_bytes: Sequence[float] | None,
                   output_bytes: float) -> dict[str, float]:
    """Pipeline device `d`'s memory at its peak (`peak.device_memory`): its model states by ZeRO
    stage, the activations in flight under the live timeline, and the runtime's buffers."""
    p, v = plan.pp, plan.vpp
    S = p * v
    mine_stages = device_stages(d, p, v, plan.schedule)
    zero = max((l.annotation.zero for l in mine), default=0)
    sharded = fsdp2(options, zero, shard)
    states = state_bytes(sync, plan, options, shard, w_elem, sharded)
    local = sum(n for n, _ in sync.params)
    largest = max((sum(n for n, _ in l.params.values()) for l in mine), default=0.0)
    buffers = 0.0 if sharded else buffer_bytes(sync.grad_bytes, options.bucket_bytes, shard, zero, largest * w_elem)
    split = plan.schedule in ZB_SCHEDULES  # the backward split into input- and weight-gradient passes
    if p > 1 and options.pipeline_runtime == "torch" and send_bytes is not None:
        buffers += pipeline_buffers(mine_stages, S, m, flight, send_bytes, output_bytes, pending_send=not split,
                                    warmup_send=plan.schedule == "1f1b" and v == 1,
                                    last_outputs=m if plan.schedule == "gpipe" else 1)
    by_stage = [[l for l in mine if l.stage == s] for s in mine_stages]
    # FSDP2 once backward is over (measured, torch 2.13): the unsharded compute-dtype parameters
    # and, in mixed precision, the unsharded compute-dtype gradients, the fp32 reduce-scatter
    # input (every gradient, `reduce_dtype`) and its 1/shard output.
    after = 0.0
    if sharded:
        unsharded_grads = local * w_elem if w_elem != GRADIENT_BYTES else 0.0
        after = local * w_elem + unsharded_grads + local * GRADIENT_BYTES * (1 + 1 / shard)
    order = device_order(plan.schedule, p, d, m, v) if p > 1 else None
    # Held from I to W: a stage's received activation's gradient, unless the stage before is on this
    # device (a V's turn: that gradient is its gradient-receive buffer, `pipeline_buffers`).
    input_grads = ({s: send_bytes[s - 1] for s in mine_stages if s > 0 and s - 1 not in mine_stages}
                   if split and send_bytes else {})
    torch_pipeline = p > 1 and options.pipeline_runtime == "torch" and bool(send_bytes)
    received = {s: send_bytes[s - 1] for s in mine_stages if s > 0} if torch_pipeline and send_bytes else {}
    grad_received = ({s: send_bytes[s] for s in mine_stages if s < S - 1}
                     if torch_pipeline and send_bytes else {})
    # The torch backend's optimizer step (`shardc.train`: AdamW with foreach=False) updates one
    # parameter at a time and makes two fp32 copies of it (its second moment's square root, then
    # that over the bias correction): the largest local parameter's, beside the states at rest.
    # Megatron's and DeepSpeed's fused Adam (the other runtimes) make none.
    step = 0.0
    if options.zero_runtime == "fsdp2" and options.pipeline_runtime == "torch":
        step = 2 * GRADIENT_BYTES * max((numel / (group if sharded and z else 1)
                                         for (numel, z), group in zip(sync.params, sync.shards(shard))), default=0.0)
    return device_memory(by_stage, states, flight=flight, virtual=v, interleaved=v > 1, optimizer_step=step,
                         fsdp=sharded, local_param_bytes=local * w_elem, buffers=buffers, after_backward=after,
                         regather=zero >= 3 and not split, accumulate=m > 1 and p == 1,
                         copy_bytes=weight_copy_bytes(plan.dtype) if not sharded and zero < 3 else 0.0,
                         order=order, stage_ids=mine_stages, input_grads=input_grads, received=received,
                         grad_received=grad_received)
