"""One prepared check of everything GPU-related, for a short lease of a 1-GPU machine.

Steps (each bounded in time; a failing step is recorded and the next one runs):
1. environment: torch, CUDA, NCCL, the GPU and the shardc preset it maps to;
2. run: `shardc run examples/gpt.py:tiny --nproc 1 --steps 5 --json` (NCCL on `cuda:0`, peak
   memory from the CUDA allocator, predicted on the GPU preset);
3. numerics: the GPT example's one-device plans (dp=1; micro-batches; full recomputation)
   trained 3 AdamW steps by shardc in one NCCL process on the GPU, fp32 (TF32 off), against
   the same training of the plain model on the CPU: losses and parameters, with the largest
   relative difference;
4. calibration: `python -m shardc.calibration.gpu` on GPT-2 small's matmul shapes and
   square sizes to 8192, bf16 and fp32, against the preset;
5. study: `shardc study --device cuda --nproc 1 --sweep recompute,mb --calibrate-matmuls` on a
   4-layer GPT (the report includes the calibration on the study model's shapes, and each plan
   predicted again on the fitted curve);
6. run-too-many: `shardc run --nproc <GPUs + 1>` must stop with the "one GPU per process" error.
All steps share one time budget (`--budget`, 480 s): each step's limit is cut to what is left,
and a step that would start with under 20 s left is recorded as skipped.

`--cpu-dry-run` runs every step with the device string `cpu` (gloo; step 3 forced with
`SHARDC_DEVICE=cuda`, which fails the same way on a machine with no GPU; small sizes), to prove
the script itself works where there is no GPU. Writes five files under `--out`:
`gpu_check.json` (every result), `gpu_check.md` (the summary and the calibration tables),
`gpu_check.log` (each step's output), `gpu-calibration.json` and `study.tar.gz` (the study's
report folder); working folders go to `--work` (a temporary folder): a lease brings back at
most 8 files, none deeper than two folders.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TINY = "examples/gpt.py:tiny?batch=4"
STUDY_MODEL = {"cuda": "examples/gpt.py:gpt?n_layer=4&n_embd=512&n_head=8&vocab_size=8192&seq=256&batch=8",
               "cpu": "examples/gpt.py:gpt?n_layer=2&n_embd=64&n_head=4&vocab_size=256&seq=32&batch=8"}
CALIBRATION = {"cuda": ("examples/gpt.py:gpt2_small", "256,512,1024,2048,4096,8192", "0.02"),
               "cpu": (TINY, "32,64,128", "0.002")}
NUMERICS_PLANS = ("dp=1", "dp=1,mb=2", "dp=1,recompute=full")
STEPS, LR, EPS = 3, 1e-3, 1e-4


class Log:
    """The log file, and the deadline every step's time limit is cut to."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.file = open(path, "w")  # noqa: SIM115 - closed by main
        self.deadline = time.monotonic() + budget_s

    def limit(self, seconds: float) -> float:
        """`seconds`, or what is left of the budget when that is less."""
        return max(1.0, min(seconds, self.deadline - time.monotonic()))

    def write(self, text: str) -> None:
        self.file.write(text if text.endswith("\n") else text + "\n")
        self.file.flush()


