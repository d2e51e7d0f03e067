"""The user API: `shardc.compile(model, example_inputs, ...)` -> `CompiledPlan`.

    plan = shardc.compile(model, example_inputs, plan="dp=2,tp=2")
    print(plan)                      # the partitioned, lowered IR
    print(plan.code(rank=0))         # what rank 0 runs (torch.fx generated code)
    plan.estimate()                  # predicted step time and memory (shardc.cost)
    module = plan.parallelize(model) # on each rank, after init_process_group
    loss = module(*batch); loss.backward(); optimizer.step()   # pp=1
    loss = module.step(*batch); optimizer.step()              # any plan, pipelines included

Compilation is the driver's `compile` pipeline (`shardc.driver`): it traces the model at the
batch the plan needs, files nodes under layers (group-layers), checks the plan (validate-plan),
partitions it (apply-plan) and lowers it (lower). The returned plan is plain data;
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

from shardc.ir import Axis, Graph, Mesh
from shardc.ir.diagnostics import ShardcError
from shardc.plan.parallel import ParallelPlan


@dataclass
class CompiledPlan:
    """A partitioned and lowered graph plus what it was compiled from.

    `graph` is the lowered IR (`print(plan)` shows it); `plan` the ParallelPlan; `cluster` the
    cluster it was planned for (for `estimate`); `constants` the values of the graph's
    `const.N` buffers (folded constants the model itself does not hold). `micro_graph` is the
    same plan lowered for one micro-batch (the model traced with dp*mb sequences, every node
    partitioned as in `graph`): what runs when the plan has more than one micro-batch; None when
    `graph` already is one micro-batch (or the model cannot be traced again, an ONNX import).
    `partitioned_ir` is `graph` printed before lowering: what `estimate` parses and scores, as
    `shardc estimate` does (collectives are the cost model's to price, not nodes to count again).
    """

    graph: Graph
    plan: ParallelPlan
    cluster: Any = None
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    input_names: tuple[str, ...] = ()
    micro_graph: Graph | None = None
    micro_constants: dict[str, torch.Tensor] = field(default_factory=dict)
    partitioned_ir: str = ""

    @property
    def runtime_graph(self) -> Graph:
        """The lowered graph each rank runs per micro-batch."""
        return self.micro_graph if self.micro_graph is not None else self.graph

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
        head = f"# rank {rank} of {self.mesh} ({coords}), plan {self.plan}\n"
        if self.mesh.axis_size(Axis.PP) == 1:
            return head + module_code(self.module(rank))
        from shardc.analysis.stages import device_stages
        from shardc.backends.torch.codegen import generate
        from shardc.backends.torch.stages import split_stages

        stages = split_stages(self.runtime_graph)
        pp, parts = self.mesh.axis_size(Axis.PP), []
        schedule, virtual = str(self.runtime_graph.attrs.get("schedule", "1f1b")), len(stages.stages) // pp
        mine = device_stages(self.mesh.coordinates(rank)[Axis.PP], pp, virtual, schedule)
        for s in mine:
            parts.append(f"# ==== stage {s} of {len(stages.stages)} ====\n"
                         + module_code(generate(stages.stages[s], rank, local_inputs=True)))
        if stages.loss is not None and len(stages.stages) - 1 in mine:
            parts.append("# ==== loss (the schedule's loss_fn on the last stage) ====\n"
                         + module_code(generate(stages.loss, rank, local_inputs=True)))
        return head + "\n".join(parts)

    def estimate(self, cluster: Any = None, routing_skew: float | None = None) -> Any:
        """The cost model's prediction for `cluster` (default: the one compiled for): the driver's
        `estimate` pass on the partitioned graph, as `shardc estimate` runs it. `routing_skew`:
        the busiest expert-parallel rank's routed tokens over the balanced share (`shardc.cost.moe`;
        default 1.0, balanced)."""
        from shardc import driver
        from shardc.passmanager import PassContext

        cluster = cluster if cluster is not None else self.cluster
        if cluster is None:
            raise ShardcError("plan.estimate() needs a cluster", hint="pass cluster='8xA100-80GB' to shardc.compile "
                              "or to estimate()")
        ctx = PassContext(cluster=driver.as_cluster(cluster), plan=self.plan)
        from shardc.ir.parser import parse

        graph = parse(self.partitioned_ir) if self.partitioned_ir else self.graph
        if routing_skew is not None:
            graph.attrs["routing_skew"] = float(routing_skew)
        driver.run(graph, "estimate", ctx)
        return ctx.options["estimate"]

    def parallelize(self, model: torch.nn.Module, *, init: Any = None, seed: int = 0,
                    device: torch.device | str | None = None, loss_fn: Any = None) -> torch.nn.Module:
        """This rank's trainable module (call on every rank after `init_process_group`).

        Parameters come from `model`'s own tensors, each rank keeping its shard; for a model on
        the meta device, `init(name, tensor)` fills one full tensor at a time (seeded by `seed`
        and the name, so every rank agrees) and each rank keeps its piece. Inputs are the global
        batch in the traced shapes; every rank slices its own part.

        Every returned module has `step(*inputs) -> loss`: forward and backward over the plan's
        micro-batches (gradient accumulation; the pipeline schedule when pp > 1), gradients
        synchronised and ready for any torch optimizer, returning this rank's mean loss (detached;
        replicated on model axes and pipeline ranks, each rank's own share on data axes: average
        over dp/cp for the global loss). With pp=1 the module is also callable: `module(*inputs)`
        returns that loss with its graph (micro-batches run one after another inside), for the
        user's own `loss.backward()`. A pipelined plan (pp > 1) returns a
        `shardc.backends.torch.pipelined.PipelinedModule`: only `step` runs it. The loss is the
        graph's own output (the model computes it from a target input), or
        `loss_fn(outputs, target)` when given (the model then returns e.g. logits, and `step`
        takes `step(*inputs, target=...)`).
        """
        if self.plan.pp > 1 or self.mesh.axis_size(Axis.PP) > 1:
            from shardc.backends.torch.pipelined import parallelize_pipeline

            return parallelize_pipeline(self, model, init=init, seed=seed, device=device, loss_fn=loss_fn)
        from shardc.backends.torch.parallelize import parallelize_graph, with_constants

        return parallelize_graph(self.graph, with_constants(model, {**self.constants, **self.micro_constants}),
                                 init=init, seed=seed, device=device, micro_graph=self.micro_graph,
                                 loss_fn=loss_fn)

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer unsharded, on every rank (a collective: call on all ranks)."""
        from shardc.backends.torch.parallelize import full_state_dict

        return full_state_dict(self.runtime_graph, module)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ShardcError(f"rank {rank} is outside the plan's {self.mesh} (ranks 0..{self.world_size - 1})")


