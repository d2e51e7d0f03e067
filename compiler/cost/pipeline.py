"""Pipeline time from the schedule: a small event simulation of every schedule shardc runs.

Each device runs its ops in the order its schedule prescribes: forward F, backward B, or, for
the zero-bubble schedules, the backward split into its input-gradient pass I and its
weight-gradient pass W (B = I + W), of micro-batch j on virtual stage s. An op starts when its
device is free and its input has arrived: F(j, s) needs F(j, s-1) plus the send to this stage,
B or I (j, s) needs B or I (j, s+1) plus the send (the last stage's needs its own F), W(j, s)
needs I(j, s) (the same device, earlier in its order). Per-stage times may differ, so imbalance
shows up as waiting, and the makespan has the bubble of the schedule: with equal stages,
(p-1)/(m+p-1) of the total for GPipe and 1F1B, (p-1)/(v*m) of the ideal time for interleaved
1F1B, and for zero-bubble schedules what W fills of it.

Orders: GPipe, 1F1B and interleaved 1F1B are Megatron's (interleaved in torch's rounds); the
zero-bubble schedules (`ZB_SCHEDULES`) are read off torch.distributed.pipelining's own schedule
classes (`torch_order`: their per-rank `pipeline_order`, built by the class's own method), so
the priced order is the executed one. DualPipeV's overlapped F+B pairs run as F then B (on one
CPU stream they do; on GPUs its overlap of compute with communication is not priced).

The split of a backward (`weight_gradient_share`): each contraction computes the gradient of
each operand with as many FLOPs as its forward, so a linear with a parameter operand spends
half of its backward on the weight gradient (W) and half on the input gradient (I); contractions
of two activations (the attention core) and the non-matmul ops are all input gradient. A
layer's W time is its backward compute time times (forward FLOPs of its parameter contractions)
/ (2 x forward FLOPs of all its contractions); recomputation and backward collectives are I
(torch's I pass runs them, before any weight gradient).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from shardc.ir.diagnostics import ShardcError

# Zero-bubble schedules whose per-device order is torch's (`torch_order`).
ZB_SCHEDULES = ("zbv", "interleaved-zb", "dualpipev")
Op = tuple[str, int, int]  # (F | B | I | W, micro-batch, virtual stage)


@dataclass(frozen=True, slots=True)
class PipelineTimes:
    """Makespan and, per device, its busy time, the end of its last backward, and that op's length."""

    makespan: float
    busy: tuple[float, ...]
    last_end: tuple[float, ...]
    last_backward: tuple[float, ...]


def bubble_fraction(stages: int, micro_batches: int, virtual: int = 1, schedule: str = "1f1b") -> float:
    """The idle fraction of a balanced pipeline's total time: (p-1)/(v*m + p-1) for GPipe, 1F1B
    and interleaved 1F1B; for the zero-bubble schedules, simulated on equal stages with
    F = I = W (the zero-bubble paper's unit), idle time over the devices' total time."""
    p, m, v = stages, micro_batches, virtual
    if p <= 1:
        return 0.0
    if schedule not in ZB_SCHEDULES:
        return (p - 1) / (v * m + p - 1)
    S = p * v
    t = simulate(schedule, [1.0 / v] * S, [2.0 / v] * S, m, p, wgrad=[1.0 / v] * S)
    return 1.0 - sum(t.busy) / (p * t.makespan)


def torch_order(schedule: str, p: int, m: int, v: int) -> dict[int, list[Op]]:
    """Per pp rank, the ops torch's schedule class for `schedule` runs, as `(kind, j, s)`: the
    class's own `_calculate_single_rank_operations` (and, for interleaved zero bubble, its
    bubble insertion) on a bare instance, so no process group or stage is needed."""
    return {d: list(ops) for d, ops in _torch_order(schedule, p, m, v).items()}


