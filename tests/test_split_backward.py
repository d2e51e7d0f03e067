"""A split backward's own CPU on the local cluster (`runtime_cpu.schedule_actions`, `split_backward_cpu`,
`calibration.pipeline_steps.split_refill`): charged on the schedule's input-gradient ops only, per
byte the stage saved, never on accelerators. No timing here: estimates on a fixed profile, and the
calibration's measurement checked for its form only."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest
from test_hardware import _profile

from shardc.cost.pipeline import device_order
from shardc.hardware import local_cluster, make_cluster

MODEL = "examples/gpt.py:gpt?n_layer=4&n_embd=64&n_head=2&vocab_size=128&seq=16&batch=8&tie=false"
SPLIT_PLANS = ("pp=2,vpp=2,mb=1,schedule=zbv", "pp=2,vpp=2,mb=1,schedule=interleaved-zb",
               "pp=2,vpp=2,mb=1,schedule=dualpipev")
WHOLE_PLANS = ("pp=2,mb=1", "pp=2,vpp=2,mb=1,schedule=interleaved")


def _refill_profile(per_byte: float, action: float = 0.0, walk: float = 0.0):
    from shardc.calibration.profile import EagerCosts, KernelFit

    eager = EagerCosts((("elementwise", KernelFit(3e-6, 3e-11, 8e-6, 1e-11)),), 50e-6, 4e-9,
                       pipeline_action=action, split_backward_per_tensor=walk, split_backward_per_byte=per_byte)
    return replace(_profile(), eager=eager)


def _estimate(cluster, plan: str):
    from shardc.driver import estimate

    return estimate(MODEL, cluster, plan)[0]


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_refill_is_charged_per_saved_byte_on_input_passes_past_the_first_stage(nproc: int) -> None:
    """With only the refill measured, each input-gradient op ("I") of a stage past the first costs
    the same extra for every micro-batch, twice as much at twice the rate; the first stage's
    (torch runs its backward whole) and every other op cost nothing more; the schedules that do
    not split their backward are priced as before."""
    one, two = local_cluster(nproc, _refill_profile(1e-9)), local_cluster(nproc, _refill_profile(2e-9))
    zero = local_cluster(nproc, _refill_profile(0.0))
    for plan in SPLIT_PLANS:
        plan = f"dp={nproc // 2},{plan}"  # 4 processes: two pipelines side by side
        a, b = _estimate(one, plan), _estimate(two, plan)
        extra_a, extra_b = dict(a.pipeline.extra), dict(b.pipeline.extra)
        assert extra_a.keys() == extra_b.keys() and {op[0] for op in extra_a} == {"I"}
        assert all(s > 0 and t > 0 for (_, _, s), t in extra_a.items())
        assert all(extra_b[op] == pytest.approx(2 * t) for op, t in extra_a.items())
        for s in {s for _, _, s in extra_a}:
            assert len({round(t, 15) for (_, _, x), t in extra_a.items() if x == s}) == 1  # per stage, not per micro-batch
        assert b.step_time_s > a.step_time_s > _estimate(zero, plan).step_time_s
    for plan in (f"dp={nproc // 2},{p}" for p in WHOLE_PLANS):
        assert _estimate(two, plan).step_time_s == pytest.approx(_estimate(zero, plan).step_time_s)


def test_dualpipev_charges_only_the_backwards_it_splits() -> None:
    """DualPipeV runs most backwards whole ("B") and a few split ("I" then "W"): the split's own
    work (one action, the walk, the refill) lands on exactly its "I" ops past the first stage."""
    cluster = local_cluster(2, _refill_profile(1e-9, action=1e-4, walk=1e-5))
    est = _estimate(cluster, SPLIT_PLANS[2])
    p = est.pipeline
    orders = [op for d in range(p.pp) for op in device_order("dualpipev", p.pp, d, p.micro_batches, p.vpp)]
    inputs = {op for op in orders if op[0] == "I"}
    whole = {op for op in orders if op[0] == "B"}
    assert inputs and whole  # the schedule mixes both at this size
    extra = dict(p.extra)
    assert set(extra) == inputs and not whole & set(extra)


@pytest.mark.parametrize("plan", SPLIT_PLANS)
def test_more_split_work_never_prices_a_schedule_cheaper(plan: str) -> None:
    """The step time of a split schedule never falls as the split's measured CPU (refill per byte,
    walk per tensor, action) grows, on processes that share the cores (4 on 2) or not (2 on 2)."""
    for nproc in (2, 4):
        steps = [_estimate(local_cluster(nproc, _refill_profile(r, action=r * 1e5, walk=r * 1e4)),
                           f"dp={nproc // 2},{plan}").step_time_s
                 for r in (0.0, 1e-9, 4e-9)]
        assert steps == sorted(steps)


def test_accelerator_clusters_are_unchanged() -> None:
    """An accelerator has no eager CPU costs: no schedule action, walk or refill is charged, so a
    split schedule's ops carry no extra there."""
    cluster = make_cluster("A100-80GB", 1, 2)
    assert cluster.device.eager is None
    for plan in SPLIT_PLANS:
        assert _estimate(cluster, plan).pipeline.extra == ()


def test_the_profile_keeps_the_refill() -> None:
    """`EagerCosts.split_backward_per_byte` survives the profile's JSON form and scales with the
    sharing slowdown like every eager cost; profiles written before it read as 0 (not measured)."""
    from shardc.calibration.profile import eager_from_json

    eager = _refill_profile(3e-10).eager
    assert eager is not None
    data = json.loads(json.dumps(asdict(eager)))
    assert eager_from_json(data) == eager
    assert eager.scaled(2.0).split_backward_per_byte == pytest.approx(6e-10)
    del data["split_backward_per_byte"]
    assert eager_from_json(data).split_backward_per_byte == 0.0


def test_the_calibration_measures_the_refill() -> None:
    """`split_refill` on this machine (about a second): a finite, non-negative CPU time per byte.
    Only its form is asserted (no timing claims)."""
    from shardc.calibration.pipeline_steps import split_refill

    refill = split_refill(reps=3)
    assert math.isfinite(refill) and refill >= 0.0
