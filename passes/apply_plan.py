"""apply-plan: turn a hand-written `ParallelPlan` (Megatron style) into a partitioned IR.

Mesh. `mesh<pp=P, dp=D, cp=C, tp=T>`, all four axes always (size 1 included), so a rank's
coordinates mean the same in every plan; partitions and layouts never name an axis of size 1.

Rules, node by node in graph order; each mesh axis picks the iteration dim it splits:
- follow: a node splits an axis along the dim that takes its first input that is sharded on
  that axis exactly as it is (`propagate.follow`), so views, norms, elementwise ops and
  attention move no data. Graph inputs start `{dp:S(0), cp:S(1)}` (batch, sequence).
- dp, cp: with nothing to follow, the dim whose role is the batch (dp) or the sequence (cp),
  traced from the graph inputs. A node with a ring dim (attention's keys) split on cp in
  space gets `time t/C rotate cp` (ring attention; an attention written out as matmuls gets
  its keys all-gathered instead).
- cp=N:zigzag (`cp_layout="zigzag"`): every split on cp is zig-zag (`partition<cp:s zigzag>`,
  layouts `S(1, zigzag)`): the sequence is cut into 2N chunks and cp rank i holds chunks i and
  2N-1-i, so causal attention costs every rank the same. Graph inputs and position buffers
  arrive in that order (the permutation happens once, where the input is split); every op
  along the sequence keeps it, and collectives on cp put positions back in order.
- tp (Megatron, from the dataflow, not from names): a linear with a parameter weight (or a
  matmul by a parameter matrix: transformers' Conv1D) is row-parallel (splits k, its output is
  `P(sum)`) when its input arrives sharded on the last dim, else column-parallel (splits n;
  strided `n/k` when a `split` into k equal pieces reads it, possibly through a bias add and
  views: a fused qkv). So q/k/v and fc1 (gate and up) are column, the output projection and
  fc2 row; heads split by following. The token embedding (ids from a graph input) is
  vocab-parallel (splits v, `P(sum)` out); the LM head is column-parallel and cross entropy
  follows it on its vocab dim (rule "vocab").
- partial inputs are resolved where they are read: all_reduce (replicated), or with sequence
  parallelism (sp=1, tp>1) reduce_scatter onto the sequence: norms, dropouts and residual
  adds then run sequence-sharded over tp, and column-parallel inputs are all-gathered.
- with sp, float graph inputs (a block traced alone) start sequence-sharded over tp as well.
- parameters and buffers are held as their first reader needs them (`Partial` held replicated;
  a row-parallel bias is then zeroed on all but one rank, `to_partial`).
- a split dim must divide evenly by the axes splitting it, except the vocabulary on tp (shards
  padded; torch's Shard does the same).
- tp on an `experts` node (expert tensor parallelism, `shardc.ops.moe`): every expert's
  intermediate dim `i` splits (gate/up column-parallel, down row-parallel, the output
  `P(sum)`, resolved like a row-parallel linear's), when tp divides it; else the experts stay
  whole on tp.
- ep (expert parallelism, `shardc.ops.moe`): an `experts` node splits its expert dim (rule
  "expert": its weights sharded, its tokens where they are, exchanged by all-to-all inside the
  op); every other node splits the batch on ep as on dp (graph inputs `{dp:S(0), ep:S(0)}`), so
  ep ranks are data-parallel ranks for the dense layers, their parameters' gradients summed over
  ep by `grad_all_reduce` (ep is a model axis for `lower`, not a DDP axis).
- pp: layers (group-layers runs first if the graph has none) get stages by
  `shardc.analysis.stages`: the repeated blocks are cut into pp*vpp contiguous chunks as even
  as possible (extra blocks go to the middle stages first), layers before the first block join
  stage 0, after the last the last stage, between blocks the previous block's; virtual stage
  k runs on pp rank `shardc.analysis.stages.stage_device` (k % pp; zbv and dualpipev a V:
  rank r holds k = r and 2pp-1-r). Every layer records the plan's zero; the plan's
  recompute goes to the transformer blocks only (`Layering.block_names`; the embedding, the
  head and layers between blocks get none, as in Megatron-LM; a graph without repeated blocks:
  every layer), and with `recompute_layers=N` to the first N blocks of each model chunk only
  (Megatron's block method).
- graph.attrs: plan (its text), microbatch_size, microbatches (gbs / (dp*mb)), global_batch,
  traced_batch (the batch the graph was traced with; per device per micro-batch, activation
  shapes are the local shapes with the batch scaled by microbatch_size / (traced_batch / dp)),
  schedule, virtual_stages, sequence_parallel, dtype.
Errors: a plan the graph cannot take (a degree not dividing a split dim, more stages than
blocks, a batch not divisible by dp) is a ShardcError naming the node and the constraint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import ClassVar

from shardc.analysis.dims import model_dims
from shardc.analysis.propagate import derives_from_input, follow, io_layouts, iteration_space
from shardc.analysis.roles import Roles, dim_roles, iteration_roles
from shardc.analysis.stages import layer_stages, layering
from shardc.ir import (
    Axis,
    Graph,
    Layer,
    LayerAnnotation,
    Layout,
    Mesh,
    Node,
    Partial,
    Partition,
    Placement,
    Replicate,
    Shard,
    TemporalSplit,
    Value,
)
from shardc.ir.diagnostics import ShardcError
from shardc.ops.registry import IterationSpace, get_op
from shardc.passes.group_layers import group_layers
from shardc.passes.validate_plan import check_plan
from shardc.passmanager import Pass, PassContext, register_pass
from shardc.plan.parallel import ParallelPlan, check_recompute_layers


@dataclass
class _Planner:
    graph: Graph
    plan: ParallelPlan
    mesh: Mesh
    roles: Roles
    vocab: int | None

    @cached_property
    def users(self) -> dict[Value, list[Node]]:
        """Who reads each value: partitioning annotates nodes and never rewires them, so once."""
        return self.graph.users()

    @property
    def sequence_parallel(self) -> bool:
        return self.plan.sp and self.plan.tp > 1

    def axes(self) -> list[str]:
        return [a for a in (Axis.DP, Axis.EP, Axis.CP, Axis.TP) if a in self.mesh.names and self.mesh.axis_size(a) > 1]

    def partition(self, node: Node, space: IterationSpace) -> Partition:
        it_roles = iteration_roles(node, space, self.roles)
        spatial: list[tuple[str, str]] = []
        strides: list[tuple[str, int]] = []
        temporal = []
        zigzag: tuple[str, ...] = ()
        for axis in self.axes():
            outer = Partition(tuple(spatial), (), tuple(strides))
            choice = self.choose(node, space, axis, outer, it_roles)
            if choice is None:
                continue
            dim, stride = choice
            spatial.append((axis, dim))
            if stride > 1:
                strides.append((axis, stride))
            if axis == Axis.CP and self.plan.cp_layout == "zigzag":
                zigzag = (Axis.CP,)
            for ring in (d for d, rule in space.special if rule == "ring"):
                if axis == Axis.CP and dim == _query_dim(space, ring):
                    temporal.append(TemporalSplit(ring, self.mesh.axis_size(axis), axis))
        return Partition(tuple(spatial), tuple(temporal), tuple(strides), zigzag)

    def choose(self, node: Node, space: IterationSpace, axis: str, outer: Partition,
               it_roles: dict[str, str]) -> tuple[str, int] | None:
        if axis == Axis.TP:
            forced = self.megatron(node, space)
            if forced is not None:
                return forced
        if axis == Axis.EP:  # an MoE layer's experts; its tokens stay where they are (`shardc.ops.moe`)
            experts = [d for d, rule in space.special if rule == "expert" and space.size(d) > 1]
            if experts:
                return experts[0], 1
        for k, v in enumerate(node.inputs):
            if k >= len(space.inputs):
                break
            found = follow(space, k, _contiguous(v.layout or Layout(), axis), axis, outer, self.mesh,
                           lambda d: self.splittable(space, d, axis))
            if found is not None:
                return found
        axis_roles: dict[str, str] = {Axis.DP: "batch", Axis.EP: "batch", Axis.CP: "seq"}
        role = axis_roles.get(axis)
        partial_in = any(isinstance((v.layout or Layout()).on(axis), Partial) for v in node.inputs)
        if axis == Axis.TP and self.sequence_parallel and partial_in:
            role = "seq"
        for dim, has in it_roles.items():  # the first input's dims first
            if role is not None and has == role and self.splittable(space, dim, axis):
                return dim, 1
        return None

    def splittable(self, space: IterationSpace, dim: str, axis: str) -> bool:
        rule = dict(space.special).get(dim)
        if dim in space.unsplittable or space.size(dim) <= 1 or (rule is not None and rule != "vocab"):
            return False
        return rule != "vocab" or axis == Axis.TP

    def megatron(self, node: Node, space: IterationSpace) -> tuple[str, int] | None:
        """Column/row-parallel linears and the vocab-parallel token embedding (module docstring)."""
        if (node.op == "linear" or (node.op == "matmul" and node.inputs[1].type.rank == 2)) and \
                len(node.inputs) >= 2 and node.inputs[1].kind == "parameter":
            x = node.inputs[0]
            p = (x.layout or Layout()).on(Axis.TP)
            if isinstance(p, Shard) and p.dim == x.type.rank - 1 and p.interleave == 1:
                return "k", 1
            return "n", _equal_split_readers(self.users, node)
        if node.op == "embedding" and node.inputs[1].kind == "parameter" and derives_from_input(self.graph,
                                                                                               node.inputs[0]):
            return "v", 1
        if node.op == "experts" and space.size("i") % self.mesh.axis_size(Axis.TP) == 0:
            return "i", 1  # expert tensor parallelism (`shardc.ops.moe`): gate/up column-, down row-parallel
        return None

    def check(self, node: Node, space: IterationSpace, partition: Partition) -> None:
        """Every split dim must divide evenly (the vocabulary may not: its shards are padded)."""
        for axis, dim in partition.spatial:
            size, n, stride = space.size(dim), self.mesh.axis_size(axis), partition.stride_of(axis)
            together = math.prod(self.mesh.axis_size(a) * partition.stride_of(a) * (2 if a in partition.zigzag
                                 else 1) for a, d in partition.spatial if d == dim)
            if size % together == 0 or (axis == Axis.TP and self.vocab is not None and size == self.vocab):
                continue
            what = f"iteration dim {dim} (size {size}"
            what += f" in {stride} interleaved pieces)" if stride > 1 else ")"
            if get_op(node.op).kind == "attention" and dim == "g":
                what = f"the {size} attention heads (key/value heads with grouped-query attention)"
            raise ShardcError(f"mesh axis {axis}={n} does not divide {what} of {node.op} at module "
                              f"{node.location.module_path or '?'}", node=node,
                              hint=f"choose {axis} dividing {size // stride} (plan key {axis}=...)")


def _contiguous(layout: Layout, axis: str) -> Placement:
    """The placement on `axis` with any zig-zag order dropped: `follow` matches dims, and the
    partition adds the order back."""
    p = layout.on(axis)
    return replace(p, zigzag=False) if isinstance(p, Shard) else p


def _query_dim(space: IterationSpace, ring: str) -> str | None:
    """The dim of the first input at the position where the second input holds `ring` (the
    query sequence of attention, whose key sequence is `ring`)."""
    if len(space.inputs) < 2:
        return None
    for q, k in zip(reversed(space.inputs[0]), reversed(space.inputs[1])):
        if k and k[0] == ring:
            return q[0] if q else None
    return None


def _equal_split_readers(users: dict[Value, list[Node]], node: Node) -> int:
    """k when the node's output reaches a split of its last dim into k equal pieces (directly, or
    through elementwise ops and views that keep the last dim: a bias add, a reshape), else 1.
    `users`: the graph's readers of each value (`Graph.users`)."""
    out = node.outputs[0]
    for _ in range(8):
        readers = users.get(out, [])
        for reader in readers:
            dim, sizes = reader.attrs.get("dim", 0), reader.attrs.get("sizes", ())
            if reader.op == "split" and reader.inputs[0] is out and dim in (-1, out.type.rank - 1) \
                    and len(sizes) > 1 and len(set(sizes)) == 1:
                return len(sizes)
        onward = [r for r in readers if get_op(r.op).kind in ("elementwise", "view") and r.op != "split"
                  and len(r.outputs) == 1 and r.output.type.shape[-1:] == out.type.shape[-1:]]
        if len(readers) != 1 or not onward:
            return 1
        out = onward[0].output
    return 1


