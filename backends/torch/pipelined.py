"""Pipelined plans from the IR: each rank builds its stages' modules and runs a torch schedule.

    module = plan.parallelize(model)        # a PipelinedModule on every rank
    optimizer = torch.optim.AdamW(module.parameters())
    loss = module.step(idx, targets)        # the whole global batch, as traced
    optimizer.step(); optimizer.zero_grad()

Rule. The plan's lowered graph for one micro-batch is cut into stages (`stages.split_stages`);
this rank generates the module of each stage it holds (`shardc.analysis.stages.stage_device`:
stage `s` on pp rank `s % pp`, with vpp > 1 the round-robin layout of interleaved 1F1B; for the
V schedules zbv and dualpipev pp rank r holds stages r and 2pp-1-r, torch's `style="v"`), with
only its own parameter shards and the tp/sp/cp collectives inside, exactly as
`codegen.generate` does for pp=1. Stage modules go into
`torch.distributed.pipelining.PipelineStage`s over the `pp` process group and run under the
plan's schedule (GPipe, 1F1B, interleaved 1F1B, and the zero-bubble ScheduleZBVZeroBubble,
ScheduleInterleavedZeroBubble, ScheduleDualPipeV) on `microbatches` micro-batches, with the loss
sub-graph of the IR (or the user's `loss_fn`) as the schedule's loss. Data axes: each stage
module is wrapped by torch and the pipeline stage drives the wrapper, as torch.distributed.
pipelining intends (`backward_maybe_with_nosync`): with ZeRO an FSDP2 `fully_shard` module
(gradients reduce-scattered once, after the stage's last micro-batch), otherwise a
`DistributedDataParallel` module (forwards and the first micro-batches' backwards under
`no_sync`; the last micro-batch's backward arms DDP's reducer, whose buckets all-reduce while
that backward is still running). Under a zero-bubble schedule the backward is split into
input- and weight-gradient passes, which DDP's reducer does not follow: without ZeRO the stage
modules run without DDP and the gradients are all-reduced (averaged, as DDP does) over the data
group once the schedule is over (`schedules.sync_data_parallel`, one flat buffer); with ZeRO
each stage is one FSDP2 unit, which torch's runtime keeps from syncing during the passes and
reduce-scatters once, after that stage's last weight-gradient pass (its REDUCE_GRAD action);
ZeRO-3 there does not reshard after forward (its weights stay gathered through the step, as
ZeRO-1/2's do, and are priced so).
Either way the module torch drives returns no views (`schedules.Unviewed`, inside the FSDP2
unit). Stages get their input and output shapes up front (the
IR knows them), so torch skips the first-step metadata inference: that extra forward runs the
DDP wrapper outside `no_sync` and would make it all-reduce every micro-batch. Then gradients
are divided by the micro-batch count (the loss is a mean over micro-batches), gradients
replicated over a model axis that splits the batch are summed there once (`gradsum`), and a
parameter held on several pipeline ranks (a tied embedding and head) gets the sum of theirs. Mixed
precision (`precision.py`): stage modules cast as generated, FSDP2 gathers compute-dtype weights
and reduce-scatters fp32 gradients, and under fp16 the schedule's loss is scaled by the module's
`grad_scaler` (the losses `step` returns are unscaled). Under `compile` (`parallelize.runs_compiled`)
each stage module and the loss module are compiled in place before torch wraps them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from shardc.analysis.stages import device_stages, stage_device
from shardc.backends.torch.codegen import generate, local_piece, local_shape
from shardc.backends.torch.collectives import MeshGroups
from shardc.backends.torch.experts import pipelined_target_rows
from shardc.backends.torch.gradsum import sum_gradients, summed_parameters
from shardc.backends.torch.parallelize import (
    check_model,
    compile_in_place,
    data_parallel_info,
    describe_state,
    device_mesh,
    local_tensors,
    mesh_groups,
    runs_compiled,
    with_constants,
)
from shardc.backends.torch.precision import (
    attach_scaler,
    compute_dtype,
    grad_scaler,
    mixed_precision_policy,
    runtime_dtype,
)
from shardc.backends.torch.ring import gather
from shardc.backends.torch.schedules import ZERO_BUBBLE, Unviewed, schedule_class, sync_data_parallel, unview
from shardc.backends.torch.stages import StagePlan, split_stages
from shardc.ir import Axis, Graph, Layout, Shard
from shardc.ir.diagnostics import ShardcError


class PipelinedModule(nn.Module):
    """This rank's pipeline stages of a compiled plan; `step(*inputs) -> loss` trains one batch.

    `parameters()`, `named_parameters()` and `state_dict()` name every parameter as the model
    does (each once, however many of this rank's stages hold it), so any torch optimizer and
    `shardc.backends.torch.checkpoint` work on it. `stage_modules` are the generated
    `torch.fx.GraphModule`s (`.code` shows what each stage runs), `stage_ids` their stages.
    """

    def __init__(self, graph: Graph, plan: StagePlan, stage_ids: list[int], modules: list[nn.Module],
                 wrapped: list[nn.Module], loss_module: nn.Module | None, dm: Any, full_inputs: list[Any],
                 loss_fn: Callable[..., torch.Tensor] | None, device: torch.device,
                 data_group: Any = None) -> None:
        super().__init__()
        self.graph, self.plan, self.stage_ids, self.dm = graph, plan, stage_ids, dm
        self.stage_modules = nn.ModuleList(modules)
        self._wrapped = wrapped
        self.loss_module = loss_module
        self.full_inputs = full_inputs  # the traced global inputs: (name, shape) per graph input
        self.microbatches = int(graph.attrs.get("microbatches", 1))
        self.num_stages = len(plan.stages)
        self.device = device
        self.pp = graph.mesh.axis_size(Axis.PP) if graph.mesh else 1
        self.coords = graph.mesh.coordinates(dist.get_rank()) if graph.mesh else {}
        self.user_loss = loss_fn
        self.schedule_name = str(graph.attrs.get("schedule", "1f1b"))
        self.data_group = data_group  # gradients averaged here after the schedule (zero-bubble, no DDP)
        self.summed = summed_parameters(graph)  # summed over model axes after the schedule (`gradsum`)
        from torch.distributed.pipelining import PipelineStage

        group = dm.get_group(Axis.PP)
        assert graph.mesh is not None
        compute = compute_dtype(graph)  # activations cross stages in the compute dtype
        self.stages = [PipelineStage(m, s, self.num_stages, device, group=group,
                                     input_args=_examples(plan.stages[s].inputs, graph.mesh, compute),
                                     output_args=_examples(plan.stages[s].outputs, graph.mesh, compute))
                       for m, s in zip(wrapped, stage_ids)]
        cls = schedule_class(self.schedule_name, len(stage_ids))
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        stages: Any = self.stages if len(self.stages) > 1 or issubclass(cls, PipelineScheduleMulti) \
            else self.stages[0]
        self.schedule = cls(stages, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)

    # ---- parameters by the model's names ----------------------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        for m in self.stage_modules:
            for name, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield prefix + name, p

    def named_buffers(self, prefix: str = "", recurse: bool = True,  # type: ignore[override]
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[str] = set()
        for m in self.stage_modules:
            for name, b in m.named_buffers():
                if name not in seen:
                    seen.add(name)
                    yield prefix + name, b

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        out: dict[str, Any] = {}
        for m in self.stage_modules:
            for k, v in m.state_dict().items():
                out.setdefault(k, v)
        return out

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    # ---- one training step ------------------------------------------------------------------

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        loss = unview(self._unscaled_loss(output, target))
        scaler = self.__dict__.get("grad_scaler")  # fp16's loss scaler: the schedule runs backward on this
        return scaler.scale(loss) if scaler is not None else loss

    def _unscaled_loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        outs = output if isinstance(output, tuple) else (output,)
        if self.loss_module is not None:
            return self.loss_module(*outs, target)
        if self.user_loss is not None:
            return self.user_loss(output, target)
        if outs[0].dim() != 0:
            raise ShardcError(f"the last stage of graph @{self.graph.name} returns a {tuple(outs[0].shape)} tensor, "
                              "not a loss", hint="pass loss_fn=fn(outputs, target) to plan.parallelize and "
                              "step(*inputs, target=...)")
        return outs[0]

    def _local(self, x: torch.Tensor, layout: Layout | None) -> torch.Tensor:
        assert self.graph.mesh is not None
        return local_piece(x, layout or Layout(), self.graph.mesh, self.coords).to(self.device)

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one global batch over the plan's micro-batches; returns the
        mean micro-batch loss of this rank's data share (detached, the same on every pp rank)."""
        if len(inputs) != len(self.full_inputs):
            raise ShardcError(f"step takes the {len(self.full_inputs)} inputs of graph @{self.graph.name} "
                              f"({', '.join(n for n, _ in self.full_inputs)}), got {len(inputs)}")
        for x, (name, shape) in zip(inputs, self.full_inputs):
            if tuple(x.shape) != tuple(shape):
                raise ShardcError(f"input {name} has shape {tuple(x.shape)}, but the plan was compiled for "
                                  f"{tuple(shape)}", hint="shapes are static: compile the plan again with example "
                                  "inputs of this shape")
        by_name = dict(zip((n for n, _ in self.full_inputs), inputs))
        args = tuple(self._local(by_name[v.name], v.layout) for v in self.plan.first_inputs) if self.is_first else ()
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.is_last:
            if self.plan.target is not None:
                tgt = self._local(by_name[self.plan.target.name], self.plan.target.layout)
            elif target is not None:
                tgt = self._local(target, Layout(tuple((a, p) for a, p in (self.plan.first_inputs[0].layout
                                                                         or Layout()).placements if a == Axis.DP)))
                mesh = self.graph.mesh
                ep = mesh.axis_size(Axis.EP) if mesh is not None and Axis.EP in mesh.names else 1
                tgt = pipelined_target_rows(tgt, ep, self.microbatches)  # the outputs' row order under ep
            else:
                tgt = torch.zeros(self.microbatches, device=self.device)
            kwargs = {"target": tgt, "losses": losses}
        # the losses are what step returns: the outputs are not merged (a scalar output, the model's
        # own loss or a router's aux loss, has no batch dim to concatenate micro-batches along)
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self._finish_gradients()
        loss = torch.stack([v.detach().float() for v in losses]).mean() if losses else torch.zeros((), device=self.device)
        scaler = self.__dict__.get("grad_scaler")
        if scaler is not None and losses:
            loss = loss / scaler.get_scale()
        group = self.dm.get_group(Axis.PP)
        last = stage_device(self.num_stages - 1, self.pp, self.schedule_name)
        dist.broadcast(loss, src=dist.get_global_rank(group, last), group=group)
        return loss

    def _finish_gradients(self) -> None:
        params = dict(self.named_parameters())
        for p in params.values():
            if p.grad is not None:
                local_tensor(p.grad).div_(self.microbatches)
        if self.data_group is not None:
            sync_data_parallel(list(params.values()), self.data_group)
        if self.summed:
            sum_gradients(params, self.summed, cast(MeshGroups, self.stage_modules[0].get_submodule("mesh")))
        tied = [name for name, stages in sorted(self.plan.param_stages.items())
                if len({stage_device(s, self.pp, self.schedule_name) for s in stages}) > 1]
        if not tied:
            return
        group = self.dm.get_group(Axis.PP)
        for name in tied:  # every pp rank joins; ranks without the parameter add zeros
            held = params.get(name)
            if held is None:
                value = self.graph.value(name)
                assert self.graph.mesh is not None
                shape = (value.layout or Layout()).local_shape(value.type.shape, self.graph.mesh)
                buf = torch.zeros(shape, device=self.device)
            else:
                if held.grad is None:
                    held.grad = torch.zeros_like(held)
                buf = local_tensor(held.grad)
            dist.all_reduce(buf, group=group)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer unsharded, on every rank (collective over all ranks)."""
        from torch.distributed.tensor import DTensor

        assert self.graph.mesh is not None
        groups = cast(MeshGroups, self.stage_modules[0].get_submodule("mesh"))  # generate() puts it there
        mine: dict[str, torch.Tensor] = {}
        layouts = {v.name: v.layout for v in self.graph.params + self.graph.buffers}
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            t = t.detach()
            if isinstance(t, DTensor):
                t = t.full_tensor()
            for axis, p in reversed((layouts.get(name) or Layout()).placements):
                if isinstance(p, Shard) and self.graph.mesh.axis_size(axis) > 1:
                    t = gather(t, groups, axis, p.dim, p.interleave, p.zigzag)
            mine[name] = t
        parts: list[Any] = [None] * self.pp
        dist.all_gather_object(parts, mine, group=self.dm.get_group(Axis.PP))
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                out.setdefault(k, v)
        return out


def parallelize_pipeline(compiled: Any, model: nn.Module, *, init: Any = None, seed: int = 0,
                         device: torch.device | str | None = None,
                         loss_fn: Callable[..., torch.Tensor] | None = None) -> PipelinedModule:
    """This rank's `PipelinedModule` for a pipelined compiled plan (see the module docstring)."""
    graph: Graph = compiled.runtime_graph
    if graph.mesh is None:
        raise ShardcError(f"graph @{graph.name} has no mesh; compile the plan first")
    dm = device_mesh(graph.mesh)
    rank = dist.get_rank()
    model = with_constants(model, {**compiled.constants, **compiled.micro_constants})
    check_model(graph, model)
    if device is None:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if dm.device_type == "cuda" else "cpu"
    dev = torch.device(device)
    plan = split_stages(graph)
    pp = graph.mesh.axis_size(Axis.PP)
    virtual = int(graph.attrs.get("virtual_stages", 1))
    if len(plan.stages) != pp * virtual:
        raise ShardcError(f"graph @{graph.name} has {len(plan.stages)} stages but the plan asks for pp*vpp = "
                          f"{pp}*{virtual}", hint="compile the plan again (apply-plan assigns the stages)")
    pp_rank = graph.mesh.coordinates(rank)[Axis.PP]
    schedule = str(graph.attrs.get("schedule", "1f1b"))
    stage_ids = list(device_stages(pp_rank, pp, virtual, schedule))
    names = {p.name for s in stage_ids for p in plan.stages[s].params + plan.stages[s].buffers}
    if plan.loss is not None:
        names |= {p.name for p in plan.loss.params + plan.loss.buffers}
    tensors: dict[str, torch.Tensor] = local_tensors(graph, model, rank, init=init, seed=seed, device=dev, names=names)
    trainable = {v.name: v.requires_grad for v in graph.params}
    for name in list(tensors):
        if name in trainable:
            tensors[name] = nn.Parameter(tensors[name], requires_grad=trainable[name])
    groups = mesh_groups(graph.mesh, dm, rank)
    modules: list[nn.Module] = [generate(plan.stages[s], rank, tensors, groups, device=str(dev), local_inputs=True) for s in stage_ids]
    loss_module = None
    if plan.loss is not None and plan.stages and len(plan.stages) - 1 in stage_ids:
        loss_module = generate(plan.loss, rank, tensors, groups, device=str(dev), local_inputs=True)
    if runs_compiled(graph, dev.type):
        for m in [*modules, *([loss_module] if loss_module is not None else [])]:
            compile_in_place(m)
    axes, via, zero = data_parallel_info(graph)
    sub = None if not axes else dm[axes[0]] if len(axes) == 1 else _flattened(dm, axes)
    fsdp = sub is not None and (via == "fsdp" or zero > 0)
    split_backward = schedule in ZERO_BUBBLE
    # The split backward detaches stage outputs in place, so what torch drives never returns views;
    # under ZeRO that module is the FSDP2 unit, for torch's runtime to unshard, reshard and
    # reduce-scatter it (after the stage's last weight-gradient pass) as a stage of its own.
    wrapped: list[nn.Module] = [Unviewed(m) for m in modules] if split_backward else list(modules)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        _check_unshared(graph, modules, "FSDP2")
        policy = mixed_precision_policy(compute_dtype(graph))
        # Under a split backward ZeRO-3 keeps the weights gathered from the stage's first forward
        # to its reduce-scatter (torchtitan's choice for pipelines): resharding after each forward
        # loses the weight gradients of passes deferred past a later forward (measured, torch 2.13).
        reshard = zero >= 3 and not split_backward
        for m in wrapped:
            if any(p.requires_grad for p in m.parameters()):
                fully_shard(m, mesh=sub, reshard_after_forward=reshard, **({"mp_policy": policy} if policy else {}))
    elif sub is not None and not split_backward:
        _check_unshared(graph, modules, "DDP")
        wrapped = [_ddp(m, sub.get_group()) for m in modules]
    data_group = sub.get_group() if sub is not None and not fsdp and split_backward else None
    full_inputs = [(v.name, tuple(v.type.shape)) for v in compiled.graph.inputs]
    module = PipelinedModule(graph, plan, stage_ids, modules, wrapped, loss_module, dm, full_inputs, loss_fn, dev,
                             data_group)
    attach_scaler(grad_scaler(compute_dtype(graph), dev), module)
    describe_state(module, graph, dm, model)
    return module


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _ddp(module: nn.Module, group: Any) -> nn.Module:
    """A stage module under DDP over the data group (left as it is when nothing in it trains).
    Every rank already holds its pieces: no broadcast at start and none of buffers (they may be
    sharded along cp, which the data group spans)."""
    from torch.nn.parallel import DistributedDataParallel

    if not any(p.requires_grad for p in module.parameters()):
        return module
    return DistributedDataParallel(module, process_group=group, init_sync=False, forward_sync_buffers=False)


def _check_unshared(graph: Graph, modules: list[nn.Module], wrapper: str) -> None:
    """Two of this rank's stages holding one parameter cannot each have a DDP or FSDP2 unit:
    DDP would all-reduce it after each stage's own last backward (one missing the other's
    part), FSDP2 would shard it twice (the second unit training a stale copy)."""
    owner: dict[int, int] = {}
    for k, m in enumerate(modules):
        for name, p in m.named_parameters():
            if owner.setdefault(id(p), k) != k:
                raise ShardcError(f"parameter {name} of graph @{graph.name} is read by two virtual stages on one "
                                  f"pipeline rank; {wrapper} cannot sync it there (the V schedules zbv and "
                                  "dualpipev put the first and last stage on rank 0)",
                                  hint="untie it (e.g. tie=false), use vpp=1, or tie parameters only between "
                                  "stages on different pipeline ranks")


def _examples(values: list[Any], mesh: Any, compute: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Meta tensors with this rank's local shapes and run-time dtypes (`precision.runtime_dtype`)
    of `values`: a stage's static metadata.

    Given inputs and outputs, torch's `PipelineStage` skips its first-step metadata inference,
    a real forward outside `no_sync` that would arm DDP's reducer before the schedule's own
    backwards (DDP then all-reduces every micro-batch and asserts when rebuilding buckets)."""
    out = []
    for v in values:
        t = torch.empty(local_shape(v, mesh), dtype=runtime_dtype(v, compute), device="meta")
        out.append(t.requires_grad_(v.requires_grad and t.is_floating_point()))
    return tuple(out)


def _flattened(dm: Any, axes: tuple[str, ...]) -> Any:
    name = "_".join(axes)
    try:
        return dm[name]
    except (KeyError, RuntimeError, ValueError):
        return dm[axes]._flatten(name)
