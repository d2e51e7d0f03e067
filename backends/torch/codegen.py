"""Codegen: one `torch.fx.GraphModule` per rank from a lowered IR graph.

Rule. Nodes are grouped by layer into regions: each layer becomes a sub-GraphModule at the
layer's module path (`blocks.0`), called from the root module; nodes outside layers live in
the root. Recomputation runs as each layer's annotation says, as the cost model prices it:
`full` calls the layer's module through `torch.utils.checkpoint.checkpoint(use_reentrant=False)`
(only its inputs are kept); `selective` calls, inside the layer's module, each attention core
(`shardc.analysis.attention`: QK^T through PV) as a module of its own (`attention_core`)
through checkpoint, so the core's own tensors are dropped and recomputed while its inputs and
output are kept (a layer with fused attention has no core and runs plainly); `none` is a plain
call. Every parameter and buffer is an `nn.Parameter` / buffer at its own module path holding
this rank's shard only (so `state_dict()` keys are the model's). Each IR node becomes one call
(`emit.py`): the registry impl on local tensors, an autograd-aware collective (`collectives.py`),
a sharding-aware local op (`local_ops.py`) or a temporal loop (`temporal.py`). fx node names are
the IR value names, so `module.code` reads like the IR.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from shardc.analysis.attention import attention_core, batch_dependent, core_runs, layer_nodes
from shardc.analysis.head_loss import HeadLoss, fused_heads
from shardc.backends.torch import collectives as C
from shardc.backends.torch import grid2d as G
from shardc.backends.torch import ring as R
from shardc.backends.torch.emit import Emitter, local_shape, py_name
from shardc.backends.torch.precision import compute_dtype
from shardc.cost.compute import localize
from shardc.cost.edges import regathered_by
from shardc.ir import Graph, Layout, Mesh, Node, Shard, Value
from shardc.ir.diagnostics import ShardcError


def module_path(layer: str) -> str:
    """A layer name as a module path: dotted parts that are identifiers or digits."""
    return ".".join(p if p.isidentifier() or p.isdigit() else py_name(p) for p in layer.split(".") if p) or "layer"


def local_piece(tensor: torch.Tensor, layout: Layout, mesh: Mesh, coords: dict[str, int]) -> torch.Tensor:
    """This rank's piece of a full tensor under `layout` (Shard placements applied in mesh order)."""
    for axis, p in layout.placements:
        if isinstance(p, Shard):
            tensor = R.take(tensor, mesh.axis_size(axis), coords[axis], p.dim, p.interleave, p.zigzag)
    return tensor


def local_input(x: torch.Tensor, mesh: C.MeshGroups, name: str, shape: tuple[int, ...],
                shards: tuple[tuple[Any, ...], ...] = (), device: str = "cpu") -> torch.Tensor:
    """Check a global input against its traced shape, then keep this rank's piece of it (on `device`)."""
    if tuple(x.shape) != tuple(shape):
        raise ShardcError(f"input {name} has shape {tuple(x.shape)}, but the plan was compiled for "
                          f"{tuple(shape)}", hint="shapes are static: compile the plan again with example "
                          "inputs of this shape")
    for shard in shards:  # (axis, dim, interleave), or with a 4th item "zigzag" (see `Shard`)
        axis, dim, interleave = shard[:3]
        x = R.take(x, mesh.size(axis), mesh.coord(axis), dim, interleave, len(shard) > 3)
    return x.to(device)


@dataclass
class Region:
    """A run of nodes of one layer (`path` None: the root's own nodes)."""

    layer: str | None
    path: str | None
    nodes: list[Node]


def regions_of(graph: Graph) -> list[Region]:
    out: list[Region] = []
    used: set[str] = set()
    for node in graph.nodes:
        if out and out[-1].layer == node.layer:
            out[-1].nodes.append(node)
            continue
        path = None
        if node.layer is not None:
            path = base = module_path(node.layer)
            k = 1
            # a path nested in another region's (T5's `encoder` after `encoder.block.0`) is
            # renamed too: placing one module would replace or hide the other
            while any(path == u or u.startswith(path + ".") or path.startswith(u + ".") for u in used):
                k += 1
                path = f"{base}_{k}"
            used.add(path)
        out.append(Region(node.layer, path, [node]))
    return out


