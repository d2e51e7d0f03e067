"""The runtime side of `plan.parallelize(model)`: process groups, local shards, data parallelism.

Rule. The lowered graph's mesh becomes a `DeviceMesh` (one process group per axis). Each rank
takes its piece of every parameter and buffer, from the model's own tensors or, for a
meta-device model, from `init(name, tensor)` applied to one full tensor at a time (seeded per
name so every rank draws the same values), so no rank ever holds the whole model. The rank's
generated module then gets the data axes' gradient averaging from torch:

    zero=0          -> DistributedDataParallel over the data axes (dp, or dp x cp flattened)
    zero=1 or 2     -> FSDP2 fully_shard(reshard_after_forward=False): parameters sharded at
                       rest, gathered once per step, gradients reduce-scattered, optimizer
                       state sharded (ZeRO-2 memory plus sharded parameters between steps)
    zero=3          -> FSDP2 fully_shard(reshard_after_forward=True)

as the `grad_sync` nodes of the lowered IR say. Under mixed precision (`precision.py`) FSDP2
gathers compute-dtype weights and reduce-scatters fp32 gradients (`MixedPrecisionPolicy`), and
an fp16 module carries its loss scaler (`grad_scaler`; `step` scales the loss).

Fused execution: when the plan's `compile` key says so (`ParallelPlan.compiled_on`: auto is on
for CUDA devices, off for CPU processes), the generated module is compiled in place with
`torch.compile` (inductor; `nn.Module.compile`, so parameter names and `state_dict` keys stay
the model's), inside the DDP / FSDP2 wrapper, as torch recommends. Dynamo traces the
autograd-aware collectives as they are (their `torch.distributed` calls become its traceable
functional collectives), so one graph covers a layer's matmuls, elementwise chains and
collectives; inductor's compiled artifacts go to torch's own on-disk cache.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from shardc.backends.torch.codegen import generate, local_piece
from shardc.backends.torch.collectives import MeshGroups
from shardc.backends.torch.precision import attach_scaler, compute_dtype, grad_scaler, mixed_precision_policy
from shardc.backends.torch.ring import gather
from shardc.ir import Graph, Layout, Mesh, Shard
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan

InitFn = Callable[[str, torch.Tensor], Any]


class ConstantsView(nn.Module):
    """The model plus the frontend's folded constants as extra buffers (only for looking tensors
    up by name: `local_tensors` and `check_model` read parameters and buffers through it)."""

    def __init__(self, model: nn.Module, constants: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.inner = model
        self.constants = constants

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.inner.named_parameters(remove_duplicate=False)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        yield from self.inner.named_buffers(remove_duplicate=False)
        yield from self.constants.items()


def with_constants(model: nn.Module, constants: dict[str, torch.Tensor]) -> nn.Module:
    """`model` seen with `constants` (a compiled plan's `const.N` buffers) beside its own tensors."""
    return ConstantsView(model, constants) if constants else model


def device_mesh(mesh: Mesh, device_type: str | None = None) -> Any:
    """A torch `DeviceMesh` with the IR mesh's axes (needs an initialised default process group)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise ShardcError("torch.distributed is not initialised", hint="call torch.distributed.init_process_group "
                          "(or launch with torchrun / shardc run) before plan.parallelize")
    world = dist.get_world_size()
    if world != mesh.size:
        raise ShardcError(f"the world has {world} processes but the plan's {mesh} needs {mesh.size}",
                          hint=f"launch {mesh.size} processes or compile a plan for {world} devices")
    device_type = device_type or ("cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")
    return init_device_mesh(device_type, tuple(s for _, s in mesh.axes), mesh_dim_names=mesh.names)


def mesh_groups(mesh: Mesh, dm: Any, rank: int) -> MeshGroups:
    groups = {a: dm.get_group(a) for a in mesh.names if mesh.axis_size(a) > 1}
    return MeshGroups(dict(mesh.axes), mesh.coordinates(rank), groups)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by its path, tied ones under each of their names."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    return out


def check_model(graph: Graph, model: nn.Module) -> None:
    """The model must have every parameter and buffer the plan names, with the traced shapes."""
    have = model_tensors(model)
    missing = [v.name for v in graph.params + graph.buffers if v.name not in have]
    wrong = [f"{v.name}: plan {tuple(v.type.shape)}, model {tuple(have[v.name].shape)}"
             for v in graph.params + graph.buffers if v.name in have and tuple(have[v.name].shape) != v.type.shape]
    if missing or wrong:
        text = []
        if missing:
            text.append(f"missing in the model: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
        if wrong:
            text.append("shapes differ: " + "; ".join(wrong[:8]))
        raise ShardcError(f"the plan for graph @{graph.name} does not match this model: " + "; ".join(text),
                          hint="compile the plan from this model (shardc.compile(model, example_inputs, ...))")


def local_tensors(graph: Graph, model: nn.Module, rank: int, init: InitFn | None = None, seed: int = 0,
                  device: torch.device | str = "cpu", names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """This rank's piece of every parameter and buffer of the plan (of those in `names`, if given)."""
    assert graph.mesh is not None
    coords = graph.mesh.coordinates(rank)
    have = model_tensors(model)
    out: dict[str, torch.Tensor] = {}
    for v in graph.params + graph.buffers:
        if names is not None and v.name not in names:
            continue
        src = have[v.name]
        if src.is_meta:
            if init is None:
                raise ShardcError(f"{v.name} is on the meta device", hint="pass init=fn to plan.parallelize; it is "
                                  "called as fn(name, tensor) on one full tensor at a time to fill it in place")
            full = torch.empty(src.shape, dtype=src.dtype, device=device)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + zlib.crc32(v.name.encode()))
                with torch.no_grad():
                    init(v.name, full)
            src = full
        out[v.name] = local_piece(src.detach(), v.layout or Layout(), graph.mesh, coords).to(device).clone()
        del src
    return out


