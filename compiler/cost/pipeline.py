"""Pipeline time from the schedule: a small event simulation of GPipe, 1F1B and interleaved 1F1B.

Each device runs its ops (forward F or backward B of micro-batch j on model chunk c) in the
order its schedule prescribes; an op starts when its device is free and its input has arrived:
F(j, s) needs F(j, s-1) plus the send to this stage, B(j, s) needs B(j, s+1) plus the send
(the last stage's B needs its own F). Per-stage times may differ, so imbalance shows up as
waiting, and the makespan has the bubble of the schedule: with equal stages, (p-1)/(m+p-1)
of the total for GPipe and 1F1B, (p-1)/(v*m) of the ideal time for interleaved 1F1B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardc.ir.diagnostics import ShardcError


@dataclass(frozen=True, slots=True)
class PipelineTimes:
    """Makespan and, per device, its busy time, the end of its last backward, and that op's length."""

    makespan: float
    busy: tuple[float, ...]
    last_end: tuple[float, ...]
    last_backward: tuple[float, ...]


def bubble_fraction(stages: int, micro_batches: int, virtual: int = 1) -> float:
    """The idle fraction of a balanced pipeline's total time: (p-1)/(v*m + p-1)."""
    p, m, v = stages, micro_batches, virtual
    return (p - 1) / (v * m + p - 1) if p > 1 else 0.0


def device_order(schedule: str, p: int, d: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Device d's ops as (F|B, micro-batch, virtual stage), Megatron's order; interleaved 1F1B
    as torch runs it: in max(1, m // p) rounds of r = m / rounds micro-batches (r = p when p
    divides m, Megatron's case), which must be whole."""
    if schedule == "gpipe" or p == 1:
        return [("F", j, d) for j in range(m)] + [("B", j, d) for j in range(m)]
    if schedule == "interleaved" and v > 1:
        rounds = max(1, m // p)
        if m % rounds:
            raise ShardcError(f"interleaved 1F1B runs {m} micro-batches in {rounds} rounds, which must divide "
                              f"them; change gbs or mb, or use schedule=1f1b")
        r, total = m // rounds, m * v

        def chunk(k: int, forward: bool) -> tuple[int, int]:
            c = (k // r) % v
            return (k // (r * v)) * r + k % r, (c if forward else v - 1 - c) * p + d

        warm = min((p - d - 1) * 2 + (v - 1) * r, total)
        order = [("F", *chunk(k, True)) for k in range(warm)]
        f, b = warm, 0
        while f < total:
            order.append(("F", *chunk(f, True)))
            order.append(("B", *chunk(b, False)))
            f, b = f + 1, b + 1
        order += [("B", *chunk(k, False)) for k in range(b, total)]
        return order
    warm = min(p - d - 1, m)
    order = [("F", j, d) for j in range(warm)]
    for j in range(m - warm):
        order += [("F", warm + j, d), ("B", j, d)]
    order += [("B", j, d) for j in range(m - warm, m)]
    return order


def simulate(schedule: str, fwd: Sequence[float], bwd: Sequence[float], micro_batches: int,
             devices: int, send: Sequence[float] | None = None) -> PipelineTimes:
    """Run the schedule. `fwd[s]`, `bwd[s]`: per micro-batch times of virtual stage s (device
    s % devices); `send[s]`: the transfer from stage s to s+1 (and its gradient back)."""
    S, p, m = len(fwd), devices, micro_batches
    v = S // p
    send = list(send) if send is not None else [0.0] * S
    orders = [device_order(schedule, p, d, m, v) for d in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    busy = [0.0] * p
    last_b = [0.0] * p
    pos = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(p):
            while pos[d] < len(orders[d]):
                kind, j, s = orders[d][pos[d]]
                if kind == "F":
                    dep = ("F", j, s - 1) if s > 0 else None
                    lag = send[s - 1] if s > 0 else 0.0
                else:
                    dep = ("B", j, s + 1) if s < S - 1 else ("F", j, s)
                    lag = send[s] if s < S - 1 else 0.0
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + lag if dep is not None else 0.0
                length = fwd[s] if kind == "F" else bwd[s]
                start = max(free[d], ready)
                done[(kind, j, s)] = free[d] = start + length
                busy[d] += length
                if kind == "B":
                    last_b[d] = length
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ShardcError(f"pipeline schedule {schedule} deadlocked (p={p}, m={m}, v={v}); this is a bug")
    return PipelineTimes(max(free), tuple(busy), tuple(free), tuple(last_b))


def makespan_closed_form(fwd: Sequence[float], bwd: Sequence[float], micro_batches: int) -> float:
    """GPipe/1F1B makespan without simulating (for solvers): the slowest stage's (F+B) for every
    micro-batch but one, plus one pass of every stage: (m-1) max(F+B) + sum(F+B). Equals
    `simulate` when stages are balanced."""
    per = [f + b for f, b in zip(fwd, bwd)]
    return (micro_batches - 1) * max(per) + sum(per)
