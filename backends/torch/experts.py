"""Expert parallelism: the `experts` op (`shardc.ops.moe`) with its experts split over a mesh axis.

Rule. On an axis of size P holding E experts, rank r keeps experts r*E/P .. (r+1)*E/P - 1 and
its own tokens. Dropless dispatch (every routed token is computed, as in one process):
1. the (token, slot) pairs are ordered by the rank holding their expert (stable, so the order
   is the tokens' own within a rank), and the per-rank counts are exchanged (all_to_all_single);
2. the pairs' hidden states and expert ids go to their expert's rank (all_to_all_single with
   those uneven splits; the states through torch's functional `all_to_all_single_autograd`, whose
   backward is the reverse exchange of their gradients);
3. each local expert runs its gated MLP on the rows it received (`shardc.ops.moe.local_experts`
   semantics: `down @ (act(gate) * up)`);
4. the results come back by the reverse exchange (combine) and are weighted and summed per token
   on the token's own rank.
So a rank computes only its experts' routed tokens: with balanced routing, tokens x top-k / P.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from shardc.backends.torch.collectives import MeshGroups
from shardc.ops.moe import ACTIVATIONS


def _exchange_counts(send: torch.Tensor, group: Any) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _exchange(x: torch.Tensor, recv_rows: list[int], send_rows: list[int], group: Any,
              grad: bool) -> torch.Tensor:
    if grad:
        return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), recv_rows, send_rows, group))
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows, group=group)
    return out


def expert_parallel(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, mesh: MeshGroups, axis: str, act: str = "silu") -> torch.Tensor:
    """This rank's tokens `x` (T, h) through the experts of every rank on `axis` (module docstring);
    `gate_up` and `down` hold this rank's experts only."""
    ranks, rank, group = mesh.size(axis), mesh.coord(axis), mesh.group(axis)
    local = gate_up.shape[0]
    slots = index.shape[1]
    expert = index.reshape(-1)
    dest = torch.div(expert, local, rounding_mode="floor")
    order = torch.sort(dest, stable=True).indices
    token = torch.div(order, slots, rounding_mode="floor")
    send_counts = torch.bincount(dest, minlength=ranks)
    recv_counts = _exchange_counts(send_counts, group)
    send_rows, recv_rows = send_counts.tolist(), recv_counts.tolist()
    # dispatch
    states = _exchange(x[token], recv_rows, send_rows, group, grad=True)
    ids = _exchange(expert[order], recv_rows, send_rows, group, grad=False) - rank * local
    # the local experts on the rows they received
    fn = ACTIVATIONS[act]
    results = torch.zeros_like(states)
    for e in range(local):
        rows = torch.where(ids == e)[0]
        if rows.numel() == 0:
            continue
        gate, up = F.linear(states[rows], gate_up[e]).chunk(2, dim=-1)
        results = results.index_add(0, rows, F.linear(fn(gate) * up, down[e]))
    if not any(recv_rows):  # no token chose these experts: keep the weights in the autograd graph (DDP)
        results = results + 0.0 * (gate_up.sum() + down.sum())
    # combine
    back = _exchange(results, send_rows, recv_rows, group, grad=True)
    scale = weights.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, token, (back * scale).to(x.dtype))


def pipelined_target_rows(share: torch.Tensor, ranks: int, microbatches: int) -> torch.Tensor:
    """A data rank's share of a pipeline's target (`PipelinedModule.step(..., target=)`), its rows
    in the order of the last stage's outputs under expert parallelism over `ranks`: each ep rank
    holds a contiguous 1/ranks of the share and torch's schedule cuts that into `microbatches`,
    while the outputs (replicated over ep: the graph's outputs are gathered on model axes) hold,
    for micro-batch j, every ep rank's j-th piece in rank order. Identity for `ranks` 1."""
    if ranks == 1 or share.dim() == 0:
        return share
    per = share.shape[0] // (ranks * microbatches)
    pieces = share.reshape(ranks, microbatches, per, *share.shape[1:]).transpose(0, 1)
    return pieces.reshape(share.shape)
