"""The CUDA code paths, checked on a machine with no GPU: what can be checked without one.

Backend choice (NCCL only with one GPU per process, a clear error otherwise), `shardc run` and
`shardc study --device cuda` refusing to run on too few GPUs (through the real launchers), a
study job on CUDA refusing a gloo group, and the CUDA profile's reading of GPU events (real
`FunctionEvent`s as torch.profiler makes them for kernels). What needs a GPU to run is in
`benchmarks/gpu_check.sh`.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from shardc.backends.torch.launch import choose_backend, spawn
from shardc.ir.diagnostics import ShardcError
from shardc.study.measure import profile_breakdown, profile_events


def _gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.delenv("SHARDC_DEVICE", raising=False)


def test_backend_is_nccl_only_with_a_gpu_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    assert choose_backend(1) == "nccl"
    assert choose_backend(1, "cpu") == "gloo"
    assert choose_backend(2) == "gloo"  # spawn's tests: gloo on CPU next to too few GPUs
    with pytest.raises(ShardcError, match=r"one GPU per process: 2 processes asked for, 1 GPUs visible") as err:
        choose_backend(2, fallback=False)  # shardc run: never silently on the CPU
    assert "--nproc 1 or fewer" in str(err.value)
    with pytest.raises(ShardcError, match="2 processes asked for"):
        choose_backend(2, "cuda")
    monkeypatch.setenv("SHARDC_DEVICE", "cpu")
    assert choose_backend(1) == "gloo"
    monkeypatch.setenv("SHARDC_DEVICE", "tpu")
    with pytest.raises(ShardcError, match="use cpu or cuda"):
        choose_backend(1)
    _gpus(monkeypatch, 0)
    assert choose_backend(4, fallback=False) == "gloo"
    with pytest.raises(ShardcError, match="1 processes asked for, 0 GPUs visible"):
        choose_backend(1, "cuda")


def test_launchers_refuse_cuda_without_enough_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from shardc.study import run_study

    _gpus(monkeypatch, 1)
    with pytest.raises(ShardcError, match="2 processes asked for"):  # before any process starts
        spawn(_never, 2, device="cuda")
    with pytest.raises(ShardcError, match="2 processes asked for, 1 GPUs visible"):
        run_study("examples/gpt.py:tiny", "1,2", device="cuda", out_dir=tmp_path / "a")
    with pytest.raises(ShardcError, match="applies to --device cuda"):
        run_study("examples/gpt.py:tiny", 1, device="cpu", cluster="H200", out_dir=tmp_path / "b")


def _never(rank: int, world: int) -> None:
    raise AssertionError("no process should start")


def test_shardc_run_on_cuda_without_a_gpu_names_the_problem() -> None:
    from shardc.run import run_model

    # The workers (real torchrun processes) see no GPU whatever machine runs the test.
    with pytest.raises(ShardcError, match=r"rank 0 failed: ShardcError: CUDA needs one GPU per process: 1 processes asked for, 0 GPUs"):
        run_model("examples/gpt.py:tiny", nproc=1, steps=1, timeout_s=120,
                  env={"SHARDC_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ""})


def test_a_cuda_study_job_refuses_a_gloo_group(tmp_path) -> None:
    from shardc.study.worker import run_jobs

    jobs = [{"id": "allreduce-1", "kind": "allreduce_sizes", "sizes": [64], "device": "cuda"}]
    with pytest.raises(ShardcError, match="joined a gloo group, not NCCL"):
        spawn(run_jobs, 1, jobs, str(tmp_path), device="cpu", timeout_s=120)


def _event(i: int, name: str, start: float, end: float, device: DeviceType = DeviceType.CUDA,
           annotation: bool = False) -> FunctionEvent:
    return FunctionEvent(i, name, 1 if device == DeviceType.CPU else 7, start, end, device_type=device,
                         is_user_annotation=annotation)


def test_cuda_profile_reads_kernels_not_cpu_ops() -> None:
    class Prof:
        def __init__(self, events: list[FunctionEvent]) -> None:
            self._events = events

        def events(self) -> list[FunctionEvent]:
            return self._events

    def rank(allreduce_us: float) -> dict:
        return profile_events(Prof([
            _event(0, "gpu_user_annotation", 0, 500, DeviceType.CUDA, annotation=True),
            _event(1, "marker", 100, 1100, DeviceType.CPU),
            _event(2, "marker", 100, 1100, DeviceType.CUDA, annotation=True),  # the GPU copy of the range
            _event(3, "aten::mm", 110, 120, DeviceType.CPU),  # launches: not GPU time
            _event(4, "ampere_sgemm_128x64_tn", 200, 500),
            _event(5, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 450, 450 + allreduce_us),
            _event(6, "elementwise_kernel", 900, 1000),
            _event(7, "late_kernel", 1200, 1300),  # after the step
        ]), "marker", "cuda")

    fast, slow = rank(100.0), rank(300.0)
    assert fast["step_us"] == 1000
    assert fast["compute"] == [(200, 500), (900, 1000)]
    assert fast["comm"] == [(450, 550)]
    assert [k for k, _ in fast["calls"]] == ["ncclDevKernel_AllReduce_Sum_f32_RING_LL|1"]
    a, b = profile_breakdown([fast, slow])
    assert a["compute_s"] == pytest.approx(400e-6)
    assert a["communication_s"] == pytest.approx(100e-6) and a["exposed_communication_s"] == pytest.approx(50e-6)
    assert a["waiting_s"] == 0.0 and b["waiting_s"] == pytest.approx(200e-6)  # the slower rank waited
    cpu = profile_events(Prof([_event(1, "marker", 100, 1100, DeviceType.CPU),
                               _event(3, "aten::mm", 110, 120, DeviceType.CPU)]), "marker")
    assert cpu["compute"] == [(110, 120)]

