"""`estimate(graph, cluster, plan)`: step time, throughput, MFU and memory of every pipeline stage.

Rules:
- The graph is costed as partitioned (`apply_plan` runs first when it has no mesh). Its batch
  is rescaled to the plan's micro-batch: every batch-dependent tensor and FLOP is multiplied
  by `mb / local batch`. Layers come from `graph.layers` (stage, recompute and ZeRO per layer);
  copies of one block with equal partitions are costed once (`layer_costs`) and reused.
- Per stage and micro-batch, forward and backward times are sums over its layers plus the
  send of the boundary activations (and of their gradients back) over the pipeline link;
  ZeRO-3 all-gathers weights before each layer's forward and backward, prefetched behind the
  previous layer's compute, so only the excess is charged. `pipeline.simulate` turns these
  into the schedule's makespan (bubble and waiting included).
- Data-parallel gradient sync (all_reduce, or reduce_scatter with ZeRO) runs in buckets of
  `bucket_bytes`, each launched when the last backward of the step has produced its
  gradients, one after another on the link: only what outlasts that backward is exposed.
  With ZeRO 1-2 the updated weights are all-gathered after the optimizer step.
- The optimizer step is memory-bound: Adam reads and writes fp32 master weights, momentum and
  variance, reads the gradient and writes the weight (28 bytes per local parameter).
- Model FLOPs count contractions only (3x the forward: forward, dgrad, wgrad) so they match
  Narayanan et al.'s 72Bslh^2(...) ; hardware FLOPs add the recomputed forward (their 96Bslh^2).
  MFU = model FLOPs / (step time x devices x peak); `tflops_per_device` uses hardware FLOPs,
  as Megatron-LM reports its throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shardc.cost.comm import collective_time, neighbour_link
from shardc.cost.context import CostContext
from shardc.cost.estimate import Estimate, StageEstimate
from shardc.cost.layer import LayerCost, layer_costs, layer_params
from shardc.cost.memory import buffer_bytes, in_flight, model_state_bytes, state_bytes_per_param
from shardc.cost.pipeline import bubble_fraction, simulate
from shardc.diagnostics import ShardcError
from shardc.hardware import Cluster
from shardc.ir import Graph, LayerAnnotation, Node
from shardc.plan import ParallelPlan

ZERO_AXES = ("dp", "cp")


@dataclass(frozen=True, slots=True)
class EstimateOptions:
    """Knobs of the model that are not part of the plan."""

    bucket_bytes: float = 25 * 2**20  # DDP's default bucket_cap_mb=25
    algorithm: str = "auto"  # collective algorithm: auto, ring, tree, hierarchical
    host_optimizer_bandwidth: float = 50e9  # CPU Adam's memory bandwidth when offloading


@dataclass(slots=True)
class _Layer:
    name: str
    block: str
    annotation: LayerAnnotation
    nodes: list[Node]
    stage: int = 0
    cost: LayerCost | None = None
    params: dict[str, tuple[float, frozenset[str]]] = field(default_factory=dict)


def _layers(graph: Graph, plan: ParallelPlan) -> list[_Layer]:
    """The graph's layers in node order; nodes outside any layer form one layer `(ungrouped)`."""
    out: dict[str, _Layer] = {}
    for node in graph.nodes:
        name = node.layer or "(ungrouped)"
        layer = out.get(name)
        if layer is None:
            known = graph.layers.get(name)
            ann = known.annotation if known else LayerAnnotation(recompute=plan.recompute, zero=plan.zero)
            layer = out[name] = _Layer(name, known.block if known else name, ann, [])
        layer.nodes.append(node)
    layers = list(out.values())
    stages = plan.pp * plan.vpp
    if any(l.annotation.stage is not None for l in layers):
        last = 0
        for l in layers:
            last = l.annotation.stage if l.annotation.stage is not None else last
            l.stage = last
    elif stages > 1:
        blocks = [l for l in layers if sum(1 for k in layers if k.block == l.block) > 1] or layers
        per, extra = divmod(len(blocks), stages)
        index = {id(l): i for i, l in enumerate(blocks)}
        bounds = [s * per + min(s, extra) for s in range(stages + 1)]
        current = 0
        for l in layers:
            if id(l) in index:
                current = max(s for s in range(stages) if bounds[s] <= index[id(l)])
            l.stage = current
    if max((l.stage for l in layers), default=0) >= stages:
        raise ShardcError(f"graph @{graph.name} puts a layer on stage {max(l.stage for l in layers)} but the "
                          f"plan has pp*vpp = {stages} stages; re-run apply-plan with this plan")
    return layers


