"""Parse the textual IR that `shardc.ir.printer` prints back into a `Graph`.

The grammar is the printer's (see its module docstring); whitespace and newlines between
tokens are free and `//` starts a comment that runs to the end of the line, so IR printed by
`--print-after-all` parses as it stands. The parser checks syntax and names only (every value
defined once, before its use); everything else is the verifier's job, so tests can write
broken graphs as text. Every error is a `ParseError` whose message starts with
`file:line:column:` and says what was expected and what was found.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from shardc.ir import (
    Graph,
    Layer,
    LayerAnnotation,
    Layout,
    Location,
    Mesh,
    Node,
    Partial,
    Partition,
    Placement,
    Replicate,
    Shard,
    TemporalSplit,
    TensorType,
    Value,
)
from shardc.ir.diagnostics import ParseError
from shardc.ir.scanner import WORD, Scanner

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUMBER = re.compile(r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?")
_MODULE_PATH = re.compile(r"[^\s\"@]*")
_DECLARATIONS = {"input": "input", "param": "parameter", "buffer": "buffer"}



def parse(text: str, *, filename: str = "<string>") -> Graph:
    """Parse one printed graph. Raises `ParseError` (`file:line:column: expected ..., found ...`)."""
    return _Parser(text, filename).graph()


def parse_file(path: str | Path) -> Graph:
    """Parse the IR file at `path`; error positions name the file as given."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ParseError(f"cannot read IR file {path}: {err.strerror or err}") from None
    return parse(text, filename=str(path))


