"""Pipelines of a plain torch model: cut it into stages by layer with torch.fx and run
torch.distributed.pipelining schedules (tp inside stages through torch's `parallelize_module`).

Compiled plans do not come this way: `plan.parallelize(model)` for pp > 1 builds each stage
from the lowered IR (`pipelined.PipelinedModule`, what `shardc run` and the study use). This
`PipelineRunner` is the torch-only baseline that ejected code mirrors and checkpoint tests train.

Rule of the cut: every repeated block (a child of the model's largest `nn.ModuleList`, or a
module path named in `stage_of`) belongs to the stage it is assigned; every other op belongs to
the latest stage any of its inputs comes from (so the embedding lands on stage 0 and the final
norm and head on the last stage), and a parameter read by a `get_attr` goes with its users.
Each stage becomes a `torch.fx.GraphModule` whose inputs are exactly the previous stage's
outputs: values needed further down the pipeline are carried through the stages between.
Parameters keep the fully qualified names they have in the original model, so state dicts of
stages merge into the model's own state dict (what checkpoints rely on).

`PipelineRunner` places the stages on the `pp` axis of a `DeviceMesh` (stage `s` on pp rank
`s % pp`, the round-robin layout interleaved 1F1B expects), optionally shards each stage over
the `tp` sub-mesh with a caller-supplied function, and runs the schedule (GPipe, 1F1B,
interleaved 1F1B) over micro-batches with the user's loss. Over `dp` each stage module is a
`DistributedDataParallel` module the pipeline stage drives (its buckets all-reduce during the
last micro-batch's backward); then gradients of parameters tied across stages (GPT's embedding
and head) are summed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from shardc.diagnostics import ShardcError

# ---- stage assignment ---------------------------------------------------------------------

def block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: its largest `nn.ModuleList` (ties: the first one found)."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    if best is None or len(best[1]) == 0:
        raise ShardcError(f"model {type(model).__name__} has no nn.ModuleList of blocks to cut into stages",
                          hint="give stage_of={module path: stage} explicitly, or use pp=1")
    return best


def even_stages(num_blocks: int, num_stages: int) -> list[int]:
    """Stage of each of `num_blocks` blocks, contiguous and as even as possible (early stages get the extra)."""
    if num_stages > num_blocks:
        raise ShardcError(f"{num_stages} pipeline stages but only {num_blocks} blocks",
                          hint=f"use at most pp*vpp = {num_blocks} stages")
    base, extra = divmod(num_blocks, num_stages)
    out: list[int] = []
    for s in range(num_stages):
        out += [s] * (base + (1 if s < extra else 0))
    return out


def block_stages(model: nn.Module, num_stages: int) -> dict[str, int]:
    """Module path of each block -> its stage, blocks split evenly over `num_stages`."""
    prefix, blocks = block_list(model)
    stages = even_stages(len(blocks), num_stages)
    return {f"{prefix}.{i}" if prefix else str(i): s for i, s in enumerate(stages)}


def _lookup(path: str, stage_of: Mapping[str, int]) -> int | None:
    """Stage of the longest prefix of `path` (by dotted components) named in `stage_of`."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        hit = stage_of.get(".".join(parts[:i]))
        if hit is not None:
            return hit
    return None


def _node_path(node: fx.Node) -> str | None:
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1]
        return path[0] if isinstance(path, tuple) else str(path)
    return None


def assign_stages(gm: fx.GraphModule, stage_of: Mapping[str, int], num_stages: int) -> dict[fx.Node, int]:
    """Stage of every non-placeholder node, by the rule in the module docstring.

    A node may carry `node.meta["stage"]` (set by a code generator) which overrides the lookup.
    """
    stage: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        own = node.meta.get("stage")
        if own is None:
            path = _node_path(node)
            own = _lookup(path, stage_of) if path is not None else None
        inputs = [stage[a] for a in node.all_input_nodes if a in stage]
        stage[node] = max([own if own is not None else 0, *inputs])
        if stage[node] >= num_stages:
            raise ShardcError(f"node {node.name} ({_node_path(node)}) is assigned stage {stage[node]} "
                              f"but there are only {num_stages} stages")
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            users = [stage[u] for u in node.users if u in stage]
            stage[node] = min(users) if users else 0
    return stage


