"""Capture a torch model as a torch.fx graph: symbolic trace first, torch.export as the fallback.

The symbolic tracer descends into every module (no leaf modules), records source stack traces
and proxies buffers, so each call lands as a torch function or tensor method with the module
path in `nn_module_stack`. Models it cannot trace (data-dependent Python control flow, as in
most transformers models) go to `torch.export.export(strict=False)`, whose graph holds aten
ops. Either way `Captured.leaves` says what every placeholder and get_attr node stands for:
a graph input, a parameter or buffer (by its `named_parameters()`/`named_buffers()` path, tied
weights collapsing to the first path), a constant tensor, or a plain Python value.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from shardc.ir.diagnostics import ShardcError

# ("input", name, example) | ("parameter", name, tensor) | ("buffer", name, tensor) | ("constant", tensor)
# | ("python", value)
Leaf = tuple[Any, ...]


@dataclass
class Captured:
    graph: torch.fx.Graph
    tracer: str  # "fx" or "export"
    leaves: dict[str, Leaf] = field(default_factory=dict)  # fx node name -> what it stands for
    user_outputs: list[int] | None = None  # export: which outputs are the model's own


class _Tracer(torch.fx.Tracer):
    """Trace through every module; keep stack traces; give buffers their own get_attr nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return False

    def trace(self, root: Any, concrete_args: Any = None) -> torch.fx.Graph:
        self._paths: dict[int, str] = {}
        if isinstance(root, torch.nn.Module):
            for name, t in list(root.named_buffers()) + list(root.named_parameters()):
                self._paths[id(t)] = name  # parameters win: a tensor both ways is a parameter
        return super().trace(root, concrete_args)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        """Parameters and buffers become get_attr nodes, found by identity in O(1) (the base class
        scans every parameter on every access, which dominates tracing a 96-layer model)."""
        name = self._paths.get(id(attr_val)) if isinstance(attr_val, torch.Tensor) else None
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]


def _positional_params(model: torch.nn.Module) -> list[inspect.Parameter]:
    params = list(inspect.signature(model.forward).parameters.values())
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _names(model: torch.nn.Module) -> tuple[dict[int, str], dict[int, str]]:
    params = {id(p): n for n, p in model.named_parameters()}
    buffers = {id(b): n for n, b in model.named_buffers()}
    return params, buffers


def _classify(obj: Any, params: dict[int, str], buffers: dict[int, str]) -> Leaf:
    if isinstance(obj, torch.Tensor):
        if id(obj) in params:
            return ("parameter", params[id(obj)], obj)
        if id(obj) in buffers:
            return ("buffer", buffers[id(obj)], obj)
        return ("constant", obj)
    return ("python", obj)


def capture_fx(model: torch.nn.Module, inputs: tuple[Any, ...], input_names: list[str]) -> Captured:
    params = _positional_params(model)
    if len(inputs) > len(params):
        raise TypeError(f"forward takes {len(params)} positional arguments but {len(inputs)} example inputs were given")
    concrete = {}
    for p in params[len(inputs):]:
        if p.default is p.empty:
            raise TypeError(f"forward argument {p.name!r} has no example input and no default")
        concrete[p.name] = p.default
    before = set(vars(model))
    try:
        graph = _Tracer().trace(model, concrete_args=concrete or None)
        return _fx_leaves(model, graph, inputs, input_names, params, concrete)
    finally:
        for attr in set(vars(model)) - before:  # fx parks tensor constants on the root; take them back
            delattr(model, attr)


def _fx_leaves(model: torch.nn.Module, graph: torch.fx.Graph, inputs: tuple[Any, ...], input_names: list[str],
               params: list[inspect.Parameter], concrete: dict[str, Any]) -> Captured:
    pnames, bnames = _names(model)
    captured = Captured(graph, "fx")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        if i < len(inputs):
            captured.leaves[node.name] = ("input", input_names[i], inputs[i])
        else:
            captured.leaves[node.name] = ("python", concrete[params[i].name] if i < len(params) else None)
    for node in graph.nodes:
        if node.op == "get_attr":
            obj: Any = model
            for atom in str(node.target).split("."):
                obj = getattr(obj, atom)
            captured.leaves[node.name] = _classify(obj, pnames, bnames)
    return captured


