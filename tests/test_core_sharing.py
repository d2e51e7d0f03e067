"""Processes sharing fewer cores than there are of them (`shardc.cost.pipeline_shared`): the rule's
properties, and the `local` cluster's estimate priced by it. No timing here: schedules of unit
lengths, and estimates on a fixed profile."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_hardware import _profile

from shardc.cost.pipeline import simulate
from shardc.cost.pipeline_shared import CoreSharing, _shared, core_sharing, simulate_schedule
from shardc.hardware import local_cluster, make_cluster

# (schedule, pp, virtual stages per device, micro-batches, split backward)
CASES = [("1f1b", 4, 1, 8, False), ("gpipe", 2, 1, 4, False), ("interleaved", 2, 2, 4, False),
         ("zbv", 4, 2, 8, True), ("interleaved-zb", 2, 2, 4, True), ("dualpipev", 4, 2, 8, True)]


def _stages(pp: int, v: int, split: bool) -> tuple[list[float], list[float], list[float] | None]:
    """Unequal stages (imbalance shows as waiting): forward 1..S/v, backward twice, W half of it."""
    S = pp * v
    fwd = [(1.0 + 0.25 * s) / v for s in range(S)]
    bwd = [2.0 * f for f in fwd]
    return fwd, bwd, [f for f in fwd] if split else None


@pytest.mark.parametrize("schedule,pp,v,m,split", CASES)
def test_with_cores_enough_it_is_the_plain_simulation(schedule: str, pp: int, v: int, m: int, split: bool) -> None:
    """Every rate is 1 when the processes fit the cores: the processor-sharing run itself (not
    only the dispatch) gives `pipeline.simulate`'s makespan, busy time, ends and every op's start
    and end, sends' lags and single ops' extra seconds included."""
    fwd, bwd, w = _stages(pp, v, split)
    send = [0.1] * len(fwd)
    extra = {("F", 1, 0): 0.3, ("B", 0, len(fwd) - 1) if not split else ("I", 0, len(fwd) - 1): 0.2}
    plain_events: list = []
    shared_events: list = []
    plain = simulate(schedule, fwd, bwd, m, pp, send=send, wgrad=w, events=plain_events, extra=extra)
    roomy = CoreSharing(cores=pp * 2, processes=pp * 2, per_device=2)
    assert not roomy.limits and roomy.rate(1) == 1.0
    shared = _shared(schedule, fwd, bwd, m, pp, roomy, send, w, shared_events, extra)
    assert shared.makespan == pytest.approx(plain.makespan)
    assert shared.busy == pytest.approx(plain.busy)
    assert shared.last_end == pytest.approx(plain.last_end)
    assert shared.last_backward == pytest.approx(plain.last_backward)
    key = lambda e: (e[0], e[4], e[1], e[2], e[3])  # noqa: E731
    assert [e[:4] for e in sorted(shared_events, key=key)] == [e[:4] for e in sorted(plain_events, key=key)]
    assert [t for e in sorted(shared_events, key=key) for t in e[4:]] == pytest.approx(
        [t for e in sorted(plain_events, key=key) for t in e[4:]])
    assert simulate_schedule(schedule, fwd, bwd, m, pp, send=send, wgrad=w, extra=extra, sharing=roomy) == plain


@pytest.mark.parametrize("schedule,pp,v,m,split", CASES)
def test_fewer_cores_than_processes_shrink_the_bubble(schedule: str, pp: int, v: int, m: int, split: bool) -> None:
    """On half as many cores as processes each op is priced at half a core, and a rank idle in a
    bubble lends its share: the step is shorter than one device per process makes it, no shorter
    than the work over the cores (every op at a whole core, the cores never idle), and the
    work done is the same."""
    fwd, bwd, w = _stages(pp, v, split)
    plain = simulate(schedule, fwd, bwd, m, pp, wgrad=w)
    tight = CoreSharing(cores=pp // 2, processes=pp)
    events: list = []
    shared = simulate_schedule(schedule, fwd, bwd, m, pp, wgrad=w, sharing=tight, events=events)
    work = sum(plain.busy) * tight.rate(pp) / tight.rate(1)  # the ops at a whole core each
    assert work / tight.cores - 1e-9 <= shared.makespan < plain.makespan
    assert shared.busy == pytest.approx(plain.busy)
    assert max(e[5] for e in events) == pytest.approx(shared.makespan)
    idle_plain = 1 - sum(plain.busy) / (pp * plain.makespan)
    idle_shared = 1 - work / (tight.cores * shared.makespan)  # the cores' idle share
    assert idle_shared < idle_plain


def test_the_rate_of_a_running_process() -> None:
    """4 processes on 2 cores: each op is priced at half a core; 2 running get a core each (2x),
    1 running cannot use two cores (2x), 3 share two (4/3x). With dp=2 beside pp=2 each pipeline
    device is two processes: one device running fills both cores."""
    four = CoreSharing(cores=2, processes=4)
    assert [four.rate(k) for k in (1, 2, 3, 4)] == pytest.approx([2.0, 2.0, 4 / 3, 1.0])
    replicas = CoreSharing(cores=2, processes=4, per_device=2)
    assert [replicas.rate(k) for k in (1, 2)] == pytest.approx([2.0, 1.0])
    with pytest.raises(ValueError, match="cores, processes and per_device >= 1"):
        CoreSharing(cores=0, processes=4)


def test_only_the_local_cluster_shares_cores() -> None:
    """The local cluster records its cores (the profile's: 2); sharing applies only where its
    processes outnumber them; a GPU preset has a device per process."""
    assert local_cluster(4, _profile()).shared_cores == 2
    assert core_sharing(local_cluster(4, _profile()), pp=4) == CoreSharing(2, 4, 1)
    assert core_sharing(local_cluster(4, _profile()), pp=2) == CoreSharing(2, 4, 2)
    assert core_sharing(local_cluster(2, _profile()), pp=2) is None
    assert core_sharing(make_cluster("H100", 1), pp=4) is None


def test_the_local_estimate_and_its_timeline_price_shared_cores(tmp_path: Path) -> None:
    """`shardc estimate` on local4 (2 cores) prices a 4-stage pipeline with the cores shared: its
    step is shorter than the same cluster with a core per process gives, and the drawn timeline
    is the simulation the step came from."""
    from test_hardware import fixed_local_profile

    from shardc.cost.report import timeline
    from shardc.driver import estimate

    model = "examples/gpt.py:gpt?n_layer=4&n_embd=64&n_head=2&vocab_size=128&seq=16&batch=8&tie=false"
    with fixed_local_profile(tmp_path):
        cluster = local_cluster(4)
        shared, _ = estimate(model, cluster, "pp=4,mb=1")
        roomy, _ = estimate(model, replace(cluster, shared_cores=4), "pp=4,mb=1")
        flat, _ = estimate(model, cluster, "dp=4,mb=2")
        flat_roomy, _ = estimate(model, replace(cluster, shared_cores=4), "dp=4,mb=2")
    assert shared.pipeline.sharing == CoreSharing(2, 4, 1) and roomy.pipeline.sharing is None
    assert shared.step_time_s < roomy.step_time_s
    assert shared.pipeline.fwd == roomy.pipeline.fwd  # the same ops, priced alike; only their overlap differs
    assert flat.step_time_s == pytest.approx(flat_roomy.step_time_s)  # every process busy all along: no change
    ends = max(e[5] for e in timeline(shared))
    assert ends < max(e[5] for e in timeline(roomy))
    assert ends <= shared.step_time_s


# ---- the pipeline runtime's own CPU work (`runtime_cpu.schedule_actions`, `calibration.pipeline_steps`) --------

def _eager_profile(action: float, walk: float):
    from shardc.calibration.profile import EagerCosts, KernelFit

    eager = EagerCosts((("elementwise", KernelFit(3e-6, 3e-11, 8e-6, 1e-11)),), 50e-6, 4e-9,
                       pipeline_action=action, split_backward_per_tensor=walk)
    return replace(_profile(), eager=eager)


def test_the_schedule_actions_are_priced_per_stage_and_micro_batch() -> None:
    """Measured CPU per action (1 ms) and per parameter tensor of a split backward (0.1 ms): each
    virtual stage's forward gains one action, its backward one (1F1B: the whole backward; ZB-V:
    the weight pass, and the input pass as an extra of its own op: one action and, past the first
    stage, the walk of its parameter tensors), its weight pass one; unmeasured (0): nothing."""
    from shardc.driver import estimate

    model = "examples/gpt.py:gpt?n_layer=4&n_embd=64&n_head=2&vocab_size=128&seq=16&batch=4&tie=false"
    plain, measured = local_cluster(2, _eager_profile(0.0, 0.0)), local_cluster(2, _eager_profile(1e-3, 1e-4))
    eager = measured.device.eager  # as a process among 2 gets them (the profile's sharing slowdown)
    assert eager is not None and eager.pipeline_action > 0
    action, walk = eager.pipeline_action, eager.split_backward_per_tensor
    assert walk == pytest.approx(action / 10)
    for plan in ("pp=2,mb=1", "pp=2,vpp=2,mb=1,schedule=zbv"):
        base, _ = estimate(model, plain, plan)
        more, _ = estimate(model, measured, plan)
        a, b = base.pipeline, more.pipeline
        assert [x - y for x, y in zip(b.fwd, a.fwd)] == pytest.approx([action] * len(a.fwd))
        assert [x - y for x, y in zip(b.bwd, a.bwd)] == pytest.approx([action] * len(a.bwd))
        if "zbv" not in plan:
            assert b.extra == a.extra == ()
            continue
        assert [x - y for x, y in zip(b.wgrad, a.wgrad)] == pytest.approx([action] * len(a.wgrad))
        inputs = dict(b.extra)
        assert a.extra == () and {op[0] for op in inputs} == {"I"} and len(inputs) == len(a.fwd) * a.micro_batches
        assert {t for (_, _, s), t in inputs.items() if s == 0} == {action}  # torch runs the first stage whole
        walked = [t - action for (_, _, s), t in inputs.items() if s > 0]
        tensors = [round(w / walk) for w in walked]
        assert walked == pytest.approx([walk * t for t in tensors]) and min(tensors) >= 4  # a block's weights at least
        assert more.step_time_s > base.step_time_s


def test_the_calibration_measures_the_runtime_and_the_contention_under_load() -> None:
    """Two gloo processes in one launch: torch's 1F1B and ZB-V schedules on tiny stages against
    the same work without the runtime (CPU per action and per parameter tensor of a split
    backward), and the probe while both train. Figures of this machine: only their form is
    asserted (no timing claims)."""
    import math

    from shardc.calibration.gloo import run_workers
    from shardc.calibration.pipeline_steps import stage_bytes

    res = run_workers(2, {"measure": ["pipeline_overhead", "action_by_size", "loaded_probe_s"], "window": 0.1,
                          "steps": 2}, timeout=180, entry="_one_worker")
    action, walk = res["pipeline_overhead"]
    assert math.isfinite(action) and math.isfinite(walk) and action >= 0 and walk >= 0
    small, large, small_bytes, large_bytes = res["action_by_size"]
    assert small >= 0 and large >= 0 and small_bytes == stage_bytes() < large_bytes == 3 * 2**20
    assert res["loaded_probe_s"] > 0


def test_an_action_costs_by_its_stages_bytes_up_to_the_largest_measured() -> None:
    """`action_fit` draws the line through the tiny and the block-sized stage's CPU per action
    (flat past the larger stage; no per-byte term when the larger read cheaper), and the
    schedule's actions on a stage are priced at its weights and saved bytes per micro-batch: a
    model with twice the width pays more per action, the same beyond the cap."""
    from shardc.calibration.local import action_fit
    from shardc.calibration.profile import EagerCosts, KernelFit
    from shardc.driver import estimate

    base = EagerCosts((("elementwise", KernelFit(3e-6, 3e-11, 8e-6, 1e-11)),), 50e-6, 4e-9)
    fitted = action_fit(base, 200e-6, 500e-6, 1e4, 3e6 + 1e4)
    assert fitted.pipeline_action_per_byte == pytest.approx(1e-10)
    assert fitted.action(1e4) == pytest.approx(200e-6) and fitted.action(3e6 + 1e4) == pytest.approx(500e-6)
    assert fitted.action(1e9) == fitted.action(3e6 + 1e4)  # no extrapolation past the larger stage
    noisy = action_fit(base, 300e-6, 250e-6, 1e4, 3e6)
    assert noisy.pipeline_action_per_byte == 0 and noisy.action(1e9) == pytest.approx(275e-6)

    def actions(width: int, eager: EagerCosts) -> list[float]:
        model = f"examples/gpt.py:gpt?n_layer=4&n_embd={width}&n_head=2&vocab_size=128&seq=16&batch=4&tie=false"
        plain, _ = estimate(model, local_cluster(2, replace(_profile(), eager=base)), "pp=2,mb=1")
        more, _ = estimate(model, local_cluster(2, replace(_profile(), eager=eager)), "pp=2,mb=1")
        return [b - a for a, b in zip(plain.pipeline.fwd, more.pipeline.fwd)]

    capped = action_fit(base, 200e-6, 500e-6, 1e3, 2e4)  # every stage here holds more than 2e4 bytes
    assert actions(32, capped) == pytest.approx(actions(64, capped))
    roomy = action_fit(base, 200e-6, 500e-6, 1e4, 1e9)
    narrow, wide = actions(32, roomy), actions(64, roomy)
    assert all(w > n > 200e-6 for n, w in zip(narrow, wide))
