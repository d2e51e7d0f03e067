"""Compute time of a node run through `torch.compile` (inductor): fused kernels, not eager ops.

Rules, per layer (the structure depends on the graph only, so a solver fragment and the whole
layer price every node alike; the bytes and FLOPs are the node's own local ones):
- Matmuls (contractions), fused attention, lookups (`index`), opaque ops and nodes with a
  temporal split stay the kernels eager runs (inductor calls extern kernels for them), priced by
  `node_compute_time`.
- Attention written out (`shardc.analysis.attention`: QK^T, scale, mask, softmax, dropout, PV)
  becomes one `scaled_dot_product_attention` kernel, as inductor's attention pattern rewrite
  makes it (flash or memory-efficient kernels on GPUs): QK^T is charged its FLOPs and the reads
  of q and k, PV its FLOPs, the read of v and the write of the output, both at the matmul rate
  of the whole kernel's FLOPs, one launch; the scores in between cost nothing. Backward as
  `node_compute_time` prices an sdpa node: twice the forward.
- Every other op (elementwise, normalisation, reduction, loss, views) joins a fusion chain:
  ops connected through a tensor with no extern kernel between them on any path (every value
  has a level, the most extern kernels above it; connected ops of one level fuse; `fusion_chains`).
  A chain is one memory-bound kernel: it reads each tensor entering it once and writes each
  tensor leaving it once (read outside the chain, or by nothing: a layer output), whatever it
  holds inside, with one launch per reduction in it (at least one; none for views only). Each
  op is charged its part: the entering tensors it is the first to read, the leaving ones it
  writes, its FLOPs at the vector rate. Backward, when a tensor entering the chain needs a
  gradient: one kernel reading what entered (what inductor's partitioner saves) and the
  gradients of what leaves, writing the gradients of what entered, twice the forward FLOPs.
- On a device with measured eager costs (the calibrated CPU) a chain launch is one elementwise
  call and bytes go at the elementwise rate; attention at the `attention_matmul` rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardc.analysis.attention import attention_cores
from shardc.cost.compute import NodeCost, kernel_time
from shardc.cost.context import CostContext
from shardc.hardware import DeviceSpec
from shardc.ir import Node, Value
from shardc.ops.registry import get_op

EXTERN_KINDS = frozenset({"contraction", "attention", "index", "opaque", "collective", "creation"})
REDUCING_KINDS = frozenset({"norm", "reduction", "loss"})


def is_cpu(device: DeviceSpec) -> bool:
    """A device made of this machine's CPU processes (`hardware.local_cluster`), not a GPU preset."""
    return device.name.startswith("local-cpu")


@dataclass(frozen=True, slots=True)
class FusedRole:
    """A node's part in its layer's compiled kernels. `kernel`: "extern" (its own kernel),
    "chain" or "attention". `reads`/`writes`: the input/output indices it is charged for;
    `launches`: kernel launches charged to it; `grad`: its kernel has a backward."""

    kernel: str
    reads: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    launches: int = 0
    grad: bool = False


def _levels(nodes: Sequence[Node], fusible: dict[Node, bool]) -> dict[Value, int]:
    """Each value's level: the most extern kernels on a path from the layer's inputs to it."""
    level: dict[Value, int] = {}
    for node in nodes:
        base = max((level.get(v, 0) for v in node.inputs), default=0)
        for v in node.outputs:
            level[v] = base if fusible[node] else base + 1
    return level