def _place(root: nn.Module, path: str, obj: Any, kind: str = "module") -> None:
    """Set `obj` at dotted `path` under `root`, creating plain container modules on the way."""
    *parents, leaf = path.split(".")
    mod = root
    for part in parents:
        child = getattr(mod, part, None) if hasattr(mod, part) else None
        if child is None:
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    if kind == "parameter":
        mod.register_parameter(leaf, obj)
    elif kind == "buffer":
        mod.register_buffer(leaf, obj)
    else:
        mod.add_module(leaf, obj)


def _under(path: str | None, name: str) -> str | None:
    if path is None or not name.startswith(path + "."):
        return None
    return name[len(path) + 1 :]


@dataclass(frozen=True)
class _Rank:
    """What every region of one rank's module reads: the mesh and this rank's coordinates, its
    process groups, each parameter's and buffer's kind and tensor, the layer path holding it
    (`home`; absent: the root), and the index of the last region reading each value."""

    mesh: Mesh
    coords: dict[str, int]
    groups: C.MeshGroups
    kinds: dict[Value, str]
    objects: dict[Value, torch.Tensor]
    home: dict[Value, str]
    last_read: dict[Value, int]
    compute: torch.dtype | None = None  # mixed precision's compute dtype (`precision.py`)
    regather: dict[Node, list[Node]] = field(default_factory=dict)  # `regathered`: gather -> its linears
    heads: dict[Node, HeadLoss] = field(default_factory=dict)  # `head_losses`: each node of a fused head and loss

    def state_path(self, v: Value) -> str:
        return f"{self.home[v]}.{_under(self.home[v], v.name)}" if v in self.home else v.name


def _state(graph: Graph, mesh: Mesh, tensors: dict[str, torch.Tensor] | None) -> tuple[dict[Value, str],
                                                                                      dict[Value, torch.Tensor]]:
    """Each parameter's and buffer's kind and this rank's tensor: the given shard (an
    `nn.Parameter` there is used as it is), else a meta tensor of the local shape."""
    kinds = dict.fromkeys(graph.params, "parameter") | dict.fromkeys(graph.buffers, "buffer")

    def tensor_of(v: Value, kind: str) -> torch.Tensor:
        if tensors is not None and v.name in tensors:
            t = tensors[v.name]
            if isinstance(t, nn.Parameter):
                return t
        else:
            from shardc.ir.dtypes import torch_dtype

            t = torch.empty(local_shape(v, mesh), dtype=torch_dtype(v.type.dtype), device="meta")
        return nn.Parameter(t, requires_grad=v.requires_grad) if kind == "parameter" else t

    return kinds, {v: tensor_of(v, kind) for v, kind in kinds.items()}


def _placement(graph: Graph, regions: list[Region], kinds: dict[Value, str]) -> tuple[dict[Value, str],
                                                                                      dict[Value, int]]:
    """Where each parameter and buffer lives (the first layer reading it that its name lies
    under) and the last region reading each value (graph outputs: past the last region)."""
    last_read: dict[Value, int] = {}
    for k, region in enumerate(regions):
        for n in region.nodes:
            for v in n.inputs:
                last_read[v] = k
    for v in graph.outputs:
        last_read[v] = len(regions)
    home: dict[Value, str] = {}
    for region in regions:
        for n in region.nodes:
            for v in n.inputs:
                if v in kinds and v not in home and _under(region.path, v.name):
                    home[v] = region.path or ""
    return home, last_read


