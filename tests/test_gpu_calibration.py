"""The GPU compute-model calibration (`shardc.calibration.gpu`, `gpu_markdown`, the study's
`gpu_report`), on the CPU.

The fit is checked on synthetic timings made from a known efficiency curve (exact, noisy,
latency-dominated, and from the preset itself); the timing code runs for real on the CPU on
tiny sizes, the same code a GPU run executes with `device="cuda"`.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from shardc.calibration.gpu import (
    MatmulShape,
    Measurement,
    calibrate,
    fit_curve,
    fitted_device,
    gpu_study_cluster,
    model_shapes,
    predicted_seconds,
    preset_for_gpu,
    preset_name,
    run_gpu_calibration,
    square_shapes,
    time_matmul,
)
from shardc.calibration.gpu_markdown import report_section
from shardc.hardware import preset
from shardc.ir.diagnostics import ShardcError
from shardc.study.gpu_report import append_to_report, calibrate_study, plans_section, repredict_plans

H200 = preset("H200").device


def _curve_time(flops: float, peak: float, eff: float, half: float, latency: float) -> float:
    return (flops + half) / (peak * eff) + latency


def test_fit_recovers_a_known_curve_exactly() -> None:
    peak, latency = 989e12, 4e-6
    points = [(2.0 * s ** 3, _curve_time(2.0 * s ** 3, peak, 0.62, 5e9, latency)) for s in (512, 1024, 2048, 4096, 8192)]
    fit = fit_curve(points, peak, latency, "bf16")
    assert fit.efficiency == pytest.approx(0.62, rel=1e-9)
    assert fit.half_flops == pytest.approx(5e9, rel=1e-9)
    assert fit.points == 5


def test_fit_with_noise_is_close_and_latency_bound_points_are_left_out() -> None:
    rng = random.Random(0)
    peak, latency = 67e12, 4e-6
    points = [(2.0 * s ** 3, _curve_time(2.0 * s ** 3, peak, 0.8, 2e9, latency) * (1 + rng.uniform(-0.03, 0.03)))
              for s in (1024, 2048, 4096, 8192)]
    tiny = [(2.0 * 8 ** 3, latency * 1.05), (2.0 * 16 ** 3, latency * 1.1)]  # >80% latency: not fitted
    fit = fit_curve(points + tiny, peak, latency)
    assert fit.points == 4
    assert fit.efficiency == pytest.approx(0.8, rel=0.05)


def test_fit_needs_two_sizes_above_latency_and_falls_back_to_no_fixed_cost() -> None:
    with pytest.raises(ShardcError, match="two or more matmul sizes"):
        fit_curve([(1e9, 1e-3), (1e9, 1.1e-3)], 1e12, 0.0, "fp32")
    # Times that fall faster than linear would need a negative fixed cost: fit through the origin.
    fit = fit_curve([(1e9, 1e-3), (4e9, 5e-3)], 1e12, 0.0)
    assert fit.half_flops == 0.0 and 0 < fit.efficiency


def test_calibrate_against_the_preset_itself_has_no_error_and_a_slow_gpu_is_reported() -> None:
    shapes = square_shapes((1024, 4096, 8192))
    exact = [Measurement(s, "bf16", predicted_seconds(s, "bf16", H200), "sweep") for s in shapes]
    result = calibrate(exact, H200)
    assert all(abs(r["preset_error"]) < 1e-12 for r in result["rows"])
    fit = result["fits"]["bf16"]
    assert fit["efficiency"] == pytest.approx(H200.matmul_efficiency, rel=1e-6)
    assert fit["half_flops"] == pytest.approx(H200.matmul_half_flops, rel=1e-6)
    slow = replace(H200, matmul_efficiency=0.5)  # a GPU that reaches 50% where the preset says 75%
    measured = [Measurement(s, "bf16", predicted_seconds(s, "bf16", slow), "sweep") for s in shapes]
    result = calibrate(measured, H200)
    assert result["fits"]["bf16"]["efficiency"] == pytest.approx(0.5, rel=1e-3)
    assert all(r["preset_error"] < 0 for r in result["rows"])  # the preset predicts too fast
    assert all(abs(r["fitted_error"]) < 1e-3 for r in result["rows"])
    text = report_section(result)
    assert "H200 preset" in text and "reach 50% of the 989 TFLOP/s peak where the preset assumes 75%" in text
    assert fitted_device(H200, replace(_fit_of(result), efficiency=1.3)).matmul_efficiency == 1.0


def _fit_of(result: dict):
    from shardc.calibration.gpu import CurveFit

    f = result["fits"]["bf16"]
    return CurveFit("bf16", f["peak_flops"], f["efficiency"], f["half_flops"], f["points"])


def test_model_shapes_of_the_gpt_example() -> None:
    from shardc.frontend import trace
    from shardc.frontend.spec import load_model

    loaded = load_model("examples/gpt.py:tiny?batch=4", device="meta")
    graph = trace(loaded.model, loaded.example_inputs, name=loaded.name, input_names=loaded.input_names)
    shapes = model_shapes(graph)
    kinds = {s.kind for s in shapes}
    assert kinds == {"linear", "matmul"}
    fwd = [s for s in shapes if s.label.endswith("fwd")]
    assert all(s.m == 4 * 16 for s in fwd)  # batch x seq rows
    assert any(s.batch > 1 for s in shapes)  # attention's batched matmuls
    assert len({(s.kind, s.batch, s.m, s.n, s.k) for s in shapes}) == len(shapes)


def test_gpu_names_map_to_presets() -> None:
    assert preset_for_gpu("NVIDIA H200") == "H200"
    assert preset_for_gpu("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert preset_for_gpu("NVIDIA A100-SXM4-40GB") == "A100-40GB"
    assert preset_for_gpu("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert preset_for_gpu("NVIDIA A100 PCIe", 40 * (1 << 30)) == "A100-40GB"
    assert preset_for_gpu("Tesla V100-SXM2-32GB") == "V100-32GB"
    with pytest.raises(ShardcError, match="no shardc preset for GPU 'NVIDIA GeForce RTX 4090'"):
        preset_for_gpu("NVIDIA GeForce RTX 4090")
    assert preset_name("8xH200") == preset_name("H200") == "H200"
    assert preset_name("2x8xH100") == "H100-SXM"
    assert gpu_study_cluster(2, "H200").num_devices == 2
    with pytest.raises(ShardcError, match="unknown cluster preset"):
        preset_name("1xB300")


def test_timing_runs_on_the_cpu_with_the_code_a_gpu_runs(tmp_path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = time_matmul(MatmulShape("t", 32, 16, 8, batch=2), "fp32", "cpu", budget_s=0.001, trials=1)
        assert 0 < t < 0.5
        result = run_gpu_calibration(None, H200, device="cpu", dtypes=["fp32", "bf16"], sizes=[16, 32, 64],
                                     out_dir=tmp_path, budget_s=0.001)
    finally:
        torch.set_num_threads(threads)
    assert {r["dtype"] for r in result["rows"]} == {"fp32", "bf16"}
    assert all(r["measured_s"] > 0 for r in result["rows"])
    assert result["environment"]["device"] == "cpu"
    assert (tmp_path / "gpu-calibration.json").exists()
    assert "measured matmuls against the H200 preset" in (tmp_path / "gpu-calibration.md").read_text()


def test_a_study_keeps_its_calibration_and_its_report_gets_the_section(tmp_path) -> None:
    data: dict = {"gpu_calibration": {}}
    (tmp_path / "report.md").write_text("# study\n")
    assert not append_to_report(data, tmp_path)
    threads = torch.get_num_threads()
    calibrate_study(data, None, lambda n: gpu_study_cluster(n, "H200"), [1, 2], tmp_path, device="cpu", sizes=[16, 32])
    assert torch.get_num_threads() == threads
    first = data["gpu_calibration"]
    calibrate_study(data, None, lambda n: gpu_study_cluster(n, "H200"), [1], tmp_path, device="cpu")  # kept
    assert data["gpu_calibration"] is first and [r["dtype"] for r in first["rows"]] == ["fp32", "fp32"]
    assert append_to_report(data, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("# study\n") and "## GPU compute model" in text and "| sweep | sweep 32 | 32x32x32 |" in text


def test_plans_are_predicted_again_on_the_fitted_curve() -> None:
    shapes = square_shapes((1024, 4096, 8192))
    slow = replace(H200, matmul_efficiency=0.5)
    data: dict = {"gpu_calibration": calibrate(
        [Measurement(s, "fp32", predicted_seconds(s, "fp32", slow), "sweep") for s in shapes], H200),
        "plans": [{"plan": "dp=1,mb=4", "status": "ok", "measured_step_time_s": 2e-3, "predicted_step_time_s": 1.5e-3},
                  {"plan": "dp=1,mb=2", "status": "error"}]}
    seen = []

    def step_time(sp, device) -> float:  # stands for the cost model: time falls as efficiency rises
        seen.append((sp.plan.mb, device.matmul_efficiency))
        return 1e-3 / device.matmul_efficiency

    rows = repredict_plans(data, H200, step_time)
    assert seen == [(4, pytest.approx(0.5, rel=1e-3))]
    assert rows == data["gpu_calibration"]["plans"] and len(rows) == 1
    assert rows[0]["plan"] == "mb=4" and rows[0]["preset_error"] == pytest.approx(-0.25)
    assert rows[0]["fitted_s"] == pytest.approx(2e-3, rel=1e-3) and abs(rows[0]["fitted_error"]) < 1e-3
    assert "| mb=4 | 2.00 | 1.50 | -25% | 2.00 | +0% |" in plans_section(rows)
    assert "| mb=4 |" not in report_section(data["gpu_calibration"]) and plans_section([]) == ""