def _input_layout(value: Value, roles: tuple[str | None, ...], mesh: Mesh, sequence_parallel: bool,
                  zigzag: bool = False) -> Layout:
    """Batch on dp, sequence on cp (zig-zag with `zigzag`); with sequence parallelism a float input
    (the residual stream of a block traced alone) also has its sequence on tp."""
    placements = []
    for axis, role in ((Axis.DP, "batch"), (Axis.EP, "batch"), (Axis.CP, "seq"), (Axis.TP, "seq")):
        if axis == Axis.TP and not (sequence_parallel and value.type.is_float):
            continue
        if axis in mesh.names and mesh.axis_size(axis) > 1 and role in roles:
            placements.append((axis, Shard(roles.index(role), zigzag=zigzag and axis == Axis.CP)))
    return Layout(tuple(placements))


def _held(layout: Layout) -> Layout:
    """How a parameter or buffer is stored for a reader needing `layout`: Partial held replicated."""
    return Layout(tuple((a, p) for a, p in layout.placements if not isinstance(p, Partial | Replicate)))


def apply_plan(graph: Graph, plan: ParallelPlan) -> Graph:
    """Partition `graph` by `plan` in place (rules in the module docstring) and return it."""
    if not graph.layers:  # first: block classes must not depend on layouts, and validation counts them
        group_layers(graph)
    check_plan(graph, plan)
    dims = model_dims(graph)
    mesh = plan.mesh()
    graph.mesh = mesh
    roles = dim_roles(graph)
    batch = graph.inputs[0].type.shape[0] if graph.inputs and graph.inputs[0].type.rank else None
    if batch is not None and batch % plan.dp:
        raise ShardcError(f"graph @{graph.name} was traced with a batch of {batch}, which dp={plan.dp} does not "
                          "divide", hint=f"trace with a batch of dp*mb = {plan.dp * plan.mb} example sequences")
    planner = _Planner(graph, plan, mesh, roles, dims.vocab)
    for v in graph.inputs:
        v.layout = _input_layout(v, roles.get(v, ()), mesh, planner.sequence_parallel,
                                 plan.cp_layout == "zigzag")
    for v in graph.params + graph.buffers:
        v.layout = None
    for node in graph.nodes:
        space = iteration_space(node)
        node.partition = planner.partition(node, space)
        planner.check(node, space, node.partition)
        try:
            ins, outs = io_layouts(node, mesh)
        except ValueError as err:
            raise ShardcError(f"partition {node.partition} does not fit {node.op}: {err}", node=node) from None
        for v, need in zip(node.inputs, ins):
            if v.kind in ("parameter", "buffer") and v.layout is None:
                v.layout = _held(need)
        for v, layout in zip(node.outputs, outs):
            v.layout = layout
    for v in graph.params + graph.buffers:
        if v.layout is None:
            v.layout = Layout()
    assign_stages(graph, plan)
    graph.attrs.update({
        "plan": str(plan), "microbatch_size": plan.mb, "microbatches": plan.micro_batches(batch),
        "global_batch": plan.global_batch(batch), "traced_batch": batch if batch is not None else 1,
        "schedule": plan.schedule, "virtual_stages": plan.vpp, "sequence_parallel": planner.sequence_parallel,
        "dtype": plan.ir_dtype,
    })
    return graph


