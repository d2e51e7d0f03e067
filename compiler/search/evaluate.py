"""Scores one point of the search space with the same formulas the CP-SAT model encodes.

A point (`Assignment`) is a candidate per group, per pipeline stage how many blocks it holds
under each recomputation (none, selective, full), and one ZeRO stage. With the block's
coefficients (see `shardc.search.problem`):

    TL_r  = block fwd+bwd (+ selective: the attention core's forward, + full: the whole forward)
            + ZeRO-3 weight gathers                                       time of one block
    S_s   = sum_r k_{s,r} TL_r + [s=0] pre + [s=p-1] post + 2 send_recv   stage time per micro-batch
    step  = sum_s S_s + (m-1) max_s S_s + max_s exposed gradient sync     1F1B with imbalance
    mem_s = n_s state + in_flight_s sum_r k_{s,r} act_r + pre/post + working memory
            + one block's activations when any block of the stage recomputes fully

with in_flight_s = min(p - s, m) (1F1B). The plan is feasible when every mem_s fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.cost.memory import in_flight
from shardc.search.problem import Problem

RECOMPUTES = ("none", "selective", "full")


@dataclass(frozen=True, slots=True)
class Assignment:
    """A candidate index per group, per stage block counts by recomputation, and the ZeRO stage."""

    choice: tuple[int, ...]
    stages: tuple[tuple[int, int, int], ...]
    zero: int


@dataclass(frozen=True, slots=True)
class Evaluation:
    step_time_s: float
    stage_time_s: tuple[float, ...]
    memory_bytes: tuple[float, ...]  # per stage (the busiest device of the stage)
    memory_parts: tuple[dict[str, float], ...]
    time_parts: dict[str, float]
    fits: bool
    limit: float

    @property
    def memory_per_device_bytes(self) -> float:
        return max(self.memory_bytes)


@dataclass(frozen=True, slots=True)
class Sections:
    """Per-section sums of chosen coefficients (block per copy; pre and post once)."""

    time: dict[str, float]
    fwd: dict[str, float]
    core: dict[str, float]
    bwd: dict[str, float]
    saved: dict[str, float]
    saved_core: dict[str, float]
    layer_input: dict[str, float]
    transient: dict[str, float]
    state: dict[str, float]
    sync: dict[str, float]
    gather: dict[str, float]


def sections(problem: Problem, a: Assignment) -> Sections:
    keys = ("pre", "block", "post")
    acc = {name: dict.fromkeys(keys, 0.0) for name in Sections.__slots__}
    for var, c in zip(problem.groups, a.choice):
        cost, s = var.costs[c], var.section
        acc["time"][s] += cost.time
        acc["fwd"][s] += cost.fwd
        acc["core"][s] += cost.fwd_core
        acc["bwd"][s] += cost.bwd
        acc["saved"][s] += cost.saved
        acc["saved_core"][s] += cost.saved_core
        acc["layer_input"][s] += cost.layer_input
        acc["transient"][s] = max(acc["transient"][s], cost.transient)
        acc["state"][s] += cost.state[a.zero]
        acc["sync"][s] += cost.sync_step[a.zero]
        acc["gather"][s] += cost.sync_mb[a.zero]
    for e in problem.edges:
        pc = e.prod_class[a.choice[e.producer]]
        cc = e.cons_class[a.choice[e.consumer]]
        acc["time"][e.section] += e.fwd[pc][cc] + e.bwd[pc][cc]
        acc["fwd"][e.section] += e.fwd[pc][cc]
        acc["bwd"][e.section] += e.bwd[pc][cc]
    return Sections(**acc)


def evaluate(problem: Problem, a: Assignment, limit: float) -> Evaluation:
    """Predicted step time and per-stage memory of `a` (see the module formulas)."""
    sec = sections(problem, a)
    p, m = len(a.stages), problem.micro_batches
    layer_time = [sec.time["block"] + sec.gather["block"],
                  sec.time["block"] + sec.core["block"] + sec.gather["block"],
                  sec.time["block"] + sec.fwd["block"] + sec.gather["block"]]
    act = [sec.saved["block"], sec.saved["block"] - sec.saved_core["block"], sec.layer_input["block"]]
    exposed_per_layer = max(0.0, sec.sync["block"] - sec.bwd["block"])
    send = 2 * problem.pricer.p2p(problem.boundary_bytes) if p > 1 else 0.0
    stage_time, exposed, memory, parts = [], [], [], []
    for s, counts in enumerate(a.stages):
        n = sum(counts)
        first, last = s == 0, s == p - 1
        t = sum(k * lt for k, lt in zip(counts, layer_time)) + send
        t += (sec.time["pre"] + sec.gather["pre"]) * first + (sec.time["post"] + sec.gather["post"]) * last
        stage_time.append(t)
        exposed.append(n * exposed_per_layer + sec.sync["pre"] * first + sec.sync["post"] * last)
        f = in_flight("1f1b", p, s, m)
        working = max([sec.transient["block"]] + [sec.transient["pre"]] * first + [sec.transient["post"]] * last)
        part = {
            "model_states": n * sec.state["block"] + sec.state["pre"] * first + sec.state["post"] * last,
            "activations": f * (sum(k * ar for k, ar in zip(counts, act)) + sec.saved["pre"] * first
                                + sec.saved["post"] * last),
            "working": working,
            "recompute_working": sec.saved["block"] if counts[2] > 0 else 0.0,
        }
        parts.append(part)
        memory.append(sum(part.values()))
    pipe = sum(stage_time) + (m - 1) * max(stage_time)
    step = pipe + max(exposed)
    time_parts = {
        "compute_and_comm": m * sum(stage_time) / p,
        "pipeline_bubble": pipe - m * sum(stage_time) / p,
        "exposed_grad_sync": max(exposed),
    }
    return Evaluation(step, tuple(stage_time), tuple(memory), tuple(parts), time_parts,
                      all(mem <= limit for mem in memory), limit)


def balanced_stages(layers: int, pp: int, recompute: str) -> tuple[tuple[int, int, int], ...] | None:
    """Megatron's split: layers / pp blocks per stage (None when it does not divide)."""
    if pp < 1 or layers % pp or (pp > 1 and layers == 0):
        return None
    n = layers // pp
    r = RECOMPUTES.index(recompute)
    return tuple(tuple(n if i == r else 0 for i in range(3)) for _ in range(pp))  # type: ignore[misc]