def data_parallel_info(graph: Graph) -> tuple[tuple[str, ...], str, int]:
    """(data axes, "ddp" | "fsdp", highest ZeRO stage) from the graph's grad_sync nodes."""
    axes: tuple[str, ...] = ()
    via, zero = "ddp", 0
    for n in graph.nodes:
        if n.op == "grad_sync":
            axes = tuple(dict.fromkeys(axes + tuple(n.attrs["axes"])))
            via = n.attrs.get("via", via)
            zero = max(zero, int(n.attrs.get("zero", 0)))
    return axes, via, zero


def parallelize_graph(graph: Graph, model: nn.Module, *, init: InitFn | None = None, seed: int = 0,
                      device: torch.device | str | None = None, micro_graph: Graph | None = None,
                      loss_fn: Callable[..., torch.Tensor] | None = None) -> nn.Module:
    """This rank's trainable module for a lowered graph (see the module docstring). With a
    `micro_graph` (the plan has several micro-batches) the module runs that one per micro-batch."""
    from shardc.backends.torch.microbatch import Microbatched

    if graph.mesh is None:
        raise ShardcError(f"graph @{graph.name} has no mesh; compile the plan first")
    runtime = micro_graph if micro_graph is not None else graph
    dm = device_mesh(graph.mesh)
    rank = dist.get_rank()
    check_model(runtime, model)
    if device is None:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if dm.device_type == "cuda" else "cpu"
    tensors = local_tensors(runtime, model, rank, init=init, seed=seed, device=device)
    runner = generate(runtime, rank, tensors, mesh_groups(graph.mesh, dm, rank), device=str(device))
    micro = int(graph.attrs.get("microbatches", 1)) if micro_graph is not None else 1
    if runs_compiled(runtime, dm.device_type):
        compile_in_place(runner)
    module = Microbatched(runner, micro, graph, runtime, loss_fn)
    describe_state(module, runtime, dm, model)
    compute = compute_dtype(runtime)
    scaler = grad_scaler(compute, device)
    attach_scaler(scaler, module)
    axes, via, zero = data_parallel_info(runtime)
    if not axes:
        return module
    sub = dm[axes[0]] if len(axes) == 1 else dm[axes]._flatten("_".join(axes))
    if via == "fsdp" or zero > 0:
        from torch.distributed.fsdp import fully_shard

        policy = mixed_precision_policy(compute)
        fully_shard(module, mesh=sub, reshard_after_forward=zero >= 3, **({"mp_policy": policy} if policy else {}))
        return module
    from shardc.backends.torch.microbatch import DataParallel

    # Every rank already holds its own pieces: no broadcast from rank 0 (buffers may be sharded
    # along cp, which this group spans).
    wrapped = DataParallel(module, process_group=sub.get_group(), init_sync=False, forward_sync_buffers=False)
    attach_scaler(scaler, wrapped)
    return wrapped


