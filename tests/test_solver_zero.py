"""ZeRO as it runs: the solver writes a ZeRO stage only where the plan has a data group (dp, cp or
ep above 1: the axes FSDP2 shards over); on a shape without one ZeRO wraps nothing at run time and
is priced as nothing, so the plan says ZeRO 0 (`shardc.search.evaluate.executed_zero`)."""

from __future__ import annotations

from types import SimpleNamespace

from shardc.search.evaluate import Assignment, executed_zero
from shardc.search.problem import MeshShape


def test_zero_without_a_data_group_is_written_as_zero_0() -> None:
    a = Assignment((0, 1), ((2, 0, 0),), 2)
    for shape in (MeshShape(tp=2), MeshShape(pp=2, tp=2), MeshShape(tp=4, vpp=2)):
        assert executed_zero(SimpleNamespace(shape=shape), a) == Assignment((0, 1), ((2, 0, 0),), 0)  # type: ignore[arg-type]
    for shape in (MeshShape(dp=2), MeshShape(cp=2, tp=2), MeshShape(ep=2), MeshShape(pp=2, dp=2)):
        assert executed_zero(SimpleNamespace(shape=shape), a) is a  # type: ignore[arg-type]
