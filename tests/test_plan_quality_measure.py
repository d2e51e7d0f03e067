"""`benchmarks/plan_quality.py --measure`'s machinery: one tiny case solved on `local4`, both plans
written as plan files, trained interleaved on four gloo processes, and the table printed with a
row per plan and the ratio columns. No timing is asserted (the machine is shared): only that the
figures come from the runs (the ratio is the medians' quotient, the prediction is the plan
file's, every rank's peak memory was measured).

The local cluster's profile is a fixed one in a private cache (as in `test_closed_loop`), so the
plans do not vary with the load.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_hardware import fixed_local_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plan_measure  # noqa: E402  (a script's helper beside it, not a package)


@pytest.fixture(autouse=True)
def local_profile(tmp_path: Path) -> Iterator[Path]:
    with fixed_local_profile(tmp_path) as folder:
        yield folder


def test_measure_trains_both_plans_and_prints_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    case = plan_measure.MeasureCase("gpt-tiny", "examples/gpt.py:tiny?batch=4", 4, 0.002, "a tiny check")
    got = plan_measure.main_measure([case], steps=2, repeats=1, time_limit=1.0, timeout_s=300)
    out = capsys.readouterr().out
    assert [(r["case"], r["plan"]) for r in got] == [("gpt-tiny", "solver"), ("gpt-tiny", "grid")]
    solver, grid = got
    assert solver["measured_ratio"] == pytest.approx(grid["measured_step_s"] / solver["measured_step_s"])
    assert solver["predicted_ratio"] == pytest.approx(grid["predicted_step_s"] / solver["predicted_step_s"])
    for r in got:
        assert len(r["measured_steps_s"]) == 1 and r["measured_step_s"] > 0 and r["measured_peak_bytes"] > 0
        assert r["limit_bytes"] == 0.002 * 2**30 and r["within_limit"] == (r["measured_peak_bytes"] <= r["limit_bytes"])
        # planned for 95% of the limit (the local headroom for the memory model's error): it fits when run
        assert r["predicted_peak_bytes"] <= 0.95 * r["limit_bytes"] and r["within_limit"]
    for text in ("measured grid/solver", "predicted grid/solver", "measured peak", "within limit",
                 "│ gpt-tiny │ solver │", "│ gpt-tiny │ grid   │", f"{solver['measured_ratio']:.3f}"):
        assert text in out, f"{text!r} not in the table:\n{out}"


def test_an_unknown_case_is_named() -> None:
    with pytest.raises(SystemExit, match=r"unknown case\(s\) \['nope'\]; the cases are \['gpt-4l', 'gpt-4l-zero'"):
        plan_measure.select(["nope"])
