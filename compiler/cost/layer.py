"""The cost of one layer for one micro-batch on one device: time by category, FLOPs, saved bytes.

Rules, node by node over the layer's partitioned IR:
- compute: `node_compute_time` on the node's local shapes (forward; backward from forward);
  when the plan runs compiled (`ctx.compiled`), what inductor makes of the layer
  (`shardc.cost.fusion`: fused elementwise chains, attention as one sdpa kernel).
- forward communication: on every input edge, the collectives that turn the value's layout
  into the layout the node requires (`reshard_steps`), on the critical path, charged to the
  category of their mesh axis (tp_comm, cp_comm, ...). Vocab-parallel cross entropy adds two
  all_reduces of one fp32 per row (max and sum of exponentials). A temporal split that rotates
  an operand around a mesh axis (ring attention) sends it steps-1 times, overlapped with the
  node's compute: only the excess is charged.
- backward communication, the conjugates (`edges`): the gradient of every value produced here
  is the sum of its consumers' contributions, redistributed into the layout the producer's
  backward needs. An input all-gathered into column-parallel linears (sequence parallelism,
  `edges.saves_shard`) is saved sharded and gathered again in backward; every reader that saves
  a gathered input is charged that gather again (as the solver prices edges; the backend runs
  one per gathered copy, and none for other readers, which keep the copy). A node whose output value holds its partial sum reduced pays the
  reduction where it is made.
- rotating temporal splits run the local kernel once per step on one step's pieces
  (`grid2d.step_types`); chunks add a launch per step. A PrimePar grid (`rotate (tp, tq)`) is
  charged by `shardc.cost.grid2d`: overlapped shifts on both axes, the skew, receive buffers.
  Working memory: the largest node's transient.
- saved for backward: each op's `saved_for_backward` entries, parameters and buffers
  excluded, a view counted as the storage it aliases, each storage once, at the producer's
  layout (an input all-gathered into column-parallel linears is counted sharded, as Megatron
  and the backend's `gather_linears` keep it; any other op reading a gathered copy saves that
  copy, keyed (where, GATHERED - i): `edges.gathered_source`); a rotating node also keeps the shards it received (`saved.received_entries`; what is saved: `shardc.cost.saved`). Selective recomputation drops what the attention core (`shardc.analysis.attention`:
  from the QK^T product to the PV product; none for a fused attention node) saves of its own
  tensors and recomputes the core; full recomputation keeps only the layer's inputs
  and recomputes the whole forward (its collectives included).
The solver prices its candidates with these same functions (`layer_terms` on a fragment).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from shardc.analysis.attention import attention_core as core_of
from shardc.analysis.head_loss import HeadLoss
from shardc.cost.comm import CommStep
from shardc.cost.compute import (
    NodeCost,
    node_compute_time,
    saved_bytes_of,
    working_bytes,
)
from shardc.cost.context import CostContext, axis_category
from shardc.cost.edges import (
    comm_time,
    feeds_only_parameters,
    gradient_contribution,
    gradient_layout,
    gradient_steps,
    input_steps,
    resolves,
)
from shardc.cost.fusion import compiled_node_cost
from shardc.cost.grid2d import grid_charge, grid_split, moving_operands, step_types
from shardc.cost.head import (
    head_regions,
    head_saved_bytes,
    head_working,
    vocab_parallel_loss,
)
from shardc.cost.moe import (
    TOKEN_OPERANDS,
    dispatcher_axes,
    dispatcher_saves,
    expert_steps,
    routed_bytes,
    routing_skew,
)
from shardc.cost.ring import as_run
from shardc.cost.saved import (
    SavedKey,
    batched_scale,
    saved_for_backward,
)
from shardc.ir import Node, Value
from shardc.ops.registry import rotating_operands


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One layer, one micro-batch, one device, under one recomputation. Times in seconds.

    `fwd` and `bwd` map categories (compute_fwd, compute_bwd, recompute, tp_comm, cp_comm, ...)
    to seconds; `bwd` includes the recomputation. FLOPs are local hardware FLOPs;
    `matmul_flops` the global forward contraction FLOPs (model FLOPs are 3x these).
    `saved_bytes` is what a micro-batch keeps until its backward, `working_bytes` what the
    recomputation regenerates at once, `transient_bytes` the largest allocation while running.
    """

    fwd: dict[str, float]
    bwd: dict[str, float]
    fwd_flops: float
    bwd_flops: float
    recompute_flops: float
    matmul_flops: float
    recompute_matmul_flops: float
    saved_bytes: float
    full_saved_bytes: float
    working_bytes: float
    collectives: tuple[tuple[str, CommStep], ...] = field(default=())
    transient_bytes: float = 0.0

    @property
    def fwd_s(self) -> float:
        return sum(self.fwd.values())

    @property
    def bwd_s(self) -> float:
        return sum(self.bwd.values())


