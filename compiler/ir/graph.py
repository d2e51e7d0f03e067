"""The partition IR's graph: locations, layer annotations, values, nodes and the SSA `Graph`.

Nodes are mutable and compare by identity; a `Graph` is an ordered list of nodes plus its
inputs, parameters, buffers, outputs and per-layer annotations. Structural equality of whole
graphs lives in `shardc.ir.equality`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from shardc.ir.types import RECOMPUTE_CHOICES, VALUE_KINDS, ZERO_STAGES, Layout, Mesh, Partition, TensorType


@dataclass(frozen=True, slots=True)
class Location:
    """Where a node came from: the module path (`blocks.3.attn.qkv`) and the frontend's source."""

    module_path: str = ""
    source: str = ""

    def __str__(self) -> str:
        text = f"@{self.module_path}" if self.module_path else "@"
        return text + (f' "{self.source}"' if self.source else "")


@dataclass(frozen=True, slots=True)
class LayerAnnotation:
    """Per-layer choices: pipeline stage, activation recomputation, ZeRO stage."""

    stage: int | None = None
    recompute: str = "none"
    zero: int = 0

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, got {self.recompute!r}")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero stage must be one of {ZERO_STAGES}, got {self.zero}")
        if self.stage is not None and self.stage < 0:
            raise ValueError(f"stage must be >= 0, got {self.stage}")


@dataclass(slots=True)
class Layer:
    """A group of nodes that form one repeated block (or a singleton such as the embedding)."""

    name: str
    block: str  # the structural class: layers with equal `block` are copies of one another
    annotation: LayerAnnotation = field(default_factory=LayerAnnotation)


# ---- values, nodes, graphs -----------------------------------------------------------------

@dataclass(eq=False, slots=True)
class Value:
    """An SSA value. `name` is unique in its graph; parameters and buffers are named by path."""

    name: str
    type: TensorType
    kind: str = "activation"
    layout: Layout | None = None
    producer: Node | None = None
    requires_grad: bool = False

    def __post_init__(self) -> None:
        if self.kind not in VALUE_KINDS:
            raise ValueError(f"value kind must be one of {VALUE_KINDS}, got {self.kind!r}")

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(eq=False, slots=True)
class Node:
    """One op application. Mutable; two nodes are equal only if they are the same object."""

    op: str
    inputs: list[Value]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    location: Location = field(default_factory=Location)
    partition: Partition | None = None
    layer: str | None = None
    # Analyses (annotate-cost, ...) write here; the printer shows selected keys.
    annotations: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for out in self.outputs:
            out.producer = self

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise ValueError(f"node {self.op} has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    def __repr__(self) -> str:
        outs = ", ".join(f"%{v.name}" for v in self.outputs)
        ins = ", ".join(f"%{v.name}" for v in self.inputs)
        return f"<{outs} = {self.op}({ins}) {self.location}>"


@dataclass(eq=False)
class Graph:
    """An SSA graph: declared inputs, parameters and buffers, an ordered node list, outputs."""

    name: str
    inputs: list[Value] = field(default_factory=list)
    params: list[Value] = field(default_factory=list)
    buffers: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    mesh: Mesh | None = None
    layers: dict[str, Layer] = field(default_factory=dict)
    # Graph-level facts of a plan (micro-batch size and count, schedule, ...), printed after the
    # mesh as `[microbatches=4, ...]`; values are what node attributes may hold.
    attrs: dict[str, Any] = field(default_factory=dict)

    def values(self) -> Iterator[Value]:
        yield from self.inputs
        yield from self.params
        yield from self.buffers
        for node in self.nodes:
            yield from node.outputs

    def value(self, name: str) -> Value:
        for v in self.values():
            if v.name == name:
                return v
        raise KeyError(f"graph @{self.name} has no value %{name}")

    def users(self) -> dict[Value, list[Node]]:
        """Value -> the nodes that read it, in graph order."""
        out: dict[Value, list[Node]] = {}
        for node in self.nodes:
            for v in node.inputs:
                lst = out.setdefault(v, [])
                if not lst or lst[-1] is not node:
                    lst.append(node)
        return out

    def layer_nodes(self, layer: str) -> list[Node]:
        return [n for n in self.nodes if n.layer == layer]

    def param_count(self) -> int:
        return sum(p.type.numel for p in self.params)

    def fresh_name(self, prefix: str = "v") -> str:
        taken = {v.name for v in self.values()}
        i = len(taken)
        while f"{prefix}{i}" in taken:
            i += 1
        return f"{prefix}{i}"

    def __str__(self) -> str:
        from shardc.ir.printer import print_graph

        return print_graph(self)
