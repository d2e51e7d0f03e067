"""Compute time of a layer run through `torch.compile` (inductor): fused kernels, not eager ops.

Rules, over one layer's nodes (or a solver fragment's) in graph order:
- Matmuls (contractions), fused attention, lookups (`index`), opaque ops and nodes with a
  temporal split stay the kernels eager runs (inductor calls cuBLAS / its extern kernels for
  them), priced as `node_compute_time` prices them.
- Attention written out (`shardc.analysis.attention`: QK^T, scale, mask, softmax, dropout, PV)
  becomes one `scaled_dot_product_attention` kernel, as inductor's attention pattern rewrite
  makes it (flash or memory-efficient kernels on GPUs): the core is priced as an sdpa node on
  the same q, k, v and output (the registry's formula and saved bytes), its FLOPs kept.
- Every other op (elementwise, normalisation, reduction, loss, views) joins a fusion chain:
  ops connected through a tensor, with no matmul between them on any path (every value gets a
  level, the number of extern kernels above it; connected ops of one level fuse). A chain is one
  memory-bound kernel: it reads the tensors entering it once and writes the tensors leaving it
  once (read by another kernel, or a layer output), whatever it holds inside; one launch per
  reduction in it (at least one). Its backward is one kernel too: it reads what entered (what
  inductor's partitioner saves) and the gradients of what leaves, writes the gradients of what
  entered and needs one, with twice the forward FLOPs. A chain of views only is free.
- The chain's time is shared among its ops in proportion to their eager time (forward and
  backward separately), so per-node and per-core sums (selective recomputation) keep their sense.
- On a device with measured eager costs (the calibrated CPU) a chain costs one elementwise call
  plus its bytes at the elementwise rate, the attention kernel one `attention_matmul` call plus
  its FLOPs at that rate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shardc.cost.compute import NodeCost, kernel_time, node_compute_time
from shardc.cost.context import CostContext
from shardc.hardware import DeviceSpec
from shardc.ir import Node, TensorType, Value
from shardc.ops.registry import get_op

EXTERN_KINDS = frozenset({"contraction", "attention", "index", "opaque", "collective", "creation"})
REDUCING_KINDS = frozenset({"norm", "reduction", "loss"})
SDPA = "scaled_dot_product_attention"


def is_cpu(device: DeviceSpec) -> bool:
    """A device made of this machine's CPU processes (`hardware.local_cluster`), not a GPU preset."""
    return device.name.startswith("local-cpu")


def _fusible(node: Node, partition: object) -> bool:
    op = get_op(node.op)
    temporal = getattr(partition, "temporal", ())
    return op.kind not in EXTERN_KINDS and not temporal


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


def _shares(total: float, parts: Sequence[float]) -> list[float]:
    """`total` split in proportion to `parts` (evenly when they are all zero)."""
    whole = sum(parts)
    if whole <= 0:
        return [total / len(parts)] * len(parts)
    return [total * p / whole for p in parts]


def fused_costs(ctx: CostContext, nodes: Sequence[Node], eager: Callable[[Node], NodeCost],
                cores: Sequence[Sequence[Node]]) -> dict[Node, NodeCost]:
    """Each node's `NodeCost` when `nodes` run compiled (module rules), on `ctx`'s local shapes:
    `eager(node)` is its eager cost, `cores` the attention cores (`attention_cores`)."""
    costs = {n: eager(n) for n in nodes}
    in_core: set[Node] = set()
    for core in cores:
        if len(core) >= 2 and all(n in costs for n in core):
            in_core.update(core)
            _attention_kernel(ctx, core, costs)
    fusible = {n: n not in in_core and _fusible(n, ctx.partition(n)) for n in nodes}
    for chain in fusion_chains(nodes, fusible):
        _chain_kernel(ctx, chain, costs)
    return costs


