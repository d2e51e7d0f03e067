"""The pipeline's schedule run on processes that share fewer cores than there are of them.

Why: the local profile prices every process at the rate it gets while all N processes compute
at once (`LocalProfile.per_process_flops(N)`: `min(N, cores) / N` of a core each). In a pipeline
they do not all compute at once: a process waiting in a bubble leaves its share of the cores to
the busy ones, so on a machine with fewer cores than processes (4 gloo processes on 2 cores) the
fill and drain run faster than `pipeline.simulate` prices them and 1F1B's bubble mostly
vanishes; what decides the step is the work of all the processes over the cores.

Rule (processor sharing): the ops, their orders and dependencies, the sends' lags and the extra
seconds of single ops are `pipeline.simulate`'s; each op's length is its work at the all-busy
rate. While `k` of the simulated pipeline's devices run an op, `k x r` processes compute (`r`
processes per pipeline device: its data-, tensor- and context-parallel peers, which run the same
schedule in step), and each advances at `(min(kr, cores) / kr) / (min(N, cores) / N)` times the
all-busy rate: a core each while they fit, the cores split evenly when they do not, never
faster than one core (a process computes on one intra-op thread). With as many cores as
processes every rate is 1 and the run is `pipeline.simulate`'s exactly (`simulate_schedule`
calls it then). Accelerator clusters have no shared cores (`Cluster.shared_cores == 0`).

`simulate_schedule` is the one entry the estimate's composition, its timeline (`--plot`) and
the solver's evaluation run, so none of them can disagree on which model priced a schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardc.cost.pipeline import Op, PipelineTimes, device_order, simulate
from shardc.ir.diagnostics import ShardcError

_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class CoreSharing:
    """`processes` processes of one plan on `cores` cores, `per_device` of them on each pipeline
    device of the simulated schedule (module rule)."""

    cores: int
    processes: int
    per_device: int = 1

    def __post_init__(self) -> None:
        if self.cores < 1 or self.processes < 1 or self.per_device < 1:
            raise ValueError(f"core sharing needs cores, processes and per_device >= 1, got {self}")

    @property
    def limits(self) -> bool:
        """Whether the processes outnumber the cores (else every rate is 1)."""
        return self.processes > self.cores

    def rate(self, running: int) -> float:
        """How many times its all-busy rate an op advances while `running` pipeline devices run one."""
        k = max(1, running) * self.per_device
        return (min(k, self.cores) / k) / (min(self.processes, self.cores) / self.processes)


def core_sharing(cluster, pp: int) -> CoreSharing | None:
    """How a plan of `pp` pipeline devices on `cluster` shares its cores: None where each process
    has a device of its own (`Cluster.shared_cores == 0`) or the cores suffice."""
    cores = getattr(cluster, "shared_cores", 0)
    processes = cluster.num_devices
    if cores <= 0 or processes <= cores:
        return None
    return CoreSharing(cores, processes, max(1, processes // max(1, pp)))


def simulate_schedule(schedule: str, fwd: Sequence[float], bwd: Sequence[float], micro_batches: int, devices: int,
                      *, send: Sequence[float] | None = None, wgrad: Sequence[float] | None = None,
                      events: list[tuple[int, str, int, int, float, float]] | None = None,
                      extra: dict[Op, float] | None = None, sharing: CoreSharing | None = None) -> PipelineTimes:
    """Run the schedule (arguments as `pipeline.simulate`'s) on processes sharing cores as
    `sharing` says (module rule); without sharing, or with cores enough, `pipeline.simulate`."""
    if sharing is None or not sharing.limits or devices <= 1:
        return simulate(schedule, fwd, bwd, micro_batches, devices, send=send, wgrad=wgrad, events=events, extra=extra)
    return _shared(schedule, fwd, bwd, micro_batches, devices, sharing, send, wgrad, events, extra)


def simulate_shared(schedule: str, fwd: Sequence[float], bwd: Sequence[float], micro_batches: int, devices: int,
                    cores: int, wgrad: Sequence[float] | None = None) -> float:
    """The makespan with the `devices` processes (one per pipeline device) sharing `cores` cores."""
    return simulate_schedule(schedule, fwd, bwd, micro_batches, devices, wgrad=wgrad,
                             sharing=CoreSharing(cores, devices)).makespan


def _dependency(op: Op, S: int, send: Sequence[float]) -> tuple[Op | None, float]:
    """The op `op` waits for and the transfer after it (as `pipeline.simulate` reads them)."""
    kind, j, s = op
    if kind == "F":
        return (("F", j, s - 1), send[s - 1]) if s > 0 else (None, 0.0)
    if kind == "W":
        return ("I", j, s), 0.0
    return (("G", j, s + 1), send[s]) if s < S - 1 else (("F", j, s), 0.0)


def _shared(schedule: str, fwd: Sequence[float], bwd: Sequence[float], m: int, p: int, sharing: CoreSharing,
            send: Sequence[float] | None, wgrad: Sequence[float] | None,
            events: list[tuple[int, str, int, int, float, float]] | None,
            extra: dict[Op, float] | None) -> PipelineTimes:
    S = len(fwd)
    v = S // p
    lag = list(send) if send is not None else [0.0] * S
    w = list(wgrad) if wgrad is not None else [0.0] * S
    orders = [device_order(schedule, p, d, m, v) for d in range(p)]
    done: dict[Op, float] = {}
    pos = [0] * p
    busy, last_end, last_b = [0.0] * p, [0.0] * p, [0.0] * p
    running: dict[int, list[float]] = {}  # device -> [work left, start, length]
    t = 0.0

    def length(op: Op) -> float:
        kind, _, s = op
        base = fwd[s] if kind == "F" else w[s] if kind == "W" else bwd[s] - w[s] if kind == "I" else bwd[s]
        return base + (extra.get(op, 0.0) if extra else 0.0)

    def arrival(d: int) -> float | None:
        """When device d's next op may start (its input there), None while its input is not made."""
        dep, delay = _dependency(orders[d][pos[d]], S, lag)
        if dep is None:
            return 0.0
        return done[dep] + delay if dep in done else None

    while True:
        for d in range(p):
            if d not in running and pos[d] < len(orders[d]):
                at = arrival(d)
                if at is not None and at <= t + _EPS:
                    work = length(orders[d][pos[d]])
                    running[d] = [work, t, work]
        waiting = [a for d in range(p) if d not in running and pos[d] < len(orders[d])
                   if (a := arrival(d)) is not None]
        if not running:
            if waiting:
                t = min(waiting)
                continue
            if any(pos[d] < len(orders[d]) for d in range(p)):
                raise ShardcError(f"pipeline schedule {schedule} deadlocked (p={p}, m={m}, v={v}); this is a bug")
            break
        rate = sharing.rate(len(running))
        t_next = min(t + min(r[0] for r in running.values()) / rate, min(waiting, default=math.inf))
        for d in list(running):
            state = running[d]
            state[0] -= (t_next - t) * rate
            if state[0] <= _EPS * max(1.0, state[2]):
                op = orders[d][pos[d]]
                done[op] = last_end[d] = t_next
                if op[0] in ("B", "I"):
                    done[("G", op[1], op[2])] = t_next  # the input gradient leaves for stage s-1
                if op[0] != "F":
                    last_b[d] = t_next - state[1]
                busy[d] += state[2]
                if events is not None:
                    events.append((d, op[0], op[1], op[2], state[1], t_next))
                del running[d]
                pos[d] += 1
        t = t_next
    return PipelineTimes(max(last_end), tuple(busy), tuple(last_end), tuple(last_b))
