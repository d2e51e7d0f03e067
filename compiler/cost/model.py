"""`estimate(graph, cluster, plan)`: step time, throughput, MFU and memory of every pipeline stage.

Rules:
- The graph is costed as partitioned (the driver partitions it first; a graph without a mesh
  is one device): any partitioned IR, whether apply-plan wrote it from a plan string or the solver chose it node
  by node. Its batch is rescaled to the plan's micro-batch: every batch-dependent tensor and
  FLOP is multiplied by `mb / local batch` (`shardc.analysis.dims.graph_batch_scale`). Layers come from `graph.layers` (stage, recompute
  and ZeRO per layer); copies of one block with equal partitions are costed once
  (`layer_costs`) and reused. Kernels are priced as the plan runs them: fused by inductor when
  its rank modules run through torch.compile (`plan.compiled_on`: `compile=1`, or auto on a GPU
  cluster; `shardc.cost.fusion`), eager per-op kernels otherwise.
- The step and the memory per device are composed from the layers' costs by
  `compose.compose` (pipeline schedule, ZeRO-3 gathers, bucketed gradient sync, optimizer,
  memory in flight), the same composition the solver evaluates its plans with. The
  activations leaving a stage are every batched value a later stage reads, sent once (as 1/tp
  pieces all-gathered on arrival where the runtime scatters them: `pipeline_scatter_gather`).
- Model FLOPs count contractions only (3x the forward: forward, dgrad, wgrad) so they match
  Narayanan et al.'s 72Bslh^2(...) ; hardware FLOPs add the recomputed forward (their 96Bslh^2).
  MFU = model FLOPs / (step time x devices x peak); `tflops_per_device` uses hardware FLOPs,
  as Megatron-LM reports its throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from shardc.analysis.dims import graph_batch_scale
from shardc.analysis.stages import layer_stages, stage_device
from shardc.cost.comm import collective_time, neighbour_link
from shardc.cost.compose import EstimateOptions, LayerWork, compose, fsdp2, zero_group
from shardc.cost.context import CostContext
from shardc.cost.edges import layer_params
from shardc.cost.estimate import Estimate
from shardc.cost.fusion import is_cpu
from shardc.cost.layer import LayerCost, LayerTerms, finish_layer, layer_terms
from shardc.cost.pipeline import bubble_fraction
from shardc.cost.ring import causal_ring_axis
from shardc.cost.timeline import LayerMemory, layer_memory
from shardc.hardware import Cluster
from shardc.ir import DATA_AXES, Axis, Graph, LayerAnnotation, Layout, Replicate, Value
from shardc.ir.diagnostics import ShardcError
from shardc.ops.registry import get_op
from shardc.plan.parallel import ParallelPlan, plan_of

__all__ = ["EstimateOptions", "estimate"]


def _layers(graph: Graph, plan: ParallelPlan) -> list[LayerWork]:
    """The graph's layers in node order; nodes outside any layer form one layer `(ungrouped)`.
    Stages come from the layer annotations, else from `shardc.analysis.stages`."""
    out: dict[str, LayerWork] = {}
    for node in graph.nodes:
        name = node.layer or "(ungrouped)"
        layer = out.get(name)
        if layer is None:
            known = graph.layers.get(name)
            ann = known.annotation if known else LayerAnnotation(recompute=plan.recompute, zero=plan.zero)
            layer = out[name] = LayerWork(name, known.block if known else name, ann, [])
        layer.nodes.append(node)
    layers = list(out.values())
    stages = plan.pp * plan.vpp
    if any(l.annotation.stage is not None for l in layers):
        last = 0
        for l in layers:
            last = l.annotation.stage if l.annotation.stage is not None else last
            l.stage = last
    elif stages > 1:  # a graph without stage annotations: the stages apply-plan would give it
        stage_of = layer_stages(graph, stages)
        for l in layers:
            l.stage = stage_of[l.name]
    if max((l.stage for l in layers), default=0) >= stages:
        raise ShardcError(f"graph @{graph.name} puts a layer on stage {max(l.stage for l in layers)} but the "
                          f"plan has pp*vpp = {stages} stages; re-run apply-plan with this plan")
    return layers


def _fingerprint(layer: LayerWork) -> tuple:
    return (layer.block, layer.annotation.recompute,
            tuple((n.op, str(n.partition), tuple(str(v.type) for v in n.outputs),
                   tuple(str(v.layout) for v in n.outputs), tuple(str(v.layout) for v in n.inputs),
                   repr(sorted(n.attrs.items()))) for n in layer.nodes))


def _param_names(layer: LayerWork) -> list[str]:
    """The layer's parameters in order of first use (copies of a block list them alike)."""
    seen: dict[str, None] = {}
    for node in layer.nodes:
        for v in node.inputs:
            if v.kind == "parameter":
                seen.setdefault(v.name, None)
    return list(seen)




def _sequence(graph: Graph) -> int:
    for v in graph.inputs:
        if v.type.rank >= 2:
            return v.type.shape[1]
    return 1