def _layer_module(rank: _Rank, region: Region, k: int,
                  core: Collection[Node] = frozenset()) -> tuple[fx.GraphModule, list[Value], list[Value]]:
    """Region `k` as a sub-GraphModule holding the parameters and buffers at home in it; with
    the values it takes from the root (in order) and those it returns that later regions read.
    Each run of `core` nodes (the attention cores of a layer recomputed selectively) becomes a
    module of its own, called through `checkpoint` (`_core_call`)."""
    path = region.path
    assert path is not None
    sub = fx.Graph()
    sub_env: dict[Value, fx.Node] = {}
    region_inputs: list[Value] = []
    produced = {v for n in region.nodes for v in n.outputs}
    for n in region.nodes:
        for v in n.inputs:
            if v in produced or v in sub_env:
                continue
            if v in rank.kinds and rank.home.get(v) == path:
                continue
            sub_env[v] = sub.placeholder(py_name(v.name))
            region_inputs.append(v)
    sub_mesh = sub.get_attr("mesh")
    emit = Emitter(sub, rank.mesh, rank.coords, sub_mesh, rank.compute)
    sub_attrs: dict[str, Any] = {"mesh": rank.groups}

    def arg(v: Value) -> fx.Node:
        if v not in sub_env:  # a parameter or buffer this layer holds
            rel = _under(path, v.name)
            assert rel is not None
            sub_env[v] = emit.read(v, sub.get_attr(rel))
            sub_attrs[rel] = rank.objects[v]
        return sub_env[v]

    emit.skews = G.prefetch_skews([n for n in region.nodes if n not in core], arg, emit.call_positional, sub_mesh)
    runs = core_runs(region.nodes, core)
    for j, run in enumerate(runs):
        if run[0] in core:
            later = {v for r in runs[j + 1:] for n in r for v in n.inputs}
            wanted = [v for n in run for v in n.outputs if v in later or rank.last_read.get(v, -1) > k]
            count = sum(r[0] in core for r in runs[:j])  # cores before this one (cross-attention)
            name = "attention_core" + (f"_{count + 1}" if count else "")
            sub_attrs[name] = _core_call(rank, run, wanted, sub, name, arg, sub_env)
            continue
        for n in run:
            if n in rank.regather:
                sub_env[n.outputs[0]] = _gather_linears(emit, rank, n, arg)
                continue
            if n in rank.heads:
                _head_loss(emit, rank.heads[n], n, arg, sub_env)
                continue
            args = [arg(v) for v in n.inputs]
            for v, out in zip(n.outputs, emit.node(n, args)):
                sub_env[v] = out
    outputs = [v for n in region.nodes for v in n.outputs if rank.last_read.get(v, -1) > k]
    sub.output(tuple(sub_env[v] for v in outputs))
    return fx.GraphModule(sub_attrs, sub, class_name=f"Layer_{py_name(path)}"), region_inputs, outputs


def _core_call(rank: _Rank, run: list[Node], wanted: list[Value], outer: fx.Graph, name: str,
               arg: Callable[[Value], fx.Node], env: dict[Value, fx.Node]) -> fx.GraphModule:
    """An attention core as a module of its own (every value it reads, parameters and buffers
    included, is an argument), called from `outer` through `checkpoint(use_reentrant=False)`:
    autograd keeps its arguments and what it returns (`wanted`, read after it), and drops and
    recomputes in backward every tensor made inside it, as `finish_layer` prices `selective`."""
    g = fx.Graph()
    inner: dict[Value, fx.Node] = {}
    inputs: list[Value] = []
    made = {v for n in run for v in n.outputs}
    for n in run:
        for v in n.inputs:
            if v not in made and v not in inner:
                inner[v] = g.placeholder(py_name(v.name))
                inputs.append(v)
    mesh = g.get_attr("mesh")
    emit = Emitter(g, rank.mesh, rank.coords, mesh)
    emit.skews = G.prefetch_skews(run, inner.__getitem__, emit.call_positional, mesh)
    for n in run:
        for v, out in zip(n.outputs, emit.node(n, [inner[w] for w in n.inputs])):
            inner[v] = out
    g.output(tuple(inner[v] for v in wanted))
    call_args = tuple(arg(v) for v in inputs)
    fn = outer.get_attr(name)
    call = outer.create_node("call_function", torch.utils.checkpoint.checkpoint, (fn, *call_args),
                             {"use_reentrant": False}, name=f"{name}_out")
    for j, v in enumerate(wanted):
        env[v] = outer.create_node("call_function", operator.getitem, (call, j), {}, name=py_name(v.name))
    return fx.GraphModule({"mesh": rank.groups}, g, class_name="AttentionCore")


