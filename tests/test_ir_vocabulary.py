"""The IR's one vocabulary: dtype spellings, mesh axis roles, recompute modes and ZeRO stages."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shardc.ir import RECOMPUTE_CHOICES, ZERO_STAGES, Axis, Mesh, TensorType
from shardc.ir.dtypes import DTYPES, PLAN_DTYPES, dtype_name, element_bytes, ir_dtype, precision, torch_dtype
from shardc.plan.parallel import ParallelPlan


@pytest.mark.parametrize("spelling, ir, plan", [
    ("f32", "f32", "fp32"), ("fp32", "f32", "fp32"), ("float32", "f32", "fp32"), ("FP32", "f32", "fp32"),
    ("bf16", "bf16", "bf16"), ("bfloat16", "bf16", "bf16"),
    ("f16", "f16", "fp16"), ("fp16", "f16", "fp16"), ("half", "f16", "fp16"), ("float16", "f16", "fp16"),
    ("f64", "f64", "fp64"), ("float64", "f64", "fp64"),
])
def test_every_spelling_reaches_the_ir_and_the_plan_name(spelling: str, ir: str, plan: str) -> None:
    assert ir_dtype(spelling) == ir and precision(spelling) == plan
    assert torch_dtype(spelling) == getattr(torch, DTYPES[ir].torch_name)


def test_torch_round_trip_and_sizes() -> None:
    for name, dtype in DTYPES.items():
        t = torch_dtype(name)
        assert dtype_name(t) == name and torch.empty((), dtype=t).element_size() == dtype.nbytes
        assert TensorType((3,), name).nbytes == 3 * dtype.nbytes
        assert TensorType((), name).is_float == dtype.is_float
    assert element_bytes("tf32") == 4 and element_bytes("fp8") == 1 and element_bytes("bf16") == 2
    assert precision("tf32") == "tf32" and precision("i64") == "i64"
    with pytest.raises(ValueError, match="unknown dtype 'tf32'"):
        ir_dtype("tf32")
    with pytest.raises(KeyError, match="no IR name"):
        dtype_name(torch.complex64)


def test_the_plan_speaks_the_same_vocabulary() -> None:
    assert {ParallelPlan(dtype=d).dtype for d in ("float32", "f32", "half", "bfloat16")} == {"fp32", "fp16", "bf16"}
    assert [ParallelPlan(dtype=d).ir_dtype for d in PLAN_DTYPES] == ["f32", "bf16", "f16"]
    assert [ParallelPlan(recompute=r).recompute for r in RECOMPUTE_CHOICES] == list(RECOMPUTE_CHOICES)
    assert [ParallelPlan(zero=z).zero for z in ZERO_STAGES] == list(ZERO_STAGES)


def test_axis_roles_are_their_names() -> None:
    mesh = Mesh(((Axis.PP, 2), ("dp", 4), (Axis.TP, 8)))
    assert mesh.names == ("pp", "dp", "tp") and str(mesh) == "mesh<pp=2, dp=4, tp=8>"
    assert mesh.axis_size(Axis.DP) == 4 and mesh.degree("tp") == 8 and mesh.degree(Axis.CP) == 1
    assert {"tp": 1}[Axis.TP] == 1 and f"{Axis.CP}" == "cp" and json.dumps([Axis.TQ]) == '["tq"]'
    with pytest.raises(KeyError, match="no axis 'cp'"):
        mesh.axis_size(Axis.CP)


def test_the_ir_layer_loads_without_torch() -> None:
    code = "import sys, shardc.ir.dtypes, shardc.ir.types; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