# ---- cutting ------------------------------------------------------------------------------

def split_stages(model: nn.Module, num_stages: int, stage_of: Mapping[str, int] | None = None,
                 traced: fx.GraphModule | None = None) -> list[fx.GraphModule]:
    """Cut `model` into `num_stages` GraphModules; stage k's inputs are stage k-1's outputs.

    `stage_of` maps module paths to stages (default: `block_stages`); `traced` is the model
    already traced by torch.fx (default: `trace_model(model)`). Parameters are shared with
    `model`, not copied, and keep their qualified names.
    """
    gm = traced if traced is not None else trace_model(model)
    stage_of = dict(stage_of) if stage_of is not None else block_stages(model, num_stages)
    stage = assign_stages(gm, stage_of, num_stages)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output_node = next(n for n in nodes if n.op == "output")
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            user_stage = num_stages - 1 if n is output_node else stage[n]
            last_use[a] = max(last_use.get(a, -1), user_stage)
    # carried[k]: values entering stage k, in definition order
    carried: list[list[fx.Node]] = [placeholders]
    for k in range(1, num_stages):
        live = [n for n in nodes if n.op != "get_attr" and n.op != "output" and n in last_use
                and last_use[n] >= k and (n.op == "placeholder" or stage[n] < k)]
        carried.append(live)
    for k in range(1, num_stages):
        for n in carried[k]:
            if n.op == "placeholder" or _is_tensor_node(n):
                continue
            raise ShardcError(f"value {n.name} ({_node_path(n) or 'top level'}) crosses from stage "
                              f"{stage[n]} to a later stage but is not a tensor; a pipeline stage can only send tensors",
                              hint="compute it inside the later block (e.g. from x.shape) or move the stage cut")
    out: list[fx.GraphModule] = []
    for k in range(num_stages):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in carried[k]:
            env[n] = g.placeholder(n.name)
        for n in nodes:
            if n.op == "get_attr" and any(stage.get(u) == k for u in n.users):
                env[n] = g.node_copy(n, env.__getitem__)
            elif n.op not in ("placeholder", "get_attr", "output") and stage[n] == k:
                env[n] = g.node_copy(n, env.__getitem__)
        if k == num_stages - 1:
            g.output(fx.map_arg(output_node.args[0], env.__getitem__))
        else:
            outs = tuple(env[n] for n in carried[k + 1])
            g.output(outs[0] if len(outs) == 1 else outs)
        g.lint()
        out.append(fx.GraphModule(model if traced is None else gm, g, class_name=f"Stage{k}"))
    return out


def trace_model(model: nn.Module, num_inputs: int = 1) -> fx.GraphModule:
    """torch.fx trace of `model` fed its first `num_inputs` forward arguments; later ones are None.

    Buffers are traced as graph values (not baked-in tensors), so slicing a buffer by an input's
    length (`mask[:s, :s]`, `rope_cos[:s]`) traces.
    """
    import inspect

    class Tracer(fx.Tracer):
        proxy_buffer_attributes = True

    names = list(inspect.signature(model.forward).parameters)[num_inputs:]
    try:
        graph = Tracer().trace(model, concrete_args={n: None for n in names} or None)
    except Exception as err:  # fx raises many types; the reason is what the user needs
        raise ShardcError(f"cannot cut {type(model).__name__} into pipeline stages: torch.fx could not trace it "
                          f"({type(err).__name__}: {err})", hint="pass an already traced GraphModule as traced=") from err
    for node in list(graph.nodes):  # the None arguments are not inputs of the pipeline
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "placeholder" and not node.users and node.target.rstrip("_1") in names:
            graph.erase_node(node)
    return fx.GraphModule(model, graph)