class _Root:
    """The root module's fx graph: global inputs cut to this rank's pieces, the root's own
    nodes, and one call per layer module (through `checkpoint` when the layer recomputes)."""

    def __init__(self, rank: _Rank) -> None:
        self.rank = rank
        self.graph = fx.Graph()
        self.mesh_node = self.graph.get_attr("mesh")
        self.emit = Emitter(self.graph, rank.mesh, rank.coords, self.mesh_node, rank.compute)
        self.env: dict[Value, fx.Node] = {}

    def inputs(self, values: list[Value], local_inputs: bool, device: str) -> None:
        for v in values:
            ph = self.graph.placeholder(py_name(v.name))
            if local_inputs:
                self.env[v] = self.emit.read(v, ph)
                continue
            shards = tuple((a, p.dim, p.interleave) + (("zigzag",) if p.zigzag else ())
                           for a, p in (v.layout or Layout()).placements if isinstance(p, Shard))
            kw = {"name": v.name, "shape": v.type.shape, "shards": shards} | ({"device": device} if device != "cpu" else {})
            self.env[v] = self.emit.read(v, self.emit.call(local_input, (ph, self.mesh_node), kw, f"{v.name}_local"))

    def value(self, v: Value) -> fx.Node:
        """`v` in the root: a computed value, or a parameter or buffer read at its path."""
        if v in self.rank.kinds and v not in self.env:
            self.env[v] = self.emit.read(v, self.graph.get_attr(self.rank.state_path(v)))
        return self.env[v]

    def nodes(self, region: Region) -> None:
        for n in region.nodes:
            if n in self.rank.regather:
                self.env[n.outputs[0]] = _gather_linears(self.emit, self.rank, n, self.value)
                continue
            if n in self.rank.heads:
                _head_loss(self.emit, self.rank.heads[n], n, self.value, self.env)
                continue
            args = [self.value(v) for v in n.inputs]
            for v, out in zip(n.outputs, self.emit.node(n, args)):
                self.env[v] = out

    def call_layer(self, graph: Graph, region: Region, inputs: list[Value], outputs: list[Value]) -> None:
        path = region.path
        assert path is not None
        call_args = tuple(self.value(v) for v in inputs)
        layer = graph.layers.get(region.layer or "")
        if layer is not None and layer.annotation.recompute == "full":
            fn = self.graph.get_attr(path)
            call = self.emit.call(torch.utils.checkpoint.checkpoint, (fn, *call_args), {"use_reentrant": False},
                                  f"{path}_out")
        else:
            call = self.graph.create_node("call_module", path, call_args, {}, name=py_name(f"{path}_out"))
        for j, v in enumerate(outputs):
            self.env[v] = self.graph.create_node("call_function", operator.getitem, (call, j), {}, name=py_name(v.name))


def generate(graph: Graph, rank: int, tensors: dict[str, torch.Tensor] | None = None,
             groups: C.MeshGroups | None = None, device: str = "cpu", local_inputs: bool = False) -> fx.GraphModule:
    """The module rank `rank` runs. `tensors` maps parameter/buffer names to this rank's local
    shards (meta tensors of the local shapes when None, e.g. to print code); an `nn.Parameter`
    there is used as it is (shared by the modules of several pipeline stages on one rank).
    With `local_inputs` the inputs are this rank's pieces already (a pipeline stage's). Under mixed
    precision (the graph's `dtype` attribute) float parameters, buffers and inputs are cast to the
    compute dtype where read (`precision.py`)."""
    mesh = graph.mesh
    if mesh is None:
        raise ShardcError(f"graph @{graph.name} has no mesh; lower a partitioned graph before codegen")
    coords = mesh.coordinates(rank)
    kinds, objects = _state(graph, mesh, tensors)
    regions = regions_of(graph)
    home, last_read = _placement(graph, regions, kinds)
    ctx = _Rank(mesh, coords, groups or C.MeshGroups(dict(mesh.axes), coords), kinds, objects, home, last_read,
                compute_dtype(graph), regathered(graph), head_losses(graph))
    cores = selective_cores(graph)
    root = _Root(ctx)
    root.inputs(graph.inputs, local_inputs, device)
    submodules: list[tuple[str, fx.GraphModule]] = []
    for k, region in enumerate(regions):
        if region.path is None:
            root.nodes(region)
            continue
        module, inputs, outputs = _layer_module(ctx, region, k, cores.get(region.layer, frozenset()))
        submodules.append((region.path, module))
        root.call_layer(graph, region, inputs, outputs)
    outs = [root.env[v] for v in graph.outputs]
    root.graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    holder = nn.Module()
    holder.add_module("mesh", ctx.groups)
    for path, module in submodules:
        _place(holder, path, module)
    for v, kind in kinds.items():
        _place(holder, ctx.state_path(v), objects[v], kind)
    root.graph.lint()
    return fx.GraphModule(holder, root.graph, class_name=f"{py_name(graph.name)}_rank{rank}")


# Collectives a chain of edge steps may put before a gather (the cost model's `saves_shard`
# takes a gather that is its edge's only step).
_CHAINED = frozenset({"recv", "all_to_all", "chunk", "pad", "all_gather", "to_partial", "grad_all_reduce", "rotate"})


def _weight(v: Value) -> bool:
    """A parameter, or a parameter through its `grad_sync` marker (identity here: the data-parallel
    wrapper syncs its gradient), as the cost model sees it before lowering."""
    marker = v.producer
    return v.kind == "parameter" or (marker is not None and marker.op == "grad_sync"
                                     and marker.inputs[0].kind == "parameter")


