"""Calibrating the GPU compute model: measured matmuls against a preset's efficiency curve.

The cost model charges a matmul of F FLOPs moving B bytes
`max(F / rate(F), B / memory_bandwidth) + kernel_latency` with
`rate(F) = peak(dtype) * matmul_efficiency * F / (F + matmul_half_flops)` (`hardware.DeviceSpec`).
Without the roofline and latency terms that is a straight line in F:
`t - kernel_latency = F / (peak * e) + h / (peak * e)`; so the curve is fitted by weighted least
squares of `t - kernel_latency` on F (weights 1/t^2: relative errors count, small and large
matmuls alike), giving `e = 1 / (slope * peak)` and `h = intercept / slope`, per dtype. Points
where the latency is more than 80% of the measured time say nothing about the curve and are left
out of the fit (they are still tabled). A fitted efficiency above 1 means the preset's peak is
too low for that dtype; it is reported as measured and capped at 1 in `fitted_device`.

Timing (`time_matmul`): the shapes the model's own matmuls have (`model_shapes`: every
`linear` and batched `matmul` of the traced graph, forward and, for `linear`, the two backward
matmuls of the same size) and a sweep of square sizes; each timed as back-to-back calls,
median of three trials, CUDA events on a GPU and the wall clock on the CPU: only the device
string differs, so the tests run the very code a GPU run does on tiny sizes.

The result is data (`calibrate`, `run_gpu_calibration`); `gpu_markdown.report_section` writes it
as markdown. `shardc.study.gpu_report` runs it after a study, predicts the plans again on the
fitted curve and adds them to the study's report.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shardc.calibration.fit import fit_linear
from shardc.calibration.gpu_markdown import report_section
from shardc.hardware import Cluster, DeviceSpec, make_cluster, preset
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import element_bytes, precision, torch_dtype

DEFAULT_SIZES = (256, 512, 1024, 2048, 4096, 8192)
CPU_SIZES = (64, 128, 256, 512)
LATENCY_SHARE = 0.8  # points whose time is more than this share of kernel latency are not fitted


# ---- which preset a GPU is -----------------------------------------------------------------

def preset_for_gpu(name: str, memory_bytes: int | None = None) -> str:
    """shardc's preset for a GPU as `torch.cuda.get_device_name()` names it: "NVIDIA H200" ->
    H200, any H100 -> H100-SXM (the only Hopper 80 GB preset), an A100 with under 60 GiB (by name
    or `memory_bytes`) -> A100-40GB, other A100s -> A100-80GB, V100 -> V100-32GB."""
    upper = name.upper()
    if "H200" in upper:
        return "H200"
    if "H100" in upper or "H800" in upper:
        return "H100-SXM"
    if "A100" in upper or "A800" in upper:
        small = "40GB" in upper or (memory_bytes is not None and memory_bytes < 60 * (1 << 30) and "80GB" not in upper)
        return "A100-40GB" if small else "A100-80GB"
    if "V100" in upper:
        return "V100-32GB"
    raise ShardcError(f"no shardc preset for GPU {name!r}; known: H200, H100, A100 (40/80 GB), V100",
                      hint="name one with --cluster, e.g. --cluster H100-SXM")


def preset_name(cluster: str) -> str:
    """The preset in a cluster text: `H200`, `8xH200` and `2x8xH200` all name H200."""
    match = re.match(r"^(?:\d+\s*[xX]\s*){0,2}(.+)$", cluster.strip())
    name = match.group(1) if match else cluster.strip()
    return preset(name).device.name  # a ShardcError naming the known presets for an unknown one


def detected_preset(device: Any = 0) -> str:
    """The preset of the visible GPU `device` (see `preset_for_gpu`)."""
    import torch

    if not torch.cuda.is_available():
        raise ShardcError("--device cuda: no CUDA device is visible", hint="use --device cpu")
    props = torch.cuda.get_device_properties(device)
    return preset_for_gpu(props.name, int(props.total_memory))


def gpu_study_cluster(nproc: int, cluster: str | None = None) -> Cluster:
    """One node of `nproc` GPUs of the preset `cluster` names (`H200`, `8xH200`), else of the
    visible GPU's preset: what a study on `--device cuda` predicts against."""
    name = preset_name(cluster) if cluster else detected_preset()
    return make_cluster(name, 1, nproc)


# ---- shapes and timing -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class MatmulShape:
    """`batch` independent (m x k) @ (k x n) products; `kind` linear (x @ w.T, one weight) or matmul."""

    label: str
    m: int
    n: int
    k: int
    batch: int = 1
    kind: str = "matmul"

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    def nbytes(self, dtype: str) -> float:
        """Bytes read and written once, as the cost model counts a matmul's traffic."""
        weights = 1 if self.kind == "linear" else self.batch
        return float(element_bytes(dtype) * (self.batch * (self.m * self.k + self.m * self.n)
                                            + weights * self.k * self.n))

    @property
    def text(self) -> str:
        return (f"{self.batch}x" if self.batch > 1 else "") + f"{self.m}x{self.n}x{self.k}"