def _is_tensor_node(n: fx.Node) -> bool:
    val = n.meta.get("tensor_meta") or n.meta.get("val")
    if val is not None:
        return True
    if n.op == "call_function" and n.target in (operator.getitem, getattr) and n.args and \
            isinstance(n.args[0], fx.Node) and n.args[0].op == "call_function" and n.args[0].target is getattr:
        return False
    if n.op == "call_function" and n.target is getattr:
        return False
    if n.op == "call_function" and n.target in (operator.floordiv, operator.mul, operator.add, operator.sub) \
            and not any(_is_tensor_node(a) for a in n.all_input_nodes):
        return False
    return True


# ---- running ------------------------------------------------------------------------------

class PipelineRunner:
    """This rank's pipeline stages and the schedule that trains them; `step` returns the loss.

    `mesh` is a DeviceMesh with a `pp` axis and optionally `dp` and `tp` axes (sizes 1 may be
    left out). `step(inputs, targets)` takes this dp replica's batch (like DDP: every dp rank
    passes its own shard), splits it into `n_microbatches`, runs the schedule, and leaves
    gradients in the parameters ready for any torch optimizer: averaged over dp, summed over
    stages for tied parameters, scaled by 1/n_microbatches (so a mean loss gives the gradient
    of the whole batch's mean loss). It returns the mean micro-batch loss on every rank.
    `shard_model(model, tp_mesh) -> model` shards the whole model over tp when tp > 1, before it
    is traced and cut (so hooks of torch's `parallelize_module` and shrunk head counts are seen
    by the tracer); `eject.apply_tensor_parallel` is torch's Megatron plan.
    """

    def __init__(self, model: nn.Module, mesh: Any, loss_fn: Callable[..., torch.Tensor], *,
                 n_microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1,
                 stage_of: Mapping[str, int] | None = None, traced: fx.GraphModule | None = None,
                 shard_model: Callable[[nn.Module, Any], nn.Module] | None = None) -> None:
        from torch.distributed.pipelining import PipelineStage

        names = mesh.mesh_dim_names or ()
        if "pp" not in names:
            raise ShardcError(f"pipeline needs a mesh with a 'pp' axis; this mesh has {names}")
        self.mesh = mesh
        self.pp = mesh["pp"].size()
        self.pp_rank = mesh["pp"].get_local_rank()
        self.virtual = virtual_stages
        self.num_stages = self.pp * virtual_stages
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.dp_mesh = mesh["dp"] if "dp" in names and mesh["dp"].size() > 1 else None
        tp_mesh = mesh["tp"] if "tp" in names and mesh["tp"].size() > 1 else None
        if n_microbatches < self.pp and virtual_stages > 1:
            raise ShardcError(f"interleaved schedule needs n_microbatches ({n_microbatches}) >= pp ({self.pp})")
        if tp_mesh is not None:
            if self.dp_mesh is not None:  # DDP cannot sync the DTensor parameters tp leaves
                raise ShardcError("PipelineRunner runs dp or tp inside a pipeline, not both",
                                  hint="compile the plan (shardc.compile(...).parallelize) for dp x tp x pp")
            if shard_model is None:
                raise ShardcError(f"the mesh has tp={tp_mesh.size()} but no shard_model function was given",
                                  hint="pass shard_model=shardc.backends.torch.eject.apply_tensor_parallel")
            model = shard_model(model, tp_mesh)
        all_stages = split_stages(model, self.num_stages, stage_of, traced)
        self.stage_ids = [self.pp_rank + i * self.pp for i in range(virtual_stages)]  # round robin
        self.modules: list[nn.Module] = [all_stages[s] for s in self.stage_ids]
        self._tied = _tied_names(model)
        self._tied_shapes = {names[0]: model.get_parameter(names[0]).shape for names in self._tied}
        device = _device_of(model)
        pp_group = mesh["pp"].get_group()
        wrapped = [_data_parallel(m, self.dp_mesh) for m in self.modules]
        self.stages = [PipelineStage(m, s, self.num_stages, device, group=pp_group)
                       for m, s in zip(wrapped, self.stage_ids)]
        self.schedule_name = schedule
        self._schedule = self._build_schedule(loss_fn)

    def _build_schedule(self, loss_fn: Callable[..., torch.Tensor]) -> Any:
        from torch.distributed.pipelining import ScheduleInterleaved1F1B

        from shardc.backends.torch.pipelined import schedule_class

        cls = schedule_class(self.schedule_name, self.virtual)

        if cls is ScheduleInterleaved1F1B:
            return cls(list(self.stages), n_microbatches=self.n_microbatches, loss_fn=loss_fn)  # type: ignore[arg-type]
        return cls(self.stages[0], n_microbatches=self.n_microbatches, loss_fn=loss_fn)

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by their names in the original model (each once)."""
        seen: set[int] = set()
        for m in self.modules:
            for name, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> dict[str, Any]:
        """Merged state dict of this rank's stages, keyed by the original model's names."""
        out: dict[str, Any] = {}
        for m in self.modules:
            out.update(m.state_dict())
        return out

    def step(self, inputs: torch.Tensor | Sequence[torch.Tensor], targets: torch.Tensor,
             loss_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward over micro-batches; gradients synchronised; returns the mean loss."""
        if loss_fn is not None and loss_fn is not self.loss_fn:
            self.loss_fn = loss_fn
            self._schedule = self._build_schedule(loss_fn)
        args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        batch = args[0].shape[0]
        if batch % self.n_microbatches:
            raise ShardcError(f"batch of {batch} does not split into {self.n_microbatches} micro-batches",
                              hint="make the per-replica batch a multiple of the micro-batch count")
        losses: list[torch.Tensor] = []
        call_args = args if self.is_first else ()
        kwargs: dict[str, Any] = {}
        if self.is_last:
            kwargs = {"target": targets, "losses": losses}
        self._schedule.step(*call_args, **kwargs)
        self._sync_tied()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=args[0].device)
        last_global = dist.get_global_rank(self.mesh["pp"].get_group(), (self.num_stages - 1) % self.pp)
        dist.broadcast(loss, src=last_global, group=self.mesh["pp"].get_group())
        if self.dp_mesh is not None:
            dist.all_reduce(loss, group=self.dp_mesh.get_group())
            loss /= self.dp_mesh.size()
        return loss

    def _sync_tied(self) -> None:
        """Sum gradients of parameters that live on several stages (ranks without one add zeros)."""
        if not self._tied:
            return
        group = self.mesh["pp"].get_group()
        mine: dict[str, nn.Parameter] = {}
        for m in self.modules:
            for name, p in m.named_parameters(remove_duplicate=False):
                mine.setdefault(name, p)
        for names in self._tied:
            held = [mine[n] for n in names if n in mine]
            ref = held[0] if held else None
            shape = self._tied_shapes[names[0]]
            grad = ref.grad if ref is not None and ref.grad is not None else None
            buf = local_tensor(grad).clone() if grad is not None else torch.zeros(shape)
            dist.all_reduce(buf, group=group)
            if ref is not None:
                if ref.grad is None:
                    ref.grad = buf
                else:
                    local_tensor(ref.grad).copy_(buf)


def _tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [tuple(v) for v in groups.values() if len(v) > 1]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def average_gradients(params: list[nn.Parameter], group: Any) -> None:
    """Average the gradients over `group`, one all_reduce each: the plain data-parallel step
    tests compare against (the pipeline runtimes sync through DDP or FSDP2, not this)."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(local_tensor(p.grad), group=group)
            local_tensor(p.grad).div_(dist.get_world_size(group))


def _data_parallel(module: nn.Module, dp_mesh: Any) -> nn.Module:
    """`module` under DDP over `dp_mesh` (as it is without one, or with nothing to train).

    DDP's own forward is kept from arming its reducer (`require_backward_grad_sync` off, as
    `no_sync` sets it): torch's pipeline stage arms it itself before the last micro-batch's
    backward, and the stage's first-step shape inference (a forward outside `no_sync`) would
    otherwise make DDP all-reduce the first micro-batch too."""
    from torch.nn.parallel import DistributedDataParallel

    if dp_mesh is None or not any(p.requires_grad for p in module.parameters()):
        return module
    ddp = DistributedDataParallel(module, process_group=dp_mesh.get_group(), init_sync=False)
    ddp.require_backward_grad_sync = False
    return ddp


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
