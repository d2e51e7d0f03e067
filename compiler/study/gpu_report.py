"""The GPU calibration in a study: run after the sweep, plans predicted again, the report section.

After `shardc study --device cuda` (or `--calibrate-matmuls` on the CPU) the model's matmuls and
a size sweep are timed against the device spec the plans were predicted on
(`shardc.calibration.gpu`); every plan that ran is then predicted again with the fitted
efficiency curve in place of the preset's, and the report gets the calibration's section
(`shardc.calibration.gpu_markdown`: how far the preset was off per dtype and per matmul) and,
per plan, the step time measured, predicted on the preset and on the fitted curve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardc.calibration.gpu import (
    CPU_SIZES,
    DEFAULT_SIZES,
    CurveFit,
    fitted_device,
    run_gpu_calibration,
)
from shardc.calibration.gpu_markdown import report_section
from shardc.hardware import Cluster, DeviceSpec
from shardc.ir.dtypes import precision


def plans_section(rows: Sequence[dict[str, Any]]) -> str:
    """The report's table of each plan that ran (`repredict_plans`' rows): its step time measured,
    predicted on the preset and on the fitted curve; empty without rows."""
    if not rows:
        return ""
    lines = ["", "Step time of each plan that ran, predicted on the preset and on the preset with the fitted "
             "curve (ms):", "", "| plan | measured | preset | error | fitted curve | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['plan']} | {r['measured_s'] * 1e3:.2f} | {r['preset_s'] * 1e3:.2f} | "
                     f"{r['preset_error']:+.0%} | {r['fitted_s'] * 1e3:.2f} | {r['fitted_error']:+.0%} |")
    return "\n".join(lines) + "\n"


def repredict_plans(data: dict[str, Any], device: DeviceSpec,
                    step_time: Callable[[Any, DeviceSpec], float]) -> list[dict[str, Any]]:
    """Each plan of a study that ran, predicted again with `device`'s curve replaced by the one
    fitted for the plan's dtype (`step_time(study_plan, device) -> seconds`, the cost model);
    kept in `data["gpu_calibration"]["plans"]` beside the measured and preset step times. (A
    device with measured eager costs, the calibrated local CPU, is charged those, not the curve:
    there the prediction does not move.)"""
    from shardc.study.plans import label, parse_study_plan

    fits = data.get("gpu_calibration", {}).get("fits", {})
    rows = []
    for p in data.get("plans", []):
        if p.get("status") != "ok":
            continue
        sp = parse_study_plan(p["plan"])
        fit = fits.get(precision(sp.plan.dtype), {})
        if "efficiency" not in fit:
            continue
        curve = CurveFit(fit["dtype"], fit["peak_flops"], fit["efficiency"], fit["half_flops"], fit["points"])
        fitted = step_time(sp, fitted_device(device, curve))
        measured, preset_s = p["measured_step_time_s"], p["predicted_step_time_s"]
        rows.append({"plan": label(p["plan"]), "measured_s": measured, "preset_s": preset_s, "fitted_s": fitted,
                     "preset_error": (preset_s - measured) / measured, "fitted_error": (fitted - measured) / measured})
    if data.get("gpu_calibration"):
        data["gpu_calibration"]["plans"] = rows
    return rows


def calibrate_study(data: dict[str, Any], model_spec: str | None, cluster_for: Callable[[int], Cluster],
                    nprocs: Sequence[int], out_dir: str | Path, *, device: str = "cuda",
                    sizes: Sequence[int] | None = None) -> None:
    """After a study: its model's matmuls and the size sweep timed against the device spec its
    plans were predicted on (`cluster_for(n).device`): on `cuda:0` in bf16 and fp32, or on the
    CPU in fp32 on one thread (as the study's processes run) with sizes to 512. Kept in
    `data["gpu_calibration"]` (a resumed study keeps the one it has); then every plan that ran is
    predicted again on the fitted curve (`repredict_plans`)."""
    from dataclasses import replace as replaced

    import torch

    from shardc.study.predict import predict

    spec = cluster_for(min(nprocs)).device
    if not data.get("gpu_calibration"):
        if device == "cuda":
            data["gpu_calibration"] = run_gpu_calibration(model_spec, spec, device="cuda:0", out_dir=out_dir,
                                                          sizes=sizes or DEFAULT_SIZES)
        else:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                data["gpu_calibration"] = run_gpu_calibration(model_spec, spec, device="cpu", dtypes=("fp32",),
                                                              sizes=sizes or CPU_SIZES, out_dir=out_dir, budget_s=0.005)
            finally:
                torch.set_num_threads(threads)
    repredict_plans(data, spec, lambda sp, dev: predict(model_spec or data["model"], sp, replaced(
        cluster_for(sp.devices), device=dev))[1]["step_time_s"])


def append_to_report(data: dict[str, Any], out_dir: str | Path) -> bool:
    """Append the calibration section and the plans predicted again on its curve to
    `out_dir/report.md` when the study has a calibration."""
    calibration = data.get("gpu_calibration")
    if not calibration:
        return False
    with open(Path(out_dir) / "report.md", "a") as f:
        f.write("\n" + report_section(calibration) + plans_section(calibration.get("plans", ())))
    return True
