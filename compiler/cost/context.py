"""What every cost rule needs to know about one graph on one cluster, computed once per estimate.

Dataflow facts (which values depend on the batch, which need gradients, who reads what, the
storage a value lives in: `shardc.analysis.aliasing`) and a cache of localized nodes. Built by
`CostContext.build`; it holds no state across estimates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.analysis.aliasing import Aliasing, aliasing
from shardc.cost.comm import LinkLevels, group_levels
from shardc.cost.compute import LocalNode, localize
from shardc.hardware import Cluster, DeviceSpec
from shardc.ir import Axis, Graph, Layout, Mesh, Node, Partition, Value

AXIS_CATEGORY: dict[str, str] = {Axis.TP: "tp_comm", Axis.CP: "cp_comm", Axis.DP: "dp_comm", Axis.PP: "pp_comm",
                                 Axis.EP: "ep_comm"}


def axis_category(axis: str) -> str:
    """Time category of a collective on mesh axis `axis` (tp_comm, cp_comm, dp_comm, pp_comm, ep_comm)."""
    return AXIS_CATEGORY.get(axis, "tp_comm")


@dataclass
class CostContext:
    """Per-estimate facts about `graph` on `cluster` at compute dtype `dtype` (IR spelling)."""

    graph: Graph
    cluster: Cluster
    mesh: Mesh | None
    dtype: str
    batch_scale: float
    algorithm: str = "auto"
    # The rank modules run through torch.compile: layers are priced as fused (`shardc.cost.fusion`).
    compiled: bool = False
    batched: set[Value] = field(default_factory=set)
    needs_grad: set[Value] = field(default_factory=set)
    users: dict[Value, list[Node]] = field(default_factory=dict)  # the nodes reading a value, in graph order
    layer_of: dict[Value, str] = field(default_factory=dict)
    # Overlays (node -> partition, value -> layout) that take precedence over the IR's own
    # annotations: the solver prices a candidate by costing its nodes as if they were so partitioned.
    partitions: dict[Node, Partition | None] = field(default_factory=dict)
    layouts: dict[Value, Layout] = field(default_factory=dict)
    # Storage owners, and the view nodes that copy when they run.
    storage: Aliasing = field(default_factory=lambda: Aliasing({}, frozenset()))
    copies: frozenset[Node] = frozenset()
    _local: dict[Node, LocalNode] = field(default_factory=dict)
    # Fused-kernel roles per layer (`shardc.cost.fusion.role_of`): partition-free, shared by overlays.
    fusion: dict = field(default_factory=dict)
    _levels: dict[tuple[str, ...], LinkLevels] = field(default_factory=dict)
    # The coordinate along its ring axis of the rank causal ring attention is priced for (ranks
    # differ: `ring.causal_ring_saved`); None: the last, which computes and keeps the most.
    ring_rank: int | None = None
    # How the runtime priced dispatches an MoE layer's tokens under expert tensor parallelism
    # (`EstimateOptions.expert_dispatch`, `shardc.cost.moe.dispatcher_axes`).
    expert_dispatch: str = "replicated"

    @property
    def device(self) -> DeviceSpec:
        return self.cluster.device

    @classmethod
    def build(cls, graph: Graph, cluster: Cluster, dtype: str, batch_scale: float = 1.0,
              algorithm: str = "auto", compiled: bool = False) -> CostContext:
        """Dataflow facts: batched values descend from graph inputs; gradients flow from
        trainable parameters through float values. `compiled`: price fused kernels."""
        ctx = cls(graph, cluster, graph.mesh, dtype, batch_scale, algorithm, compiled)
        ctx.batched = set(graph.inputs)
        # Constants the trace folded with the traced batch as dim 0 (a mask transformers expands
        # over the batch): the runtime folds them again at the micro-batch's shape.
        traced = graph.inputs[0].type.shape[0] if graph.inputs and graph.inputs[0].type.shape else 0
        ctx.batched |= {b for b in graph.buffers if traced > 1 and b.name.startswith("const.") and b.type.shape
                        and b.type.shape[0] == traced}
        any_marked = any(p.requires_grad for p in graph.params)
        ctx.needs_grad = {p for p in graph.params if p.type.is_float and (p.requires_grad or not any_marked)}
        for node in graph.nodes:
            batched = any(v in ctx.batched for v in node.inputs)
            grad = any(v in ctx.needs_grad for v in node.inputs)
            for out in node.outputs:
                if batched:
                    ctx.batched.add(out)
                if grad and out.type.is_float:
                    ctx.needs_grad.add(out)
                if node.layer is not None:
                    ctx.layer_of[out] = node.layer
            for v in node.inputs:
                readers = ctx.users.setdefault(v, [])
                if not readers or readers[-1] is not node:
                    readers.append(node)
        ctx.storage = aliasing(graph)
        ctx.copies = ctx.storage.copies
        return ctx

    def rescoped(self, mesh: Mesh | None, batch_scale: float) -> CostContext:
        """The same dataflow facts on another mesh and batch scale (no overlays, fresh caches)."""
        return CostContext(self.graph, self.cluster, mesh, self.dtype, batch_scale, self.algorithm, self.compiled,
                           self.batched, self.needs_grad, self.users, self.layer_of, storage=self.storage,
                           copies=self.copies, fusion=self.fusion, ring_rank=self.ring_rank,
                           expert_dispatch=self.expert_dispatch)

    def with_overlay(self, partitions: dict[Node, Partition | None], layouts: dict[Value, Layout]) -> CostContext:
        """This context with nodes partitioned and values laid out as given."""
        return CostContext(self.graph, self.cluster, self.mesh, self.dtype, self.batch_scale, self.algorithm,
                           self.compiled, self.batched, self.needs_grad, self.users, self.layer_of, partitions, layouts,
                           self.storage, self.copies, _levels=self._levels, fusion=self.fusion,
                           ring_rank=self.ring_rank, expert_dispatch=self.expert_dispatch)

    def partition(self, node: Node) -> Partition | None:
        return self.partitions[node] if node in self.partitions else node.partition

    def local(self, node: Node) -> LocalNode:
        """The node's layouts and local types (cached)."""
        found = self._local.get(node)
        if found is None:
            found = localize(node, self.mesh, self.dtype, self.partition(node))
            self._local[node] = found
        return found

    def levels(self, axes: tuple[str, ...]) -> LinkLevels:
        """Link levels of the group along `axes` (cached)."""
        if self.mesh is None:
            return ()
        found = self._levels.get(axes)
        if found is None:
            found = group_levels(self.mesh, axes, self.cluster)
            self._levels[axes] = found
        return found

    def scale_of(self, value: Value) -> float:
        return self.batch_scale if value in self.batched else 1.0

    def layout(self, value: Value) -> Layout:
        found = self.layouts.get(value)
        return found if found is not None else value.layout or Layout()

    def root(self, value: Value) -> Value:
        """The value whose storage `value` aliases (`shardc.analysis.aliasing`), or itself."""
        return self.storage.root(value)

    def elem_bytes(self, value: Value) -> int:
        from shardc.ir import DTYPE_BYTES

        return DTYPE_BYTES[self.dtype if value.type.is_float else value.type.dtype]

    def local_bytes(self, value: Value, layout: Layout | None = None) -> float:
        """Bytes one device holds of `value` under `layout` (its own by default), batch-scaled."""
        lay = self.layout(value) if layout is None else layout
        shape = lay.local_shape(value.type.shape, self.mesh) if self.mesh is not None else value.type.shape
        n = 1
        for d in shape:
            n *= d
        return n * self.elem_bytes(value) * self.scale_of(value)