# What a layer saves for backward: a storage (its root value), or (node, k) for an op's k-th
# saved entry of raw bytes.


@dataclass
class LayerTerms:
    """A layer's per-micro-batch sums before recomputation is applied (`finish_layer`).

    `core_*` is the attention core (QK^T through PV), what selective recomputation repeats and
    drops: `core_fwd` its forward time by category, `core_saved` the bytes produced and saved
    inside it. `inputs` are the layer's input activations (what full recomputation keeps).
    """

    fwd: dict[str, float] = field(default_factory=dict)
    bwd: dict[str, float] = field(default_factory=dict)
    core_fwd: dict[str, float] = field(default_factory=dict)
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    core_flops: float = 0.0
    matmul_flops: float = 0.0
    core_matmul_flops: float = 0.0
    saved: float = 0.0
    core_saved: float = 0.0
    inputs: float = 0.0
    transient: float = 0.0
    collectives: list[tuple[str, CommStep]] = field(default_factory=list)
    saved_entries: dict[SavedKey, tuple[float, bool]] = field(default_factory=dict)  # -> (bytes, in core)
    input_entries: dict[Value, float] = field(default_factory=dict)  # input storage -> bytes
    # Fragments only: saved storages made elsewhere, counted at the view read (see `layer_terms`).
    roots: set[Value] = field(default_factory=set)


def finish_layer(t: LayerTerms, recompute: str = "none") -> LayerCost:
    """Apply a recomputation to a layer's terms. none: keep everything. selective: drop what the
    attention core saves and run its forward again in backward. full: keep only the layer's
    inputs and run the whole forward (its collectives included) again in backward."""
    bwd = dict(t.bwd)
    if recompute == "full":
        again, flops, matmul = t.fwd, t.fwd_flops, t.matmul_flops
        kept, working = t.inputs, t.saved
    elif recompute == "selective":
        again, flops, matmul = t.core_fwd, t.core_flops, t.core_matmul_flops
        kept, working = t.saved - t.core_saved, t.core_saved
    else:
        again, flops, matmul = {}, 0.0, 0.0
        kept, working = t.saved, 0.0
    for key, val in again.items():
        _add(bwd, "recompute" if key == "compute_fwd" else key, val)
    return LayerCost(dict(t.fwd), bwd, t.fwd_flops, t.bwd_flops, flops, t.matmul_flops, matmul, kept, t.saved,
                     working, tuple(t.collectives), t.transient)


def vocab_steps(axis: str, rows: float) -> list[CommStep]:
    """A loss split over the vocabulary on `axis`: the row maximum and the sum of exponentials are
    all-reduced, one fp32 per row each (the target logit rides along with the sum)."""
    return [CommStep("all_reduce", axis, 4.0 * rows)] * 2