def _as_plan(plan: Any) -> ParallelPlan:
    """`ParallelPlan.of(plan)`; None, or a graph that records no plan, is one device."""
    if plan is None or (isinstance(plan, Graph) and "plan" not in plan.attrs):
        return ParallelPlan()
    return ParallelPlan.of(plan)


def compile(model: Any, example_inputs: Any = None, cluster: Any = None, plan: Any = None, *,
            name: str | None = None, input_names: tuple[str, ...] | None = None, seed: int = 0,
            before_lower: Callable[[Graph], Any] | None = None, print_after_all: bool = False,
            time_passes: bool = False, pipeline: str | None = None, device: str = "cpu") -> CompiledPlan:
    """Trace, partition by `plan` and lower, through `shardc.driver`; see the module docstring.

    `model` is an nn.Module (with `example_inputs`) or a model spec (`examples/gpt.py:tiny`,
    `hf:gpt2?n_layer=2`). `plan` is a ParallelPlan, its text, None (one device), a plan file
    (`shardc plan -o FILE.plan`: its path as text or a Path, or a loaded `PlanFile`), or an
    already partitioned Graph of this model (the `.ir` beside a plan file), which is lowered as
    it is. A plan file is written onto the model traced at the batch the solver traced it at
    (`driver.plan_file_graph`: the solver's partitions, stages and recomputation; `cluster`,
    else the one the file records, prices the solver's problem) and lowered. Otherwise the model
    is traced at the batch the plan needs (`driver.batch_for`): the example
    batch when the plan splits it, else dp*mb sequences (the inputs' rows repeated).
    `before_lower(graph)` may edit the partitioned graph in place before lowering (hand-written
    partitions: temporal splits, rotations). `pipeline` replaces the default
    `group-layers,validate-plan,apply-plan,lower` (it must contain `lower`). A spec is built on
    `device` (`meta` when nothing will run: no weights are allocated).
    """
    import dataclasses

    from shardc import driver
    from shardc.frontend.constants import runnable_constants
    from shardc.passmanager import PassContext

    file = None if isinstance(plan, Graph | ParallelPlan) else driver.plan_file_of(plan)
    if file is not None and name is None and not isinstance(model, str):
        name = file.model  # a module has no spec name; the file's fingerprint still checks the model
    if isinstance(model, str):
        source = driver.open_model(model, device=device)
        source = dataclasses.replace(source, name=name or source.name,
                                     input_names=input_names or source.input_names)
    else:
        source = driver.model_source(model, example_inputs, name=name, input_names=input_names)
    flags = driver.Flags(pipeline, print_after_all, time_passes)
    before, lowering = driver.split_at_lower(pipeline or driver.PIPELINES["compile"])
    if file is not None:  # the solver's partitions, written into the graph as `shardc plan -o` did
        traced, plan = driver.plan_file_graph(source, cluster, file, flags=flags)
        cluster = cluster if cluster is not None else file.cluster
    parallel = _as_plan(plan)
    ctx = PassContext(plan=parallel, seed=seed)
    if file is not None:
        graph = plan
    elif isinstance(plan, Graph):
        graph = plan
        if graph.mesh is None:
            raise ShardcError(f"graph @{graph.name} given as the plan is not partitioned (it has no mesh)")
        traced = source.trace()  # for the values of the folded constants
    else:
        traced = driver.trace_for(source, parallel)
        graph = driver.run(traced.graph, before, ctx, flags, allow_uneven=False)
    if before_lower is not None:
        before_lower(graph)
    partitioned_ir = str(graph)
    micro = driver.micro_batch_trace(source, graph)
    if micro is not None and isinstance(plan, Graph):  # the solver's partitions, node by node, before
        driver.transfer_partitions(graph, micro.graph)  # lowering turns resolved partial sums into collectives
    graph = driver.run(graph, lowering, ctx, flags, allow_uneven=False)
    micro_graph, micro_constants = None, {}
    if micro is not None:
        micro_graph = micro.graph
        if not isinstance(plan, Graph):  # the plan's rules again, on the micro-batch's shapes, same global batch
            whole = dataclasses.replace(parallel, gbs=int(graph.attrs["global_batch"]))  # not gbs=auto: 1 micro-batch
            micro_graph = driver.run(micro_graph, before, dataclasses.replace(ctx, plan=whole), allow_uneven=False)
            micro_graph.attrs = dict(graph.attrs)
            if before_lower is not None:
                before_lower(micro_graph)
        micro_graph = driver.run(micro_graph, lowering, ctx, allow_uneven=False)
        micro_constants = runnable_constants(micro.constants)
    return CompiledPlan(graph, parallel, cluster, runnable_constants(traced.constants),
                        tuple(v.name for v in graph.inputs), micro_graph, micro_constants, partitioned_ir)


def compile_to_dir(spec: str, plan: Any, out_dir: str | os.PathLike[str], cluster: Any = None,
                   flags: Any = None) -> Path:
    """`shardc compile SPEC --plan P -o DIR`: write `graph.ir` (the lowered IR), `plan.txt` and
    `rank<k>.py` (each rank's generated code) into `out_dir`, atomically (a temporary sibling
    directory renamed into place, replacing an older one). `flags` (`shardc.driver.Flags`) set
    the pipeline and what it prints. The model is built on the meta device: only code is written."""
    from shardc.driver import Flags

    flags = flags if flags is not None else Flags()
    compiled = compile(spec, cluster=cluster, plan=plan, pipeline=flags.pipeline,
                       print_after_all=flags.print_after_all, time_passes=flags.time_passes, device="meta")
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
