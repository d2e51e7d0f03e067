"""DeepSpeed's pipeline engine: its `TrainSchedule` run step by step with blocking exchanges.

Megatron-DeepSpeed (BLOOM, MT-NLG) pipelines through DeepSpeed's `PipelineEngine`, which does not
run Megatron's 1F1B loop but DeepSpeed's own schedule (deepspeed/runtime/pipe/schedule.py,
`TrainSchedule`): 2(m + p - 1) steps; at step t stage s runs a forward when t and s have the same
parity and a backward otherwise, on micro-batch

    forward:  t // 2 - s // 2                 (t even)   or  (t - 1) // 2 - s // 2
    backward: t // 2 - p + (s + 1) // 2       (t even)   or  (t - 1) // 2 - p + 1 + s // 2

(steps whose micro-batch falls outside 0..m-1 compute nothing). Before computing, a forward step
receives its activation from stage s-1 and sends s-1 the gradient of the backward it ran the
step before; the backward step of s-1 at the same step sends that activation and receives that
gradient. Every send and receive is blocking and paired (`p2p.send`/`p2p.recv`, "must be paired
... to avoid deadlock"), so an exchange starts once both stages have finished their previous
step, and its transfers (one or two) run one after the other on both stages. Neighbouring stages
are always in opposite phases. With free transfers the order costs what Megatron's 1F1B costs
(equal stages: the same makespan exactly, `tests/test_cost_runtimes.py`); what differs is that
each transfer holds the receiver as well as the sender, four per micro-batch on an inner stage
where Megatron's combined send-and-receive calls pay two.

The transfer time per exchange direction (`send[s]`, stage s to s+1) is what one activation or
gradient costs end to end; both stages of the pair wait for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardc.cost.pipeline import PipelineTimes

LOCKSTEP = "deepspeed"  # the pipeline runtime whose schedule this is (`EstimateOptions.pipeline_runtime`)


def step_work(step: int, stage: int, stages: int) -> tuple[int, bool]:
    """(micro-batch, is forward) of `stage` at `step` in DeepSpeed's TrainSchedule (module rule);
    the micro-batch may be out of range (nothing to compute)."""
    if step % 2 == stage % 2:
        base = step // 2 if step % 2 == 0 else (step - 1) // 2
        return base - stage // 2, True
    if step % 2 == 0:
        return step // 2 - stages + (stage + 1) // 2, False
    return (step - 1) // 2 - stages + 1 + stage // 2, False


def simulate_lockstep(fwd: Sequence[float], bwd: Sequence[float], send: Sequence[float], micro_batches: int,
                      events: list[tuple[int, str, int, int, float, float]] | None = None) -> PipelineTimes:
    """Run DeepSpeed's TrainSchedule on stages with one micro-batch's forward `fwd[s]`, backward
    `bwd[s]` (recomputation included) and exchange transfer `send[s]` (stage s to s+1, either
    direction). `events`, when given, receives every op as (stage, F|B, micro-batch, stage,
    start, end). Returns the makespan, each stage's busy time, the end of its last backward and
    that backward's length."""
    p, m = len(fwd), micro_batches
    clock = [0.0] * p
    busy = [0.0] * p
    last_end = [0.0] * p
    last_b = [0.0] * p
    previous = [-1] * p
    for t in range(2 * (m + p - 1)):
        work = [step_work(t, s, p) for s in range(p)]
        # Exchanges: stage s in a forward step pairs with s-1 (in a backward step): the
        # activation of the micro-batch s now runs, then the gradient of the one s ran before.
        for s in range(1, p):
            j, forward = work[s]
            if not forward:
                continue
            transfers = (0 <= j < m) + (0 <= previous[s] < m)
            if transfers:
                start = max(clock[s - 1], clock[s])
                clock[s - 1] = clock[s] = start + transfers * send[s - 1]
        for s, (j, forward) in enumerate(work):
            previous[s] = j
            if not 0 <= j < m:
                continue
            length = fwd[s] if forward else bwd[s]
            start = clock[s]
            clock[s] = start + length
            busy[s] += length
            if not forward:
                last_end[s], last_b[s] = clock[s], length
            if events is not None:
                events.append((s, "F" if forward else "B", j, s, start, clock[s]))
    return PipelineTimes(max(clock), tuple(busy), tuple(last_end), tuple(last_b))
