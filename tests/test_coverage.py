"""The transformers coverage script (`benchmarks/coverage.py`): its checks on a few tiny types,
and the README table, which must be what the script writes from its stored results."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import coverage as bench  # noqa: E402  (a script beside its results, not a package)


def test_a_decoder_passes_every_column_through_the_model_own_loss() -> None:
    row = bench.check_type("gpt2", "decoder")
    assert row.spec.startswith("hf:gpt2?") and "labels=true" in row.spec and "num_hidden_layers=1" in row.spec
    assert row.results["inspect"] == "pass"
    assert row.results["params"] == "pass"
    assert row.results["estimate"] == "pass"
    assert row.results["tp=2"] == "pass", row.results
    assert row.passed


def test_an_encoder_decoder_and_mla_trace_with_their_parameters() -> None:
    for model_type, kind in (("t5", "encoder-decoder"), ("deepseek_v3", "moe")):
        row = bench.check_type(model_type, kind, ("inspect", "params"))
        assert row.results == {"inspect": "pass", "params": "pass"} | (
            {"notes": row.results["notes"]} if "notes" in row.results else {}), row.results


def test_a_failure_names_the_op_and_skips_what_needs_it() -> None:
    from shardc.ir.diagnostics import ShardcError

    err = ShardcError("unsupported op aten.histc (call_function) in module model.layers.0.mlp: no rule")
    assert bench.failing_op(err) == "aten.histc"
    row = bench.check_type("no_such_type", "decoder")
    assert row.results["inspect"].startswith("fail: KeyError") and not row.passed


def _readme_table() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(re.escape(bench.BEGIN) + r"\n(.*)\n" + re.escape(bench.END), text, re.S)
    assert match, "README.md has no coverage table between the markers"
    return match.group(1)


def test_the_readme_table_is_the_script_output_for_its_stored_results() -> None:
    ordered = bench.table_rows(bench.load_results())
    assert _readme_table() == bench.table(ordered)
    assert len(ordered) >= 30
    assert {r.kind for r in ordered} >= {"decoder", "encoder", "encoder-decoder", "moe"}
    passed = sum(r.passed for r in ordered)
    assert f"{passed} of {len(ordered)} types pass every column." in _readme_table()


def test_an_aten_copy_node_has_a_gradient() -> None:
    """DeepSeek-V3's attention writes a slice with copy_: its out-of-place `copy` fallback node
    must train (autograd has no derivative for aten::copy itself)."""
    import torch

    from shardc.ops.fallback import call

    base, src = torch.zeros(2, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    out = call("torch.ops.aten.copy.default", [base, src], ("$0", "$1"), ())
    out.sum().backward()
    torch.testing.assert_close(out, src.detach().expand(2, 3))
    assert base.grad is not None and src.grad is not None
    torch.testing.assert_close(base.grad, torch.zeros(2, 3))
    torch.testing.assert_close(src.grad, torch.full((3,), 2.0))