def model_shapes(graph: Any) -> list[MatmulShape]:
    """The distinct matmuls of a traced graph: each `linear` forward (m = rows of x, n out, k in)
    with its input-gradient (m, k, n) and weight-gradient (n, k, m) products, and each batched
    `matmul` (batch dims folded). Labelled by the first module path that has them."""
    seen: dict[tuple, MatmulShape] = {}

    def put(label: str, m: int, n: int, k: int, batch: int, kind: str) -> None:
        key = (kind, batch, m, n, k)
        if key not in seen:
            seen[key] = MatmulShape(label, m, n, k, batch, kind)

    for node in graph.nodes:
        where = node.location.module_path or node.op
        if node.op == "linear":
            x, w = node.inputs[0].type.shape, node.inputs[1].type.shape
            n, k = int(w[0]), int(w[1])
            m = 1
            for d in x[:-1]:
                m *= int(d)
            put(f"{where} fwd", m, n, k, 1, "linear")
            put(f"{where} dgrad", m, k, n, 1, "matmul")
            put(f"{where} wgrad", n, k, m, 1, "matmul")
        elif node.op == "matmul" and node.inputs[0].type.rank >= 2 and node.inputs[1].type.rank >= 2:
            a, b = node.inputs[0].type.shape, node.inputs[1].type.shape
            out = node.outputs[0].type.shape
            m, k, n = int(a[-2]), int(a[-1]), int(b[-1])
            batch = 1
            for d in out[:-2]:
                batch *= int(d)
            put(f"{where} matmul", m, n, k, batch, "matmul")
    return list(seen.values())


def square_shapes(sizes: Iterable[int]) -> list[MatmulShape]:
    return [MatmulShape(f"sweep {s}", s, s, s) for s in sizes]


def time_matmul(shape: MatmulShape, dtype: str, device: str = "cuda", *, budget_s: float = 0.02,
                trials: int = 3, max_calls: int = 500) -> float:
    """Seconds per call of the shape's product in `dtype` on `device`: calls back to back (as a
    training step issues them), the count sized to `budget_s`, median of `trials`; CUDA events
    on a GPU, the wall clock elsewhere."""
    import torch
    import torch.nn.functional as F

    dt = torch_dtype(dtype)
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> Any:  # made on the device: a 50257 x 8192 operand is slow to make on a CPU
        return torch.randn(*shape, generator=g, device=dev, dtype=dt)

    if shape.kind == "linear":
        x, w = rand(shape.batch * shape.m, shape.k), rand(shape.n, shape.k)

        def call() -> Any:
            return F.linear(x, w)
    else:
        a, b = rand(shape.batch, shape.m, shape.k), rand(shape.batch, shape.k, shape.n)

        def call() -> Any:
            return torch.matmul(a, b)

    cuda = dev.type == "cuda"

    def timed(calls: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(dev)
            start.record()
            for _ in range(calls):
                call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - t0) / calls

    timed(2)  # warm-up: cuBLAS heuristics, allocator, clocks
    calls = int(max(3, min(max_calls, budget_s / max(timed(1), 1e-7))))
    return statistics.median(timed(calls) for _ in range(trials))


@dataclass(frozen=True, slots=True)
class Measurement:
    shape: MatmulShape
    dtype: str
    seconds: float
    source: str  # "model" or "sweep"

    @property
    def flops_per_s(self) -> float:
        return self.shape.flops / self.seconds


def measure(shapes: Sequence[tuple[MatmulShape, str]], dtypes: Sequence[str], device: str, *,
            budget_s: float = 0.02) -> list[Measurement]:
    """Every (shape, source) in every dtype, timed on `device`."""
    return [Measurement(s, precision(d), time_matmul(s, d, device, budget_s=budget_s), src)
            for d in dtypes for s, src in shapes]


# ---- the fit ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CurveFit:
    """The efficiency curve fitted for one dtype: `efficiency` may exceed 1 (preset peak too low)."""

    dtype: str
    peak_flops: float
    efficiency: float
    half_flops: float
    points: int


def predicted_seconds(shape: MatmulShape, dtype: str, device: DeviceSpec) -> float:
    """The cost model's charge for one forward matmul of `shape` (`cost.compute.kernel_time` +
    the device's kernel latency)."""
    from shardc.cost.compute import kernel_time

    return kernel_time(shape.flops, shape.nbytes(dtype), device, dtype, matmul=True) + device.kernel_latency


def fit_curve(points: Sequence[tuple[float, float]], peak: float, latency: float, dtype: str = "") -> CurveFit:
    """Fit `t - latency = (F + h) / (peak * e)` to (FLOPs, seconds) points (see the module doc)."""
    rows = [(f, t - latency) for f, t in points if f > 0 and t > 0 and t - latency > (1 - LATENCY_SHARE) * t]
    if len(rows) < 2 or len({f for f, _ in rows}) < 2:
        raise ShardcError(f"fitting the {dtype or 'matmul'} efficiency curve needs two or more matmul sizes whose "
                          f"time is not mostly kernel latency ({latency * 1e6:.1f} us); got {len(rows)}",
                          hint="add larger sizes to the sweep")
    flops, seconds = [f for f, _ in rows], [t for _, t in rows]
    weights = [1.0 / (t * t) for t in seconds]
    intercept, slope = fit_linear(flops, seconds, weights)
    if slope <= 0 or intercept < 0:  # no fixed cost (or noise): a line through the origin
        intercept, slope = fit_linear(flops, seconds, weights, intercept=False)
    return CurveFit(dtype, peak, 1.0 / (slope * peak), intercept / slope, len(rows))