def assign_stages(graph: Graph, plan: ParallelPlan) -> None:
    """Give every layer its pipeline stage (`shardc.analysis.stages`) and zero, and the
    plan's recompute to the transformer blocks only (the embedding, the head and layers between
    blocks: none, as Megatron-LM recomputes blocks); with `recompute_layers=N`, only the first N
    blocks of each model chunk (stage, or virtual stage) recompute."""
    if not graph.layers:
        group_layers(graph)
    stage_of = layer_stages(graph, plan.stages)
    # A graph without repeated blocks (an MLP) recomputes every layer, as the plan asks.
    blocks = layering(graph).block_names or tuple(graph.layers)
    per_chunk = [sum(stage_of.get(b, 0) == k for b in blocks) for k in range(plan.stages)]
    check_recompute_layers(plan, per_chunk)
    recompute: dict[str, str] = {}
    seen = [0] * plan.stages
    for name in blocks:
        k = stage_of.get(name, 0)
        keep = plan.recompute_layers is None or seen[k] < plan.recompute_layers
        recompute[name] = plan.recompute if keep else "none"
        seen[k] += 1
    for name, layer in graph.layers.items():
        graph.layers[name] = Layer(name, layer.block, LayerAnnotation(
            stage=stage_of.get(name, 0), recompute=recompute.get(name, "none"), zero=plan.zero))


@register_pass
@dataclass(frozen=True)
class ApplyPlan(ParallelPlan, Pass):
    """`apply-plan{dp=2,tp=2,sp=true}`: options are the plan's keys (the pass is the plan it
    applies, so the two cannot drift apart); with none given, the context's `plan` (a
    ParallelPlan or its text) is used."""

    name: ClassVar[str] = "apply-plan"
    __str__ = Pass.__str__

    def to_plan(self) -> ParallelPlan:
        return ParallelPlan(**{f.name: getattr(self, f.name) for f in fields(ParallelPlan)})

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        plan = self.to_plan()
        given = getattr(ctx, "plan", None) if ctx is not None else None
        if plan == ParallelPlan() and given is not None:
            plan = ParallelPlan.of(given)
        return apply_plan(graph, plan)


