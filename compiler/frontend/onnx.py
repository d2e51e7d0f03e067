"""The ONNX frontend: an ONNX file (opset 17 and newer) lifted into the partition IR.

Rule: float initializers that feed computation become trainable parameters under their own
names; anything computable from constants alone (Shape, Range, ConstantOfShape, shape
arithmetic, masks) is folded at import, so the IR holds only static shapes; scalars become
attributes. Every ONNX node maps to registry ops through one handler table (`HANDLERS`); a
node without a handler is an error naming the node, or an opaque replicated node with
`allow_opaque`. Output types come from running each registry op on the meta device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import shardc.frontend.onnx_ops  # noqa: F401  (fills the handler table)
import shardc.frontend.onnx_tail  # noqa: F401  (the exporters' long tail, as aten fallback nodes)
from shardc.frontend.onnx_import import Importer, OnnxImport, onnx_torch_dtype
from shardc.ir import Graph, Value
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import torch_dtype
from shardc.ops.registry import get_op

MIN_OPSET = 17


def _read_model(path: str) -> Any:
    import onnx

    if not os.path.exists(path):
        raise ShardcError(f"ONNX file {path} does not exist", hint="check the path")
    data = Path(path).read_bytes()
    try:
        model = onnx.load_model_from_string(data)
    except Exception as err:  # protobuf raises DecodeError and friends
        raise ShardcError(
            f"{path} is not an ONNX model (protobuf decoding failed: {err}); the file may be truncated "
            "or of another format", hint="re-export it, e.g. torch.onnx.export(model, args, dynamo=True)"
        ) from None
    if not model.HasField("graph") or not model.graph.node:
        raise ShardcError(f"{path} holds no ONNX graph (is it truncated or another protobuf file?)",
                          hint="re-export the model; the file should contain a graph with nodes")
    external = _external_files(model)
    try:
        # By path when weights sit in files beside it: the checker resolves them from the model's
        # directory, not the working directory (and a model over 2 GiB is only checkable so).
        onnx.checker.check_model(path if external else model)
    except Exception as err:
        raise ShardcError(f"{path} is not a valid ONNX model: {str(err).splitlines()[0]}",
                          hint="the file may be truncated, or its external data files "
                          f"({', '.join(sorted(external)) or 'none'}) missing from {_folder(path)}; re-export it") from None
    if external:
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(model, _folder(path))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < MIN_OPSET:
        raise ShardcError(
            f"{path} uses ONNX opset {opset}, which is too old: shardc imports opset {MIN_OPSET} and newer",
            hint=f"convert it with onnx.version_converter.convert_version(model, {MIN_OPSET}) "
            "or re-export with a newer opset")
    if model.functions:
        from onnx import inliner

        model = inliner.inline_local_functions(model)
    return model


def _folder(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def _external_files(model: Any) -> set[str]:
    """The files (relative to the model's folder) its initializers keep their data in
    (`torch.onnx.export(..., dynamo=True).save(path)` writes `model.onnx.data`)."""
    from onnx.external_data_helper import uses_external_data

    files: set[str] = set()
    for init in model.graph.initializer:
        if uses_external_data(init):
            files.update(e.value for e in init.external_data if e.key == "location")
    return files


def import_onnx(path: str | os.PathLike[str], *, input_shapes: dict[str, tuple[int, ...]] | None = None,
                allow_opaque: bool = False) -> OnnxImport:
    """Import an ONNX file into the IR; `input_shapes` gives static shapes for dynamic inputs."""

    path = str(path)
    model = _read_model(path)
    return Importer(model, path, dict(input_shapes or {}), allow_opaque).run(model)


def parse_input_shapes(specs: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """`["idx=8x128", "mask=8x1x1x128"]` -> {"idx": (8, 128), ...} (the `--input-shape` syntax)."""
    out: dict[str, tuple[int, ...]] = {}
    for spec in specs:
        name, sep, dims = spec.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            out[name] = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise ShardcError(f"--input-shape {spec!r} is malformed", hint="write NAME=DxDxD, e.g. input_ids=8x128") from None
    return out


def write_onnx(result: OnnxImport, params: dict[str, torch.Tensor], out_path: str | os.PathLike[str]) -> None:
    """Write the source model with its initializers replaced by `params` (IR names), atomically."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(result.path)
    by_init = {result.initializer_of[k]: v for k, v in params.items() if k in result.initializer_of}
    missing = set(result.initializer_of) - set(params)
    if missing:
        raise ShardcError(f"write_onnx: no trained value for parameters {sorted(missing)[:5]}")
    for init in model.graph.initializer:
        if init.name in by_init:
            arr = by_init[init.name].detach().cpu().to(onnx_torch_dtype(init.data_type)).numpy()
            init.CopyFrom(numpy_helper.from_array(arr, init.name))
    out_path = str(out_path)
    tmp = out_path + ".tmp"
    try:
        onnx.save(model, tmp)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class OnnxModule(torch.nn.Module):
    """An imported ONNX model as an nn.Module: its parameters under their IR names (dotted names
    become submodules, so `named_parameters()` yields the IR names) and a forward that runs the
    IR with the registry's torch implementations. `shardc.frontend.trace` returns `shardc_graph`
    for it instead of tracing."""

    def __init__(self, result: OnnxImport) -> None:
        super().__init__()
        self.shardc_graph = result.graph
        self.shardc_import = result
        for v in result.graph.params + result.graph.buffers:
            *path, leaf = v.name.split(".")
            owner: torch.nn.Module = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            tensor = result.state[v.name]
            if v.kind == "parameter":
                owner.register_parameter(leaf, torch.nn.Parameter(tensor.clone()))
            else:
                owner.register_buffer(leaf, tensor.clone())

    def shardc_graph_for(self, inputs: Sequence[Any]) -> Graph:
        """The IR for inputs of these shapes: this module's own graph (a copy) when they match,
        else the file imported again at those shapes (its dims must be dynamic there)."""
        import copy

        graph = self.shardc_graph
        shapes = {v.name: tuple(x.shape) for v, x in zip(graph.inputs, inputs)}
        if all(shapes[v.name] == v.type.shape for v in graph.inputs):
            return copy.deepcopy(graph)
        return import_onnx(self.shardc_import.path, input_shapes=shapes).graph

    def forward(self, *inputs: torch.Tensor) -> Any:
        graph = self.shardc_graph
        state = dict(self.named_parameters()) | dict(self.named_buffers())
        env: dict[Value, Any] = dict(zip(graph.inputs, inputs))
        for v in graph.params + graph.buffers:
            env[v] = state[v.name]
        for node in graph.nodes:
            out = get_op(node.op).impl(*[env[v] for v in node.inputs], **node.attrs)
            for v, t in zip(node.outputs, out if isinstance(out, tuple | list) else [out]):
                env[v] = t
        outs = [env[v] for v in graph.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)


def example_inputs(graph: Graph, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs matching the graph's declared types; integer inputs that feed an embedding are
    drawn below its vocabulary size."""
    gen = torch.Generator().manual_seed(seed)
    high: dict[Value, int] = {}
    for node in graph.nodes:
        if node.op == "embedding":
            high[node.inputs[0]] = node.inputs[1].type.shape[0]
    out = []
    for v in graph.inputs:
        dtype = torch_dtype(v.type.dtype)
        if v.type.is_float:
            out.append(torch.randn(v.type.shape, generator=gen, dtype=dtype))
        elif v.type.dtype == "bool":
            out.append(torch.ones(v.type.shape, dtype=torch.bool))
        else:
            out.append(torch.randint(0, high.get(v, 2), v.type.shape, generator=gen, dtype=dtype))
    return tuple(out)


def load_onnx_module(path: str, *, input_shapes: dict[str, tuple[int, ...]] | None = None,
                     seed: int = 0) -> tuple[OnnxModule, tuple[torch.Tensor, ...]]:
    """An ONNX file as (module, example inputs), the form every shardc command takes."""
    result = import_onnx(path, input_shapes=input_shapes)
    return OnnxModule(result), example_inputs(result.graph, seed)
