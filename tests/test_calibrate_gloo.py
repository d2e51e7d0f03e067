"""The gloo calibration's wrapper-overhead measurement and the profile field that carries it."""

from __future__ import annotations

import json

from shardc.calibration.gloo import run_workers
from shardc.calibration.profile import PROFILE_VERSION, AlphaBeta, CollectiveFit, LocalProfile
from shardc.hardware import local_cluster


def test_wrapper_overhead_is_measured_with_two_gloo_processes() -> None:
    res = run_workers(2, {"measure": "wrapper_overhead"}, timeout=120, entry="_one_worker")
    # The wrapper copies, builds an autograd node and runs backward on top of the raw gloo call:
    # CPU work, measured in thread time, so it shows; tens of microseconds to a millisecond.
    assert 1e-6 < res["wrapper_overhead"] < 0.01


def _profile_json(version: int, overhead: list[list[float]] | None) -> dict:
    fits = (CollectiveFit("all_reduce", 2, ((64, 2e-4), (1 << 20, 2e-3)), AlphaBeta(2e-4, 1e-9)),)
    data = LocalProfile(version, "now", "cpu", 2, 8 << 30, "x", True, ((256, 4e10),), 1e11, 5e5, (("bf16", 1.0),),
                        2e10, 2e-6, ((2, 6e10, 1e10),), fits).to_json()
    data.pop("wrapper_overhead")
    if overhead is not None:
        data["wrapper_overhead"] = overhead
    return json.loads(json.dumps(data))


def test_old_profiles_load_without_overhead_and_new_ones_keep_it() -> None:
    old = LocalProfile.from_json(_profile_json(2, None))
    assert old.wrapper_overhead == () and local_cluster(2, old).intra.call_overhead == 0.0
    new = LocalProfile.from_json(_profile_json(PROFILE_VERSION, [[2, 4e-4], [4, 9e-4]]))
    assert new.wrapper_overhead == ((2, 4e-4), (4, 9e-4))
    assert LocalProfile.from_json(json.loads(json.dumps(new.to_json()))) == new
    assert local_cluster(4, new).intra.call_overhead == 9e-4 and local_cluster(2, new).intra.call_overhead == 4e-4