def _attention_kernel(ctx: CostContext, core: Sequence[Node], costs: dict[Node, NodeCost]) -> None:
    """Price the core as one sdpa node on its q, k, v and output, shared among its nodes."""
    first, last = core[0], core[-1]
    device, dtype = ctx.device, ctx.dtype
    q, kt = ctx.local(first).in_types[:2]
    v, out = ctx.local(last).in_types[1], ctx.local(last).out_types[0]
    k = TensorType(kt.shape[:-2] + (kt.shape[-1], kt.shape[-2]), kt.dtype)
    scaled = [first.inputs[0], first.inputs[1], last.inputs[1]]
    scale = max(ctx.scale_of(x) for x in scaled)
    grads = [x in ctx.needs_grad for x in scaled]
    sdpa = get_op(SDPA)
    if device.eager is not None:
        cost = _eager_attention(sdpa.count_flops([q, k, v], [out], {}) * scale, any(grads), device, dtype)
    else:
        cost = node_compute_time(sdpa, [q, k, v], [out], {}, device, dtype, needs_grad=grads, scale=scale)
    _spread(core, cost, costs, keep_flops=True)


def _eager_attention(flops: float, grad: bool, device: DeviceSpec, dtype: str) -> NodeCost:
    assert device.eager is not None
    fit = device.eager.fit("attention_matmul", "matmul")
    per_flop = device.peak("fp32") / device.peak(dtype)
    fwd = fit.fwd_call + flops * fit.fwd_per_unit * per_flop
    bwd = fit.bwd_call + 2 * flops * fit.bwd_per_unit * per_flop if grad else 0.0
    return NodeCost(fwd, bwd, flops, 2 * flops if grad else 0.0, 0.0)


def _chain_kernel(ctx: CostContext, chain: Sequence[Node], costs: dict[Node, NodeCost]) -> None:
    """Price a fusion chain as one kernel forward and one backward, shared among its nodes."""
    device, dtype, needs_grad = ctx.device, ctx.dtype, ctx.needs_grad
    members = set(chain)
    made = {v for n in chain for v in n.outputs}
    entering: dict[Value, float] = {}
    leaving: dict[Value, float] = {}
    for node in chain:
        local = ctx.local(node)
        for v, t in zip(node.inputs, local.in_types):
            if v not in made:
                entering[v] = max(entering.get(v, 0.0), t.nbytes * ctx.scale_of(v))
        for v, t in zip(node.outputs, local.out_types):
            users = ctx.users.get(v, [])
            if not users or any(u not in members for u in users):
                leaving[v] = t.nbytes * ctx.scale_of(v)
    if all(get_op(n.op).kind == "view" for n in chain):
        if any(costs[n].fwd_s or costs[n].bwd_s for n in chain):
            _spread(chain, NodeCost(0.0, 0.0, 0.0, 0.0, 0.0), costs, keep_flops=True)
        return
    flops = sum(costs[n].fwd_flops for n in chain)
    read, written = sum(entering.values()), sum(leaving.values())
    grad = any(v in needs_grad for v in entering) and any(costs[n].bwd_s > 0 for n in chain)
    grad_in = sum(b for v, b in entering.items() if v in needs_grad)
    launches = max(1, sum(1 for n in chain if get_op(n.op).kind in REDUCING_KINDS))
    if device.eager is not None:
        fit = device.eager.fit("elementwise")
        fwd = launches * fit.fwd_call + (read + written) * fit.fwd_per_unit
        bwd = launches * fit.bwd_call + (read + written + grad_in) * fit.bwd_per_unit if grad else 0.0
    else:
        fwd = kernel_time(flops, read + written, device, dtype, matmul=False) + launches * device.kernel_latency
        bwd = (kernel_time(2 * flops, read + written + grad_in, device, dtype, matmul=False)
               + launches * device.kernel_latency) if grad else 0.0
    _spread(chain, NodeCost(fwd, bwd, flops, 2 * flops if grad else 0.0, read + written), costs, keep_flops=True)


def _spread(group: Sequence[Node], total: NodeCost, costs: dict[Node, NodeCost], *, keep_flops: bool) -> None:
    """Replace the costs of `group` by shares of `total` (times by eager time; FLOPs kept per node
    when `keep_flops`, the FLOPs the ops do whichever kernel runs them)."""
    fwd = _shares(total.fwd_s, [costs[n].fwd_s for n in group])
    bwd = _shares(total.bwd_s, [costs[n].bwd_s for n in group]) if total.bwd_s else [0.0] * len(group)
    nbytes = _shares(total.fwd_bytes, [costs[n].fwd_bytes for n in group])
    for k, n in enumerate(group):
        old = costs[n]
        flops = (old.fwd_flops, old.bwd_flops) if keep_flops else (0.0, 0.0)
        costs[n] = NodeCost(fwd[k], bwd[k], flops[0], flops[1], nbytes[k])
