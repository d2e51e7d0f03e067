"""IR nodes as torch.fx calls on one rank's local tensors (`shardc.backends.torch.codegen`
assembles the modules from them).

Rule. A collective becomes its autograd-aware function (`collectives.py`; the zig-zag
variants of `ring.py` when a side is a zig-zag shard; grad_sync, send and recv are left to the
data-parallel wrapper and the pipeline runtime); a node with a temporal split becomes a loop
(`temporal.py`: chunks, or shards rotating over a mesh axis; ring attention; PrimePar's 2-D
grid of `grid2d.py`); any other node the registry op on local tensors, or its sharding-aware
form (`local_ops.py`: vocab-parallel embedding and cross entropy, attention at its query
offset). fx node names are the IR value names. A partition the capability table
(`shardc.ops.lowering`) refuses raises its reason, the rule the solver's candidates obey.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from shardc.analysis.head_loss import HeadLoss
from shardc.backends.torch import collectives as C
from shardc.backends.torch import experts as X
from shardc.backends.torch import grid2d as G
from shardc.backends.torch import local_ops as L
from shardc.backends.torch import precision as P
from shardc.backends.torch import ring as R
from shardc.backends.torch import temporal as T
from shardc.backends.torch.fused_loss import chunked_linear_cross_entropy
from shardc.ir import Layout, Mesh, Node, Shard, Value
from shardc.ir.diagnostics import ShardcError
from shardc.ops.lowering import Site, refusal
from shardc.ops.registry import get_op

MEAN_OPS = frozenset({"mean"})


def py_name(name: str) -> str:
    """A Python identifier for an IR name (`blocks.0.ln.weight` -> `blocks_0_ln_weight`)."""
    text = re.sub(r"\W", "_", name)
    return text if text and not text[0].isdigit() else f"v_{text}"


def local_shape(v: Value, mesh: Mesh) -> tuple[int, ...]:
    return (v.layout or Layout()).local_shape(v.type.shape, mesh)


def shard_offset(v: Value, dim: int, mesh: Mesh, coords: dict[str, int]) -> int:
    """Global index of the first element of this rank's piece of `v` along `dim`."""
    layout = v.layout or Layout()
    axes = layout.sharded_dims().get(dim, [])
    if any(getattr(layout.on(a), "interleave", 1) > 1 or getattr(layout.on(a), "zigzag", False) for a in axes):
        raise ShardcError(f"%{v.name} is a strided or zig-zag shard along dim {dim}; this op needs a contiguous one",
                          hint="zig-zag sequences (cp=N:zigzag) reach attention as ring attention only")
    index = 0
    for a in axes:
        index = index * mesh.axis_size(a) + coords[a]
    return index * local_shape(v, mesh)[dim]