def estimate(graph: Graph, cluster: Cluster, plan: ParallelPlan | None = None, *,
             options: EstimateOptions | None = None) -> Estimate:
    """Predict step time and per-device memory of training `graph` under `plan` on `cluster`.

    `graph` may be any partitioned IR: per-node partitions (temporal and rotating ones
    included), per-layer stages, recomputation and ZeRO stages, as apply-plan or the solver
    wrote them. With `plan=None` the plan the graph records (`plan_of`) gives the mesh degrees,
    micro-batch, global batch, schedule and dtype."""
    options = options or EstimateOptions()
    plan = plan if plan is not None else plan_of(graph)
    if graph.mesh is None and plan.devices > 1:
        raise ShardcError(f"graph @{graph.name} is not partitioned but plan {plan} spans {plan.devices} devices",
                          hint="partition it first: the pipeline group-layers,validate-plan,apply-plan,estimate "
                               "(shardc.driver) does")
    batch = graph_batch_scale(graph, plan.mb)
    gbs = plan.global_batch(batch.traced)
    m = plan.micro_batches(gbs)
    ctx = CostContext.build(graph, cluster, plan.ir_dtype, batch.factor, options.algorithm,
                            compiled=plan.compiled_on(not is_cpu(cluster.device)))
    ctx.expert_dispatch = options.expert_dispatch
    layers = _layers(graph, plan)
    _cost_layers(ctx, layers, plan, options)
    sends, send_bytes = _stage_sends(ctx, layers, plan.pp * plan.vpp, cluster, options.pipeline_scatter_gather)
    result = compose(layers, sends, ctx, plan, m, options, send_bytes, _output_bytes(ctx, graph))
    stages = list(result.stages)
    ring = causal_ring_axis(ctx, graph.nodes)
    if ring is not None:  # ranks along a causal ring keep different blocks: each coordinate's memory
        axis, n = ring
        figures = []
        for c in range(n):
            mine = [replace(l, cost=None, memory=None, params={}) for l in layers]
            _cost_layers(replace(ctx, ring_rank=c, _local={}), mine, plan, options)
            figures.append([s.memory_bytes for s in compose(mine, sends, ctx, plan, m, options, send_bytes,
                                                            _output_bytes(ctx, graph)).stages])
        stages = [replace(s, memory_by_coordinate=(axis, tuple(f[i] for f in figures))) for i, s in enumerate(stages)]
    return Estimate.build(graph, cluster, plan, layers, stages, result.step_time_s, m, gbs,
                          _sequence(graph), bubble_fraction(plan.pp, m, plan.vpp, plan.schedule), cluster.device.memory_bytes, ctx,
                          result.schedule)


def _cost_layers(ctx: CostContext, layers: Sequence[LayerWork], plan: ParallelPlan, options: EstimateOptions) -> None:
    """Each layer's cost, parameters and micro-batch timeline, in place; copies of one block
    with equal partitions are costed once."""
    cache: dict[tuple, tuple[LayerCost, list[tuple[float, frozenset[str]]], LayerTerms]] = {}
    memories: dict[tuple, LayerMemory] = {}
    _, shard = zero_group(ctx.graph.mesh)
    earlier: dict[int, set[str]] = {}
    for layer in layers:
        key = _fingerprint(layer)
        names = _param_names(layer)
        if key not in cache:
            found = layer_params(ctx, layer.nodes)
            terms = layer_terms(ctx, layer.nodes)
            cache[key] = (finish_layer(terms, layer.annotation.recompute),
                          [(found[n][1], found[n][2]) for n in names], terms)
        layer.cost, params, terms = cache[key]
        layer.params = dict(zip(names, params))
        mine = earlier.setdefault(stage_device(layer.stage, plan.pp, plan.schedule), set())
        hold = fsdp2(options, layer.annotation.zero, shard)
        tied = frozenset(n for n in names if n in mine)
        if (key, tied, hold) not in memories:
            memories[(key, tied, hold)] = layer_memory(ctx, layer.nodes, terms, layer.annotation.recompute, tied, hold)
        layer.memory = memories[(key, tied, hold)]
        mine.update(names)


def _output_bytes(ctx: CostContext, graph: Graph) -> float:
    """Bytes of what the last stage returns per micro-batch before the loss (the loss's input);
    a graph without a loss returns its outputs as `lower` makes them: gathered on every axis but
    the data axes (where each rank keeps its share)."""
    for node in reversed(graph.nodes):
        if get_op(node.op).kind == "loss" and node.inputs:
            return ctx.local_bytes(node.inputs[0])
    return sum(ctx.local_bytes(v, Layout(tuple((a, p) for a, p in ctx.layout(v).placements if a in DATA_AXES)))
               for v in graph.outputs)


def _stage_sends(ctx: CostContext, layers: Sequence[LayerWork], stages: int, cluster: Cluster,
                 scatter_gather: bool = False) -> tuple[list[float], list[float]]:
    """Seconds and bytes to send the activations leaving each stage for the next (one micro-batch).
    `scatter_gather` (`EstimateOptions.pipeline_scatter_gather`): an activation replicated over tp
    travels as 1/tp per tp rank and is all-gathered over tp on arrival; bytes stay the whole
    activation (what the receiving stage holds)."""
    stage_of = {l.name: l.stage for l in layers}
    out = [0.0] * stages
    nbytes = [0.0] * stages
    if ctx.mesh is None or Axis.PP not in ctx.mesh.names:
        return out, nbytes
    link = neighbour_link(ctx.mesh, Axis.PP, cluster)
    tp = ctx.mesh.axis_size(Axis.TP) if Axis.TP in ctx.mesh.names else 1
    sent: set[Value] = set()
    for layer in layers:
        for node in layer.nodes:
            for v in node.inputs:
                src = stage_of.get(ctx.layer_of.get(v, ""), layer.stage)
                if src < layer.stage and v not in sent and v in ctx.batched:
                    sent.add(v)
                    size = ctx.local_bytes(v)
                    if scatter_gather and tp > 1 and isinstance(ctx.layout(v).on(Axis.TP), Replicate):
                        out[src] += (collective_time("send_recv", size / tp, ((link, 2),))
                                     + collective_time("all_gather", size, ctx.levels((Axis.TP,)), ctx.algorithm))
                    else:
                        out[src] += collective_time("send_recv", size, ((link, 2),))
                    nbytes[src] += size
    return out, nbytes
