"""Micro-batches without a pipeline: gradient accumulation as the plan's `microbatches` says.

Rule. A global batch of B = dp * microbatches * mb sequences is cut so that data rank r's
share (rows r*B/dp ... (r+1)*B/dp, as with one micro-batch) is run mb rows at a time: micro-batch
j of the whole group is `x.view(dp, microbatches, mb, ...)[:, j]`, the batch the plan's
micro-batch graph was traced for. `step(*inputs)` runs forward and backward per micro-batch on
the loss divided by the count (the mean over micro-batches is the batch mean, the micro-batches
being equal), with the data-parallel gradient reduction only on the last one (DDP `no_sync`,
FSDP2 `set_requires_gradient_sync`, whose weights also stay gathered from one micro-batch to the
next: `set_reshard_after_backward`, so ZeRO-1/2 gather once per step and ZeRO-3 m + 1 times), and
the model-axis sum of gradients replicated there once after the last (`gradsum`). Calling the
module runs all micro-batches inside one forward and returns their mean loss (outputs that are
not scalars are concatenated along the batch), for a user loop that calls `loss.backward()`
itself (the model-axis sum then runs at that backward's end).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardc.backends.torch.gradsum import sum_after_backward, sum_gradients, summed_parameters
from shardc.ir import Axis, Graph
from shardc.ir.diagnostics import ShardcError


def micro_rows(x: torch.Tensor, groups: int, count: int, index: int) -> torch.Tensor:
    """Micro-batch `index` of `count` of a batch shared by `groups` data ranks (module docstring)."""
    per = x.shape[0] // (groups * count)
    return x.reshape(groups, count, per, *x.shape[1:])[:, index].reshape(groups * per, *x.shape[1:])


class Microbatched(nn.Module):
    """A generated rank module run once per micro-batch; parameters keep the model's names.

    The generated module's children, parameters and buffers are registered here directly (not
    under a prefix), so `state_dict()` keys stay the model's and DDP / FSDP2 see them.
    """

    runner: Any  # the generated module (kept out of the submodules: its children are ours)

    def __init__(self, runner: nn.Module, microbatches: int, graph: Graph, runtime: Graph,
                 loss_fn: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__()
        for name, child in runner.named_children():
            self.add_module(name, child)
        for name, p in runner.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in runner.named_buffers(recurse=False):
            self.register_buffer(name, b)
        self.__dict__["runner"] = runner  # not a submodule: its children are ours
        self.microbatches = microbatches
        self.full_inputs = [(v.name, tuple(v.type.shape)) for v in graph.inputs]
        self.data_ranks = runtime.mesh.axis_size(Axis.DP) if runtime.mesh else 1
        self.loss_fn = loss_fn
        self.summed = summed_parameters(runtime)  # gradients summed over model axes once per step
        self._stepping = False

    @property
    def code(self) -> str:
        return str(self.runner.code)

    def _check(self, inputs: tuple[torch.Tensor, ...]) -> None:
        if len(inputs) != len(self.full_inputs):
            raise ShardcError(f"the module takes {len(self.full_inputs)} inputs "
                              f"({', '.join(n for n, _ in self.full_inputs)}), got {len(inputs)}")
        for x, (name, shape) in zip(inputs, self.full_inputs):
            if tuple(x.shape) != shape:
                raise ShardcError(f"input {name} has shape {tuple(x.shape)}, but the plan was compiled for "
                                  f"{shape}", hint="shapes are static: compile the plan again with example "
                                  "inputs of this shape")

    def forward(self, *inputs: torch.Tensor, microbatch: int | None = None) -> Any:
        out = self._forward(*inputs, microbatch=microbatch)
        if self.summed and not self._stepping:  # a user loop's own backward: the sum at its end
            return sum_after_backward(out, self.sum_gradients)
        return out

    def _forward(self, *inputs: torch.Tensor, microbatch: int | None = None) -> Any:
        if self.microbatches == 1:
            return self.runner(*inputs)
        self._check(inputs)
        if microbatch is not None:
            return self.runner(*(micro_rows(x, self.data_ranks, self.microbatches, microbatch) for x in inputs))
        outs = [self.runner(*(micro_rows(x, self.data_ranks, self.microbatches, j) for x in inputs))
                for j in range(self.microbatches)]
        return _merge(outs)

    def sum_gradients(self) -> None:
        """Sum the gradients replicated over a model axis there, once (`gradsum`)."""
        if self.summed:
            sum_gradients(dict(self.named_parameters()), self.summed, self.runner.get_submodule("mesh"))

    def _loss(self, out: Any, target: torch.Tensor | None, index: int) -> torch.Tensor:
        if self.loss_fn is None:
            if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor) and out[0].dim() == 0:
                out = out[0]  # a model returning its own loss first (transformers with labels)
            if not isinstance(out, torch.Tensor) or out.dim() != 0:
                raise ShardcError("step needs a scalar loss from the model", hint="pass loss_fn=fn(outputs, target) "
                                  "to plan.parallelize and step(*inputs, target=...)")
            return out
        if target is None:
            raise ShardcError("plan.parallelize got a loss_fn: call step(*inputs, target=...)")
        rank = self.runner.get_submodule("mesh").coords.get(Axis.DP, 0)
        share = target.chunk(self.data_ranks)[rank]
        return self.loss_fn(out, share.chunk(self.microbatches)[index] if self.microbatches > 1 else share)

    def train_step(self, caller: nn.Module, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch through `caller` (this module or its DDP /
        FSDP2 wrapper); returns the mean loss, detached."""
        total = torch.zeros(())
        self._stepping = True
        try:
            for j in range(self.microbatches):
                last = j == self.microbatches - 1
                with _sync(caller, last):
                    out = caller(*inputs, microbatch=j) if self.microbatches > 1 else caller(*inputs)
                    loss = self._loss(out, target, j)
                    part = loss / self.microbatches if self.microbatches > 1 else loss
                    scaler = self.__dict__.get("grad_scaler")  # fp16's loss scaler (`precision.py`)
                    (scaler.scale(part) if scaler is not None else part).backward()
                total = total + loss.detach().float().cpu()
        finally:
            self._stepping = False
        self.sum_gradients()  # model axes: once, after the last micro-batch (DDP / FSDP2 are done)
        return total / self.microbatches

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """See `train_step`; `self` may have become an FSDP2 module (fully_shard)."""
        return self.train_step(self, *inputs, target=target)


class DataParallel(DistributedDataParallel):
    """DDP over a `Microbatched` module, with its `step`."""

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        return self.module.train_step(self, *inputs, target=target)


def _sync(caller: nn.Module, last: bool) -> Any:
    """DDP: `no_sync` but for the last micro-batch. FSDP2: no reduce-scatter and no reshard after
    backward but for the last, so the gradients accumulate unsharded and the weights stay gathered
    into the next micro-batch's forward (torch 2.13 reshards after every backward unless told not
    to, and the next forward would gather them again)."""
    if isinstance(caller, DistributedDataParallel):
        return contextlib.nullcontext() if last else caller.no_sync()
    for name in ("set_requires_gradient_sync", "set_reshard_after_backward"):
        setter = getattr(caller, name, None)
        if setter is not None:
            setter(last)
    return contextlib.nullcontext()


def _merge(outs: list[Any]) -> Any:
    first = outs[0]
    if isinstance(first, tuple):
        return tuple(_merge([o[k] for o in outs]) for k in range(len(first)))
    if isinstance(first, torch.Tensor):
        return torch.stack(outs).mean(0) if first.dim() == 0 else torch.cat(outs, 0)
    return first
