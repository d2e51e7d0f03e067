"""Rotating temporal splits: the per-step kernel shapes, and PrimePar's 2-D primitive P(q x q).

Rules:
- A rotating split runs the node's local kernel once per step on one step's pieces: an operand
  that rotates holds one piece already (its shard); an operand holding the rotated dim whole
  (the weight of a 1-D rotation, sliced at the current piece) contributes one piece per step.
  So a 1-D rotation of `k` over tp does the FLOPs of one tp-th of the node, not tp times them.
- P(q x q) (`time k/q rotate (a, b)`): two mesh axes of size q form a grid; axis a splits a
  row dim M of the first operand I, axis b a column dim of the output, and the reduced dim k
  is sharded along a in the second operand W and along b in I. Device (r, c) starts on piece
  r + c (a skew: one point-to-point permutation of I along b and of W along a; a parameter's
  is posted at the start of its layer and overlaps the layer's earlier compute, an
  activation's is exposed), then runs q steps; between steps I moves one neighbour along b and
  W along a, concurrently and double-buffered, overlapped with the step's compute, so the
  forward pays `skew + (q - 1) * max(0, max(t_I, t_W) - compute / q)`. Backward replays the
  steps: the operands move as in forward (overlapped with the step's two matmuls, c = backward
  / q), each gradient accumulator moves after its matmul, the one with the longer transfer
  first (overlapping the other matmul), and after the last step the gradients go home the same
  way: per step `max(0, max(t_I, t_W) - c, t_long - c / 2, t_short)` exposed. No collective,
  nothing replicated; the transient adds one receive buffer per moving operand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from shardc.cost.comm import CommStep
from shardc.ir import Partition, TemporalSplit, TensorType
from shardc.ops.registry import IterationSpace, rotating_operands


@dataclass(frozen=True, slots=True)
class GridCharge:
    """Exposed seconds of one P(q x q) node and the transfers it makes (per device)."""

    fwd_s: float
    bwd_s: float
    steps: tuple[tuple[str, CommStep], ...]
    buffers: float  # bytes of the receive buffers held while the node runs


def grid_split(partition: Partition | None) -> TemporalSplit | None:
    """The partition's grid split (`rotate (a, b)`), or None."""
    for split in partition.temporal if partition is not None else ():
        if split.grid is not None:
            return split
    return None


def moving_operands(space: IterationSpace, partition: Partition, split: TemporalSplit) -> dict[str, list[int]]:
    """Per rotation axis (one, or the two of a grid), the inputs that move along it: the registry's
    one rotation rule (`rotating_operands`) applied to each axis in turn. Axes nothing moves on are left out."""
    out: dict[str, list[int]] = {}
    for axis in split.axes:
        moving = rotating_operands(space, partition, replace(split, rotate=axis, grid=None))
        if moving:
            out[axis] = moving
    return out


def step_types(space: IterationSpace | None, partition: Partition | None,
               types: Sequence[TensorType]) -> tuple[TensorType, ...]:
    """The input types one step of the rotating splits works on (see the module rule)."""
    out = list(types)
    if space is None or partition is None:
        return tuple(out)
    for split in partition.temporal:
        if not split.axes or split.steps <= 1:
            continue
        moving = {i for ins in moving_operands(space, partition, split).values() for i in ins}
        for i, operand in enumerate(space.inputs[: len(out)]):
            if i in moving:
                continue
            for d, factors in enumerate(operand):
                if factors[:1] == (split.dim,) and out[i].shape[d] % split.steps == 0:
                    shape = list(out[i].shape)
                    shape[d] //= split.steps
                    out[i] = TensorType(tuple(shape), out[i].dtype)
    return tuple(out)


def grid_charge(split: TemporalSplit, moving_bytes: dict[str, float], transfer_s: dict[str, float],
                skew_s: float, fwd_s: float, bwd_s: float) -> GridCharge:
    """Exposed time of a P(q x q) node whose operands move `moving_bytes[axis]` per step taking
    `transfer_s[axis]` seconds, with `skew_s` of exposed skew, given its whole forward and
    backward compute (module rule)."""
    q = split.steps
    one = max(transfer_s.values(), default=0.0)  # the two axes' transfers run concurrently
    sends = q - 1
    fwd = skew_s + sends * max(0.0, one - fwd_s / q)
    c = bwd_s / q
    times = sorted(transfer_s.values(), reverse=True) + [0.0, 0.0]
    grads = max(0.0, times[0] - c / 2, times[1])  # the accumulators' sends after their matmuls
    bwd = sends * max(grads, one - c) + grads
    steps: list[tuple[str, CommStep]] = []
    for axis, nbytes in moving_bytes.items():
        steps += [("fwd", CommStep("rotate", axis, nbytes))] * q  # the skew, then q - 1 shifts
        steps += [("bwd", CommStep("rotate", axis, 2 * nbytes))] * sends + [("bwd", CommStep("rotate", axis, nbytes))]
    return GridCharge(fwd, bwd, tuple(steps), sum(moving_bytes.values()))
