"""A pipeline's makespan when its processes share fewer cores than there are of them.

Why: the local profile prices every process at the rate it gets while all `p` processes
compute at once (`LocalProfile.per_process_flops(p)`: `min(p, cores) / p` of a core each). In a
pipeline they do not all compute at once: a process waiting in a bubble leaves its share of
the cores to the busy ones, so on a machine with fewer cores than processes the fill and drain
run faster than `pipeline.simulate` prices them, and 1F1B's bubble partly vanishes.

Rule (processor sharing): the ops, orders and dependencies are `pipeline.simulate`'s; each op's
length is its work at the all-busy rate. While `k` processes run an op, each advances at
`(min(k, cores) / k) / (min(p, cores) / p)` times that rate (k <= cores: a core each; more:
the cores split evenly). Not used by the estimate: the model prices accelerators, one per
process; this explains, beside it, what a CPU measurement with p > cores shows
(`shardc.study.pipeline_measure`).
"""

from __future__ import annotations

from collections.abc import Sequence

from shardc.cost.pipeline import device_order
from shardc.ir.diagnostics import ShardcError

_EPS = 1e-12


def simulate_shared(schedule: str, fwd: Sequence[float], bwd: Sequence[float], micro_batches: int, devices: int,
                    cores: int, wgrad: Sequence[float] | None = None) -> float:
    """The makespan of the schedule (arguments as `pipeline.simulate`'s) with the `devices`
    processes sharing `cores` cores (module rule). Equals `simulate`'s when cores >= devices."""
    S, p, m = len(fwd), devices, micro_batches
    v = S // p
    w = list(wgrad) if wgrad is not None else [0.0] * S
    orders = [device_order(schedule, p, d, m, v) for d in range(p)]
    full = min(p, cores) / p  # the share each process gets with all busy: the rate lengths are given at
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    running: dict[int, float] = {}  # device -> work left on its current op
    t = 0.0

    def ready(d: int) -> bool:
        kind, j, s = orders[d][pos[d]]
        if kind == "F":
            return s == 0 or ("F", j, s - 1) in done
        if kind == "W":
            return ("I", j, s) in done
        return ("G", j, s + 1) in done if s < S - 1 else ("F", j, s) in done

    def length(d: int) -> float:
        kind, _, s = orders[d][pos[d]]
        return fwd[s] if kind == "F" else w[s] if kind == "W" else bwd[s] - w[s] if kind == "I" else bwd[s]

    while True:
        for d in range(p):
            if d not in running and pos[d] < len(orders[d]) and ready(d):
                running[d] = length(d)
        if not running:
            if any(pos[d] < len(orders[d]) for d in range(p)):
                raise ShardcError(f"pipeline schedule {schedule} deadlocked (p={p}, m={m}, v={v}); this is a bug")
            return t
        k = len(running)
        rate = (min(k, cores) / k) / full
        step = min(running.values()) / rate
        t += step
        for d in list(running):
            running[d] -= step * rate
            if running[d] <= _EPS:
                kind, j, s = orders[d][pos[d]]
                done[(kind, j, s)] = t
                if kind in ("B", "I"):
                    done[("G", j, s)] = t
                del running[d]
                pos[d] += 1
