"""Per-stage peak memory of every pipeline schedule, measured while training on two gloo
processes, against the cost model's prediction per pipeline device (issue 16's target: within 5%
for every schedule).

The prediction walks each device's order of forward, backward, input- and weight-gradient passes
(`shardc.cost.peak.order_peaks`): a forward keeps its virtual stage's saved activations until its
backward or, split, its weight pass; torch's input-gradient pass (`stage_backward_input`) keeps the
graph and the output gradients it captures for the weight pass, and the stage input's gradient,
until that pass; the first stage's weight pass runs its whole backward.

History of this test: it was a strict xfail at +27% / +36% (ZB-V) and the same harness showed
interleaved 1F1B at +56% / +83%. Most of that was the memory tracker itself: its saved-tensor
hook returned the saved tensor whole, so an op saving its own output (softmax) held a reference
cycle through its grad_fn that autograd breaks only when backward frees the node; a retained
graph's input-only nodes never are, so the tracker kept them alive to the step's end and into the
next run of the same process (interleaved ran after ZB-V). The rest was the input-gradient pass's
captured gradients and retained graph, now priced. All six plans run in one torchrun (one group).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_hardware import fixed_local_profile

from shardc.run import launch_all, predict, resolve_plan, summarize

NPROC = 2
SPEC = "examples/gpt.py:tiny?batch=4&seq=128&n_layer=4"
PLANS = ("pp=2,vpp=2,schedule=zbv", "pp=2,vpp=2,schedule=dualpipev", "pp=2,vpp=2,schedule=interleaved-zb",
         "pp=2,vpp=2,schedule=interleaved", "pp=2,schedule=1f1b", "pp=2,schedule=gpipe")


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """Every schedule trained in one torchrun (a warm-up step, then the tracked step each)."""
    with fixed_local_profile(tmp_path_factory.mktemp("shardc-cache")):
        plans = [resolve_plan(text, NPROC) for text in PLANS]
        got = launch_all([(SPEC, plan) for plan in plans], nproc=NPROC, steps=2, seed=3, timeout_s=600)
        out = {}
        for text, plan, reports in zip(PLANS, plans, got):
            est, note = predict(SPEC, plan, None, NPROC)
            out[text] = summarize(SPEC, plan, reports, est, note)
        yield out


@pytest.mark.parametrize("plan", PLANS)
def test_peak_memory_per_stage_within_5_percent(measured: dict[str, dict[str, Any]], plan: str) -> None:
    summary = measured[plan]
    assert len(summary["ranks"]) == NPROC
    for r in summary["ranks"]:
        got, want = r["peak_memory_bytes"], r["predicted_peak_memory_bytes"]
        assert want is not None, summary["prediction"]
        assert got == pytest.approx(want, rel=0.05), \
            f"{plan} rank {r['rank']}: measured {got:,.0f} B, predicted {want:,.0f} B ({got / want - 1:+.1%})"
