"""Step 1 of the driver: a model to trace, from a spec (`open_model`) or an nn.Module and its
example inputs (`model_source`), as a `Source` that traces at any batch.

The example inputs are cut or repeated along their first dim here and nowhere else (a printed
IR or a fixed-shape ONNX import cannot change it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardc.ir import Graph
from shardc.ir.diagnostics import ShardcError

if TYPE_CHECKING:  # it loads torch (the registry); `shardc --help` should not wait for it
    from shardc.frontend import TraceResult


@dataclass(frozen=True)
class Source:
    """A model ready to trace at any batch. `model` with `inputs` is traced by the frontend;
    `build(batch)` builds a graph directly (a printed IR, which ignores the batch)."""

    name: str
    model: Any = None
    inputs: tuple[Any, ...] = ()
    input_names: tuple[str, ...] | None = None
    allow_opaque: bool = False
    build: Callable[[int | None], Graph] | None = None
    fixed_batch: int | None = None

    @property
    def batch(self) -> int | None:
        """The example batch: the first dim all inputs share (None when they share none)."""
        if self.build is not None:
            return self.fixed_batch
        firsts = {x.shape[0] if hasattr(x, "shape") and len(x.shape) else None for x in self.inputs}
        return firsts.pop() if len(firsts) == 1 else None

    @property
    def fixed_import(self) -> bool:
        """An import that cannot import itself again at other shapes (an ONNX file with a static
        batch), or a printed IR."""
        if self.build is not None:
            return self.fixed_batch is not None
        return getattr(self.model, "shardc_graph", None) is not None and not hasattr(self.model, "shardc_graph_for")

    @property
    def resizable(self) -> bool:
        """Whether `trace` can change the batch: not a fixed import, and batch-first inputs."""
        return not self.fixed_import and (self.build is not None or self.batch is not None)

    def trace(self, batch: int | None = None) -> TraceResult:
        """The graph (and the values of its `const.N` buffers) at `batch` sequences (None: the
        example batch). The inputs' first dim is cut, or its rows repeated, to `batch`."""
        from shardc.frontend import TraceResult, trace_with_state

        if self.build is not None:
            return TraceResult(self.build(batch))
        inputs = self.inputs
        if batch is not None and batch != self.batch:
            if not self.resizable:
                raise ShardcError(f"model {self.name} cannot be traced at a batch of {batch}: its inputs do not "
                                  "all have the batch as their first dim, or it is a fixed-shape import",
                                  hint="give batch-first inputs, or a plan that splits the example batch")
            inputs = tuple(_resize(x, batch) for x in inputs)
        return trace_with_state(self.model, inputs, name=self.name, allow_opaque=self.allow_opaque,
                                input_names=self.input_names)


def _resize(x: Any, rows: int) -> Any:
    if rows <= x.shape[0]:
        return x[:rows]
    return x.repeat(math.ceil(rows / x.shape[0]), *([1] * (x.dim() - 1)))[:rows]


def open_model(spec: str, *, device: str = "meta", allow_opaque: bool = False,
               input_shapes: dict[str, tuple[int, ...]] | None = None) -> Source:
    """The `Source` a model spec names (see the module docstring); `device="cpu"` builds real
    weights; `input_shapes` fix an ONNX file's dynamic input dims (`--input-shape`)."""
    if spec.endswith(".ir"):
        from shardc.ir.parser import parse_file

        graph = parse_file(spec)
        batch = graph.inputs[0].type.shape[0] if graph.inputs and graph.inputs[0].type.rank else 1
        return Source(graph.name, build=lambda _batch: parse_file(spec), fixed_batch=batch)  # a fresh graph each time
    from shardc.frontend.spec import load_model

    loaded = load_model(spec, device=device, input_shapes=input_shapes)
    return Source(loaded.name, loaded.model, tuple(loaded.example_inputs), loaded.input_names, allow_opaque)


def model_source(model: Any, example_inputs: Any, *, name: str | None = None,
                 input_names: tuple[str, ...] | None = None) -> Source:
    """The `Source` of an nn.Module and its example inputs (a tensor or a tuple of them)."""
    if example_inputs is None:
        raise ShardcError("shardc.compile needs example_inputs (a tuple of tensors in forward's order)")
    inputs = tuple(example_inputs) if isinstance(example_inputs, tuple | list) else (example_inputs,)
    return Source(name or type(model).__name__.lower(), model, inputs, input_names)
