"""PrimePar's 2-D spatial-temporal primitive P(q x q) for a contraction, on two mesh axes.

Rule. Two mesh axes of size q form a grid; the node's first operand `x` (rows M, reduced k) is
sharded on k along one axis (`x_axis`, the grid's columns) and the second operand `w` on k
along the other (`w_axis`, the rows), each held in the standard layout (block = own
coordinate). Device (r, c), r its coordinate on `w_axis` and c on `x_axis`, first skews: `x`
moves `r` places along `x_axis` and `w` moves `c` places along `w_axis` (one point-to-point
permutation each), so both hold k-block r + c. Then q steps: the local product of the held
blocks is added to the output, while the next blocks are already on their way (isend/irecv
into a second buffer): `x` one neighbour along `x_axis`, `w` one neighbour along `w_axis`. No
collective; nothing is replicated; the output accumulates locally. Backward replays the
rotation: the operands and their gradient accumulators travel together, each device adding its
contribution to the block it holds, and after the q-th step every gradient block goes home in
one permutation; per step the gradient with the longer transfer is computed first, so its send
overlaps the other's matmul. Only the two skewed local blocks are saved for backward.

A parameter `w` is skewed ahead of time: codegen posts its permutation (`skew_start`) at the
start of the layer, so the transfer overlaps the layer's earlier compute, and the grid waits
for it instead of skewing; backward is unchanged (the gradient goes home in one permutation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shardc.backends.torch.collectives import MeshGroups, rotate_start


def _post(x: torch.Tensor, mesh: MeshGroups, axis: str, shift: int, tag: int) -> Any:
    """Start moving `x` `shift` places along `axis` (this rank receives from `-shift` away)."""
    if shift % mesh.size(axis) == 0:
        return None
    return rotate_start(x, mesh, axis, shift, tag=tag)


def _done(x: torch.Tensor, handle: Any) -> torch.Tensor:
    return x if handle is None else handle.wait()


def _product(op: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w) if op == "linear" else torch.matmul(x, w)


def _grad(op: str, which: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """d(x) (`which` "x") or d(w) of one local product (linear: x w^T; matmul: x w, w 2-d)."""
    if which == "x":
        return dy @ w if op == "linear" else dy @ w.t()
    rows_dy, rows_x = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    return rows_dy.t() @ rows_x if op == "linear" else rows_x.t() @ rows_dy


class _Grid(torch.autograd.Function):
    """The forward and backward schedules of the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, op: str, mesh: MeshGroups,  # type: ignore[override]
                x_axis: str, w_axis: str, skew: Any) -> torch.Tensor:
        q = mesh.size(x_axis)
        hx = _post(x, mesh, x_axis, -mesh.coord(w_axis), 0)
        hw = _post(w, mesh, w_axis, -mesh.coord(x_axis), 1) if skew is False else skew
        x, w = _done(x, hx).contiguous(), _done(w, hw).contiguous()
        ctx.save_for_backward(x, w)
        ctx.op, ctx.mesh, ctx.x_axis, ctx.w_axis = op, mesh, x_axis, w_axis
        total = None
        for t in range(q):
            hx = _post(x, mesh, x_axis, -1, 0) if t + 1 < q else None
            hw = _post(w, mesh, w_axis, -1, 1) if t + 1 < q else None
            out = _product(op, x, w)
            total = out if total is None else total + out
            x, w = _done(x, hx), _done(w, hw)
        assert total is not None
        return total

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:  # type: ignore[override]
        x, w = ctx.saved_tensors
        mesh, xa, wa = ctx.mesh, ctx.x_axis, ctx.w_axis
        q = mesh.size(xa)
        dy = dy.contiguous()
        # The gradient with the longer transfer is computed first, so that its send overlaps
        # the other's matmul.
        order = tuple(which for which in (("x", "w") if x.numel() >= w.numel() else ("w", "x"))
                      if ctx.needs_input_grad[0 if which == "x" else 1])
        acc: dict[str, torch.Tensor] = {}
        for t in range(q):
            last = t + 1 == q
            hx = None if last else _post(x, mesh, xa, -1, 0)
            hw = None if last else _post(w, mesh, wa, -1, 1)
            sent = {}
            for which in order:
                g = _grad(ctx.op, which, x, w, dy)
                acc[which] = g if which not in acc else acc[which] + g
                # Between steps one neighbour on; after the last, home: the held block is k-block
                # (own + other coordinate - 1) along each axis.
                axis, other = (xa, wa) if which == "x" else (wa, xa)
                sent[which] = _post(acc[which].contiguous(), mesh, axis, mesh.coord(other) - 1 if last else -1,
                                    2 if which == "x" else 3)
            if not last:
                x, w = _done(x, hx), _done(w, hw)
            acc = {which: _done(acc[which], sent[which]) for which in order}
        return acc.get("x"), acc.get("w"), None, None, None, None, None


