"""Step 2 of the driver: the batch a plan needs traced (`batch_for`, `solver_batch`,
`trace_for`), and the model traced again for one micro-batch with the partitions of the full
batch carried over node by node (`micro_batch_trace`, `transfer_partitions`). The traced batch
never limits a plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardc.driver.source import Source
from shardc.ir import Axis, Graph
from shardc.ir.diagnostics import ShardcError

if TYPE_CHECKING:  # both load torch (the registry); `shardc --help` should not wait for it
    from shardc.frontend import TraceResult
    from shardc.plan.parallel import ParallelPlan


def batch_for(plan: ParallelPlan, batch: int | None) -> int | None:
    """The batch to trace at for `plan`: the example `batch` when the plan splits it (dp divides
    it, and dp*mb too when gbs=auto takes it for the global batch), else one micro-batch of
    every replica, dp*mb sequences (gbs=auto then means that many). None: keep the example's.
    ep splits the batch further (each micro-batch over its ranks), so dp*ep must divide it."""
    need = plan.dp * plan.ep if plan.gbs is not None else plan.dp * plan.mb
    if batch is not None and batch % need == 0:
        return None
    return plan.dp * plan.mb


def solver_batch(gbs: int) -> int:
    """The batch the solver traces at: the global batch, so every data-parallel degree it tries
    divides the traced batch and the IR it writes is the graph it scored (at least 2: the
    registry binds a batch of one as a broadcast dim that no mesh axis splits)."""
    return max(gbs, 2)


def trace_for(source: Source, plan: ParallelPlan | None) -> TraceResult:
    """`source` traced at the batch `plan` needs (its own batch without a plan)."""
    if plan is None or not source.resizable:
        return source.trace()
    return source.trace(batch_for(plan, source.batch))


def micro_batch_trace(source: Source, partitioned: Graph) -> TraceResult | None:
    """The model traced for one micro-batch of the plan `partitioned` records (dp*mb sequences;
    not yet partitioned): what runs when the plan has several micro-batches. None when it has
    one, or the model is a fixed import."""
    micro = int(partitioned.attrs.get("microbatches", 1))
    if micro <= 1 or partitioned.mesh is None or source.fixed_import:
        return None
    rows = partitioned.mesh.axis_size(Axis.DP) * int(partitioned.attrs.get("microbatch_size", 1))
    if source.batch is None:
        raise ShardcError(f"plan {partitioned.attrs.get('plan')} has {micro} micro-batches, but the inputs of graph "
                          f"@{partitioned.name} do not all have the batch as their first dim",
                          hint="use mb so that gbs = dp*mb (one micro-batch), or give batch-first inputs")
    return source.trace(rows)


def transfer_partitions(src: Graph, dst: Graph) -> None:
    """Give `dst` (the same model traced at another batch) `src`'s mesh, layers, attributes,
    node partitions and the layouts of its inputs, parameters and buffers, node by node.
    Partitions are carried by dim position (`propagate.carry_partition`: a micro-batch of one
    sequence binds the batch as a broadcast dim, and the dims' names shift) with their strides
    counted on `dst`'s sizes (`d0/8` at 8 sequences is `d0/2` at 2, not a reorder of the rows
    the loss reads), output layouts
    are what the carried partition gives on `dst`'s shapes, with a partial sum `src` holds
    resolved (`resolves_partial`) resolved alike. `src` may be lowered already: its
    collectives are skipped."""
    from shardc.analysis.propagate import carry_partition, io_layouts, iteration_space
    from shardc.ir import Layout, Partial
    from shardc.ops.collectives import COLLECTIVE_OPS
    from shardc.ops.verifier import resolves_partial

    src_nodes = [n for n in src.nodes if n.op not in COLLECTIVE_OPS]
    ops_src, ops_dst = [n.op for n in src_nodes], [n.op for n in dst.nodes]
    if ops_src != ops_dst:
        first = next((i for i, (a, b) in enumerate(zip(ops_src, ops_dst)) if a != b), min(len(ops_src), len(ops_dst)))
        raise ShardcError(f"graph @{src.name} traced for one micro-batch differs from the full batch at node {first} "
                          f"({len(ops_src)} vs {len(ops_dst)} nodes)", hint="use one micro-batch (gbs = dp*mb)")
    dst.mesh, dst.layers, dst.attrs = src.mesh, dict(src.layers), dict(src.attrs)
    for a, b in zip(src_nodes, dst.nodes):
        b.partition, b.layer = a.partition, a.layer
        if a.partition is None or src.mesh is None or not (a.partition.spatial or a.partition.temporal):
            for va, vb in zip(a.outputs, b.outputs):
                vb.layout = va.layout
            continue
        try:
            b.partition = carry_partition(a.partition, iteration_space(a), iteration_space(b))
        except ValueError as err:
            raise ShardcError(f"graph @{src.name} traced for one micro-batch ({dst.inputs[0].type if dst.inputs else '?'}"
                              f") cannot take {a.partition} of plan {src.attrs.get('plan')} at node {b.op} @{b.layer}: "
                              f"{err}", node=b, hint="plan with micro-batches of at least 2 sequences per replica "
                              "(a larger --gbs), or one micro-batch (gbs = dp*mb)") from None
        made_src, made_dst = io_layouts(a, src.mesh)[1], io_layouts(b, src.mesh)[1]
        for va, vb, ms, md in zip(a.outputs, b.outputs, made_src, made_dst):
            held = dict(md.placements)
            if resolves_partial(ms, va.layout):  # reduced where made: on the partial axes as `src` holds it
                for axis in (x for x, p in ms.placements if isinstance(p, Partial)):
                    held[axis] = (va.layout or Layout()).on(axis)
            vb.layout = Layout(tuple((x, held[x]) for x in src.mesh.names if x in held)).without_replicate()
    for group_src, group_dst in ((src.inputs, dst.inputs), (src.params, dst.params), (src.buffers, dst.buffers)):
        by_name = {v.name: v for v in group_src}
        for v in group_dst:
            if v.name in by_name:
                v.layout = by_name[v.name].layout