def rotation_exposure(one: float, steps: int, fwd_s: float, bwd_s: float) -> tuple[float, float]:
    """Exposed forward and backward seconds of a rotating split: `steps - 1` neighbour sends of
    `one` seconds each (backward moves operand and gradient: twice), each overlapping one step
    of the node's compute; only what outlasts the compute is charged."""
    sends = steps - 1
    if sends <= 0:
        return 0.0, 0.0
    return (max(0.0, sends * one - fwd_s * sends / steps), max(0.0, 2 * sends * one - bwd_s * sends / steps))


def regather_exposed(gather_s: float, kind: str, bwd_s: float) -> float:
    """An input saved sharded but used gathered (sequence parallelism) is gathered again in
    backward, launched before the input gradient's matmul and waited for by the weight
    gradient's: a contraction hides it behind half its backward."""
    return max(0.0, gather_s - (bwd_s / 2 if kind == "contraction" else 0.0))


def _add(acc: dict[str, float], key: str, value: float) -> None:
    if value:
        acc[key] = acc.get(key, 0.0) + value


def attention_core(ctx: CostContext, nodes: Sequence[Node]) -> frozenset[Node]:
    """The layer's attention cores (`shardc.analysis.attention`: from each QK^T product through
    the next PV product; a fused attention node is none), the one definition codegen executes."""
    return core_of(nodes, ctx.batched)


def layer_costs(ctx: CostContext, nodes: Sequence[Node], recompute: str = "none") -> LayerCost:
    """The `LayerCost` of the layer made of `nodes` (in graph order) under `recompute`."""
    return finish_layer(layer_terms(ctx, nodes), recompute)


def layer_terms(ctx: CostContext, nodes: Sequence[Node], internal_only: bool = False,
                core: Collection[Node] | None = None) -> LayerTerms:
    """The `LayerTerms` of `nodes`, node by node over their partitioned IR (module rules).

    `internal_only` prices a fragment (the solver's node group): activations produced outside
    `nodes` are taken as they arrive (their resharding is the edge's, `input_steps`), and the
    gradients of values also read outside are left to the edges (`gradient_steps`); `core`
    then gives the attention cores of the whole layer (`attention_core`)."""
    inside = set(nodes)
    produced = {v for n in nodes for v in n.outputs}
    core = attention_core(ctx, nodes) if core is None else core
    regions = head_regions(ctx, nodes)
    t = LayerTerms()
    for node in nodes:
        in_core, local = node in core, ctx.local(node)
        cost = _compute(ctx, node, in_core, t, node in regions)
        saves = dispatcher_saves(ctx, node, saved_bytes_of(local.op, local.in_types, local.out_types, node.attrs))
        if node in regions:
            saves = _charge_head(ctx, regions[node], node, cost, saves, t)
        node_fwd: dict[str, float] = {"compute_fwd": cost.fwd_s}
        _forward_edges(ctx, node, cost, {idx for kind, idx, _ in saves if kind == "in"}, produced, internal_only,
                       node_fwd, t)
        _charge_special(ctx, node, cost, node_fwd, t)
        _charge_grid(ctx, node, cost, node_fwd, t)
        _resolved_partials(ctx, node, node_fwd, t)
        for key, val in node_fwd.items():
            _add(t.fwd, key, val)
            if in_core:
                _add(t.core_fwd, key, val)
        _output_gradients(ctx, node, inside, internal_only, t)
        saved_for_backward(ctx, node, saves, in_core, core, produced, internal_only, t.saved_entries, t.roots)
    t.saved = sum(b for b, _ in t.saved_entries.values())
    t.core_saved = sum(b for b, c in t.saved_entries.values() if c)
    t.inputs = sum(t.input_entries.values())
    return t