def skew_start(w: torch.Tensor, mesh: MeshGroups, w_axis: str, x_axis: str, tag: int) -> Any:
    """Post the skew of a grid's weight: this rank receives the block `coord(x_axis)` places
    further along `w_axis` (None when it keeps its own)."""
    return _post(w, mesh, w_axis, -mesh.coord(x_axis), tag)


def grid_contraction(op: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                     mesh: MeshGroups, x_axis: str, w_axis: str, skew: Any = False) -> torch.Tensor:
    """`op` ("linear": x w^T + bias, or "matmul": x w) on a P(q x q) grid (module rule);
    `x` moves along `x_axis`, `w` along `w_axis`, both of size q. The bias is added once.
    `skew`: the handle of a `skew_start` of `w` posted earlier (False: skew `w` here)."""
    if op not in ("linear", "matmul") or (op == "matmul" and w.dim() != 2):
        raise ValueError(f"a P(q x q) grid runs linear or a matmul by a 2-d operand, not {op}")
    if mesh.size(x_axis) != mesh.size(w_axis):
        raise ValueError(f"grid axes {x_axis} and {w_axis} differ in size")
    if mesh.size(x_axis) == 1:
        return _product(op, x, w) if bias is None else _product(op, x, w) + bias
    out = _Grid.apply(x, w, op, mesh, x_axis, w_axis, skew)
    return out if bias is None else out + bias


def grid_axes(node: Any) -> tuple[str, str] | None:
    """(x_axis, w_axis) of a lowered grid node: each of its first two inputs moves along the grid
    axis on which it is sharded on the reduced dim (None: not a grid node, or malformed)."""
    from shardc.ir import Layout, Shard
    from shardc.ops.registry import get_op

    part = node.partition
    split = next((t for t in part.temporal if t.grid is not None), None) if part is not None else None
    if split is None or node.op not in ("linear", "matmul") or len(node.inputs) < 2:
        return None
    space = get_op(node.op).iteration_space([v.type for v in node.inputs], [v.type for v in node.outputs],
                                            node.attrs)
    along = []
    for i in range(2):
        dim = next((j for j, f in enumerate(space.inputs[i]) if f and f[0] == split.dim), None)
        along.append(next((a for a in split.axes if dim is not None
                           and (node.inputs[i].layout or Layout()).on(a) == Shard(dim)), None))
    x_axis, w_axis = along
    return (x_axis, w_axis) if x_axis is not None and w_axis is not None and x_axis != w_axis else None


def prefetch_skews(nodes: list[Any], arg: Any, call: Any, mesh_node: Any) -> dict[Any, Any]:
    """At the start of a layer, post the skew of every grid node's parameter weight (module
    rule): `arg(value)` gives the fx node of a value, `call(fn, args, name)` emits a call."""
    out: dict[Any, Any] = {}  # grid node -> its weight's skew
    for node in nodes:
        axes = grid_axes(node)
        w = node.inputs[1] if axes is not None else None
        if w is not None and w.producer is not None and w.producer.op == "grad_sync":
            w = w.producer.inputs[0]  # an identity in the generated code (DDP/FSDP sync it)
        if axes is None or w is None or w.kind != "parameter":
            continue
        out[node] = call(skew_start, (arg(w), mesh_node, axes[1], axes[0], 100 + len(out)), f"{w.name}_skew")
    return out