def shardc(args: list[str], log: Log, timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """`python -m shardc.cli ARGS` with a time limit; (exit code, stdout), both logged."""
    cmd = [sys.executable, "-m", "shardc.cli", *args]
    log.write(f"$ {' '.join(cmd)}")
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=log.limit(timeout),
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as err:
        log.write(f"timed out after {timeout:.0f} s\n{err.stdout or ''}{err.stderr or ''}")
        return -9, ""
    log.write(done.stdout[-20000:] + done.stderr[-20000:])
    return done.returncode, done.stdout


# ---- the steps ----------------------------------------------------------------------------------

def step_environment(device: str) -> dict[str, Any]:
    import torch

    import shardc

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
                           "shardc": str(Path(shardc.__file__).resolve().parent), "device": device,
                           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if device == "cuda":
        from shardc.calibration.gpu import detected_preset

        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env["memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as err:  # a report, not a reason to stop
            env["nccl"] = f"unknown ({type(err).__name__})"
        env["preset"] = detected_preset()
    env["ok"] = device == "cpu" or env["gpus"] >= 1
    return env


def step_run(device: str, preset: str | None, log: Log) -> dict[str, Any]:
    args = ["run", "examples/gpt.py:tiny", "--nproc", "1", "--steps", "5", "--json"]
    args += ["--cluster", f"1x{preset}"] if preset else []
    code, out = shardc(args, log, 180)
    if code != 0:
        return {"ok": False, "exit_code": code}
    summary = json.loads(out[out.index("{"):])
    want = "nccl" if device == "cuda" else "gloo"
    losses = summary["losses"]
    rank = summary["ranks"][0]
    checks = {"backend": summary["backend"] == want, "losses_finite": all(math.isfinite(x) for x in losses),
              "loss_falls": losses[-1] < losses[0], "peak_memory_measured": rank["peak_memory_bytes"] > 0}
    return {"ok": all(checks.values()), "checks": checks, "summary": summary}


def step_run_too_many(device: str, gpus: int, log: Log) -> dict[str, Any]:
    nproc = gpus + 1
    env = {"SHARDC_DEVICE": "cuda"} if device == "cpu" else {}
    code, _ = shardc(["run", "examples/gpt.py:tiny", "--nproc", str(nproc), "--steps", "1", "--plan", f"dp={nproc}"],
                     log, 120, env)
    text = log_tail(log)
    wanted = f"CUDA needs one GPU per process: {nproc} processes asked for, {gpus} GPUs visible"
    return {"ok": code != 0 and wanted in text, "exit_code": code, "expected_message": wanted}


def log_tail(log: Log) -> str:
    path = Path(log.file.name)
    return path.read_text()[-4000:]


def numerics_worker(rank: int, world: int, plans: tuple[str, ...]) -> list[Any]:
    """In one NCCL (or gloo) process: each plan compiled and trained by shardc on this rank's device."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import shardc
    from shardc.frontend.spec import load_model

    out = []
    for plan in plans:
        torch.manual_seed(0)
        loaded = load_model(TINY, device="cpu")
        compiled = shardc.compile(loaded.model, tuple(loaded.example_inputs), plan=plan,
                                  input_names=loaded.input_names)
        module = compiled.parallelize(loaded.model)
        device = next(module.parameters()).device
        losses = _train(module, _batches(loaded.example_inputs, device))
        full = compiled.full_state_dict(module)
        out.append((plan, str(device), losses, {k: v.detach().cpu().clone() for k, v in full.items()}))
    return out


def _batches(inputs: Any, device: Any) -> list[tuple[Any, ...]]:
    import torch

    g = torch.Generator().manual_seed(1234)
    return [tuple(torch.randint(0, 128, x.shape, generator=g).to(device) for x in inputs) for _ in range(STEPS)]


def _train(module: Any, data: list[tuple[Any, ...]]) -> list[float]:
    import torch

    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS)
    losses = []
    for batch in data:
        loss = module(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def step_numerics(device: str, log: Log) -> dict[str, Any]:
    import torch

    from shardc.backends.torch.launch import spawn
    from shardc.frontend.spec import load_model

    torch.manual_seed(0)
    loaded = load_model(TINY, device="cpu")
    ref_losses = _train(loaded.model, _batches(loaded.example_inputs, "cpu"))
    ref = {k: v.detach() for k, v in loaded.model.named_parameters()}
    results = spawn(numerics_worker, 1, NUMERICS_PLANS, timeout_s=log.limit(240), device=device)[0]
    # One GPU process against the CPU: different kernels and summation orders, so the bar is
    # 1e-4 relative (the CPU-vs-CPU multi-process tests hold 1e-5); the largest gaps are reported.
    rtol = 1e-5 if device == "cpu" else 1e-4
    cases = []
    for plan, where, losses, full in results:
        loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        param_rel = max(float(((full[k] - v).abs() / (v.abs() + 1e-3)).max()) for k, v in ref.items())
        close = all(torch.allclose(full[k], v, rtol=rtol, atol=rtol / 10) for k, v in ref.items())
        cases.append({"plan": plan, "device": where, "losses": losses, "reference_losses": ref_losses,
                      "max_loss_rel_diff": loss_rel, "max_param_rel_diff": param_rel, "rtol": rtol,
                      "ok": loss_rel <= rtol and close and where.startswith(device)})
    return {"ok": all(c["ok"] for c in cases), "cases": cases}


def step_study(device: str, out: Path, work: Path, log: Log) -> dict[str, Any]:
    study = work / "study"
    args = ["study", STUDY_MODEL[device], "--nproc", "1", "--sweep", "recompute,mb", "--device", device,
            "--out", str(study), "--steps", "3", "--warmup", "2", "--calibrate-matmuls"]
    code, _ = shardc(args, log, 300)
    results = study / "results.json"
    if not results.exists():
        return {"ok": False, "exit_code": code}
    data = json.loads(results.read_text())
    plans = [{k: p.get(k) for k in ("plan", "status", "measured_step_time_s", "predicted_step_time_s",
                                     "step_time_error", "measured_peak_memory_bytes", "predicted_peak_memory_bytes",
                                     "memory_errors", "error")} for p in data["plans"]]
    ran = [p for p in data["plans"] if p["status"] == "ok"]
    devices = {r.get("device") for p in ran for r in p.get("ranks", [])}
    checks = {"exit_code_0": code == 0, "plans_ran": len(ran) == len(data["plans"]) and bool(ran),
              "report_written": (study / "report.md").exists(),
              "calibration_in_report": "GPU compute model" in (study / "report.md").read_text(),
              "plans_repredicted": len(data.get("gpu_calibration", {}).get("plans", [])) == len(ran)}
    with tarfile.open(out / "study.tar.gz", "w:gz") as tar:
        tar.add(study, arcname="study")
    return {"ok": all(checks.values()), "checks": checks, "plans": plans, "devices": sorted(map(str, devices)),
            "gpu_calibration": data.get("gpu_calibration", {}).get("fits"),
            "repredicted": data.get("gpu_calibration", {}).get("plans")}


def step_calibration(device: str, preset: str, out: Path, work: Path, log: Log) -> dict[str, Any]:
    model, sizes, budget = CALIBRATION[device]
    target = work / "calibration"
    args = ["--model", model, "--device", "cuda:0" if device == "cuda" else "cpu", "--preset", preset,
            "--sizes", sizes, "--budget", budget, "--out", str(target)]
    cmd = [sys.executable, "-m", "shardc.calibration.gpu", *args]
    log.write(f"$ {' '.join(cmd)}")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=log.limit(240))
    log.write(done.stdout[-20000:] + done.stderr[-20000:])
    path = target / "gpu-calibration.json"
    if done.returncode != 0 or not path.exists():
        return {"ok": False, "exit_code": done.returncode}
    data = json.loads(path.read_text())
    shutil.copy(path, out / "gpu-calibration.json")
    return {"ok": bool(data["rows"]), "fits": data["fits"], "markdown": (target / "gpu-calibration.md").read_text()}


# ---- driver -------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-dry-run", action="store_true", help="every step on the CPU (gloo), small sizes")
    p.add_argument("--out", default=os.environ.get("OUT", "out/gpu-check"))
    p.add_argument("--work", default=None, help="working folder (default: a new temporary folder)")
    p.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all steps; later steps are skipped")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu_dry_run else "cuda"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if device == "cpu":
        os.environ["SHARDC_DEVICE"] = "cpu"  # gloo even where a GPU is visible
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    log = Log(out / "gpu_check.log", args.budget)
    report: dict[str, Any] = {"device": device, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "work": str(work),
                              "steps": {}}
    env = _guarded(report, "environment", lambda: step_environment(device), log)
    preset = (env or {}).get("preset") if device == "cuda" else None
    gpus = int((env or {}).get("gpus", 0)) if device == "cuda" else 0
    steps = {  # the most telling first: a short budget cuts the end
        "run": lambda: step_run(device, preset, log),
        "numerics": lambda: step_numerics(device, log),
        "calibration": lambda: step_calibration(device, preset or "H200", out, work, log),
        "study": lambda: step_study(device, out, work, log),
        "run-too-many": lambda: step_run_too_many(device, gpus, log),
    }
    only = {s for s in args.only.split(",") if s}
    for name, fn in steps.items():
        if only and name not in only:
            continue
        if log.deadline - time.monotonic() < 20:
            report["steps"][name] = {"ok": False, "error": f"skipped: the {args.budget:.0f} s budget is spent"}
            continue
        _guarded(report, name, fn, log)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    summary = _summary(report)
    (out / "gpu_check.md").write_text(summary)
    print(summary)
    log.file.close()
    return 0 if all(s.get("ok") for s in report["steps"].values()) else 1


def _guarded(report: dict[str, Any], name: str, fn: Any, log: Log) -> dict[str, Any] | None:
    import traceback

    print(f"[gpu_check] {name} ...", flush=True)
    log.write(f"==== {name}")
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as err:
        result = {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.perf_counter() - start, 1)
    report["steps"][name] = result
    (Path(log.file.name).parent / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"[gpu_check] {name}: {'ok' if result.get('ok') else 'FAILED'} ({result['seconds']} s)"
          + (f" {result['error']}" if "error" in result else ""), flush=True)
    return result


def _summary(report: dict[str, Any]) -> str:
    steps = report["steps"]
    lines = [f"# GPU check ({report['device']}, started {report['started']})", "",
             "| step | result | seconds | notes |", "|---|---|---|---|"]
    for name, s in steps.items():
        lines.append(f"| {name} | {'ok' if s.get('ok') else 'FAILED'} | {s.get('seconds')} | {_note(name, s)} |")
    cal = steps.get("calibration", {}).get("markdown")
    return "\n".join(lines) + "\n" + ("\n" + cal if cal else "")


def _note(name: str, s: dict[str, Any]) -> str:
    if "error" in s:
        return s["error"].splitlines()[0][:200]
    if name == "environment":
        return ", ".join(f"{k} {s[k]}" for k in ("gpu", "preset", "torch", "cuda", "nccl") if s.get(k)) or "cpu"
    if name == "run" and "summary" in s:
        r = s["summary"]
        pred = r["predicted_step_time_s"]
        return (f"{r['backend']}; step {r['measured_step_time_s'] * 1e3:.1f} ms (predicted "
                f"{'-' if pred is None else f'{pred * 1e3:.1f} ms'}); peak {r['ranks'][0]['peak_memory_bytes']} B "
                f"(predicted {r['ranks'][0]['predicted_peak_memory_bytes']}); checks {s['checks']}")
    if name == "numerics" and "cases" in s:
        return "; ".join(f"{c['plan']} on {c['device']}: loss {c['max_loss_rel_diff']:.1e}, params "
                         f"{c['max_param_rel_diff']:.1e}" for c in s["cases"])
    if name == "study" and "plans" in s:
        from shardc.study.plans import label

        return "; ".join(f"{label(p['plan'])}: {p['status']}" + (f" time err {p['step_time_error']:+.0%}, memory err "
                         f"{max(abs(e or 0) for e in p['memory_errors']):.1%}" if p["status"] == "ok" else "")
                         for p in s["plans"])
    if name == "calibration" and "fits" in s:
        return "; ".join(f"{d}: efficiency {f.get('efficiency', float('nan')):.3g} vs preset "
                         f"{f.get('preset_efficiency', float('nan')):.2f}" for d, f in s["fits"].items())
    return str({k: v for k, v in s.items() if k not in ("ok", "seconds")})[:200]


if __name__ == "__main__":
    raise SystemExit(main())
