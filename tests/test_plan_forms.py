"""One plan type: `ParallelPlan.of` coerces text, plans and partitioned graphs; `plan_of` reads
back the plan a graph records; `plan.mesh()` is the mesh apply-plan writes; the solver's
`MeshShape` converts to and from a plan; the plan file (`PlanFile`) round-trips through JSON;
a study plan is a `ParallelPlan` plus the study's own keys."""

from __future__ import annotations

import json

import pytest
from test_apply_plan_graphs import tiny_lm

from shardc.ir import Axis, Mesh
from shardc.ir.diagnostics import ShardcError
from shardc.passes.apply_plan import apply_plan
from shardc.passes.validate_plan import context_plan
from shardc.passmanager import PassContext
from shardc.plan.file import FORMAT, GroupChoice, PlanFile
from shardc.plan.parallel import ParallelPlan, plan_of
from shardc.search.problem import MeshShape
from shardc.study.plans import StudyPlan, parse_study_plan

PLANS = ["dp=2,mb=1,gbs=2", "tp=2,sp=1,gbs=2", "dp=2,tp=2,mb=1,gbs=4,zero=1,recompute=full", "cp=2,gbs=2,dtype=fp32"]


@pytest.mark.parametrize("text", PLANS)
def test_of_text_plan_and_partitioned_graph_agree(text: str) -> None:
    plan = ParallelPlan.parse(text)
    assert ParallelPlan.of(text) == plan and ParallelPlan.of(plan) is plan
    graph = apply_plan(tiny_lm(), plan)
    assert plan_of(graph) == ParallelPlan.of(graph) == plan  # the graph records the plan it was written with
    assert graph.mesh == plan.mesh()  # the mesh apply-plan writes is the plan's


def test_of_rejects_what_is_not_a_plan() -> None:
    with pytest.raises(ShardcError, match="records no plan"):
        ParallelPlan.of(tiny_lm())
    with pytest.raises(ShardcError, match="not int"):
        ParallelPlan.of(42)  # type: ignore[arg-type]
    with pytest.raises(ShardcError, match="needs a plan"):
        context_plan(PassContext(), "validate-plan")
    assert context_plan(PassContext(plan="dp=2"), "validate-plan") == ParallelPlan(dp=2)


def test_mesh_axes_outermost_first() -> None:
    mesh = ParallelPlan.parse("dp=2,tp=4,pp=3,cp=5").mesh()
    assert mesh == Mesh((("pp", 3), ("dp", 2), ("cp", 5), ("tp", 4)))
    assert mesh.names == (Axis.PP, Axis.DP, Axis.CP, Axis.TP) and mesh.size == 120
    assert ParallelPlan().mesh().size == 1


def test_mesh_shape_converts_to_and_from_a_plan() -> None:
    plan = ParallelPlan.parse("dp=2,tp=4,pp=2,cp=1,mb=2,gbs=16,zero=1")
    shape = MeshShape.of(plan)
    assert shape == MeshShape(2, 2, 1, 4) and shape.mesh() == plan.mesh() and shape.devices == plan.devices
    assert shape.plan(plan.mb, 16, plan.zero, plan.dtype) == plan
    grid = MeshShape.of(plan, tq=2)  # PrimePar's tp x tq grid: the plan's tp is tp*tq
    assert grid == MeshShape(2, 2, 1, 2, 2) and grid.plan(2, 16, 1) == plan
    assert grid.mesh().axes[-2:] == (("tp", 2), ("tq", 2)) and grid.intra().names == ("dp", "tp", "tq")
    with pytest.raises(ShardcError, match="tq=3 does not divide tp=4"):
        MeshShape.of(plan, tq=3)


def _file(**kw: object) -> PlanFile:
    groups = (GroupChoice("<graph>", 0, "R", "embed"), GroupChoice("block.0", 1, "tp:S(1)", "fc1"))
    return PlanFile(**{"model": "m", "plan": ParallelPlan.parse("dp=2,tp=4,pp=2,mb=1,gbs=8,zero=1"),  # type: ignore[arg-type]
                       "micro_batches": 4, "stages": ((1, 0, 0), (0, 0, 1)), "groups": groups,
                       "step_time_s": 1.5, "memory_per_device_bytes": 2e9, **kw})


def test_plan_file_json_round_trip(tmp_path) -> None:
    uniform, grid = _file(), _file(tq=2, stage_groups=((GroupChoice("block.0", 1, "R"),),) * 2)
    for f in (uniform, grid):
        path = tmp_path / "plan.json"
        f.save(path)
        assert PlanFile.load(path) == f
    data = grid.to_json()
    assert data["format"] == FORMAT and data["mesh"] == {"pp": 2, "dp": 2, "cp": 1, "tp": 2, "tq": 2}
    assert (data["mb"], data["gbs"], data["zero"], data["dtype"]) == (1, 8, 1, "bf16")
    assert data["stages"][1] == {"none": 0, "selective": 0, "full": 1}
    assert "stage_groups" not in uniform.to_json() and "anchor" not in data["stage_groups"][0][0]


def test_plan_file_errors(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ShardcError, match="not a shardc plan file"):
        PlanFile.load(path)
    path.write_text(json.dumps({"format": FORMAT, "mesh": {"pp": 1}}))
    with pytest.raises(ShardcError, match="damaged plan file"):
        PlanFile.load(path)
    with pytest.raises(ShardcError, match="cannot read plan file"):
        PlanFile.load(tmp_path / "missing.json")
    with pytest.raises(ShardcError, match="global batch"):
        _file(plan=ParallelPlan(dp=2))


def test_study_plan_is_a_parallel_plan_and_its_own_keys() -> None:
    sp = parse_study_plan("pp=2,mb=2,split=3+1,bucket_mb=0.5")
    assert sp == StudyPlan(ParallelPlan.parse("pp=2,mb=2,dtype=fp32"), (3, 1), 0.5)
    assert sp.text == str(sp.plan) + ",split=3+1,bucket_mb=0.5" and parse_study_plan(sp.text) == sp
    assert sp.label == "pp=2,mb=2,split=3+1,bucket_mb=0.5"
    with pytest.raises(ShardcError, match="names 3 stages but the plan has pp\\*vpp = 2"):
        StudyPlan(sp.plan, (1, 1, 1))
