"""Point-to-point transfers in the pipeline simulation (`cost.pipeline_shared.simulate_schedule`):
longer transfers never price a schedule cheaper, whether the processes have a core each or share
fewer. No timing here: schedules of unit lengths."""

from __future__ import annotations

import pytest

from shardc.cost.pipeline_shared import CoreSharing, simulate_schedule

# (schedule, pp, virtual stages per device, micro-batches, split backward)
CASES = [("1f1b", 4, 1, 8, False), ("gpipe", 2, 1, 4, False), ("interleaved", 4, 2, 8, False),
         ("zbv", 4, 2, 8, True), ("interleaved-zb", 4, 2, 8, True), ("dualpipev", 4, 2, 8, True)]
LAGS = (0.0, 0.01, 0.05, 0.2, 1.0)


@pytest.mark.parametrize("schedule,pp,v,m,split", CASES)
def test_longer_transfers_never_shorten_a_schedule(schedule: str, pp: int, v: int, m: int, split: bool) -> None:
    """Unequal stages (forward 1..S/v, backward twice, W half of it) and every send's lag raised
    step by step: the makespan never falls, with a core per process, two cores or one."""
    S = pp * v
    fwd = [(1.0 + 0.25 * s) / v for s in range(S)]
    bwd = [2.0 * f for f in fwd]
    wgrad = list(fwd) if split else None
    for sharing in (None, CoreSharing(2, pp), CoreSharing(1, pp)):
        spans = [simulate_schedule(schedule, fwd, bwd, m, pp, send=[lag] * S, wgrad=wgrad, sharing=sharing).makespan
                 for lag in LAGS]
        assert all(b >= a - 1e-9 * a for a, b in zip(spans, spans[1:])), (schedule, sharing, spans)  # to rounding
        assert spans[-1] > spans[0]  # a transfer on the critical path shows