def _charge_head(ctx: CostContext, region: HeadLoss, node: Node, cost: NodeCost,
                 saves: list[tuple[str, int, float]], t: LayerTerms) -> list[tuple[str, int, float]]:
    """A node of a fused head and loss (module rule): the head's matmul again in backward and the
    chunks' launches (at the loss); the loss's saved log-sum-exps instead of its logits. Returns
    what `node` saves under the fusion."""
    if node is not region.loss:
        return saves
    again = _eager_cost(ctx, region.linear)
    launches = (region.steps - 1) * ctx.device.kernel_latency
    _add(t.fwd, "compute_fwd", launches)  # the loss's kernels per chunk (the head's: its own chunk split)
    _add(t.bwd, "compute_bwd", again.fwd_s + 2 * launches)
    t.bwd_flops += again.fwd_flops
    t.transient = max(t.transient, head_working(ctx, region, False), head_working(ctx, region, True))
    local, part = ctx.local(node), ctx.partition(node)
    rows = local.in_types[1].numel * ctx.batch_scale / region.steps
    for axis, dim in part.spatial if part is not None else ():
        if dim == "v":  # per chunk: the rows' maximum, then (sum of exponentials, target logit); not `vocab_steps`
            fused = [CommStep("all_reduce", axis, 4.0 * rows), CommStep("all_reduce", axis, 8.0 * rows)] * region.steps
            extra = sum(comm_time(ctx, c) for c in fused) - sum(comm_time(ctx, c) for c in vocab_steps(axis, rows * region.steps))
            _add(t.fwd, axis_category(axis), extra)
    t.saved_entries[(node, -1 - len(node.inputs))] = (head_saved_bytes(ctx, region), False)
    return [s for s in saves if not (s[0] == "in" and s[1] == 0)]


def _eager_cost(ctx: CostContext, node: Node) -> NodeCost:
    """The node's eager compute (the slowest rank's, one kernel per rotation step)."""
    local = ctx.local(node)
    part = ctx.partition(node)
    cost = node_compute_time(local.op, step_types(local.space, part, local.in_types), local.out_types, node.attrs,
                             ctx.device, ctx.dtype, needs_grad=[v in ctx.needs_grad for v in node.inputs],
                             scale=ctx.batch_scale, scaled_in=[v in ctx.batched for v in node.inputs],
                             scaled_out=[v in ctx.batched for v in node.outputs], copies=node in ctx.copies)
    return as_run(cost, node, part)


def _compute(ctx: CostContext, node: Node, in_core: bool, t: LayerTerms, fused: bool = False) -> NodeCost:
    """The node's compute (`_eager_cost`, or its part of the fused kernels when the plan runs
    compiled), added to `t` with its FLOPs and its transient (a fused head's and loss's is the
    region's, `_charge_head`); returns its `NodeCost`."""
    local = ctx.local(node)
    op, part = local.op, ctx.partition(node)
    cost = _eager_cost(ctx, node)
    cost = compiled_node_cost(ctx, node, cost) if ctx.compiled else cost
    _add(t.bwd, "compute_bwd", cost.bwd_s)
    t.fwd_flops += cost.fwd_flops
    t.bwd_flops += cost.bwd_flops
    if op.kind in ("contraction", "attention"):
        g: float = op.count_flops([v.type for v in node.inputs], [v.type for v in node.outputs], node.attrs)
        g *= batched_scale(ctx, node.inputs)
        t.matmul_flops += g
        t.core_matmul_flops += g if in_core else 0.0
    t.core_flops += cost.fwd_flops if in_core else 0.0
    looped = [s for s in part.temporal if s.rotate is None and s.grid is None] if part else []
    chunks = max([s.steps for s in looped] or [1])
    # the loop concatenates its outputs when the cut dim is one of the output's, else sums them
    space = local.space
    concat = all(any(f and f[0] == s.dim for f in space.outputs[0]) for s in looped) \
        if looped and space is not None and space.outputs else True
    if not fused:
        t.transient = max(t.transient, working_bytes(op, local.in_types, local.out_types, chunks,
                                                     batched_scale(ctx, node.outputs),
                                                     1 if vocab_parallel_loss(ctx, node) else 2, concat))
    return cost