def capture_export(model: torch.nn.Module, inputs: tuple[Any, ...], input_names: list[str]) -> Captured:
    from torch.export.graph_signature import InputKind, OutputKind

    program = torch.export.export(model, tuple(inputs), strict=False)
    sig = program.graph_signature
    pnames, bnames = _names(model)
    by_path = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    captured = Captured(program.graph, "export")
    user = 0
    for spec in sig.input_specs:
        name = getattr(spec.arg, "name", None)
        if name is None:
            continue
        if spec.kind == InputKind.USER_INPUT:
            example = inputs[user] if user < len(inputs) else None
            captured.leaves[name] = ("input", input_names[user], example) if isinstance(example, torch.Tensor) \
                else ("python", example)
            user += 1
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) or (
                spec.kind == InputKind.CONSTANT_TENSOR and spec.target in by_path):
            captured.leaves[name] = _classify(by_path[str(spec.target)], pnames, bnames)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            captured.leaves[name] = ("constant", program.constants[str(spec.target)])
        else:
            raise ShardcError(f"torch.export gave an input of kind {spec.kind.name} ({spec.target}), which shardc cannot lower")
    captured.user_outputs = [i for i, spec in enumerate(sig.output_specs) if spec.kind == OutputKind.USER_OUTPUT]
    return captured


def capture(model: torch.nn.Module, inputs: tuple[Any, ...], input_names: list[str]) -> Captured:
    """fx symbolic trace, else torch.export; a model neither can trace is a ShardcError naming both reasons.
    transformers' routed-expert blocks are captured as one op each (`shardc.frontend.moe`)."""
    from shardc.frontend.moe import one_op_experts

    with one_op_experts(model):
        return _capture(model, inputs, input_names)


def _capture(model: torch.nn.Module, inputs: tuple[Any, ...], input_names: list[str]) -> Captured:
    try:
        return capture_fx(model, inputs, input_names)
    except Exception as fx_err:
        try:
            return capture_export(model, inputs, input_names)
        except ShardcError:
            raise
        except Exception as export_err:
            where = culprit(model, export_err) or culprit(model, fx_err)
            raise ShardcError(
                f"cannot trace {type(model).__name__}: torch.fx symbolic trace failed "
                f"({type(fx_err).__name__}: {_first_line(fx_err)}) and torch.export failed "
                f"({type(export_err).__name__}: {_first_line(export_err)})"
                + (f"\n  in module {where}" if where else ""),
                hint="make the model's control flow independent of tensor values (use torch.where, "
                     "or torch.cond), or pass example inputs that trace",
            ) from export_err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else "no message"


_TORCH_DIR = os.path.dirname(torch.__file__)


def culprit(model: torch.nn.Module, err: BaseException) -> str:
    """The innermost module of `model` running when `err` was raised, with the user's source line."""
    owners = {id(m): path for path, m in model.named_modules()}
    seen: set[int] = set()
    chain: BaseException | None = err
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        frames = []
        tb = chain.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        for frame in reversed(frames):
            owner = frame.f_locals.get("self")
            if id(owner) in owners:
                path = owners[id(owner)] or "<root>"
                line = next((f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" for f in reversed(frames)
                             if not f.f_code.co_filename.startswith(_TORCH_DIR)), "")
                return f"{path} ({type(owner).__name__})" + (f" at {line}" if line else "")
        chain = chain.__cause__ or chain.__context__
    return ""


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_THIS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_of(stack_trace: str | None) -> str:
    """`file.py:line` of the innermost frame outside torch and shardc."""
    frames = _FRAME.findall(stack_trace or "")
    for path, line in reversed(frames):
        if not path.startswith(_TORCH_DIR) and not os.path.abspath(path).startswith(_THIS_DIR):
            return f"{os.path.basename(path)}:{line}"
    return f"{os.path.basename(frames[-1][0])}:{frames[-1][1]}" if frames else ""


_EXPORT_PATH = re.compile(r"\[(\d+)\]|\['([^']+)'\]")


def module_path_of(node: torch.fx.Node) -> str:
    """The innermost module the node ran in, as a `named_modules()` path (`blocks.3.attn`)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if path.startswith("L['self']") or path.startswith("L__self__"):  # strict export's spelling
        path = re.sub(r"^L\['self'\]\.?|^L__self__\.?", "", path)
        path = _EXPORT_PATH.sub(lambda m: "." + (m.group(1) or m.group(2)), path).lstrip(".")
    return str(path)