def fusion_chains(nodes: Sequence[Node], fusible: dict[Node, bool]) -> list[list[Node]]:
    """The fusion chains of `nodes` (graph order), each in graph order (module rule)."""
    level = _levels(nodes, fusible)
    parent: dict[Node, Node] = {n: n for n in nodes if fusible[n]}

    def find(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in parent:
        mine = max((level.get(v, 0) for v in node.inputs), default=0)
        for v in node.inputs:
            src = v.producer
            if src is not None and src in parent and level[v] == mine:
                parent[find(src)] = find(node)
    chains: dict[Node, list[Node]] = {}
    for node in nodes:
        if node in parent:
            chains.setdefault(find(node), []).append(node)
    return list(chains.values())


def fused_roles(nodes: Sequence[Node], batched: set[Value], needs_grad: set[Value],
                users: dict[Value, list[Node]]) -> dict[Node, FusedRole]:
    """Every node's `FusedRole` in the layer made of `nodes` (graph order; module rules)."""
    roles: dict[Node, FusedRole] = {}
    cores = attention_cores(nodes, batched)
    for core in cores:
        grad = any(v in needs_grad for v in core[0].inputs[:2] + core[-1].inputs[1:2])
        roles[core[0]] = FusedRole("attention", (0, 1), (), 1, grad)
        roles[core[-1]] = FusedRole("attention", (1,), (0,), 0, grad)
        for node in core[1:-1]:
            roles[node] = FusedRole("attention")
    fusible = {n: n not in roles and get_op(n.op).kind not in EXTERN_KINDS for n in nodes}
    for chain in fusion_chains(nodes, fusible):
        members = set(chain)
        made = {v for n in chain for v in n.outputs}
        views = all(get_op(n.op).kind == "view" for n in chain)
        launches = 0 if views else max(1, sum(get_op(n.op).kind in REDUCING_KINDS for n in chain))
        seen: set[Value] = set()
        entering: list[Value] = []
        for node in chain:
            entering += [v for v in node.inputs if v not in made and v not in entering]
        grad = any(v in needs_grad for v in entering)
        for k, node in enumerate(chain):
            reads = []
            for i, v in enumerate(node.inputs):
                if v not in made and v not in seen:
                    seen.add(v)
                    reads.append(i)
            writes = tuple(j for j, v in enumerate(node.outputs)
                           if not users.get(v) or any(u not in members for u in users[v]))
            roles[node] = FusedRole("chain", () if views else tuple(reads), () if views else writes,
                                    launches if k == 0 else 0, grad)
    for node in nodes:
        roles.setdefault(node, FusedRole("extern"))
    return roles


def compiled_cost(role: FusedRole, eager: NodeCost, in_bytes: Sequence[float], out_bytes: Sequence[float],
                  grads: Sequence[bool], device: DeviceSpec, dtype: str) -> NodeCost:
    """The node's `NodeCost` compiled, from its `role`, its eager cost (FLOPs kept) and its local
    input and output bytes (batch-scaled); `grads[i]`: input i needs a gradient."""
    if role.kernel == "extern":
        return eager
    read = sum(in_bytes[i] for i in role.reads)
    written = sum(out_bytes[j] for j in role.writes)
    flops = eager.fwd_flops
    if role.kernel == "attention":
        if not role.reads and not role.writes:  # the scores between the products: inside the kernel
            return NodeCost(0.0, 0.0, flops, eager.bwd_flops, 0.0)
        return _attention(role, flops, read + written, device, dtype)
    grad_in = sum(in_bytes[i] for i in role.reads if grads[i])
    back = role.grad and eager.bwd_s > 0
    bwd_flops = 2 * flops if back else 0.0
    if device.eager is not None:
        fit = device.eager.fit("elementwise")
        fwd = role.launches * fit.fwd_call + (read + written) * fit.fwd_per_unit
        bwd = role.launches * fit.bwd_call + (read + written + grad_in) * fit.bwd_per_unit if back else 0.0
        return NodeCost(fwd, bwd, flops, bwd_flops, read + written)
    latency = role.launches * device.kernel_latency
    fwd = kernel_time(flops, read + written, device, dtype, matmul=False) + latency
    bwd = kernel_time(2 * flops, read + written + grad_in, device, dtype, matmul=False) + latency if back else 0.0
    return NodeCost(fwd, bwd, flops, bwd_flops, read + written)


def _attention(role: FusedRole, flops: float, nbytes: float, device: DeviceSpec, dtype: str) -> NodeCost:
    """One product of a fused attention kernel (the two products of a core do equal FLOPs, so the
    rate is the kernel's at twice this one's)."""
    if device.eager is not None:
        fit = device.eager.fit("attention_matmul", "matmul")
        per_flop = device.peak("fp32") / device.peak(dtype)
        fwd = role.launches * fit.fwd_call + flops * fit.fwd_per_unit * per_flop
        bwd = 2 * role.launches * fit.bwd_call + 2 * flops * fit.bwd_per_unit * per_flop if role.grad else 0.0
        return NodeCost(fwd, bwd, flops, 2 * flops if role.grad else 0.0, nbytes)
    if flops <= 0:
        return NodeCost(0.0, 0.0, 0.0, 0.0, 0.0)
    compute = flops / device.matmul_flops_per_s(2 * flops, dtype)
    fwd = max(compute, nbytes / device.memory_bandwidth) + role.launches * device.kernel_latency
    return NodeCost(fwd, 2 * fwd if role.grad else 0.0, flops, 2 * flops if role.grad else 0.0, nbytes)


def role_of(ctx: CostContext, node: Node) -> FusedRole:
    """`node`'s role among the nodes of its layer in `ctx.graph` (computed once per layer and
    kept in `ctx.fusion`, which every overlay of the context shares: roles ignore partitions)."""
    roles = ctx.fusion.get(node.layer)
    if roles is None:
        nodes = [n for n in ctx.graph.nodes if n.layer == node.layer]
        roles = ctx.fusion[node.layer] = fused_roles(nodes, ctx.batched, ctx.needs_grad, ctx.users)
    return roles.get(node, FusedRole("extern"))


def compiled_node_cost(ctx: CostContext, node: Node, eager: NodeCost) -> NodeCost:
    """`node`'s cost when its rank module runs compiled (module rules), from its eager cost on
    `ctx`'s local shapes; a node with a temporal split keeps its eager kernels."""
    role = role_of(ctx, node)
    part = ctx.partition(node)
    if role.kernel == "extern" or (part is not None and part.temporal):
        return eager
    local = ctx.local(node)
    in_bytes = [t.nbytes * ctx.scale_of(v) for v, t in zip(node.inputs, local.in_types)]
    out_bytes = [t.nbytes * ctx.scale_of(v) for v, t in zip(node.outputs, local.out_types)]
    grads = [v in ctx.needs_grad for v in node.inputs]
    return compiled_cost(role, eager, in_bytes, out_bytes, grads, ctx.device, ctx.dtype)