class Emitter:
    """Turns IR nodes into fx calls inside one region graph."""

    def __init__(self, fxg: fx.Graph, mesh: Mesh, coords: dict[str, int], mesh_node: fx.Node,
                 compute: torch.dtype | None = None) -> None:
        self.g, self.mesh, self.coords, self.mesh_node = fxg, mesh, coords, mesh_node
        self.skews: dict[Node, fx.Node] = {}  # grid node -> its weight's prefetched skew
        self.compute = compute  # the plan's compute dtype (`precision.py`); None: fp32, no casts
        self.fused: dict[Node, fx.Node] = {}  # a column-parallel linear -> its output from `gather_linears`

    def gather_linears(self, gather: Node, x: fx.Node, readers: list[Node], params: list[fx.Node | None],
                       kinds: tuple[str, ...]) -> fx.Node:
        """An all_gather read only by column-parallel linears (`codegen.regathered`) as one
        `collectives.gather_linears` call (`params`: each reader's weight and bias, None without;
        `kinds`: each reader's op, linear or matmul); each reader's node then reads its output."""
        attrs = dict(gather.attrs)
        axis, dim = attrs.pop("axis"), attrs.pop("dim")
        if any(k != "linear" for k in kinds):
            attrs["kinds"] = kinds
        call = self.call(C.gather_linears, (x, self.mesh_node, axis, dim, *params), attrs, gather.outputs[0].name)
        for j, reader in enumerate(readers):
            self.fused[reader] = self.g.create_node("call_function", operator.getitem, (call, j), {},
                                                    name=py_name(reader.outputs[0].name))
        return call

    def head_loss(self, region: HeadLoss, x: fx.Node, weight: fx.Node, bias: fx.Node | None,
                  targets: fx.Node) -> fx.Node:
        """A fused head and loss (`shardc.analysis.head_loss`) as one `chunked_linear_cross_entropy`
        call over the region's chunks; the loss reads the logits in fp32 inside it."""
        loss = region.loss
        site = Site.of(loss, self.mesh)
        reason = refusal(site) if site is not None else None
        if reason is not None:
            raise ShardcError(reason, node=loss, hint="the solver never offers this partition; fix the hand edit "
                              "or the plan that wrote it")
        attrs: dict[str, Any] = {k: v for k, v in loss.attrs.items() if k in ("ignore_index", "reduction")}
        logits = loss.inputs[0]
        axes = (logits.layout or Layout()).sharded_dims().get(logits.type.rank - 1, [])
        if axes:  # vocab-parallel: `vocab_refusal` allows one axis
            attrs.update(mesh=self.mesh_node, axis=axes[0],
                         vocab_start=shard_offset(logits, logits.type.rank - 1, self.mesh, self.coords))
        return self.call(chunked_linear_cross_entropy, (x, weight, bias, targets, region.steps), attrs,
                         loss.outputs[0].name)

    def read(self, v: Value, node: fx.Node) -> fx.Node:
        """A parameter, buffer or graph input as the IR's ops read it: float ones cast to the
        compute dtype (mixed precision, `precision.py`), others as they are."""
        if self.compute is None or not v.type.is_float:
            return node
        return P.cast(self.g, node, self.compute, py_name(v.name), weight=v.kind in ("parameter", "buffer"))

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], name: str) -> fx.Node:
        node = self.g.create_node("call_function", fn, _plain(args), _plain(kwargs), name=py_name(name))
        return node

    def call_positional(self, fn: Callable[..., Any], args: tuple, name: str) -> fx.Node:
        return self.call(fn, args, {}, name)

    def node(self, node: Node, args: list[fx.Node]) -> list[fx.Node]:
        if node in self.fused:
            return [self.fused[node]]
        op = get_op(node.op)
        name = node.outputs[0].name
        if op.kind == "loss" and self.compute is not None:  # the loss reads fp32 (`precision.py`)
            args = [P.cast(self.g, a, torch.float32, py_name(v.name)) if v.type.is_float else a
                    for v, a in zip(node.inputs, args)]
        if op.kind == "collective":
            if node.op in ("grad_sync", "send", "recv"):
                return [args[0]]  # the data-parallel wrapper / pipeline runtime does these
            attrs = dict(node.attrs)
            axis = attrs.pop("axis")
            fn = getattr(C, node.op)
            zigzag = [isinstance(p, Shard) and p.zigzag for p in
                      ((node.inputs[0].layout or Layout()).on(axis), (node.outputs[0].layout or Layout()).on(axis))]
            if any(zigzag):  # a zig-zag shard: the contiguous collective with the positions permuted
                if node.op not in R.ZIGZAG_COLLECTIVES:
                    raise ShardcError(f"{node.op} of a zig-zag shard is not supported", node=node)
                fn = R.ZIGZAG_COLLECTIVES[node.op]
                if node.op == "all_to_all":
                    attrs.update(src_zigzag=zigzag[0], dst_zigzag=zigzag[1])
            return [self.call(fn, (args[0], self.mesh_node, axis), attrs, name)]
        part = node.partition
        site = Site.of(node, self.mesh)
        reason = refusal(site) if site is not None else None
        if reason is not None:  # the capability table the solver filters with: same rule, same message
            raise ShardcError(reason, node=node, hint="the solver never offers this partition; fix the hand edit "
                              "or the plan that wrote it")
        if part is not None and part.temporal:
            out = self.temporal(node, args)
        else:
            out = self.plain(node, args)
        if len(node.outputs) == 1:
            return [out]
        return [self.g.call_function(operator.getitem, (out, k)) for k in range(len(node.outputs))]

    def plain(self, node: Node, args: list[fx.Node]) -> fx.Node:
        name, attrs, mesh = node.outputs[0].name, dict(node.attrs), self.mesh
        ins, outs = node.inputs, node.outputs
        if node.op in ("reshape", "expand"):
            attrs["shape"] = local_shape(outs[0], mesh)
        if node.op == "split":
            dim = attrs["dim"] + (ins[0].type.rank if attrs["dim"] < 0 else 0)
            attrs["sizes"] = tuple(local_shape(o, mesh)[dim] for o in outs)
        if node.op == "embedding" and 0 in (ins[1].layout or Layout()).sharded_dims():
            start = shard_offset(ins[1], 0, mesh, self.coords)
            return self.call(L.vocab_parallel_embedding, tuple(args), {"vocab_start": start}, name)
        if node.op == "cross_entropy":
            last = ins[0].type.rank - 1
            axes = (ins[0].layout or Layout()).sharded_dims().get(last, [])
            if len(axes) > 1:
                raise ShardcError("cross entropy with classes split over more than one mesh axis", node=node)
            if axes:
                kw = {"axis": axes[0], "vocab_start": shard_offset(ins[0], last, mesh, self.coords), **attrs}
                return self.call(L.vocab_parallel_cross_entropy, (*args, self.mesh_node), kw, name)
        if node.op == "experts" and 0 in (ins[3].layout or Layout()).sharded_dims():
            axes = (ins[3].layout or Layout()).sharded_dims()[0]
            if len(axes) > 1:
                raise ShardcError("experts split over more than one mesh axis", node=node)
            return self.call(X.expert_parallel, (*args, self.mesh_node), {"axis": axes[0], **attrs}, name)
        if node.op == "scaled_dot_product_attention":
            attrs["q_offset"] = shard_offset(ins[0], ins[0].type.rank - 2, mesh, self.coords)
            return self.call(L.attention, tuple(args), attrs, name)
        return self.call(L.compute_op(node.op), tuple(args), attrs, name)

    def temporal(self, node: Node, args: list[fx.Node]) -> fx.Node:
        """A node with one temporal split (`node` checked it against `shardc.ops.lowering`) as a
        loop: a grid, a ring attention, a rotating contraction or chunks."""
        part = node.partition
        assert part is not None and len(part.temporal) == 1
        split = part.temporal[0]
        op = get_op(node.op)
        space = op.iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs], node.attrs)
        name, attrs = node.outputs[0].name, dict(node.attrs)
        dims = [next((j for j, f in enumerate(operand) if f and f[0] == split.dim), None) for operand in space.inputs]
        dims += [None] * (len(node.inputs) - len(dims))
        if split.grid is not None:
            return self.grid(node, args, split)
        if split.rotate is not None:
            axis = split.rotate
            if op.kind == "attention":
                q = node.inputs[0]
                placement = (q.layout or Layout()).on(axis)
                if isinstance(placement, Shard) and placement.zigzag:
                    attrs["zigzag"] = True
                else:
                    attrs["q_offset"] = shard_offset(q, q.type.rank - 2, self.mesh, self.coords)
                if len(node.inputs) > 3:
                    mask = node.inputs[3]
                    held = (mask.layout or Layout()).on(axis)
                    attrs["rotate_mask"] = isinstance(held, Shard) and held.dim == mask.type.rank - 1
                return self.call(R.ring_attention, tuple(args), {"mesh": self.mesh_node, "axis": axis, **attrs}, name)
            rotating = tuple(i for i, d in enumerate(dims) if d is not None
                             and (node.inputs[i].layout or Layout()).on(axis) == Shard(d))
            indexed = tuple((i, d) for i, d in enumerate(dims) if d is not None and i not in rotating)
            once = tuple(i for i, d in enumerate(dims) if d is None and node.op == "linear")
            loop = {"mesh": self.mesh_node, "axis": axis, "rotating": rotating, "indexed": indexed, "once": once}
            return self.call(T.rotating_loop, (node.op, *args), {**loop, **attrs}, name)
        out_dims = [next((j for j, f in enumerate(o) if f and f[0] == split.dim), None) for o in space.outputs]
        reduce = "mean" if node.op in MEAN_OPS or (node.op == "cross_entropy" and attrs.get("reduction", "mean")
                                                   == "mean") else "sum"
        kw: dict[str, Any] = {"dims": tuple(dims), "out_dim": out_dims[0], "steps": split.steps, "reduce": reduce}
        target = node.op
        if node.op == "scaled_dot_product_attention":
            q = node.inputs[0]
            s_dim = q.type.rank - 2
            base = shard_offset(q, s_dim, self.mesh, self.coords)
            kw["offsets"] = (("q_offset", base, local_shape(q, self.mesh)[s_dim] // split.steps),) \
                if dims[0] == s_dim else ()
            target = "attention"
        return self.call(T.temporal_loop, (target, *args), {**kw, **attrs}, name)

    def grid(self, node: Node, args: list[fx.Node], split: Any) -> fx.Node:
        """PrimePar's P(q x q) (`grid2d.py`): each of the first two inputs moves along the grid
        axis on which it is sharded on the reduced dim."""
        axes = G.grid_axes(node)
        if axes is None:
            raise ShardcError(f"a grid split {split} runs a linear or matmul whose two operands are sharded on "
                              f"{split.dim} along different grid axes", node=node)
        kw: dict[str, Any] = {"mesh": self.mesh_node, "x_axis": axes[0], "w_axis": axes[1]}
        if node in self.skews:
            kw["skew"] = self.skews[node]
        return self.call(G.grid_contraction, (node.op, *args), kw, node.outputs[0].name)


def _plain(x: Any) -> Any:
    """Arguments as the generated code should spell them: a mesh axis (`Axis.TP`, a str enum) as
    the plain string `'tp'`, inside tuples, lists and dicts too."""
    if isinstance(x, str) and type(x) is not str:
        return str(x)
    if type(x) in (tuple, list):
        return type(x)(_plain(y) for y in x)
    if type(x) is dict:
        return {k: _plain(v) for k, v in x.items()}
    return x
