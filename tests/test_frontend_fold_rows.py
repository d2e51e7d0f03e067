"""Constant folding computes a large elementwise op on one row when its operands are alike along
the result's dim 0 (`shardc.frontend.constants._one_row`): transformers' causal mask at a solver's
global batch (Mixtral-8x7B at 256 x 4096: four (256, 1, 4096, 4096) bool ops, 3-8 s each, issue 15).
The graph and the values of its `const.N` buffers are what the full computation gives; a row-folded
buffer stays a broadcast view while the model is planned (copying out Mixtral's 4 GiB mask was 7.7 s
of its `shardc plan`) and is made contiguous to run (`runnable_constants`)."""

from __future__ import annotations

import pytest
import torch
from test_moe import MIXTRAL

from shardc.driver.source import open_model
from shardc.frontend import constants
from shardc.ir.printer import print_graph

ONE_ROW = constants._one_row


def _traced(monkeypatch: pytest.MonkeyPatch, threshold: int, calls: list[str]) -> tuple[str, dict[str, torch.Tensor]]:
    def counted(node, args, kwargs):  # noqa: ANN001, ANN202 - the folding's own signature
        out = ONE_ROW(node, args, kwargs)
        if out is not None:
            calls.append(str(node.target))
        return out

    monkeypatch.setattr(constants, "_ONE_ROW_ELEMENTS", threshold)
    monkeypatch.setattr(constants, "_one_row", counted)
    result = open_model(MIXTRAL).trace()
    return print_graph(result.graph), result.constants


def test_a_mask_folded_on_one_row_is_the_full_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    full_calls: list[str] = []
    want_ir, want = _traced(monkeypatch, 1 << 62, full_calls)  # never one row
    row_calls: list[str] = []
    got_ir, got = _traced(monkeypatch, 1, row_calls)            # every elementwise fold it can
    assert not full_calls and {"aten.le.Tensor", "aten.__and__.Tensor"} <= set(row_calls), row_calls
    assert got_ir == want_ir
    assert got.keys() == want.keys() and got
    views = [name for name, t in got.items() if not t.is_contiguous()]
    assert views, "the row-folded mask is kept as its broadcast view while planning"
    runnable = constants.runnable_constants(got)
    for name, value in want.items():
        assert value.is_contiguous() and runnable[name].is_contiguous(), name  # a module's buffer, never a view
        assert got[name].is_contiguous() or got[name].untyped_storage().nbytes() * value.shape[0] <= value.nbytes, name
        torch.testing.assert_close(runnable[name], value, rtol=0, atol=0, msg=name)
