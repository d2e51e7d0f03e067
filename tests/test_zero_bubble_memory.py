"""Peak memory of a zero-bubble (ZB-V) plan, measured while training on two gloo processes,
against the cost model's prediction per pipeline device (as tests/test_memory_accuracy.py).

The prediction counts, per device, the activations of the (micro-batch, virtual stage) pairs in
flight in torch's ScheduleZBVZeroBubble order (from a forward to its weight-gradient pass:
`shardc.cost.pipeline.in_flight_order`) stacked under the live timeline of the one in progress.

Known defect, measured (GPT tiny, 4 blocks, seq 128, pp=2 vpp=2 schedule=zbv, fp32): rank 0
7,823,512 B against 6,156,288 B predicted (+27%), rank 1 7,880,820 B against 5,785,856 B (+36%);
the tracker puts +1.0 MB more in activations (about one model chunk's saved activations for one
micro-batch) and 1.2-1.6 MB in `other` (tensors the timeline does not model: by their size the
input gradients torch's split backward leaves on each received activation, `inp.grad`, and the
output gradients captured for the deferred weight-gradient passes), and the causal-mask buffer
once per stage module (2 on a V device; predicted once). The same harness measures interleaved
1F1B (pp=2 vpp=2, not a zero-bubble schedule) +56% / +83%, almost all in `other`, so the
pipelining runtime's multi-stage buffers are the larger part and are not specific to ZB-V. Until
peak.py models them, this test is a strict xfail with these figures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_hardware import fixed_local_profile

from shardc.run import launch_all, predict, resolve_plan, summarize

NPROC = 2
SPEC = "examples/gpt.py:tiny?batch=4&seq=128&n_layer=4"
PLAN = "pp=2,vpp=2,schedule=zbv"


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The ZB-V plan trained in one torchrun (warm-up step, then the tracked step)."""
    with fixed_local_profile(tmp_path_factory.mktemp("shardc-cache")):
        plan = resolve_plan(PLAN, NPROC)
        got = launch_all([(SPEC, plan)], nproc=NPROC, steps=2, seed=3, timeout_s=400)[0]
        est, note = predict(SPEC, plan, None, NPROC)
        yield summarize(SPEC, plan, got, est, note)


@pytest.mark.xfail(strict=True, reason="ZB-V peak memory above the prediction: rank 0 +27% (7,823,512 B against "
                   "6,156,288 B), rank 1 +36% (7,880,820 B against 5,785,856 B); see the module docstring")
def test_zbv_peak_memory_per_stage_within_5_percent(measured: dict[str, Any]) -> None:
    assert len(measured["ranks"]) == NPROC
    for r in measured["ranks"]:
        got, want = r["peak_memory_bytes"], r["predicted_peak_memory_bytes"]
        assert want is not None, measured["prediction"]
        assert got == pytest.approx(want, rel=0.05), \
            f"{PLAN} rank {r['rank']}: measured {got:,.0f} B, predicted {want:,.0f} B ({got / want - 1:+.1%})"
