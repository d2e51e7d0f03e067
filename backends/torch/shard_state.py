"""The sharded state of a `plan.parallelize` module as DTensors, for torch.distributed.checkpoint.

Rule. Generated modules hold plain local shards; their layouts are in the plan's IR. Each
parameter (and buffer, and optimizer state of a parameter's shape) is presented to DCP as a
`DTensor` over the plan's mesh without its `pp` axis (pipeline ranks hold different stages;
DCP keys state by name, so stages merge by name): `Shard(d)` where the IR layout shards dim d
on that axis, `Replicate()` elsewhere, with the global shape of the IR. A DTensor view shares
the local shard's storage, so DCP loads straight into the parameter. Two kinds of shard have no
contiguous DTensor placement and are gathered first (correctness before memory): a strided
shard (a fused q/k/v weight split by heads: `Shard(0/3)`) is all-gathered over its axis and
saved replicated there; an FSDP2 (ZeRO) parameter is gathered to the rank's model-parallel
shard. Loading fills such a gathered buffer, then copies the rank's piece back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardc.backends.torch.collectives import MeshGroups
from shardc.backends.torch.ring import gather, take
from shardc.ir import Axis, Graph, Layout, Mesh, Shard

Writeback = Callable[[], None]


def shardc_parts(model: Any) -> tuple[Any, Graph, Any] | None:
    """(module holding the parameters, runtime graph, DeviceMesh) of a shardc module, else None."""
    inner = model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
    graph = getattr(inner, "shardc_graph", None)
    mesh = getattr(inner, "shardc_mesh", None)
    if isinstance(graph, Graph) and mesh is not None:
        return inner, graph, mesh
    return None


def _placements(layout: Layout, axes: tuple[str, ...]) -> tuple[list[Any], bool]:
    """DTensor placements over `axes` and whether a strided (or zig-zag) shard had to be replicated."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    out: list[Any] = []
    strided = False
    for axis in axes:
        p = layout.on(axis)
        if isinstance(p, Shard) and (p.interleave > 1 or p.zigzag):
            strided = True
            out.append(Replicate())
        elif isinstance(p, Shard):
            out.append(DShard(p.dim))
        else:
            out.append(Replicate())
    return out, strided


class StateViews:
    """Builds DCP entries for one shardc module and remembers how to write loaded values back."""

    def __init__(self, model: Any) -> None:
        parts = shardc_parts(model)
        assert parts is not None, "not a module from plan.parallelize"
        self.inner, self.graph, dm = parts
        if self.graph.mesh is None:
            raise ValueError("a plan.parallelize module's graph has no mesh")
        self.graph_mesh: Mesh = self.graph.mesh
        self.axes = tuple(a for a in self.graph_mesh.names if a != Axis.PP)
        self.mesh = dm[self.axes]
        self.groups: MeshGroups = self.inner.get_submodule("stage_modules.0.mesh") \
            if hasattr(self.inner, "stage_modules") else self.inner.get_submodule("mesh")
        self.layouts = {v.name: v for v in self.graph.params + self.graph.buffers}
        self.writebacks: list[Writeback] = []

    def named(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by the model's names (constants folded by the
        frontend are left out)."""
        skip = set(getattr(self.inner, "shardc_constants", ()))
        out: dict[str, torch.Tensor] = {}
        for name, t in [*self.inner.named_parameters(), *self.inner.named_buffers()]:
            if name in self.layouts and name not in skip:
                out.setdefault(name, t)
        return out

    def view(self, name: str, tensor: torch.Tensor, loading: bool) -> torch.Tensor:
        """The DTensor DCP saves from / loads into for `tensor`, a shard of IR value `name`."""
        from torch.distributed.tensor import DTensor

        value = self.layouts[name]
        layout = value.layout or Layout()
        placements, strided = _placements(layout, self.axes)
        fsdp = isinstance(tensor, DTensor)
        local: Any = tensor.detach()
        if fsdp:
            local = local.full_tensor() if not loading else torch.empty(
                layout.local_shape(value.type.shape, self.graph_mesh), dtype=tensor.dtype, device=local.device)
        if strided:
            if loading:
                gathered = self._gathered_shape(value)
                local = torch.empty(gathered, dtype=tensor.dtype, device=local.device)
            else:
                for axis in reversed(self.axes):
                    p = layout.on(axis)
                    if isinstance(p, Shard) and (p.interleave > 1 or p.zigzag):
                        local = gather(local, self.groups, axis, p.dim, p.interleave, p.zigzag)
        if loading and (fsdp or strided):
            self.writebacks.append(self._writeback(tensor, local, layout, strided))
        shape = tuple(value.type.shape)
        stride = torch.empty(shape, device="meta").stride() if shape else ()
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=stride)

    def _gathered_shape(self, value: Any) -> tuple[int, ...]:
        layout = value.layout or Layout()
        shape = list(layout.local_shape(value.type.shape, self.graph_mesh))
        for axis in self.axes:
            p = layout.on(axis)
            if isinstance(p, Shard) and (p.interleave > 1 or p.zigzag):
                shape[p.dim] *= self.graph_mesh.axis_size(axis)
        return tuple(shape)

    def _writeback(self, target: torch.Tensor, buffer: torch.Tensor, layout: Layout, strided: bool) -> Writeback:
        def run() -> None:
            from torch.distributed.tensor import DTensor

            piece = buffer
            if strided:
                for axis in self.axes:
                    p = layout.on(axis)
                    if isinstance(p, Shard) and (p.interleave > 1 or p.zigzag):
                        piece = take(piece, self.groups.size(axis), self.groups.coord(axis), p.dim, p.interleave, p.zigzag)
            with torch.no_grad():
                if isinstance(target, DTensor):  # FSDP2: this rank's chunk of dim 0 over its data mesh
                    dest = target.to_local()
                    n, r = target.device_mesh.size(), target.device_mesh.get_local_rank()
                    chunk = piece.chunk(n, 0)[r] if r < len(piece.chunk(n, 0)) else piece[:0]
                    dest.copy_(chunk.reshape(dest.shape))
                else:
                    target.copy_(piece)
        return run

    def run_writebacks(self) -> None:
        for fn in self.writebacks:
            fn()
        self.writebacks = []