def fitted_device(device: DeviceSpec, fit: CurveFit) -> DeviceSpec:
    """`device` with the fitted curve (efficiency capped at 1, as DeviceSpec requires)."""
    return replace(device, matmul_efficiency=min(1.0, fit.efficiency), matmul_half_flops=fit.half_flops)


def calibrate(measurements: Sequence[Measurement], device: DeviceSpec) -> dict[str, Any]:
    """Per dtype the fitted curve beside the preset's, and per measurement the preset's and the
    fit's predicted time and their errors ((predicted - measured) / measured)."""
    fits: dict[str, Any] = {}
    rows = []
    for dtype in dict.fromkeys(m.dtype for m in measurements):
        mine = [m for m in measurements if m.dtype == dtype]
        try:
            fit = fit_curve([(m.shape.flops, m.seconds) for m in mine], device.peak(dtype), device.kernel_latency, dtype)
        except ShardcError as err:
            fits[dtype] = {"error": err.message}
            fit = None
        better = fitted_device(device, fit) if fit is not None else None
        preset_err: list[float] = []
        fitted_err: list[float] = []
        for m in mine:
            pred = predicted_seconds(m.shape, dtype, device)
            refit = predicted_seconds(m.shape, dtype, better) if better is not None else None
            row: dict[str, Any] = {"label": m.shape.label, "shape": m.shape.text, "kind": m.shape.kind, "source": m.source,
                   "dtype": dtype, "flops": m.shape.flops, "measured_s": m.seconds,
                   "measured_tflops": m.flops_per_s / 1e12, "preset_s": pred, "preset_tflops": m.shape.flops / pred / 1e12,
                   "preset_error": (pred - m.seconds) / m.seconds,
                   "fitted_s": refit, "fitted_error": None if refit is None else (refit - m.seconds) / m.seconds}
            rows.append(row)
            preset_err.append(abs(pred - m.seconds) / m.seconds)
            if refit is not None:
                fitted_err.append(abs(refit - m.seconds) / m.seconds)
        if fit is not None:
            fits[dtype] = {**asdict(fit), "preset_efficiency": device.matmul_efficiency,
                           "preset_half_flops": device.matmul_half_flops,
                           "best_measured_tflops": max(m.flops_per_s for m in mine) / 1e12,
                           "median_abs_preset_error": statistics.median(preset_err),
                           "median_abs_fitted_error": statistics.median(fitted_err) if fitted_err else None}
    return {"device": device.name, "kernel_latency_s": device.kernel_latency, "fits": fits, "rows": rows}


def environment(device: str) -> dict[str, str]:
    import torch

    env = {"device": device, "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def run_gpu_calibration(model_spec: str | None, device_spec: DeviceSpec, *, device: str = "cuda",
                        dtypes: Sequence[str] = ("bf16", "fp32"), sizes: Sequence[int] = DEFAULT_SIZES,
                        out_dir: str | Path | None = None, budget_s: float = 0.02) -> dict[str, Any]:
    """Time the model's matmul shapes and the square `sizes` in `dtypes` on `device`, fit against
    `device_spec` (`calibrate`); with `out_dir`, write `gpu-calibration.json` and `.md` there."""
    shapes: list[tuple[MatmulShape, str]] = []
    if model_spec:
        from shardc.frontend import trace
        from shardc.frontend.spec import load_model

        loaded = load_model(model_spec, device="meta")
        graph = trace(loaded.model, loaded.example_inputs, name=loaded.name, input_names=loaded.input_names)
        shapes += [(s, "model") for s in model_shapes(graph)]
    shapes += [(s, "sweep") for s in square_shapes(sizes)]
    result = calibrate(measure(shapes, dtypes, device, budget_s=budget_s), device_spec)
    result["environment"] = environment(device)
    result["model"] = model_spec
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu-calibration.json").write_text(json.dumps(result, indent=1))
        (out / "gpu-calibration.md").write_text(report_section(result))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m shardc.calibration.gpu [--model SPEC] [--device cuda] [--preset H200] --out DIR`."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m shardc.calibration.gpu")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default=None, help="default: the visible GPU's preset")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    p.add_argument("--budget", type=float, default=0.02, help="seconds of calls per timing trial")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.device == "cpu":  # one thread, as the CPU study runs (and no oversubscribed thread pool)
        import torch

        torch.set_num_threads(1)
    name = preset_name(args.preset) if args.preset else detected_preset()
    result = run_gpu_calibration(args.model, preset(name).device, device=args.device, dtypes=args.dtypes.split(","),
                                 sizes=[int(x) for x in args.sizes.split(",") if x], out_dir=args.out,
                                 budget_s=args.budget)
    print(report_section(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