class _Parser(Scanner):
    """A recursive-descent parser over the `Scanner`: one method per rule of the grammar."""

    def __init__(self, text: str, filename: str) -> None:
        super().__init__(text, filename)
        self.values: dict[str, Value] = {}
        self.defined_at: dict[str, int] = {}

    # ---- the grammar ----------------------------------------------------------------------
    def graph(self) -> Graph:
        self.keyword("graph", "at the start of the IR")
        self.expect("@", "before the graph name")
        graph = Graph(self.name("a graph name"))
        if self.peek_keyword("mesh"):
            graph.mesh = self.mesh()
        if self.peek("["):
            graph.attrs = self.attrs()
        self.expect("{", "to open the graph body")
        while True:
            self.skip()
            start = self.pos
            if self.peek_keyword("return"):
                self.pos += len("return")
                graph.outputs = self.separated(self.use, "}")
                break
            m = WORD.match(self.text, self.pos)
            word = m.group() if m else ""
            if word in _DECLARATIONS:
                self.pos = m.end()  # type: ignore[union-attr]
                value = self.declaration(_DECLARATIONS[word], start)
                {"input": graph.inputs, "parameter": graph.params, "buffer": graph.buffers}[value.kind].append(value)
            elif word == "layer":
                self.pos = m.end()  # type: ignore[union-attr]
                layer = self.layer()
                if layer.name in graph.layers:
                    self.fail(f"layer {layer.name} is declared twice", start)
                graph.layers[layer.name] = layer
            elif self.peek("%") or (word and _IDENT.fullmatch(word)):
                graph.nodes.append(self.node())
            else:
                self.expected("a declaration (input, param, buffer, layer), a node or 'return'")
        self.expect("}", "to close the graph body")
        self.skip()
        if self.pos < len(self.text):
            self.expected("end of file after the graph")
        return graph

    def mesh(self) -> Mesh:
        start = self.pos
        self.keyword("mesh")
        self.expect("<", "after 'mesh'")

        def axis() -> tuple[str, int]:
            name = self.regex(_IDENT, "a mesh axis name")
            self.expect("=", f"after mesh axis {name}")
            return name, self.integer(f"the size of mesh axis {name}")

        axes = self.separated(axis, ">")
        self.expect(">", "to close the mesh")
        return self.build(start, lambda: Mesh(tuple(axes)))

    def define(self, name: str, value: Value, start: int) -> None:
        if name in self.values:
            line = self.text.count("\n", 0, self.defined_at[name]) + 1
            self.fail(f"value %{name} is already defined (line {line})", start)
        self.values[name] = value
        self.defined_at[name] = start

    def value_name(self) -> tuple[str, int]:
        self.skip()
        start = self.pos
        self.expect("%", "before a value name")
        if self.peek('"'):
            return self.string(), start
        m = WORD.match(self.text, self.pos)
        if not m:
            self.expected("a value name after '%'")
        self.pos = m.end()
        return m.group(), start

    def use(self) -> Value:
        name, start = self.value_name()
        if name not in self.values:
            self.fail(f"undefined value %{name}", start)
        return self.values[name]

    def declaration(self, kind: str, start: int) -> Value:
        frozen = kind == "parameter" and self.peek_keyword("frozen")
        if frozen:
            self.pos += len("frozen")
        name, name_start = self.value_name()
        self.expect(":", f"after %{name}")
        type_, layout = self.typed()
        value = Value(name, type_, kind, layout, requires_grad=kind == "parameter" and not frozen)
        self.define(name, value, name_start)
        return value

    def layer(self) -> Layer:
        name = self.name("a layer name")
        fields: dict[str, str] = {}
        while True:
            self.skip()
            m = _IDENT.match(self.text, self.pos)
            if not m or m.group() not in ("block", "stage", "recompute", "zero", "offload"):
                break
            key_start = self.pos
            self.pos = m.end()
            self.expect("=", f"after '{m.group()}'")
            if m.group() in fields:
                self.fail(f"layer {name} sets {m.group()} twice", key_start)
            fields[m.group()] = self.name(f"a value for {m.group()}")
        start = self.pos

        def make() -> Layer:
            stage = fields.get("stage", "none")
            # IR printed before offload was removed says offload=false on every layer: still
            # read; offload=true asked for something no backend does.
            if fields.get("offload", "false") != "false":
                raise ValueError(f"layer {name}: offload={fields['offload']} is not supported (optimizer-state "
                                 "offload is not executed by any backend); drop the offload field")
            annotation = LayerAnnotation(
                stage=None if stage == "none" else int(stage), recompute=fields.get("recompute", "none"),
                zero=int(fields.get("zero", "0")),
            )
            return Layer(name, fields.get("block", name), annotation)

        return self.build(start, make)

    def typed(self) -> tuple[TensorType, Layout | None]:
        self.skip()
        start = self.pos
        dtype = self.regex(_IDENT, "a dtype such as f32")
        self.expect("[", f"after dtype {dtype}")
        dims = self.separated(lambda: self.integer("a dimension size"), "]")
        self.expect("]", "to close the shape")
        type_ = self.build(start, lambda: TensorType(tuple(dims), dtype))
        layout = self.layout() if self.peek("{") else None
        return type_, layout

    def layout(self) -> Layout:
        start = self.pos
        self.expect("{")

        def placement() -> tuple[str, Placement]:
            axis = self.regex(_IDENT, "a mesh axis name in the layout")
            self.expect(":", f"after mesh axis {axis}")
            kind_start = self.pos
            kind = self.regex(_IDENT, "a placement S(dim), R or P(op)")
            if kind == "R":
                return axis, Replicate()
            if kind not in ("S", "P"):
                self.fail(f"expected a placement S(dim), R or P(op), found '{kind}'", kind_start)
            self.expect("(", f"after {kind}")
            arg: Any = self.integer("a tensor dim") if kind == "S" else self.regex(_IDENT, "a reduction op")
            interleave = self.integer("an interleave count") if kind == "S" and self.accept("/") else 1
            zigzag = kind == "S" and self.accept(",")
            if zigzag:
                self.keyword("zigzag", "after ',' in S(")
            self.expect(")", f"to close {kind}(")
            return axis, self.build(kind_start, lambda: Shard(arg, interleave, zigzag) if kind == "S" else Partial(arg))

        placements = self.separated(placement, "}")
        self.expect("}", "to close the layout")
        return self.build(start, lambda: Layout(tuple(placements)))

    def partition(self) -> Partition:
        start = self.pos
        self.keyword("partition")
        self.expect("<", "after 'partition'")

        strides: list[tuple[str, int]] = []
        zigzag: list[str] = []

        def spatial() -> tuple[str, str]:
            axis = self.regex(_IDENT, "a mesh axis name")
            self.expect(":", f"after mesh axis {axis}")
            dim = self.regex(WORD, "an iteration dim")
            if self.accept("/"):
                strides.append((axis, self.integer(f"the stride of {axis}:{dim}")))
            if self.peek_keyword("zigzag"):
                self.pos += len("zigzag")
                zigzag.append(axis)
            return axis, dim

        def temporal() -> TemporalSplit:
            dim_start = self.pos
            dim = self.regex(WORD, "an iteration dim")
            self.expect("/", f"after temporal dim {dim}")
            steps = self.integer("a number of steps")
            rotate = grid = None
            if self.peek_keyword("rotate"):
                self.pos += len("rotate")
                if self.accept("("):  # a PrimePar grid: `rotate (tp, tq)`
                    rotate = self.regex(_IDENT, "the first mesh axis of the grid")
                    self.expect(",", "between the two grid axes")
                    grid = self.regex(_IDENT, "the second mesh axis of the grid")
                    self.expect(")", "to close the grid axes")
                else:
                    rotate = self.regex(_IDENT, "a mesh axis to rotate along")
            return self.build(dim_start, lambda: TemporalSplit(dim, steps, rotate, grid))

        pairs = [] if self.peek(";") else self.separated(spatial, ">")
        splits: list[TemporalSplit] = []
        if self.accept(";"):
            self.keyword("time", "after ';' in a partition")
            splits = self.separated(temporal, ">")
        self.expect(">", "to close the partition")
        return self.build(start, lambda: Partition(tuple(pairs), tuple(splits), tuple(strides), tuple(zigzag)))

    def attr_value(self) -> Any:
        self.skip()
        start = self.pos
        if self.peek('"'):
            return self.string()
        if self.accept("("):
            items: list[Any] = []
            while not self.peek(")"):
                items.append(self.attr_value())
                if not self.accept(","):
                    break
            self.expect(")", "to close the tuple")
            return tuple(items)
        m = _NUMBER.match(self.text, self.pos)
        if m and not _IDENT.match(self.text, m.end()):
            self.pos = m.end()
            text = m.group()
            return float(text) if any(c in text for c in ".eE") else int(text)
        if self.accept("-inf"):
            return float("-inf")
        m = _IDENT.match(self.text, self.pos)
        constants = {"none": None, "true": True, "false": False, "inf": float("inf"), "nan": float("nan")}
        if m and m.group() in constants:
            self.pos = m.end()
            return constants[m.group()]
        self.fail(f"expected an attribute value (number, string, true, false, none, inf, nan or a tuple), "
                  f"found {self.found()}", start)

    def attrs(self) -> dict[str, Any]:
        attrs: dict[str, Any] = {}
        self.expect("[")

        def item() -> None:
            self.skip()
            start = self.pos
            key = self.regex(WORD, "an attribute name")
            self.expect("=", f"after attribute name {key}")
            if key in attrs:
                self.fail(f"attribute {key} is given twice", start)
            attrs[key] = self.attr_value()

        self.separated(item, "]")
        self.expect("]", "to close the attributes")
        return attrs

    def node(self) -> Node:
        self.skip()
        names: list[tuple[str, int]] = []
        if self.peek("%"):
            names.append(self.value_name())
            while self.accept(","):
                names.append(self.value_name())
            self.expect("=", "after the node's result names")
        op = self.regex(_IDENT, "an op name")
        attrs = self.attrs() if self.peek("[") else {}
        self.expect("(", f"before the operands of {op}")
        inputs = self.separated(self.use, ")")
        self.expect(")", "after operands")
        outputs: list[Value] = []
        if names:
            self.expect(":", f"before the result types of {op}")
            for i, (name, _) in enumerate(names):
                if i:
                    self.expect(",", f"between the result types of {op} ({len(names)} results)")
                type_, layout = self.typed()
                outputs.append(Value(name, type_, "activation", layout))
        node = Node(op, inputs, outputs, attrs)
        for (name, start), value in zip(names, outputs):
            self.define(name, value, start)
        if self.peek_keyword("partition"):
            node.partition = self.partition()
        if self.peek_keyword("layer") and self.text.startswith("=", self.pos + len("layer")):
            self.pos += len("layer=")
            node.layer = self.name("a layer name after 'layer='")
        if self.peek_keyword("ann") and self.text.startswith("[", self.pos + len("ann")):
            self.pos += len("ann")
            node.annotations = self.attrs()
        self.expect("@", f"before the location of {op} (write '@' alone when it has none)")
        path = _MODULE_PATH.match(self.text, self.pos)
        assert path is not None  # the pattern matches the empty string
        self.pos = path.end()
        source = ""
        if self.text.startswith(" ", self.pos) and self.peek('"'):
            source = self.string()
        node.location = Location(path.group(), source)
        return node
