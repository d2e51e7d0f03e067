"""Pipelines from strings, the driver's verification, printing, timing and error wrapping."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest

from shardc.ir import Graph, TensorType
from shardc.ir.diagnostics import ShardcError
from shardc.ir.parser import parse
from shardc.ir.printer import print_graph
from shardc.passmanager import (
    Pass,
    PassContext,
    PassError,
    available_passes,
    parse_pipeline,
    pass_text,
    register_pass,
    run_pipeline,
)

TEXT = """\
graph @g {
  input %x : f32[4,8]
  %y = relu(%x) : f32[4,8] @act
  %z = tanh(%y) : f32[4,8] @act2
  return %z
}
"""


@dataclass(frozen=True)
class Options(Pass):
    name: ClassVar[str] = "test-options"
    steps: int = 1
    limit: float = 1.5
    fast: bool = False
    label: str | None = None
    mode: Literal["a", "b"] = "a"
    axes: tuple[str, ...] = ("dp",)

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        return graph


@dataclass(frozen=True)
class Rename(Pass):
    name: ClassVar[str] = "test-rename"
    prefix: str = "v"

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        for i, node in enumerate(graph.nodes):
            for v in node.outputs:
                v.name = f"{self.prefix}{i}"
        return graph


@dataclass(frozen=True)
class Boom(Pass):
    name: ClassVar[str] = "test-boom"

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        raise ShardcError("cannot split this", node=graph.nodes[1], hint="try less")


@dataclass(frozen=True)
class Break(Pass):
    name: ClassVar[str] = "test-break"

    def apply(self, graph: Graph, ctx: PassContext) -> Graph:
        graph.nodes[0].outputs[0].type = TensorType((4, 9), "f32")
        return graph


REGISTRY = {p.name: p for p in (Options, Rename, Boom, Break)}


def test_options_are_typed_by_fields() -> None:
    [p] = parse_pipeline("test-options{steps=3, limit=2, fast=true label=none mode=b axes=dp+cp}", REGISTRY)
    assert p == Options(steps=3, limit=2.0, fast=True, label=None, mode="b", axes=("dp", "cp"))
    assert pass_text(p) == "test-options{steps=3,limit=2.0,fast=true,mode=b,axes=dp+cp}"
    assert parse_pipeline(pass_text(p), REGISTRY) == [p]
    assert parse_pipeline("test-options{label=\"x y\"}", REGISTRY) == [Options(label="x y")]
    assert pass_text(Options()) == "test-options"


@pytest.mark.parametrize(("text", "message"), [
    ("test-nope", "unknown pass 'test-nope'; known passes: test-options, test-rename, test-boom, test-break"),
    ("test-options{speed=1}", "pass test-options has no option 'speed'; its options: steps, limit, fast, label, mode, axes"),
    ("test-options{steps=many}", "option steps of pass test-options: expected an integer, got 'many'"),
    ("test-options{fast=perhaps}", "option fast of pass test-options: expected true or false, got 'perhaps'"),
    ("test-options{mode=c}", "option mode of pass test-options: 'c' is not one of a, b"),
    ("test-options{steps}", "pass test-options: option 'steps' needs the form name=value"),
    ("test-options{steps=1,steps=2}", "pass test-options: option steps is given twice"),
    ("test options", "cannot read pipeline element 'test options'"),
])
def test_pipeline_errors(text: str, message: str) -> None:
    with pytest.raises(ShardcError) as info:
        parse_pipeline(text, REGISTRY)
    assert message in str(info.value)


def test_passes_are_discovered_in_the_package() -> None:
    passes = available_passes()
    assert {"annotate-cost", "group-layers"} <= set(passes)
    assert [p.name for p in parse_pipeline("group-layers, annotate-cost{dtype=bf16}")] == ["group-layers",
                                                                                           "annotate-cost"]
    with pytest.raises(ShardcError, match="known passes: .*annotate-cost.*group-layers"):
        parse_pipeline("anotate-cost")
    with pytest.raises(ShardcError, match="dtype must be one of"):
        parse_pipeline("annotate-cost{dtype=f8}")


def test_register_pass_checks_the_name() -> None:
    @dataclass(frozen=True)
    class Bad(Pass):
        name: ClassVar[str] = "Bad_Name"

    with pytest.raises(ValueError, match="kebab-case"):
        register_pass(Bad)


def test_print_after_all_and_time_passes() -> None:
    out = io.StringIO()
    ctx = PassContext()
    graph = run_pipeline(parse(TEXT), [Rename(), Rename(prefix="w")], ctx, print_after_all=True,
                         time_passes=True, out=out)
    text = out.getvalue()
    first = print_graph(graph).replace("%w", "%v")
    assert text.startswith("// ----- IR after test-rename -----\n" + first
                           + "// ----- IR after test-rename -----\n" + print_graph(graph))
    assert "pass timings" in text and "test-rename" in text.split("pass timings")[1] and "total" in text
    assert [t.name for t in ctx.timings] == ["test-rename", "test-rename"]
    assert all(t.seconds >= 0 and t.verify_seconds > 0 for t in ctx.timings)
    assert parse(text.split("// ----- IR after test-rename -----\n")[2].split("pass timings")[0].rsplit("}", 1)[0]
                 + "}\n").name == "g"


def test_a_failing_pass_is_named_with_its_predecessors_and_node() -> None:
    with pytest.raises(PassError) as info:
        run_pipeline(parse(TEXT), parse_pipeline("test-rename,test-options{steps=2},test-boom", REGISTRY))
    message = str(info.value)
    assert message.startswith("pass test-boom: failed: cannot split this\n"
                              "  passes run before it: test-rename, test-options")
    assert "node: %v1 = tanh(%v0)" in message and "hint: try less" in message
    assert info.value.node is not None and isinstance(info.value.__cause__, ShardcError)


def test_plain_exceptions_and_broken_ir_are_wrapped() -> None:
    @dataclass(frozen=True)
    class Crash(Pass):
        name: ClassVar[str] = "test-crash"

        def apply(self, graph: Graph, ctx: PassContext) -> Graph:
            return {}["missing"]

    with pytest.raises(PassError, match=r"pass test-crash: failed: KeyError: 'missing'\n  passes run before it: none"):
        run_pipeline(parse(TEXT), [Crash()])
    with pytest.raises(PassError) as info:
        run_pipeline(parse(TEXT), [Rename(), Break()])
    message = str(info.value)
    assert message.startswith("pass test-break: left IR that fails verification: graph @g: output 0 %v0 has "
                              "type f32[4,9] but relu gives f32[4,8]")
    assert "passes run before it: test-rename" in message and "at module act" in message
    run_pipeline(parse(TEXT), [Break()], verify=False)
