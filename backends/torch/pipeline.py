"""Pipelines of a plain torch model: cut it into stages by layer with torch.fx and run
torch.distributed.pipelining schedules (tp inside stages through torch's `parallelize_module`).

Compiled plans do not come this way: `plan.parallelize(model)` for pp > 1 builds each stage
from the lowered IR (`pipelined.PipelinedModule`, the path `shardc run` uses), which also runs
what torch's tensor-parallel vocabulary cannot say (GPT's fused qkv, sequence and context
parallelism inside stages). `PipelineRunner` stays as the torch-only baseline the empirical
study measures (`shardc.study.worker`) and that ejected code mirrors.

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
the `tp` sub-mesh with a caller-supplied function, runs the schedule (GPipe, 1F1B, interleaved
1F1B) over micro-batches with the user's loss, then averages gradients over the `dp` axis and
sums gradients of parameters tied across stages (GPT's embedding and head).
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

SCHEDULES = ("gpipe", "1f1b", "interleaved")


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


def stages_from_graph(graph: Any) -> dict[str, int]:
    """Module path -> stage from an IR graph whose layers carry `annotation.stage` (apply_plan's output).

    Adapter over the IR: each node's `location.module_path` gets the stage of its layer; paths of
    nodes whose layer has no stage are left out (they follow the data flow).
    """
    out: dict[str, int] = {}
    for node in graph.nodes:
        layer = graph.layers.get(node.layer) if node.layer else None
        if layer is None or layer.annotation.stage is None or not node.location.module_path:
            continue
        out[node.location.module_path] = layer.annotation.stage
    return out


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

def stages_of_rank(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Stages held by one pp rank: `pp_rank + i*pp` for each virtual stage i (round robin)."""
    return [pp_rank + i * pp for i in range(virtual)]


def _schedule_class(name: str, virtual: int) -> type:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    key = name.lower().replace("-", "").replace("_", "")
    if virtual > 1 and key in ("1f1b", "interleaved", "interleaved1f1b"):
        return ScheduleInterleaved1F1B
    table = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "interleaved1f1b": ScheduleInterleaved1F1B}
    if key not in table:
        raise ShardcError(f"unknown pipeline schedule {name!r}; known: gpipe, 1f1b, interleaved")
    cls = table[key]
    if cls is ScheduleInterleaved1F1B and virtual < 2:
        raise ShardcError("schedule interleaved needs vpp >= 2 virtual stages per device",
                          hint="set vpp=2 (or more) in the plan, or use schedule=1f1b")
    if cls is not ScheduleInterleaved1F1B and virtual > 1:
        raise ShardcError(f"schedule {name} runs one stage per device but vpp={virtual}",
                          hint="use schedule=interleaved or vpp=1")
    return cls


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
            if shard_model is None:
                raise ShardcError(f"the mesh has tp={tp_mesh.size()} but no shard_model function was given",
                                  hint="pass shard_model=shardc.backends.torch.eject.apply_tensor_parallel")
            model = shard_model(model, tp_mesh)
        all_stages = split_stages(model, self.num_stages, stage_of, traced)
        self.stage_ids = stages_of_rank(self.pp_rank, self.pp, virtual_stages)
        self.modules: list[nn.Module] = [all_stages[s] for s in self.stage_ids]
        self._tied = _tied_names(model)
        self._tied_shapes = {names[0]: model.get_parameter(names[0]).shape for names in self._tied}
        device = _device_of(model)
        pp_group = mesh["pp"].get_group()
        self.stages = [PipelineStage(m, s, self.num_stages, device, group=pp_group)
                       for m, s in zip(self.modules, self.stage_ids)]
        self.schedule_name = schedule
        self._schedule = self._build_schedule(loss_fn)

    def _build_schedule(self, loss_fn: Callable[..., torch.Tensor]) -> Any:
        cls = _schedule_class(self.schedule_name, self.virtual)
        from torch.distributed.pipelining import ScheduleInterleaved1F1B

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
        if self.dp_mesh is not None:
            average_gradients(list(self.parameters()), self.dp_mesh.get_group())
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
    """Average the gradients over `group`, flattened into one all_reduce per dtype (pipelines
    sync data-parallel gradients this way: DDP's reducer does not run under a schedule)."""
    size = dist.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(local_tensor(p.grad))
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
