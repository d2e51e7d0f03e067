"""Compute time of a node run through `torch.compile` (inductor): fused kernels, not eager ops.

Rules, per layer (the structure depends on the graph only, so a solver fragment and the whole
layer price every node alike; the bytes and FLOPs are the node's own local ones):
- Matmuls (contractions), fused attention, lookups (`index`), opaque ops and nodes with a
  temporal split stay the kernels eager runs (inductor calls extern kernels for them), priced by
  `node_compute_time`.
- Attention written out (`shardc.analysis.attention`: QK^T, scale, mask, softmax, dropout, PV)
  runs as inductor makes it: its two matmuls, with the ops between them one fused kernel like
  any chain. Inductor's attention pattern rewrite into `scaled_dot_product_attention` does not
  fire on such a core under training in torch 2.13 (no `fuse_attention` in dynamo's counters
  for `examples/gpt.py`'s causal `masked_fill`; `tests/test_compiled.py` checks it),
  so no flash kernel is assumed; a model that calls `scaled_dot_product_attention` gets that
  kernel, priced by `node_compute_time` (flash-style: nothing quadratic read or saved).
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
- A chain that is only bias adds (a matmul's output plus a parameter) and views is the matmul's
  epilogue (inductor keeps `addmm`, the bias added as cuBLAS writes): it reads the bias, no launch.
- On a device with measured eager costs (the calibrated CPU) a chain launch is one elementwise
  call and bytes go at the elementwise rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    """A node's part in its layer's compiled kernels. `kernel`: "extern" (its own kernel) or
    "chain" (a fusion chain's). `reads`/`writes`: the input/output indices it is charged for;
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
    """The fusion chains of `nodes` (graph order), each in graph order (module rule): ops of one
    level joined through their tensors, then a chain joined to a chain it feeds when no path
    through an extern kernel leads from the one to the other (a pointwise producer that only
    depends on the layer's inputs, like a mask, is computed inside its consumer's kernel)."""
    level = _levels(nodes, fusible)
    parent: dict[Node, Node] = {n: n for n in nodes if fusible[n]}
    users: dict[Value, list[Node]] = {}
    for node in nodes:
        for v in node.inputs:
            users.setdefault(v, []).append(node)

    def find(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def through_extern(src: Node, dst: Node) -> bool:
        """Whether a path from chain `src` reaches chain `dst` after passing an extern kernel."""
        stack = [(n, False) for n in parent if find(n) is src]
        seen: set[tuple[Node, bool]] = set()
        while stack:
            node, passed = stack.pop()
            for v in node.outputs:
                for user in users.get(v, []):
                    extern = passed or not fusible[user]
                    if extern and user in parent and find(user) is dst:
                        return True
                    if (user, extern) not in seen:
                        seen.add((user, extern))
                        stack.append((user, extern))
        return False

    for node in parent:
        mine = max((level.get(v, 0) for v in node.inputs), default=0)
        for v in node.inputs:
            src = v.producer
            if src is not None and src in parent and level[v] == mine:
                parent[find(src)] = find(node)
    changed = True
    while changed:
        changed = False
        for node in parent:
            for v in node.inputs:
                src = v.producer
                if src in parent and find(src) is not find(node) and not through_extern(find(src), find(node)):
                    parent[find(src)] = find(node)
                    changed = True
    chains: dict[Node, list[Node]] = {}
    for node in nodes:
        if node in parent:
            chains.setdefault(find(node), []).append(node)
    return list(chains.values())


def fused_roles(nodes: Sequence[Node], needs_grad: set[Value],
                users: dict[Value, list[Node]]) -> dict[Node, FusedRole]:
    """Every node's `FusedRole` in the layer made of `nodes` (graph order; module rules)."""
    roles: dict[Node, FusedRole] = {}
    fusible = {n: get_op(n.op).kind not in EXTERN_KINDS for n in nodes}
    for chain in fusion_chains(nodes, fusible):
        members = set(chain)
        made = {v for n in chain for v in n.outputs}
        views = all(get_op(n.op).kind == "view" for n in chain)
        epilogue = not views and all(get_op(n.op).kind == "view" or _bias_add(n) for n in chain)
        launches = 0 if views or epilogue else max(1, sum(get_op(n.op).kind in REDUCING_KINDS for n in chain))
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
            if epilogue:  # the matmul writes what leaves; only the bias is read here
                reads, writes = [i for i in reads if node.inputs[i].kind == "parameter"], ()
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


def _bias_add(node: Node) -> bool:
    """An add of a contraction's output and a 1-d parameter (transformers' Conv1D bias)."""
    if node.op != "add" or len(node.inputs) != 2:
        return False
    kinds = {v.kind for v in node.inputs}
    made = next((v for v in node.inputs if v.kind != "parameter"), None)
    return ("parameter" in kinds and made is not None and made.producer is not None
            and get_op(made.producer.op).kind == "contraction"
            and any(v.kind == "parameter" and v.type.rank == 1 for v in node.inputs))


def role_of(ctx: CostContext, node: Node) -> FusedRole:
    """`node`'s role among the nodes of its layer in `ctx.graph` (computed once per layer and
    kept in `ctx.fusion`, which every overlay of the context shares: roles ignore partitions)."""
    roles = ctx.fusion.get(node.layer)
    if roles is None:
        nodes = [n for n in ctx.graph.nodes if n.layer == node.layer]
        roles = ctx.fusion[node.layer] = fused_roles(nodes, ctx.needs_grad, ctx.users)
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
