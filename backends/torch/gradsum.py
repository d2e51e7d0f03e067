"""Gradients summed over model axes once per step: the `sum_axes` of the lowered IR's `grad_sync`.

Rule. A parameter replicated on a model axis whose readers all split that axis (the batch split
over tp with replicated weights, `shardc.analysis.summed`) has a partial gradient on each rank
of the axis. Gradients accumulate linearly over uses and micro-batches, so the runtime sums the
accumulated gradient once, after the step's last backward, as DDP reduces data parallelism:
per axis the gradients of every such parameter this rank holds laid end to end (graph order,
so every rank of the group lays them out alike; a gradient that is None joins as zeros; per
dtype), all-reduced (sum) over the axis's process group in buckets of `SUM_BUCKET_BYTES` (DDP's
25 MiB: the copy in flight never holds more), each copied back. Under FSDP2
the gradient is a DTensor sharded over the data axes: its local shard is summed (every rank of
the model axis holds the same shard of it), so ZeRO's reduce-scatter over dp and this sum over
tp each happen once, in either order. The cost model prices exactly this (`shardc.cost.sync`:
one all_reduce per axis group of the summed bytes, exposed after backward).

Where it runs: `Microbatched.train_step` and `PipelinedModule.step` call `sum_gradients` after
the last micro-batch; a user loop that calls `loss.backward()` on the module's output gets it at
the end of that backward (`sum_after_backward`), after DDP's or FSDP2's own end-of-backward work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from shardc.backends.torch.collectives import MeshGroups
from shardc.cost.sync import SUM_BUCKET_BYTES
from shardc.ir import Graph


def summed_parameters(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the model axes its gradient is summed over once per step, from the
    lowered graph's `grad_sync` nodes (`sum_axes`), in graph order."""
    out: dict[str, tuple[str, ...]] = {}
    for node in graph.nodes:
        if node.op == "grad_sync" and node.attrs.get("sum_axes"):
            name = node.inputs[0].name
            out[name] = tuple(dict.fromkeys(out.get(name, ()) + tuple(node.attrs["sum_axes"])))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def sum_gradients(params: Mapping[str, torch.Tensor], summed: Mapping[str, tuple[str, ...]], mesh: MeshGroups,
                  bucket_bytes: int = SUM_BUCKET_BYTES) -> int:
    """Sum the gradients of `params` named in `summed` over their axes (module rule): per axis (and
    dtype) the gradients laid end to end, all-reduced `bucket_bytes` at a time (`shardc.cost.sync.sum_buckets`).
    Returns the number of all_reduces run."""
    groups: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for name, axes in summed.items():
        p = params.get(name)
        if p is None or not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = _local(p.grad)
        for axis in axes:
            if mesh.size(axis) > 1:
                groups.setdefault((axis, grad.dtype), []).append(grad)
    calls = 0
    for (axis, dtype), grads in groups.items():
        flat = [g.view(-1) for g in grads]
        element = torch.empty((), dtype=dtype).element_size()
        per = max(1, bucket_bytes // element)
        total = sum(f.numel() for f in flat)
        for start in range(0, total, per):
            pieces = _pieces(flat, start, min(total, start + per))
            buffer = torch.cat(pieces)
            dist.all_reduce(buffer, group=mesh.group(axis))
            k = 0
            for piece in pieces:
                piece.copy_(buffer[k:k + piece.numel()])
                k += piece.numel()
            calls += 1
    return calls


def _pieces(flat: list[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Views of the elements [lo, hi) of the tensors in `flat` laid end to end."""
    out, at = [], 0
    for f in flat:
        a, b = max(lo, at), min(hi, at + f.numel())
        if a < b:
            out.append(f[a - at:b - at])
        at += f.numel()
    return out


class _AtBackwardEnd(torch.autograd.Function):
    """Identity on the outputs; when their gradient arrives, `fn` is queued to run once the whole
    backward is over, behind the callbacks DDP and FSDP2 queue to finish their own reductions."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[], None], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.fn = fn
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:  # type: ignore[override]
        fn, ctx.fn = ctx.fn, None
        if fn is not None:
            engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
            # DDP queues its finalizer when its last bucket is ready, i.e. after this: re-queue once
            # from our own callback so the sum runs after it (callbacks queued by callbacks run too).
            engine.queue_callback(lambda: engine.queue_callback(fn))
        return (None, *grads)


def sum_after_backward(out: Any, fn: Callable[[], None]) -> Any:
    """`out` (a tensor or a tuple / list of them) with `fn` armed to run at the end of the backward
    that flows through any of its trainable floating-point tensors (`_AtBackwardEnd`)."""
    leaves = out if isinstance(out, tuple | list) else (out,)
    picks = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad
             and t.is_floating_point()]
    if not picks or not torch.is_grad_enabled():
        return out
    wrapped = _AtBackwardEnd.apply(fn, *(leaves[k] for k in picks))
    items = list(leaves)
    for k, t in zip(picks, wrapped):
        items[k] = t
    if isinstance(out, torch.Tensor):
        return items[0]
    return type(out)(items) if isinstance(out, list) else tuple(items)