def _fingerprint(layer: _Layer) -> tuple:
    return (layer.block, layer.annotation.recompute,
            tuple((n.op, n.partition, tuple(v.type for v in n.outputs), tuple(v.layout for v in n.outputs),
                   tuple(v.layout for v in n.inputs), repr(sorted(n.attrs.items()))) for n in layer.nodes))


def _param_names(layer: _Layer) -> list[str]:
    """The layer's parameters in order of first use (copies of a block list them alike)."""
    seen: dict[str, None] = {}
    for node in layer.nodes:
        for v in node.inputs:
            if v.kind == "parameter":
                seen.setdefault(v.name, None)
    return list(seen)


def _batch_scale(graph: Graph, plan: ParallelPlan) -> tuple[float, int]:
    """(scale from the graph's local batch to the plan's micro-batch, the graph's batch)."""
    if not graph.inputs or not graph.inputs[0].type.shape:
        return 1.0, plan.mb
    first = graph.inputs[0]
    batch = first.type.shape[0]
    split = 1
    if graph.mesh is not None and first.layout is not None:
        for axis in first.layout.sharded_dims().get(0, []):
            split *= graph.mesh.axis_size(axis)
    return plan.mb * split / batch, batch


def _sequence(graph: Graph) -> int:
    for v in graph.inputs:
        if v.type.rank >= 2:
            return v.type.shape[1]
    return 1


def estimate(graph: Graph, cluster: Cluster, plan: ParallelPlan, *,
             options: EstimateOptions | None = None) -> Estimate:
    """Predict step time and per-device memory of training `graph` under `plan` on `cluster`."""
    options = options or EstimateOptions()
    if graph.mesh is None and plan.devices > 1:
        try:
            from shardc.passes.apply_plan import apply_plan
        except ImportError as err:
            raise ShardcError(f"graph @{graph.name} is not partitioned and the apply-plan pass is not "
                              "available; partition it first") from err
        graph = apply_plan(graph, plan)
    scale, graph_batch = _batch_scale(graph, plan)
    gbs = plan.global_batch(graph_batch)
    m = plan.micro_batches(gbs)
    ctx = CostContext.build(graph, cluster, plan.ir_dtype, scale, options.algorithm)
    layers = _layers(graph, plan)
    cache: dict[tuple, tuple[LayerCost, list[tuple[float, frozenset[str]]]]] = {}
    for layer in layers:
        key = _fingerprint(layer)
        names = _param_names(layer)
        if key not in cache:
            found = layer_params(ctx, layer.nodes)
            cache[key] = (layer_costs(ctx, layer.nodes, layer.annotation.recompute),
                          [(found[n][1], found[n][2]) for n in names])
        layer.cost, params = cache[key]
        layer.params = dict(zip(names, params))
    return _assemble(graph, cluster, plan, options, ctx, layers, m, gbs)


def _stage_sends(ctx: CostContext, layers: Sequence[_Layer], stages: int, cluster: Cluster) -> list[float]:
    """Seconds to send the activations leaving each stage for the next (one micro-batch)."""
    stage_of = {l.name: l.stage for l in layers}
    out = [0.0] * stages
    if ctx.mesh is None or "pp" not in ctx.mesh.names:
        return out
    link = neighbour_link(ctx.mesh, "pp", cluster)
    sent: set[int] = set()
    for layer in layers:
        for node in layer.nodes:
            for v in node.inputs:
                src = stage_of.get(ctx.layer_of.get(id(v), ""), layer.stage)
                if src < layer.stage and id(v) not in sent and id(v) in ctx.batched:
                    sent.add(id(v))
                    out[src] += collective_time("send_recv", ctx.local_bytes(v), ((link, 2),))
    return out


def _zero3_gather(ctx: CostContext, layer: _Layer, shard_levels, elem: int) -> tuple[float, float]:
    """Exposed forward and backward seconds of a ZeRO-3 layer's weight all-gathers."""
    nbytes = sum(n for n, _ in layer.params.values()) * elem
    t = collective_time("all_gather", nbytes, shard_levels, ctx.algorithm)
    cost = layer.cost
    assert cost is not None
    return max(0.0, t - cost.fwd.get("compute_fwd", 0.0)), max(0.0, t - cost.bwd.get("compute_bwd", 0.0))