@lru_cache(maxsize=256)
def _torch_order(schedule: str, p: int, m: int, v: int) -> dict[int, tuple[Op, ...]]:
    from torch.distributed.pipelining import schedules as ts

    cls: Any = {"zbv": ts.ScheduleZBVZeroBubble, "interleaved-zb": ts.ScheduleInterleavedZeroBubble,
                "dualpipev": ts.ScheduleDualPipeV}[schedule]
    if schedule in ("zbv", "dualpipev") and v != 2:
        raise ShardcError(f"schedule {schedule} runs exactly two virtual stages per device, not vpp={v}",
                          hint="set vpp=2")
    if schedule == "interleaved-zb" and m % max(1, m // p):
        raise ShardcError(f"interleaved zero bubble runs {m} micro-batches in {max(1, m // p)} rounds, which must "
                          "divide them; change gbs or mb")
    shim = object.__new__(cls)  # the attributes the order methods read, as __init__ sets them
    shim.pp_group_size, shim.n_local_stages, shim._n_microbatches = p, v, m
    shim.num_stages = shim._num_stages = p * v
    shim.number_of_rounds = max(1, m // p)
    shim.microbatches_per_round = m // shim.number_of_rounds
    shim.pipeline_order = {r: shim._calculate_single_rank_operations(r) for r in range(p)}
    if schedule == "interleaved-zb":
        shim.pipeline_order = shim._add_bubbles_to_actions(p * v)
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}
    out: dict[int, tuple[Op, ...]] = {}
    for rank, actions in shim.pipeline_order.items():
        ops: list[Op] = []
        for action in actions:
            if action is None:
                continue
            for a in action.sub_actions or (action,):  # DualPipeV's overlapped (F; B) pairs
                kind = kinds.get(a.computation_type.value)
                if kind is None or a.microbatch_index is None:
                    raise ShardcError(f"torch's {cls.__name__} order holds {a}, which the simulation does not "
                                      "know; this is a bug")
                ops.append((kind, a.microbatch_index, a.stage_index))
        out[rank] = tuple(ops)
    return out


def device_order(schedule: str, p: int, d: int, m: int, v: int) -> list[Op]:
    """Device d's ops as (F|B|I|W, micro-batch, virtual stage): Megatron's order; interleaved 1F1B
    as torch runs it: in max(1, m // p) rounds of r = m / rounds micro-batches (r = p when p
    divides m, Megatron's case), which must be whole; the zero-bubble schedules torch's own."""
    if schedule in ZB_SCHEDULES and p > 1:
        return torch_order(schedule, p, m, v)[d]
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


def in_flight_order(schedule: str, p: int, d: int, m: int, v: int) -> int:
    """The most (micro-batch, virtual stage) pairs device `d` holds activations of at once in
    its order: from the start of a forward to the end of its backward (its W when split: the
    input-gradient pass keeps the graph for the weight gradients, torch's `retain_graph`)."""
    held = peak = 0
    for kind, _, _ in device_order(schedule, p, d, m, v):
        if kind == "F":
            held += 1
            peak = max(peak, held)
        elif kind in ("B", "W"):
            held -= 1
    return peak


def simulate(schedule: str, fwd: Sequence[float], bwd: Sequence[float], micro_batches: int,
             devices: int, send: Sequence[float] | None = None,
             wgrad: Sequence[float] | None = None,
             events: list[tuple[int, str, int, int, float, float]] | None = None,
             extra: dict[Op, float] | None = None) -> PipelineTimes:
    """Run the schedule. `fwd[s]`, `bwd[s]`: per micro-batch times of virtual stage s (on the
    device the schedule's order places it); `send[s]`: the transfer from stage s to s+1 (and its
    gradient back); `wgrad[s]`: the weight-gradient part of `bwd[s]` (W; I is the rest), for
    schedules that split the backward (default: none of it). `events`, when given, receives
    every op run as (device, F|B|I|W, micro-batch, virtual stage, start, end): the timeline.
    `extra[(kind, j, s)]`: seconds one op spends beyond its stage's time (FSDP2's gathers before
    some forwards and backwards of ZeRO-3: `fsdp.pipeline_gathers`)."""
    S, p, m = len(fwd), devices, micro_batches
    v = S // p
    send = list(send) if send is not None else [0.0] * S
    w = list(wgrad) if wgrad is not None else [0.0] * S
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
                elif kind == "W":
                    dep, lag = ("I", j, s), 0.0
                else:
                    dep = ("G", j, s + 1) if s < S - 1 else ("F", j, s)
                    lag = send[s] if s < S - 1 else 0.0
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + lag if dep is not None else 0.0
                length = fwd[s] if kind == "F" else w[s] if kind == "W" else bwd[s] - w[s] if kind == "I" else bwd[s]
                if extra:
                    length += extra.get((kind, j, s), 0.0)
                start = max(free[d], ready)
                done[(kind, j, s)] = free[d] = start + length
                if events is not None:
                    events.append((d, kind, j, s, start, free[d]))
                if kind in ("B", "I"):
                    done[("G", j, s)] = free[d]  # the input gradient leaves for stage s-1
                busy[d] += length
                if kind != "F":
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


def param_root(value: Any, depth: int = 4) -> bool:
    """Whether `value` is a parameter, or a view or cast of one (a transposed or bf16 weight)."""
    while depth and value is not None:
        if value.kind == "parameter":
            return True
        node = value.producer
        if node is None or len(node.inputs) != 1:
            return False
        value, depth = node.inputs[0], depth - 1
    return False


def weight_gradient_share(nodes: Sequence[Any]) -> float:
    """The fraction of a layer's backward compute that is weight gradients (W), by the module
    rule: (forward FLOPs of contractions with a parameter operand) / (2 x forward FLOPs of all
    contractions and attention cores). 0 for a layer without contractions (norms, the loss)."""
    from shardc.ops.registry import get_op

    weights = total = 0.0
    for node in nodes:
        op = get_op(node.op)
        if op.kind not in ("contraction", "attention"):
            continue
        flops = float(op.count_flops([v.type for v in node.inputs], [v.type for v in node.outputs], node.attrs))
        total += 2.0 * flops
        if op.kind == "contraction" and any(param_root(v) for v in node.inputs[1:]):
            weights += flops
    return weights / total if total else 0.0