def _forward_edges(ctx: CostContext, node: Node, cost: NodeCost, saved_inputs: Collection[int],
                   produced: Collection[Value], internal_only: bool, node_fwd: dict[str, float],
                   t: LayerTerms) -> None:
    """Forward edges: each input's layout into the layout this node requires; the layer's input
    activations are recorded (a fragment leaves their resharding to its edges)."""
    if ctx.mesh is None:
        return
    local = ctx.local(node)
    dispatched = dispatcher_axes(ctx, node)  # Megatron's dispatcher moves the tokens there (`shardc.cost.moe`)
    for i, v in enumerate(node.inputs):
        if v not in produced and v.kind == "activation" and v in ctx.batched and (
                not internal_only or v.producer is None or v.producer.layer != node.layer):
            t.input_entries[ctx.root(v)] = ctx.local_bytes(ctx.root(v))
            if internal_only:
                t.roots.add(ctx.root(v))
                continue
        for step in input_steps(ctx, v, ctx.layout(v), local.in_layouts[i]):
            if step.axis in dispatched and i in TOKEN_OPERANDS:
                continue
            _add(node_fwd, axis_category(step.axis), comm_time(ctx, step))
            t.collectives.append(("fwd", step))
            # Priced per reader that saves its gathered input, as the solver prices its edges
            # (`search.costs`); the backend gathers again once per gathered copy, for column-
            # parallel readers only (`edges.saves_shard`).
            if step.kind == "all_gather" and i in saved_inputs:
                _add(t.bwd, axis_category(step.axis), regather_exposed(comm_time(ctx, step), local.op.kind,
                                                                       cost.bwd_s))
                t.collectives.append(("bwd", step))


def _resolved_partials(ctx: CostContext, node: Node, node_fwd: dict[str, float], t: LayerTerms) -> None:
    """A partial sum the node's own output resolves (all_reduce, or reduce_scatter onto the
    sequence) is reduced where it is made."""
    local = ctx.local(node)
    if ctx.partition(node) is None:
        return
    dispatched = dispatcher_axes(ctx, node)
    for k, v in enumerate(node.outputs):
        if k < len(local.out_layouts) and resolves(local.out_layouts[k], ctx.layout(v)):
            for step in input_steps(ctx, v, local.out_layouts[k], ctx.layout(v)):
                if step.axis in dispatched:
                    continue
                _add(node_fwd, axis_category(step.axis), comm_time(ctx, step))
                t.collectives.append(("fwd", step))


def _output_gradients(ctx: CostContext, node: Node, inside: Collection[Node], internal_only: bool,
                      t: LayerTerms) -> None:
    """Backward: the gradient of each output, summed from all its consumers and brought into the
    layout this node's backward needs (a fragment leaves values also read outside to the edges)."""
    if ctx.mesh is None:
        return
    part = ctx.partition(node)
    local = ctx.local(node)
    for k, v in enumerate(node.outputs):
        if v not in ctx.needs_grad:
            continue
        users = ctx.users.get(v, [])
        if internal_only and any(u not in inside for u in users):
            continue
        contributions = [gradient_contribution(ctx, u, i) for u in users for i, w in enumerate(u.inputs) if w is v]
        split = {a for a, _ in part.spatial} if part else set()
        made = local.out_layouts[k] if part is not None and k < len(local.out_layouts) else ctx.layout(v)
        for step in gradient_steps(ctx, v, contributions, gradient_layout(made, ctx.layout(v)),
                                   feeds_only_parameters(node, ctx.needs_grad), split):
            if step.axis in dispatcher_axes(ctx, node):
                continue
            _add(t.bwd, axis_category(step.axis), comm_time(ctx, step))
            t.collectives.append(("bwd", step))


