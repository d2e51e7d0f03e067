"""The GPU calibration's result as markdown: the section `python -m shardc.calibration.gpu` prints
and writes beside its JSON, and a study appends to its report (`shardc.study.gpu_report`).

Per dtype the fitted against the preset's efficiency and half-rate FLOPs and the median error of
each, then per matmul the measured and predicted rates.
"""

from __future__ import annotations

from typing import Any


def report_section(result: dict[str, Any]) -> str:
    """The section for `result` (`gpu.calibrate`, `gpu.run_gpu_calibration`): how far the preset was
    off, and the tables."""
    env = result.get("environment", {})
    lines = [f"## GPU compute model: measured matmuls against the {result['device']} preset", ""]
    if env:
        lines += [f"Measured on {env.get('gpu', env.get('device', '?'))} (torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
                  f"device `{env.get('device', '?')}`).", ""]
    lines += ["Model: `t = max(F / (peak * e * F / (F + h)), bytes / bandwidth) + latency`; fitted per dtype by "
              f"least squares on relative error (latency {result['kernel_latency_s'] * 1e6:.1f} us kept).", "",
              "| dtype | peak TFLOP/s | best measured TFLOP/s | efficiency preset / fitted | half FLOPs preset / fitted "
              "| median abs error preset / fitted |", "|---|---|---|---|---|---|"]
    findings = []
    for dtype, f in result["fits"].items():
        if "error" in f:
            lines.append(f"| {dtype} | - | - | no fit: {f['error']} | - | - |")
            continue
        fitted_err = "-" if f["median_abs_fitted_error"] is None else f"{f['median_abs_fitted_error']:.0%}"
        lines.append(f"| {dtype} | {f['peak_flops'] / 1e12:.1f} | {f['best_measured_tflops']:.1f} | "
                     f"{f['preset_efficiency']:.2f} / {f['efficiency']:.2f} | {f['preset_half_flops']:.3g} / "
                     f"{f['half_flops']:.3g} | {f['median_abs_preset_error']:.0%} / {fitted_err} |")
        findings.append(f"{dtype}: the preset's matmul times were off by {f['median_abs_preset_error']:.0%} "
                        f"(median over {sum(1 for r in result['rows'] if r['dtype'] == dtype)} shapes); large "
                        f"matmuls reach {f['efficiency']:.0%} of the {f['peak_flops'] / 1e12:.0f} TFLOP/s peak "
                        f"where the preset assumes {f['preset_efficiency']:.0%}")
    lines += [""] + [f"- {x}." for x in findings]
    lines += ["", "| source | matmul | shape (b x m x n x k) | dtype | measured us | measured TFLOP/s | preset TFLOP/s "
              "| preset error | fitted error |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        fitted = "-" if r["fitted_error"] is None else f"{r['fitted_error']:+.0%}"
        lines.append(f"| {r['source']} | {r['label']} | {r['shape']} | {r['dtype']} | {r['measured_s'] * 1e6:.1f} | "
                     f"{r['measured_tflops']:.2f} | {r['preset_tflops']:.2f} | {r['preset_error']:+.0%} | {fitted} |")
    return "\n".join(lines) + "\n"
