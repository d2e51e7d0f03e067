"""Malformed IR: every error names file:line:column and says what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardc.ir.diagnostics import ParseError
from shardc.ir.parser import parse, parse_file

GOOD = """\
graph @g mesh<tp=2> {
  input %x : f32[4,8]
  param %w : f32[16,8]{tp:S(0)}
  layer blocks.0 block=block0 stage=none recompute=none zero=0
  %y = linear(%x, %w) : f32[4,16]{tp:S(1)} partition<tp:n> layer=blocks.0 @blocks.0.fc "m.py:3"
  return %y
}
"""


def error_of(text: str, filename: str = "model.ir") -> str:
    with pytest.raises(ParseError) as info:
        parse(text, filename=filename)
    return str(info.value)


def test_good_text_parses() -> None:
    graph = parse(GOOD)
    assert [n.op for n in graph.nodes] == ["linear"]
    assert graph.nodes[0].inputs == [graph.inputs[0], graph.params[0]]


@pytest.mark.parametrize(("bad", "good", "message"), [
    # a type where the closing parenthesis of the operands belongs
    ("linear(%x, %w) :", "linear(%x, %w : f32[4,8]) :", "model.ir:5:22: expected ')' after operands, found ':'"),
    ("%y = linear", "%y linear", "model.ir:5:6: expected '=' after the node's result names, found 'linear'"),
    ("f32[4,16]{tp:S(1)}", "f32[4,16{tp:S(1)}", "model.ir:5:33: expected ']' to close the shape, found '{'"),
    ("{tp:S(1)}", "{tp:Q(1)}", "model.ir:5:38: expected a placement S(dim), R or P(op), found 'Q'"),
    ("partition<tp:n>", "partition<tp:n", "model.ir:5:59: expected '>' to close the partition, found 'layer'"),
    ("@blocks.0.fc", "blocks.0.fc", "model.ir:5:75: expected '@' before the location of linear"),
    ("f32[4,8]", "f33[4,8]", "model.ir:2:14: unknown dtype 'f33'"),
    ("mesh<tp=2>", "mesh<tp=0>", "model.ir:1:10: mesh axis tp has size 0"),
    ("stage=none", "stage=first", "invalid literal for int()"),
    ("return %y", "return %z", "model.ir:6:10: undefined value %z"),
    ("  return %y\n}\n", "  return %y\n", "model.ir:7:1: expected '}' to close the graph body, found end of file"),
    ("  return %y\n}\n", "  return %y\n}\n}\n", "model.ir:8:1: expected end of file after the graph, found '}'"),
    ("graph @g", "grph @g", "model.ir:1:1: expected 'graph' at the start of the IR, found 'grph'"),
    ('"m.py:3"', '"m.py:3', "model.ir:5:88: unterminated string"),
])
def test_malformed_ir_names_position(bad: str, good: str, message: str) -> None:
    assert bad in GOOD
    text = GOOD.replace(bad, good, 1)
    assert message in error_of(text), error_of(text)
    assert error_of(text).startswith("model.ir:")


def test_use_before_definition_and_duplicates() -> None:
    text = GOOD.replace("  %y = linear", "  %z = relu(%y) : f32[4,16] @\n  %y = linear")
    assert error_of(text).startswith("model.ir:5:13: undefined value %y")
    text = GOOD.replace("  param %w", "  param %x")
    assert error_of(text).startswith("model.ir:3:9: value %x is already defined (line 2)")
    text = GOOD.replace("layer=blocks.0 ", "").replace("  return", "  %y = relu(%y) : f32[4,16] @\n  return")
    assert error_of(text).startswith("model.ir:6:3: value %y is already defined (line 5)")
    text = GOOD.replace("  return", "  layer blocks.0 block=b\n  return")
    assert "layer blocks.0 is declared twice" in error_of(text)


def test_attribute_errors() -> None:
    text = GOOD.replace("linear(", "linear[a=1, a=2](")
    assert "model.ir:5:20: attribute a is given twice" in error_of(text)
    text = GOOD.replace("linear(", "linear[a=maybe](")
    assert error_of(text).startswith("model.ir:5:17: expected an attribute value")
    text = GOOD.replace("linear(", "linear[a=(1, 2](")
    assert "expected ')' to close the tuple, found ']'" in error_of(text)


def test_comments_and_free_layout_are_accepted() -> None:
    text = "// ----- IR after group-layers -----\n" + GOOD.replace(" : f32[4,16]{", "\n      : f32[4,16]{")
    assert len(parse(text).nodes) == 1


def test_parse_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.ir"
    path.write_text(GOOD.replace("%x, %w)", "%x %w)"))
    with pytest.raises(ParseError, match=r"broken\.ir:5:18: expected '\)' after operands, found '%'"):
        parse_file(path)
    with pytest.raises(ParseError, match="cannot read IR file"):
        parse_file(tmp_path / "missing.ir")