def regathered(graph: Graph) -> dict[Node, list[Node]]:
    """The all_gathers of a lowered graph whose copy only column-parallel linears read
    (`shardc.cost.edges.regathered_by`, the rule the cost model prices): gather -> its readers,
    in order. Each runs as `collectives.gather_linears` (the shard saved, gathered again in backward)."""
    users = graph.users()
    out: dict[Node, list[Node]] = {}
    for node in graph.nodes:
        if node.op != "all_gather" or node.outputs[0] in graph.outputs:
            continue
        src = node.inputs[0].producer
        shard = (node.inputs[0].layout or Layout()).on(node.attrs["axis"])
        if (src is not None and src.op in _CHAINED) or (isinstance(shard, Shard) and shard.zigzag):
            continue
        readers = [(u, j) for u in users.get(node.outputs[0], []) for j, w in enumerate(u.inputs) if w is node.outputs[0]]
        if regathered_by(readers, lambda n: n.partition is None or not n.partition.temporal, _weight) and all(
                u.layer == node.layer for u, _ in readers):
            out[node] = [u for u, _ in readers]
    return out


def _gather_linears(emit: Emitter, rank: _Rank, gather: Node, value: Callable[[Value], fx.Node]) -> fx.Node:
    readers = rank.regather[gather]
    params: list[fx.Node | None] = []
    def param(v: Value) -> fx.Node:
        # A `grad_sync` marker is the identity (`_weight`): within this layer (emitted in graph order,
        # maybe after the gather) read the parameter itself; from another layer (a tied weight) the
        # marker's value, which this layer receives.
        marker = v.producer
        local = marker is not None and marker.op == "grad_sync" and marker.layer == gather.layer
        return value(marker.inputs[0] if local and marker is not None else v)

    for u in readers:  # weight and bias (None without) of each reader
        params += [param(u.inputs[1]), param(u.inputs[2]) if len(u.inputs) > 2 else None]
    kinds = tuple(u.op for u in readers)
    return emit.gather_linears(gather, value(gather.inputs[0]), readers, params, kinds)


def head_losses(graph: Graph) -> dict[Node, HeadLoss]:
    """The fused head-and-loss regions of a lowered graph (`shardc.analysis.head_loss`, the rule
    the cost model prices), by each of their nodes: each runs as one `chunked_linear_cross_entropy`."""
    mesh = graph.mesh

    def layouts(node: Node) -> tuple[tuple[Layout, ...], tuple[Layout, ...]]:
        local = localize(node, mesh, "f32")
        return local.in_layouts, local.out_layouts

    return fused_heads(graph.nodes, graph.users(), lambda n: n.partition, lambda v: v.layout or Layout(), layouts,
                       graph.outputs)


def _head_loss(emit: Emitter, region: HeadLoss, node: Node, value: Callable[[Value], fx.Node],
               env: dict[Value, fx.Node]) -> None:
    """A node of a fused head and loss: the loss emits the region's one call; the linear and the
    reshapes before it emit nothing (their values are never made)."""
    if node is not region.loss:
        return
    head = region.linear
    bias = value(head.inputs[2]) if len(head.inputs) > 2 else None
    env[node.outputs[0]] = emit.head_loss(region, value(head.inputs[0]), value(head.inputs[1]), bias,
                                          value(node.inputs[1]))


def selective_cores(graph: Graph) -> dict[str | None, frozenset[Node]]:
    """The attention cores (`shardc.analysis.attention`) of the layers annotated `selective`, by
    layer: the nodes their generated module runs under checkpoint (empty: nothing recomputed)."""
    chosen = {name for name, layer in graph.layers.items() if layer.annotation.recompute == "selective"}
    if not chosen:
        return {}
    batched = batch_dependent(graph)
    return {name: attention_core(nodes, batched) for name, nodes in layer_nodes(graph).items() if name in chosen}


def module_code(module: nn.Module) -> str:
    """The generated code of a rank's root module and of every layer module under it."""
    root_code = str(getattr(module, "code", ""))
    parts = [f"# ---- {type(module).__name__} (root) ----\n{root_code.strip()}\n"]
    for path, sub in module.named_modules():
        if path and isinstance(sub, fx.GraphModule):
            parts.append(f"# ---- {path}: {type(sub).__name__} ----\n{sub.code.strip()}\n")
    return "\n".join(parts)
