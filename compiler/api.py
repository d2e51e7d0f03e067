"""The user API: `shardc.compile(model, example_inputs, ...)` -> `CompiledPlan`.

    plan = shardc.compile(model, example_inputs, plan="dp=2,tp=2")
    print(plan)                      # the partitioned, lowered IR
    print(plan.code(rank=0))         # what rank 0 runs (torch.fx generated code)
    plan.estimate()                  # predicted step time and memory (shardc.cost)
    module = plan.parallelize(model) # on each rank, after init_process_group
    loss = module(*batch); loss.backward(); optimizer.step()

Compilation traces the model (`shardc.frontend`), files nodes under layers (group-layers),
partitions it by the plan (apply-plan) and lowers it (lower). The returned plan is plain data;
`parallelize` is what touches torch.distributed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardc.diagnostics import ShardcError
from shardc.ir import Graph, Mesh
from shardc.plan import ParallelPlan


@dataclass
class CompiledPlan:
    """A partitioned and lowered graph plus what it was compiled from.

    `graph` is the lowered IR (`print(plan)` shows it); `plan` the ParallelPlan; `cluster` the
    cluster it was planned for (for `estimate`); `constants` the values of the graph's
    `const.N` buffers (folded constants the model itself does not hold).
    """

    graph: Graph
    plan: ParallelPlan
    cluster: Any = None
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    input_names: tuple[str, ...] = ()

    @property
    def mesh(self) -> Mesh:
        assert self.graph.mesh is not None
        return self.graph.mesh

    @property
    def world_size(self) -> int:
        return self.mesh.size

    def __str__(self) -> str:
        return str(self.graph)

    def module(self, rank: int) -> torch.fx.GraphModule:
        """Rank `rank`'s generated module with meta-device parameters (for reading, not running)."""
        from shardc.backends.torch.codegen import generate

        self._check_rank(rank)
        return generate(self.graph, rank)

    def code(self, rank: int = 0) -> str:
        """The Python code rank `rank` runs: the root module, then each layer module."""
        from shardc.backends.torch.codegen import module_code

        self._check_rank(rank)
        coords = ", ".join(f"{a}={c}" for a, c in self.mesh.coordinates(rank).items())
        return f"# rank {rank} of {self.mesh} ({coords}), plan {self.plan}\n" + module_code(self.module(rank))

    def estimate(self, cluster: Any = None) -> Any:
        """The cost model's prediction (`shardc.cost.estimate`) for `cluster` (default: the one compiled for)."""
        from shardc.cost import estimate
        from shardc.hardware import parse_cluster

        cluster = cluster if cluster is not None else self.cluster
        if cluster is None:
            raise ShardcError("plan.estimate() needs a cluster", hint="pass cluster='8xA100-80GB' to shardc.compile "
                              "or to estimate()")
        if isinstance(cluster, str):
            cluster = parse_cluster(cluster)
        return estimate(self.graph, cluster, self.plan)

    def parallelize(self, model: torch.nn.Module, *, init: Any = None, seed: int = 0,
                    device: torch.device | str | None = None) -> torch.nn.Module:
        """This rank's trainable module (call on every rank after `init_process_group`).

        Parameters come from `model`'s own tensors, each rank keeping its shard; for a model on
        the meta device, `init(name, tensor)` fills one full tensor at a time (seeded by `seed`
        and the name, so every rank agrees) and each rank keeps its piece. Inputs are the global
        batch in the traced shapes; every rank slices its own part. The output is the loss (or
        the model's outputs): replicated on model axes, each rank's own part on data axes
        (the loss is the mean over this rank's share of the batch).
        """
        from shardc.backends.torch.parallelize import parallelize_graph

        if self.plan.pp > 1:
            raise ShardcError(f"plan {self.plan} is pipelined (pp={self.plan.pp})", hint="pipelined plans run "
                              "through shardc.backends.torch.pipeline.PipelineRunner (one step function per "
                              "schedule); plan.parallelize covers pp=1")
        return parallelize_graph(self.graph, _with_constants(model, self.constants), init=init, seed=seed,
                                 device=device)

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer unsharded, on every rank (a collective: call on all ranks)."""
        from shardc.backends.torch.parallelize import full_state_dict

        return full_state_dict(self.graph, module)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ShardcError(f"rank {rank} is outside the plan's {self.mesh} (ranks 0..{self.world_size - 1})")


class _ConstantsView(torch.nn.Module):
    """The model plus the folded constants as extra buffers (only for looking tensors up by name)."""

    def __init__(self, model: torch.nn.Module, constants: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.inner = model
        self.constants = constants

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.inner.named_parameters(remove_duplicate=False)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        yield from self.inner.named_buffers(remove_duplicate=False)
        yield from self.constants.items()


def _with_constants(model: torch.nn.Module, constants: dict[str, torch.Tensor]) -> torch.nn.Module:
    return _ConstantsView(model, constants) if constants else model


def _as_plan(plan: Any) -> ParallelPlan:
    if plan is None:
        return ParallelPlan()
    if isinstance(plan, ParallelPlan):
        return plan
    if isinstance(plan, str):
        return ParallelPlan.parse(plan)
    if isinstance(plan, Graph):
        return ParallelPlan.parse(str(plan.attrs["plan"])) if "plan" in plan.attrs else ParallelPlan()
    raise ShardcError(f"plan must be a ParallelPlan, its text ('dp=2,tp=2'), a partitioned Graph or None, "
                      f"not {type(plan).__name__}")


def compile(model: Any, example_inputs: Any = None, cluster: Any = None, plan: Any = None, *,
            name: str | None = None, input_names: tuple[str, ...] | None = None, seed: int = 0,
            before_lower: Callable[[Graph], Any] | None = None, print_after_all: bool = False) -> CompiledPlan:
    """Trace, partition by `plan` and lower; see the module docstring.

    `model` is an nn.Module (with `example_inputs`) or a model spec (`examples/gpt.py:tiny`,
    `hf:gpt2?n_layer=2`). `plan` is a ParallelPlan, its text, None (one device), or an already
    partitioned Graph of this model (what the solver writes, `shardc plan -o`), which is lowered
    as it is.
    `before_lower(graph)` may edit the partitioned graph in place before lowering (hand-written
    partitions: temporal splits, rotations).
    """
    from shardc.frontend import trace_with_state
    from shardc.passes.apply_plan import ApplyPlan
    from shardc.passes.group_layers import GroupLayers
    from shardc.passes.lower import Lower
    from shardc.passmanager import PassContext, run_pipeline

    if isinstance(model, str):
        from shardc.models import load_model

        loaded = load_model(model, device="cpu")
        model, example_inputs = loaded.model, loaded.example_inputs
        input_names = input_names or loaded.input_names
        name = name or loaded.name
    if example_inputs is None:
        raise ShardcError("shardc.compile needs example_inputs (a tuple of tensors in forward's order)")
    inputs = tuple(example_inputs) if isinstance(example_inputs, tuple | list) else (example_inputs,)
    traced = trace_with_state(model, inputs, name=name, input_names=input_names)
    parallel = _as_plan(plan)
    ctx = PassContext(cluster=cluster, plan=parallel, seed=seed)
    if isinstance(plan, Graph):
        graph = plan
        if graph.mesh is None:
            raise ShardcError(f"graph @{graph.name} given as the plan is not partitioned (it has no mesh)")
    else:
        graph = run_pipeline(traced.graph, [GroupLayers(), ApplyPlan()], ctx, print_after_all=print_after_all)
    if before_lower is not None:
        before_lower(graph)
    graph = run_pipeline(graph, [Lower()], ctx, print_after_all=print_after_all)
    return CompiledPlan(graph, parallel, cluster, dict(traced.constants),
                        tuple(v.name for v in graph.inputs))


def compile_to_dir(spec: str, plan: Any, out_dir: str | os.PathLike[str], cluster: Any = None) -> Path:
    """`shardc compile SPEC --plan P -o DIR`: write `graph.ir` (the lowered IR), `plan.txt` and
    `rank<k>.py` (each rank's generated code) into `out_dir`, atomically (a temporary sibling
    directory renamed into place, replacing an older one)."""
    compiled = compile(spec, cluster=cluster, plan=plan)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "graph.ir").write_text(str(compiled.graph))
        (tmp / "plan.txt").write_text(str(compiled.plan) + "\n")
        for rank in range(compiled.world_size):
            (tmp / f"rank{rank}.py").write_text(compiled.code(rank))
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            if old.exists():
                shutil.rmtree(old)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