def _charge_special(ctx: CostContext, node: Node, cost: NodeCost, node_fwd: dict[str, float], t: LayerTerms) -> None:
    """Vocab-parallel loss reductions, expert parallelism's all-to-alls and temporal splits (chunks;
    rotations as in ring attention)."""
    local, part = ctx.local(node), ctx.partition(node)
    if ctx.mesh is None or part is None or local.space is None:
        return
    special = dict(local.space.special)
    for axis, dim in part.spatial:
        if special.get(dim) == "expert":  # expert parallelism (`shardc.cost.moe`)
            skew = routing_skew(ctx.graph, ctx.mesh.axis_size(axis))
            _add(node_fwd, "compute_fwd", (skew - 1.0) * cost.fwd_s)
            _add(t.bwd, "compute_bwd", (skew - 1.0) * cost.bwd_s)
            gathers = [(a, ctx.mesh.axis_size(a)) for a in dispatcher_axes(ctx, node)]
            for phase, step in expert_steps(axis, skew * routed_bytes(local.in_types) * ctx.batch_scale, gathers):
                # the dispatcher's tp gathers are the dispatch's: ep_comm (`shardc.cost.moe`)
                _add(node_fwd if phase == "fwd" else t.bwd, axis_category(axis), comm_time(ctx, step))
                t.collectives.append((phase, step))
        if special.get(dim) == "vocab" and len(local.in_types) > 1:
            for step in vocab_steps(axis, local.in_types[1].numel * ctx.batch_scale):
                _add(node_fwd, axis_category(axis), comm_time(ctx, step))
                t.collectives.append(("fwd", step))
    for split in part.temporal:
        if split.steps <= 1 or split.grid is not None:  # a grid is charged by `_charge_grid`
            continue
        if split.rotate is None:  # chunks: one more launch per step (a rotation's are in its compute)
            node_fwd["compute_fwd"] += (split.steps - 1) * ctx.device.kernel_latency
            continue
        moving = sum(local.in_types[i].nbytes * ctx.scale_of(node.inputs[i])
                     for i in rotating_operands(local.space, part, split))
        step = CommStep("rotate", split.rotate, moving)
        exposed_fwd, exposed_bwd = rotation_exposure(comm_time(ctx, step), split.steps, cost.fwd_s, cost.bwd_s)
        _add(node_fwd, axis_category(split.rotate), exposed_fwd)
        _add(t.bwd, axis_category(split.rotate), exposed_bwd)
        sends = split.steps - 1
        t.collectives += [("fwd", step)] * sends + [("bwd", CommStep("rotate", split.rotate, 2 * moving))] * sends


def _charge_grid(ctx: CostContext, node: Node, cost: NodeCost, node_fwd: dict[str, float], t: LayerTerms) -> None:
    """PrimePar's P(q x q) (`shardc.cost.grid2d`): overlapped shifts, the skew, and receive
    buffers on top of the node's working memory. Nothing when the node has no grid split."""
    local, partition = ctx.local(node), ctx.partition(node)
    split = grid_split(partition)
    if ctx.mesh is None or partition is None or split is None or local.space is None or split.steps <= 1:
        return
    along = moving_operands(local.space, partition, split)
    moving = {axis: sum(local.in_types[i].nbytes * ctx.scale_of(node.inputs[i]) for i in ins)
              for axis, ins in along.items()}
    transfer = {axis: comm_time(ctx, CommStep("rotate", axis, b)) for axis, b in moving.items()}
    skews = [comm_time(ctx, CommStep("rotate", axis, local.in_types[i].nbytes * ctx.scale_of(node.inputs[i])))
             for axis, ins in along.items() for i in ins if node.inputs[i].kind != "parameter"]
    grid = grid_charge(split, moving, transfer, max(skews, default=0.0), cost.fwd_s, cost.bwd_s)
    category = axis_category(grid.steps[0][1].axis) if grid.steps else "tp_comm"
    _add(node_fwd, category, grid.fwd_s)
    _add(t.bwd, category, grid.bwd_s)
    t.collectives.extend(grid.steps)
    t.transient = max(t.transient, working_bytes(local.op, local.in_types, local.out_types, 1,
                                                 batched_scale(ctx, node.outputs)) + grid.buffers)
