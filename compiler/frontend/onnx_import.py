"""The ONNX importer's core: the `Importer` that walks an ONNX graph and the handler table
(`HANDLERS`, filled by `shardc.frontend.onnx_ops`) that maps each ONNX op to registry ops.
`shardc.frontend.onnx` is the entry point (`import_onnx`, `write_onnx`, `OnnxModule`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import torch

from shardc.ir import Graph, Location, Node, TensorType, Value
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import dtype_name, torch_dtype
from shardc.ops.registry import get_op

Operand: TypeAlias = Value | torch.Tensor


@dataclass
class OnnxImport:
    """The imported graph, the values of its parameters and buffers by IR name, and for each
    parameter the ONNX initializer it came from (used to write trained weights back)."""

    graph: Graph
    state: dict[str, torch.Tensor]
    initializer_of: dict[str, str] = field(default_factory=dict)
    path: str = ""


def _sanitize(name: str) -> str:
    text = re.sub(r"[^A-Za-z0-9_.]", "_", name).strip(".") or "v"
    return text if not text[0].isdigit() else "v" + text


def _module_path(node: Any) -> str:
    """The torch module path recorded by torch.onnx's exporter, else the node's name scope."""
    for prop in node.metadata_props:
        if prop.key == "namespace":
            scopes = [s.split(":")[0].strip() for s in prop.value.split("/")]
            mods = [s for s in scopes[1:-1] if s]
            return mods[-1] if mods else ""
    if node.name.startswith("/"):
        return ".".join(p for p in node.name.split("/")[1:-1] if p)
    return ""


class Importer:
    def __init__(self, model: Any, path: str, input_shapes: dict[str, tuple[int, ...]], allow_opaque: bool) -> None:
        from onnx import numpy_helper

        self.path = path
        self.allow_opaque = allow_opaque
        name = _sanitize(Path(path).stem or "onnx")
        self.graph = Graph(name)
        self.state: dict[str, torch.Tensor] = {}
        self.initializer_of: dict[str, str] = {}
        self.env: dict[str, Operand] = {}
        self.names: set[str] = set()
        self.initializers: dict[str, torch.Tensor] = {}
        self.held = held_names(model)
        self.weights: dict[int, str] = {}  # id of a trainable initializer's tensor -> its name
        for init in model.graph.initializer:
            t = torch.from_numpy(numpy_helper.to_array(init).copy())
            self.initializers[init.name] = t
            if t.is_floating_point() and t.numel() > 1 and init.name not in self.held:
                self.weights[id(t)] = init.name
            self.env[init.name] = t
        unknown = set(input_shapes) - {i.name for i in model.graph.input}
        if unknown:
            raise ShardcError(f"--input-shape names {sorted(unknown)}, which are not inputs of {path}; its "
                              f"inputs are {[i.name for i in model.graph.input if i.name not in self.initializers]}")
        self.node: Any = None
        for inp in model.graph.input:
            if inp.name in self.initializers:
                continue
            self.env[inp.name] = self._declare_input(inp, input_shapes)

    # ---- values ----
    def _unique(self, name: str) -> str:
        base = _sanitize(name)
        out, i = base, 1
        while out in self.names:
            out, i = f"{base}_{i}", i + 1
        self.names.add(out)
        return out

    def _declare_input(self, inp: Any, input_shapes: dict[str, tuple[int, ...]]) -> Value:
        tt = inp.type.tensor_type
        dtype = dtype_name(onnx_torch_dtype(tt.elem_type))
        if inp.name in input_shapes:
            shape = tuple(input_shapes[inp.name])
            if len(shape) != len(tt.shape.dim):
                raise ShardcError(f"--input-shape {inp.name}={'x'.join(map(str, shape))} has rank {len(shape)} "
                                  f"but input {inp.name!r} has rank {len(tt.shape.dim)}")
            for i, (d, given) in enumerate(zip(tt.shape.dim, shape)):
                if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != given:
                    raise ShardcError(
                        f"input {inp.name!r} of {self.path} fixes dim {i} to {d.dim_value}; it cannot be given as "
                        f"{given}", hint="export the model with that dim dynamic (torch.onnx.export(..., "
                        "dynamic_shapes=...)) to import it at other shapes")
        else:
            shape_list = []
            for i, d in enumerate(tt.shape.dim):
                if d.HasField("dim_value") and d.dim_value > 0:
                    shape_list.append(d.dim_value)
                else:
                    label = d.dim_param or "?"
                    raise ShardcError(
                        f"input {inp.name!r} of {self.path} has a dynamic dimension {label!r} (dim {i}) without a value",
                        hint=f"give static shapes, e.g. --input-shape {inp.name}="
                        + "x".join(str(x.dim_value) if x.dim_value > 0 else "8" for x in tt.shape.dim))
            shape = tuple(shape_list)
        v = Value(self._unique(inp.name), TensorType(shape, dtype), "input")
        self.graph.inputs.append(v)
        return v

    def materialize(self, operand: Operand, hint_name: str) -> Value:
        """A constant used by computation: a float initializer becomes a trainable parameter,
        anything else a buffer; the value is kept in `state`."""
        if isinstance(operand, Value):
            return operand
        for init_name, tensor in self.initializers.items():
            if tensor is operand:
                key = ("init", init_name)
                break
        else:
            init_name, key = "", ("const", str(id(operand)))
        cached = self.env.get(f"\0{key}")
        if isinstance(cached, Value):
            return cached
        dtype = dtype_name(operand.dtype)
        trainable = bool(init_name) and id(operand) in self.weights
        name = self._unique(init_name or hint_name)
        v = Value(name, TensorType(tuple(operand.shape), dtype), "parameter" if trainable else "buffer",
                  requires_grad=trainable)
        (self.graph.params if trainable else self.graph.buffers).append(v)
        self.state[name] = operand
        if trainable:
            self.initializer_of[name] = init_name
        self.env[f"\0{key}"] = v
        return v

    # ---- emitting ----
    def apply(self, op: str, operands: Sequence[Operand], attrs: dict[str, Any] | None = None,
              scalar_attr: bool = False) -> list[Operand]:
        """Fold `op` when every operand is a constant, else emit an IR node. With `scalar_attr`,
        a one-element constant operand of a binary op becomes the `other` attribute."""
        attrs = dict(attrs or {})
        opdef = get_op(op)
        # Constants fold, but not a weight: `Transpose(W)` stays a node, so W itself is trained.
        if all(isinstance(o, torch.Tensor) and id(o) not in self.weights for o in operands):
            result = opdef.impl(*operands, **attrs)
            return list(result) if isinstance(result, tuple | list) else [result]
        ops = list(operands)
        if scalar_attr and len(ops) == 2:
            for i, o in enumerate(ops):
                if isinstance(o, torch.Tensor) and o.numel() == 1:
                    other = ops[1 - i]
                    assert isinstance(other, Value)
                    attrs["other"] = o.item()
                    if i == 0:
                        attrs["reverse"] = True
                    ops = [other]
                    break
        values = [self.materialize(o, f"{self.node.output[0]}_c{i}") for i, o in enumerate(ops)]
        metas = [torch.empty(v.type.shape, dtype=torch_dtype(v.type.dtype), device="meta") for v in values]
        try:
            result = opdef.impl(*metas, **attrs)
        except Exception as err:
            raise ShardcError(f"ONNX node {self.node.name!r} ({self.node.op_type}) cannot be imported as "
                              f"{op}: {err}", where=self.path) from None
        results = list(result) if isinstance(result, tuple | list) else [result]
        names = list(self.node.output)[: len(results)] + [f"{self.node.output[0]}_{i}" for i in range(len(results))]
        outs = [Value(self._unique(names[i]), TensorType(tuple(r.shape), dtype_name(r.dtype)))
                for i, r in enumerate(results)]
        loc = Location(_module_path(self.node), f"{Path(self.path).name}:{self.node.name or self.node.op_type}")
        self.graph.nodes.append(Node(op, values, outs, attrs, loc))
        return list(outs)

    def run(self, model: Any) -> OnnxImport:
        for node in model.graph.node:
            self.node = node
            handler = HANDLERS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            ins = [self.env[n] if n else None for n in node.input]
            if handler is None:
                outs = self._unhandled(node, ins)
            else:
                outs = handler(self, ins, _attrs(node))
            for name, v in zip(node.output, outs):
                if name:
                    self.env[name] = v
        for out in model.graph.output:
            o = self.env[out.name]
            if isinstance(o, torch.Tensor):
                raise ShardcError(f"output {out.name!r} of {self.path} is a constant; shardc needs outputs "
                                  "computed from the inputs")
            self.graph.outputs.append(o)
        return OnnxImport(self.graph, self.state, self.initializer_of, self.path)

    def _unhandled(self, node: Any, ins: list[Operand | None]) -> list[Operand]:
        op = f"{node.domain + '::' if node.domain else ''}{node.op_type}"
        raise ShardcError(
            f"ONNX op {op} (node {node.name!r}, module {_module_path(node) or '?'}) has no registry entry",
            where=self.path,
            hint="add a handler to shardc.frontend.onnx_ops mapping it to registry ops (opaque nodes are "
            "not supported for ONNX: shardc could not execute them)")


_SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
_HELD = re.compile(r"^\w+: (?:BUFFER|CONSTANT_TENSOR) target='([^']+)'", re.M)


_PARAMETER = re.compile(r"^\w+: PARAMETER target='([^']+)'", re.M)


def held_names(model: Any) -> set[str]:
    """Float initializers that are not trained. Without a torch graph signature: none (every
    float initializer of more than one element is a weight). With the signature torch.onnx's
    exporter keeps in the graph's metadata: the torch model's buffers and constants (a rotary
    `inv_freq`), and initializers its optimiser folded from them (rotary tables, masks), told
    from folded weights (`Transpose(W)` folded) in that no MatMul or Gemm reads them."""
    text = next((p.value for p in model.graph.metadata_props if p.key == _SIGNATURE), "")
    if not text:
        return set()
    params = set(_PARAMETER.findall(text))
    multiplied = {name for node in model.graph.node if node.op_type in ("MatMul", "Gemm") for name in node.input}
    return set(_HELD.findall(text)) | {i.name for i in model.graph.initializer
                                       if i.name not in params and i.name not in multiplied}


def onnx_torch_dtype(elem_type: int) -> torch.dtype:
    from onnx import TensorProto

    table: dict[int, torch.dtype] = {TensorProto.FLOAT: torch.float32, TensorProto.DOUBLE: torch.float64, TensorProto.FLOAT16: torch.float16,
             TensorProto.BFLOAT16: torch.bfloat16, TensorProto.INT64: torch.int64, TensorProto.INT32: torch.int32,
             TensorProto.INT8: torch.int8, TensorProto.UINT8: torch.uint8, TensorProto.BOOL: torch.bool,
             TensorProto.INT16: torch.int16}
    if elem_type not in table:
        raise ShardcError(f"ONNX element type {elem_type} is not supported")
    return table[elem_type]


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper, numpy_helper

    out: dict[str, Any] = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if hasattr(v, "dims") and hasattr(v, "data_type"):
            v = torch.from_numpy(numpy_helper.to_array(v).copy())
        elif isinstance(v, bytes):
            v = v.decode()
        out[a.name] = v
    return out


Handler = Callable[[Importer, list[Any], dict[str, Any]], list[Operand]]
HANDLERS: dict[str, Handler] = {}