def runs_compiled(graph: Graph, device_type: str) -> bool:
    """Whether a rank module of `graph` runs through torch.compile on `device_type` ("cuda" or
    "cpu"): the plan the graph records (`compile=auto|0|1`, `ParallelPlan.compiled_on`); a graph
    recording no plan is auto."""
    text = graph.attrs.get("plan")
    plan = ParallelPlan.parse(str(text)) if text else ParallelPlan()
    return plan.compiled_on(device_type == "cuda")


def compile_in_place(module: nn.Module) -> nn.Module:
    """`module` compiled by inductor in place (`nn.Module.compile`): its forward runs the compiled
    code on the next call, and its parameters, buffers and submodules keep their names, so
    optimizers, DDP / FSDP2 and checkpoints see the module as before."""
    module.compile(backend="inductor")
    return module


def describe_state(module: nn.Module, graph: Graph, dm: Any, model: nn.Module) -> None:
    """What checkpoints need to know about a generated module (`shard_state.shardc_parts`):
    its graph and mesh, the buffers that are not state (folded constants, non-persistent
    buffers) and the model's tied parameter names."""
    own = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    own |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    facts: dict[str, Any] = {"shardc_graph": graph, "shardc_mesh": dm}
    folded = getattr(model, "constants", None)  # ConstantsView: the frontend's folded constants
    folded = set(folded) if isinstance(folded, dict) else set()
    inner = getattr(model, "inner", model) if folded else model
    persistent = set(inner.state_dict().keys())  # non-persistent buffers are rebuilt, not saved
    facts["shardc_constants"] = tuple(v.name for v in graph.buffers
                                      if v.name not in own or v.name in folded or v.name not in persistent)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    facts["shardc_tied"] = [tuple(v) for v in groups.values() if len(v) > 1]
    for key, value in facts.items():
        object.__setattr__(module, key, value)  # plain attributes, not submodules


def unwrap(module: nn.Module) -> nn.Module:
    return module.module if hasattr(module, "module") and isinstance(module.module, nn.Module) else module


def full_state_dict(graph: Graph, module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as the full (unsharded) tensor, on every rank (collective)."""
    from torch.distributed.tensor import DTensor

    assert graph.mesh is not None
    own = getattr(module, "full_state_dict", None)
    if callable(own):  # a PipelinedModule gathers over its pipeline ranks too
        return own()
    inner = unwrap(module)
    local: dict[str, torch.Tensor] = dict(inner.named_parameters(remove_duplicate=False))
    local.update(dict(inner.named_buffers(remove_duplicate=False)))
    dm_groups: MeshGroups | None = None
    out: dict[str, torch.Tensor] = {}
    for v in graph.params + graph.buffers:
        t = local[v.name].detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        for axis, p in reversed((v.layout or Layout()).placements):
            if isinstance(p, Shard) and graph.mesh.axis_size(axis) > 1:
                if dm_groups is None:
                    dm_groups = cast(MeshGroups, inner.get_submodule("mesh"))  # generate() puts it there
                t = gather(t, dm_groups, axis, p.dim, p.interleave, p.zigzag)
        out[v.name] = t
    return out
