"""torch's pipeline schedule for a plan's `schedule`, and what the zero-bubble ones need of a stage.

Rule. `schedule_class` maps the plan key to torch.distributed.pipelining's class: gpipe ->
ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved (or any non-gpipe schedule with vpp > 1) ->
ScheduleInterleaved1F1B, and the zero-bubble `ZERO_BUBBLE`: zbv -> ScheduleZBVZeroBubble,
interleaved-zb -> ScheduleInterleavedZeroBubble, dualpipev -> ScheduleDualPipeV (zbv and
dualpipev with exactly two stages per rank, placed in a V by `shardc.analysis.stages`). The
zero-bubble schedules split each backward into an input-gradient pass, which detaches the stage
outputs in place (so a stage module's outputs must not be views: `Unviewed`), and a
weight-gradient pass that DDP's reducer does not follow (so data-parallel gradients are averaged
after the schedule instead: `sync_data_parallel`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from shardc.ir.diagnostics import ShardcError

# The zero-bubble schedules (plan key schedule=...) and torch's classes for them.
ZERO_BUBBLE = {"zbv": "ScheduleZBVZeroBubble", "interleaved-zb": "ScheduleInterleavedZeroBubble",
               "dualpipev": "ScheduleDualPipeV"}


def schedule_class(name: str, virtual: int) -> type:
    """torch's schedule class for a plan's `schedule` with `virtual` stages per pp rank: GPipe,
    1F1B, interleaved 1F1B (any schedule but gpipe with vpp > 1), and the zero-bubble
    `ZERO_BUBBLE` (zbv and dualpipev with exactly two stages per rank)."""
    import torch.distributed.pipelining as tp
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    spelled = name.lower().replace("_", "-")
    if spelled in ZERO_BUBBLE:
        if spelled in ("zbv", "dualpipev") and virtual != 2:
            raise ShardcError(f"schedule {spelled} runs exactly two virtual stages per pp rank (a V), not {virtual}",
                              hint="set vpp=2 in the plan")
        return cast(type, getattr(tp, ZERO_BUBBLE[spelled]))
    key = name.lower().replace("-", "").replace("_", "")
    if virtual > 1 and key in ("1f1b", "interleaved", "interleaved1f1b"):
        return ScheduleInterleaved1F1B
    table = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "interleaved1f1b": ScheduleInterleaved1F1B}
    if key not in table:
        raise ShardcError(f"unknown pipeline schedule {name!r}; known: gpipe, 1f1b, interleaved, "
                          f"{', '.join(ZERO_BUBBLE)}")
    cls = table[key]
    if cls is ScheduleInterleaved1F1B and virtual < 2:
        raise ShardcError("schedule interleaved needs vpp >= 2 virtual stages per device",
                          hint="set vpp=2 (or more) in the plan, or use schedule=1f1b")
    if cls is not ScheduleInterleaved1F1B and virtual > 1:
        raise ShardcError(f"schedule {name} runs one stage per device but vpp={virtual}",
                          hint="use schedule=interleaved or vpp=1")
    return cls


def unview(t: Any) -> Any:
    """`t`, or a copy of it when it is a view: torch's split backward detaches stage outputs in
    place (`stage_backward_input`), which views refuse."""
    return t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t


class Unviewed(nn.Module):
    """A stage module whose outputs are never views (`unview`), for the zero-bubble schedules."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        out = self.inner(*args)
        return tuple(unview(t) for t in out) if isinstance(out, tuple) else unview(out)


def sync_data_parallel(params: list[nn.Parameter], group: Any) -> None:
    """Average the trainable parameters' gradients over the data group, as DDP would (one flat
    all-reduce; a parameter without a gradient joins with zeros so every rank sends the same)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        return
    for p in trainable:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [cast(torch.Tensor, p.grad) for p in trainable]  # plain tensors: no FSDP here
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    k = 0
    for g in grads:
        g.copy_(flat[k:k + g.numel()].view_as(g))
        k += g.numel()
