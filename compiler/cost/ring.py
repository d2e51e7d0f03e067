"""The compute of causal ring attention per rank, contiguous or zig-zag (load-balanced).

A node with a temporal split rotating along a mesh axis of size n runs its local kernel n
times (`compute.rotation_steps`): one (local queries x one key shard) block per step. Under a
causal mask the backend (`shardc.backends.torch.ring`) skips the blocks whose keys all lie in
the queries' future and masks only the diagonal ones, so ranks differ:

- contiguous (`Shard(s)`): rank c holds positions [c, c+1) * seq/n and computes its c earlier
  shards in full and its own diagonal shard (computed, then masked): c + 1 blocks. The last
  rank computes all n and, since every rank waits for the slowest at the next collective, the
  step pays n blocks, as if nothing were skipped; the average rank does (n + 1) / 2.
- zig-zag (`Shard(s, zigzag)`): in units of one chunk (seq / 2n) against another, a full
  block is 4 units; every rank computes 3 units for its own shard (both diagonal chunk pairs
  and the late chunk against the early one) and 2 for every other shard (its late chunk
  against both, or both against the early one): 2n + 1 units, (2n + 1) / 4 blocks, on every
  rank. For n = 4 that is 2.25 blocks against 4 contiguous: 1.78x less attention time.

`causal_ring_blocks(n, zigzag)` is the per-rank count and `causal_ring_cost` scales a node's
n-step cost by slowest / n; anything else (not attention, not causal, not rotating) keeps its cost.

Memory (`causal_ring_saved`), contiguous: the backend's ring runs eager ops, not a fused
kernel, so beyond the kernel's q, k, v, output and log-sum-exp (what the op registry saves) each
block it computes keeps its exponentials (local queries x one key shard per head), and each block
of a received shard keeps that key and value shard (the matmuls save them): rank c keeps c + 1
blocks and c received shards, so the last rank keeps the most (measured, Llama tiny, seq 256,
one head, tp=2: rank 1 holds 128 KiB more than rank 0 at its peak, one block and one k/v pair).
"""

from __future__ import annotations

from typing import Any

from shardc.analysis.aliasing import aliases
from shardc.cost.compute import NodeCost, repeated, rotation_steps
from shardc.ir import Node, Partition
from shardc.ops.registry import get_op


def causal_ring_blocks(n: int, zigzag: bool) -> list[float]:
    """Per rank of a ring of n, the (local queries x key shard) blocks causal ring attention
    computes (module rules)."""
    if zigzag:
        return [(2 * n + 1) / 4] * n
    return [float(c + 1) for c in range(n)]


def ring_balance(node: Node, partition: Partition | None) -> tuple[int, bool] | None:
    """(ring size, zig-zag) when `node` is causal attention rotating its keys along a mesh axis
    that also splits its queries, else None. The size is the split's step count."""
    if partition is None or get_op(node.op).kind != "attention" or not node.attrs.get("is_causal"):
        return None
    for split in partition.temporal:
        if split.rotate is not None and split.grid is None and split.steps > 1 and \
                any(a == split.rotate for a, _ in partition.spatial):
            return split.steps, split.rotate in partition.zigzag
    return None


def causal_ring_saved(ctx: Any, node: Node) -> float:
    """Bytes contiguous causal ring attention saves for backward on the rank of coordinate
    `ctx.ring_rank` along its ring (None: the last) beyond the fused kernel's (module rules);
    0 for any other node (zig-zag rings do equal work on every rank and are not priced so)."""
    ring = ring_balance(node, ctx.partition(node))
    if ring is None or ring[1]:
        return 0.0
    n = ring[0]
    blocks = min(n - 1, n - 1 if ctx.ring_rank is None else ctx.ring_rank) + 1
    q, k, v = ctx.local(node).in_types[:3]
    exponentials = q.nbytes // max(1, q.shape[-1]) * k.shape[-2]
    return ctx.scale_of(node.inputs[0]) * (blocks * exponentials + (blocks - 1) * (k.nbytes + v.nbytes))


def causal_ring_axis(ctx: Any, nodes: Any) -> tuple[str, int] | None:
    """(ring axis, size) of the first contiguous causal ring attention among `nodes`, else None."""
    for node in nodes:
        part = ctx.partition(node)
        ring = ring_balance(node, part)
        if ring is not None and not ring[1]:
            for split in part.temporal:
                if split.rotate is not None:
                    return split.rotate, ring[0]
    return None


def causal_ring_cost(cost: NodeCost, node: Node, partition: Partition | None) -> NodeCost:
    """`cost` (the node's n-step compute) scaled to what the slowest rank computes."""
    ring = ring_balance(node, partition)
    if ring is None:
        return cost
    n, zigzag = ring
    f = max(causal_ring_blocks(n, zigzag)) / n
    return NodeCost(cost.fwd_s * f, cost.bwd_s * f, cost.fwd_flops * f, cost.bwd_flops * f, cost.fwd_bytes * f)


def as_run(cost: NodeCost, node: Node, partition: Partition | None) -> NodeCost:
    """What one node's kernels cost as the runtime runs them: one kernel per rotation step, the
    slowest rank's share of a causal ring, nothing for a dropout that returns its input (p=0:
    PyTorch makes no kernel). The cost model's layers and `annotate-cost` both charge this."""
    if node.op == "dropout" and aliases(node):
        return NodeCost(0.0, 0.0, 0.0, 0.0, 0.0)
    return causal_ring_cost(repeated(cost, rotation_steps(partition)), node, partition)