def _assemble(graph: Graph, cluster: Cluster, plan: ParallelPlan, options: EstimateOptions, ctx: CostContext,
              layers: list[_Layer], m: int, gbs: int) -> Estimate:
    from shardc.cost.sync import gradient_sync

    p, v = plan.pp, plan.vpp
    S = p * v
    mesh = ctx.mesh
    zero_axes = tuple(a for a in ZERO_AXES if mesh is not None and a in mesh.names)
    shard = 1
    for a in zero_axes:
        shard *= mesh.axis_size(a) if mesh is not None else 1
    shard_levels = ctx.levels(zero_axes)
    w_elem, g_elem, _ = state_bytes_per_param(plan.dtype)
    sends = _stage_sends(ctx, layers, S, cluster)
    times = [dict[str, float]() for _ in range(S)]
    fwd, bwd = [0.0] * S, [0.0] * S
    for layer in layers:
        cost = layer.cost
        assert cost is not None
        s = layer.stage
        for key, val in cost.fwd.items():
            times[s][key] = times[s].get(key, 0.0) + val * m
        for key, val in cost.bwd.items():
            times[s][key] = times[s].get(key, 0.0) + val * m
        fwd[s] += cost.fwd_s
        bwd[s] += cost.bwd_s
        if layer.annotation.zero >= 3 and shard > 1:
            ef, eb = _zero3_gather(ctx, layer, shard_levels, w_elem)
            fwd[s] += ef
            bwd[s] += eb
            times[s]["dp_comm"] = times[s].get("dp_comm", 0.0) + (ef + eb) * m
    for s in range(S):
        back = sends[s - 1] if s > 0 else 0.0
        fwd[s] += sends[s]
        bwd[s] += back
        if sends[s] or back:
            times[s]["pp_comm"] = times[s].get("pp_comm", 0.0) + (sends[s] + back) * m
    pipe = simulate(plan.schedule if p > 1 else "1f1b", fwd, bwd, m, p)
    syncs = gradient_sync(ctx, layers, plan, options, zero_axes, shard, pipe, bwd, g_elem, w_elem)
    end = max(pipe.last_end[d] + syncs[d].tail for d in range(p))
    step = end + max(s.after for s in syncs)
    stages: list[StageEstimate] = []
    capacity = cluster.device.memory_bytes
    for d in range(p):
        mine = [l for l in layers if l.stage % p == d]
        cat: dict[str, float] = {}
        for s in range(d, S, p):
            for key, val in times[s].items():
                cat[key] = cat.get(key, 0.0) + val
        cat["dp_comm"] = cat.get("dp_comm", 0.0) + syncs[d].tail + syncs[d].gather
        cat["optimizer"] = syncs[d].optimizer
        cat["bubble"] = max(0.0, step - sum(cat.values()))
        params = syncs[d].params
        states = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0}
        for numel, zero in params:
            for key, val in model_state_bytes(numel, plan.dtype, zero, shard, plan.offload).items():
                states[key] += val
        saved = sum(l.cost.saved_bytes for l in mine if l.cost)
        flight = in_flight(plan.schedule, p, d, m, v)
        activations = saved * flight / (v if plan.schedule == "interleaved" else 1)
        grad_bytes = sum(n for n, _ in params) * g_elem
        largest = max((sum(n for n, _ in l.params.values()) for l in mine), default=0.0)
        zero = max((l.annotation.zero for l in mine), default=0)
        memory = {**states, "activations": activations,
                  "recompute_working": max((l.cost.working_bytes for l in mine if l.cost), default=0.0),
                  "buffers": buffer_bytes(grad_bytes, options.bucket_bytes, shard, zero, largest * w_elem)}
        stages.append(StageEstimate(d, tuple(l.name for l in mine), cat, memory, flight,
                                    sum(l.cost.saved_bytes for l in mine if l.cost), syncs[d].grad_bytes,
                                    syncs[d].comm_bytes))
    return Estimate.build(graph, cluster, plan, layers, stages, step, m, gbs, _sequence(graph),
                          bubble_fraction(p, m, v), capacity, ctx)
