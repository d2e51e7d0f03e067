"""The one front door: model spec -> graph -> pipeline string -> result.

Every command (`shardc inspect`, `estimate`, `plan`, `compile`, `run`'s prediction, the study's
predictions) and `shardc.compile` take this road, so that they agree on the same plan:

1. `open_model(spec)` loads a model spec (the syntax of `shardc.frontend.spec`, plus a printed
   `.ir` file), on the meta device unless weights are needed. `model_source` does the same for
   an `nn.Module` and its example inputs.
2. `Source.trace(batch)` traces it at the batch the plan needs (`batch_for`, `solver_batch`):
   the traced batch never limits a plan. The example inputs are cut or repeated along their
   first dim here and nowhere else (a printed IR or a fixed-shape ONNX import cannot change
   it).
3. `run` runs a pipeline string over the registered passes (`PIPELINES`: each command's
   default), verifying the IR after every pass, printing it after each (`Flags.print_after_all`)
   and timing each (`Flags.time_passes`). A `ParallelPlan` is checked by the `validate-plan`
   pass and nowhere else in this road.
4. The result is the graph and what the passes left in the context: `ctx.options["estimate"]`
   (the `estimate` pass), `ctx.options["search"]` (the `solve` pass).

A plan may also be a plan file (`shardc plan -o FILE.plan`, `plan_file_of`): then step 2
traces at the batch the solver traced at (`solver_batch` of the file's global batch), step 3
runs `group-layers` and writes the file's partitions, stages and recomputation into the graph
(`plan_file_graph`, the solver's own conversion) in place of `validate-plan,apply-plan`, and
everything after (estimate, lower) is the same as for a plan string.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from shardc.hardware import Cluster, parse_cluster
from shardc.ir import Axis, Graph
from shardc.ir.diagnostics import ShardcError
from shardc.passmanager import Pass, PassContext, parse_pipeline, run_pipeline

if TYPE_CHECKING:  # both load torch (the registry); `shardc --help` should not wait for it
    from shardc.frontend import TraceResult
    from shardc.plan.file import PlanFile
    from shardc.plan.parallel import ParallelPlan

PIPELINES: dict[str, str] = {
    "inspect": "group-layers,annotate-cost",
    "partition": "group-layers,validate-plan,apply-plan",
    "estimate": "group-layers,validate-plan,apply-plan,estimate",
    "compile": "group-layers,validate-plan,apply-plan,lower",
    # what comes before `estimate` partitions the graph that is both predicted and run
    "study": "group-layers,validate-plan,apply-plan,estimate",
}


@dataclass(frozen=True, slots=True)
class Flags:
    """How a pipeline runs: `pipeline` replaces the command's default; the IR is printed after
    every pass and each pass timed on `out` (stdout when None)."""

    pipeline: str | None = None
    print_after_all: bool = False
    time_passes: bool = False
    out: TextIO | None = None


# ---- 1. loading -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """A model ready to trace at any batch. `model` with `inputs` is traced by the frontend;
    `build(batch)` builds a graph directly (a printed IR, which ignores the batch)."""

    name: str
    model: Any = None
    inputs: tuple[Any, ...] = ()
    input_names: tuple[str, ...] | None = None
    allow_opaque: bool = False
    build: Callable[[int | None], Graph] | None = None
    fixed_batch: int | None = None

    @property
    def batch(self) -> int | None:
        """The example batch: the first dim all inputs share (None when they share none)."""
        if self.build is not None:
            return self.fixed_batch
        firsts = {x.shape[0] if hasattr(x, "shape") and len(x.shape) else None for x in self.inputs}
        return firsts.pop() if len(firsts) == 1 else None

    @property
    def fixed_import(self) -> bool:
        """An import that cannot import itself again at other shapes (an ONNX file with a static
        batch), or a printed IR."""
        if self.build is not None:
            return self.fixed_batch is not None
        return getattr(self.model, "shardc_graph", None) is not None and not hasattr(self.model, "shardc_graph_for")

    @property
    def resizable(self) -> bool:
        """Whether `trace` can change the batch: not a fixed import, and batch-first inputs."""
        return not self.fixed_import and (self.build is not None or self.batch is not None)

    def trace(self, batch: int | None = None) -> TraceResult:
        """The graph (and the values of its `const.N` buffers) at `batch` sequences (None: the
        example batch). The inputs' first dim is cut, or its rows repeated, to `batch`."""
        from shardc.frontend import TraceResult, trace_with_state

        if self.build is not None:
            return TraceResult(self.build(batch))
        inputs = self.inputs
        if batch is not None and batch != self.batch:
            if not self.resizable:
                raise ShardcError(f"model {self.name} cannot be traced at a batch of {batch}: its inputs do not "
                                  "all have the batch as their first dim, or it is a fixed-shape import",
                                  hint="give batch-first inputs, or a plan that splits the example batch")
            inputs = tuple(_resize(x, batch) for x in inputs)
        return trace_with_state(self.model, inputs, name=self.name, allow_opaque=self.allow_opaque,
                                input_names=self.input_names)


def _resize(x: Any, rows: int) -> Any:
    if rows <= x.shape[0]:
        return x[:rows]
    return x.repeat(math.ceil(rows / x.shape[0]), *([1] * (x.dim() - 1)))[:rows]


def open_model(spec: str, *, device: str = "meta", allow_opaque: bool = False,
               input_shapes: dict[str, tuple[int, ...]] | None = None) -> Source:
    """The `Source` a model spec names (see the module docstring); `device="cpu"` builds real
    weights; `input_shapes` fix an ONNX file's dynamic input dims (`--input-shape`)."""
    if spec.endswith(".ir"):
        from shardc.ir.parser import parse_file

        graph = parse_file(spec)
        batch = graph.inputs[0].type.shape[0] if graph.inputs and graph.inputs[0].type.rank else 1
        return Source(graph.name, build=lambda _batch: parse_file(spec), fixed_batch=batch)  # a fresh graph each time
    from shardc.frontend.spec import load_model

    loaded = load_model(spec, device=device, input_shapes=input_shapes)
    return Source(loaded.name, loaded.model, tuple(loaded.example_inputs), loaded.input_names, allow_opaque)


def model_source(model: Any, example_inputs: Any, *, name: str | None = None,
                 input_names: tuple[str, ...] | None = None) -> Source:
    """The `Source` of an nn.Module and its example inputs (a tensor or a tuple of them)."""
    if example_inputs is None:
        raise ShardcError("shardc.compile needs example_inputs (a tuple of tensors in forward's order)")
    inputs = tuple(example_inputs) if isinstance(example_inputs, tuple | list) else (example_inputs,)
    return Source(name or type(model).__name__.lower(), model, inputs, input_names)


# ---- 2. the batch a plan needs ----------------------------------------------------------------

def batch_for(plan: ParallelPlan, batch: int | None) -> int | None:
    """The batch to trace at for `plan`: the example `batch` when the plan splits it (dp divides
    it, and dp*mb too when gbs=auto takes it for the global batch), else one micro-batch of
    every replica, dp*mb sequences (gbs=auto then means that many). None: keep the example's.
    ep splits the batch further (each micro-batch over its ranks), so dp*ep must divide it."""
    need = plan.dp * plan.ep if plan.gbs is not None else plan.dp * plan.mb
    if batch is not None and batch % need == 0:
        return None
    return plan.dp * plan.mb


def solver_batch(gbs: int) -> int:
    """The batch the solver traces at: the global batch, so every data-parallel degree it tries
    divides the traced batch and the IR it writes is the graph it scored (at least 2: the
    registry binds a batch of one as a broadcast dim that no mesh axis splits)."""
    return max(gbs, 2)


def trace_for(source: Source, plan: ParallelPlan | None) -> TraceResult:
    """`source` traced at the batch `plan` needs (its own batch without a plan)."""
    if plan is None or not source.resizable:
        return source.trace()
    return source.trace(batch_for(plan, source.batch))


def micro_batch_trace(source: Source, partitioned: Graph) -> TraceResult | None:
    """The model traced for one micro-batch of the plan `partitioned` records (dp*mb sequences;
    not yet partitioned): what runs when the plan has several micro-batches. None when it has
    one, or the model is a fixed import."""
    micro = int(partitioned.attrs.get("microbatches", 1))
    if micro <= 1 or partitioned.mesh is None or source.fixed_import:
        return None
    rows = partitioned.mesh.axis_size(Axis.DP) * int(partitioned.attrs.get("microbatch_size", 1))
    if source.batch is None:
        raise ShardcError(f"plan {partitioned.attrs.get('plan')} has {micro} micro-batches, but the inputs of graph "
                          f"@{partitioned.name} do not all have the batch as their first dim",
                          hint="use mb so that gbs = dp*mb (one micro-batch), or give batch-first inputs")
    return source.trace(rows)


def transfer_partitions(src: Graph, dst: Graph) -> None:
    """Give `dst` (the same model traced at another batch) `src`'s mesh, layers, attributes,
    node partitions and the layouts of its inputs, parameters and buffers, node by node.
    Partitions are carried by dim position (`propagate.rename_partition`: a micro-batch of one
    sequence binds the batch as a broadcast dim, and the dims' names shift), output layouts
    are what the carried partition gives on `dst`'s shapes, with a partial sum `src` holds
    resolved (`resolves_partial`) resolved alike. `src` may be lowered already: its
    collectives are skipped."""
    from shardc.analysis.propagate import dims_by_position, io_layouts, iteration_space, rename_partition
    from shardc.ir import Layout, Partial
    from shardc.ops.collectives import COLLECTIVE_OPS
    from shardc.ops.verifier import resolves_partial

    src_nodes = [n for n in src.nodes if n.op not in COLLECTIVE_OPS]
    ops_src, ops_dst = [n.op for n in src_nodes], [n.op for n in dst.nodes]
    if ops_src != ops_dst:
        first = next((i for i, (a, b) in enumerate(zip(ops_src, ops_dst)) if a != b), min(len(ops_src), len(ops_dst)))
        raise ShardcError(f"graph @{src.name} traced for one micro-batch differs from the full batch at node {first} "
                          f"({len(ops_src)} vs {len(ops_dst)} nodes)", hint="use one micro-batch (gbs = dp*mb)")
    dst.mesh, dst.layers, dst.attrs = src.mesh, dict(src.layers), dict(src.attrs)
    for a, b in zip(src_nodes, dst.nodes):
        b.partition, b.layer = a.partition, a.layer
        if a.partition is None or src.mesh is None or not (a.partition.spatial or a.partition.temporal):
            for va, vb in zip(a.outputs, b.outputs):
                vb.layout = va.layout
            continue
        try:
            b.partition = rename_partition(a.partition, dims_by_position(iteration_space(a), iteration_space(b)))
        except ValueError as err:
            raise ShardcError(f"graph @{src.name} traced for one micro-batch ({dst.inputs[0].type if dst.inputs else '?'}"
                              f") cannot take {a.partition} of plan {src.attrs.get('plan')} at node {b.op} @{b.layer}: "
                              f"{err}", node=b, hint="plan with micro-batches of at least 2 sequences per replica "
                              "(a larger --gbs), or one micro-batch (gbs = dp*mb)") from None
        made_src, made_dst = io_layouts(a, src.mesh)[1], io_layouts(b, src.mesh)[1]
        for va, vb, ms, md in zip(a.outputs, b.outputs, made_src, made_dst):
            held = dict(md.placements)
            if resolves_partial(ms, va.layout):  # reduced where made: on the partial axes as `src` holds it
                for axis in (x for x, p in ms.placements if isinstance(p, Partial)):
                    held[axis] = (va.layout or Layout()).on(axis)
            vb.layout = Layout(tuple((x, held[x]) for x in src.mesh.names if x in held)).without_replicate()
    for group_src, group_dst in ((src.inputs, dst.inputs), (src.params, dst.params), (src.buffers, dst.buffers)):
        by_name = {v.name: v for v in group_src}
        for v in group_dst:
            if v.name in by_name:
                v.layout = by_name[v.name].layout


# ---- 3. pipelines -----------------------------------------------------------------------------

def run(graph: Graph, pipeline: str | list[Pass], ctx: PassContext, flags: Flags = Flags(), *,
        allow_uneven: bool = True) -> Graph:
    """Run `pipeline` over `graph` (verifying after every pass), as `flags` ask. Shards split
    unevenly are allowed (apply-plan pads the vocabulary on tp, and the cost model prices the
    padded shard) unless `allow_uneven` is False, as compiling for the backend asks."""
    return run_pipeline(graph, pipeline, ctx, print_after_all=flags.print_after_all,
                        time_passes=flags.time_passes, out=flags.out, allow_uneven=allow_uneven)


def load(spec: str, *, batch: int | None = None, pipeline: str = "group-layers", device: str = "meta",
         flags: Flags = Flags()) -> Graph:
    """The model `spec` names traced at `batch` (None: its example batch) after `pipeline`."""
    return run(open_model(spec, device=device).trace(batch).graph, pipeline, PassContext(), flags)


def as_cluster(cluster: str | Cluster | None) -> Cluster | None:
    """A cluster from its text (`8xA100-80GB`, `local2`); None stays None. A `local` cluster on
    a machine never calibrated is measured once first (`shardc calibrate` redoes it), so every
    command predicts for this machine out of the box."""
    if not isinstance(cluster, str):
        return cluster
    from shardc.calibration.local import load_profile  # the cached profile, measured when there is none

    return parse_cluster(cluster, local_profile=load_profile)


def as_plan(plan: str | ParallelPlan | None) -> ParallelPlan | None:
    """`ParallelPlan.of(plan)`; None stays None."""
    from shardc.plan.parallel import ParallelPlan

    return None if plan is None else ParallelPlan.of(plan)


PLAN_FILE_SUFFIXES = (".plan", ".json")


def plan_file_of(plan: Any) -> PlanFile | None:
    """The plan file `plan` names, loaded: a `PlanFile`, a `Path`, or text that is a file's path
    (it ends in .plan or .json, or names an existing file; plan text is `key=value` pairs and
    names no file). None for any other plan. A named file that is missing is a ShardcError."""
    from shardc.plan.file import PlanFile

    if isinstance(plan, PlanFile):
        return plan
    if isinstance(plan, os.PathLike) or (isinstance(plan, str) and (
            plan.endswith(PLAN_FILE_SUFFIXES) or ("=" not in plan and Path(plan).is_file()))):
        return PlanFile.load(plan)
    return None


def plan_file_graph(source: Source, cluster: str | Cluster | None, file: PlanFile, *,
                    flags: Flags = Flags()) -> tuple[TraceResult, Graph]:
    """(the trace, the partitioned graph) of plan file `file` on `source`: traced at the batch
    the solver traced at, layers grouped, and partitioned as the file says
    (`shardc.search.planfile.partitioned_graph`). The partitions are labels on the file's own
    mesh: `cluster` (else the one the file records) only prices the solver's problem, and must
    have the plan's device count. A file of another model is a ShardcError naming the file."""
    from shardc.search.planfile import partitioned_graph

    resolved = as_cluster(cluster if cluster is not None else file.cluster)
    if resolved is None:
        raise ShardcError(f"plan file {file.path} records no cluster", hint="give --cluster (the one it was planned on)")
    if resolved.num_devices != file.plan.devices:
        raise ShardcError(f"plan file {file.path} is a plan for {file.plan.devices} devices ({file.plan}), but cluster "
                          f"{resolved} has {resolved.num_devices}",
                          hint=f"use a cluster (or --nproc) of {file.plan.devices} devices, or plan again for this one")
    batch = solver_batch(int(file.plan.global_batch()))
    traced = source.trace(batch if source.resizable and batch != source.batch else None)
    graph = run(traced.graph, "group-layers", PassContext(cluster=resolved), flags)
    return traced, partitioned_graph(graph, resolved, file)


def _traced(source: Source | str, cluster: str | Cluster | None,
            plan: str | ParallelPlan | PlanFile | os.PathLike[str] | None, flags: Flags = Flags(),
            ) -> tuple[Graph, PassContext, bool]:
    """`source` traced at the batch `plan` needs, the pass context holding the cluster and the
    plan (None when there is none), and whether the graph is partitioned already (a plan file)."""
    source = open_model(source) if isinstance(source, str) else source
    file = plan_file_of(plan)
    if file is not None:
        graph = plan_file_graph(source, cluster, file, flags=flags)[1]
        return graph, PassContext(cluster=as_cluster(cluster) if cluster is not None else None), True
    parsed = as_plan(plan)  # type: ignore[arg-type]  # a PathLike is a plan file, handled above
    return trace_for(source, parsed).graph, PassContext(cluster=as_cluster(cluster), plan=parsed), False


def partition(source: Source | str, cluster: str | Cluster | None,
              plan: str | ParallelPlan | PlanFile | os.PathLike[str], *,
              flags: Flags = Flags(), pipeline: str | None = None) -> tuple[Graph, PassContext]:
    """Trace at the plan's batch and run `group-layers,validate-plan,apply-plan` (or `pipeline`);
    a plan file is written into the graph instead (`plan_file_graph`) and `pipeline` runs after."""
    graph, ctx, partitioned = _traced(source, cluster, plan, flags)
    if partitioned:
        text = pipeline or flags.pipeline
        return (run(graph, text, ctx, flags) if text else graph), ctx
    return run(graph, pipeline or flags.pipeline or PIPELINES["partition"], ctx, flags), ctx


def estimate(source: Source | str, cluster: str | Cluster,
             plan: str | ParallelPlan | PlanFile | os.PathLike[str] | None, *,
             flags: Flags = Flags(), pipeline: str | None = None) -> tuple[Any, Graph]:
    """(the Estimate, the partitioned graph) of `plan` on `cluster`: the `estimate` pipeline. A
    printed IR that is already partitioned (`shardc plan -o`'s `.ir`) and a plan file's graph
    (`plan_file_graph`) are only estimated."""
    graph, ctx, partitioned = _traced(source, cluster, plan, flags)
    if partitioned and pipeline is None and flags.pipeline is None:
        pipeline = "estimate"
    if pipeline is None and flags.pipeline is None and ctx.plan is None:
        if graph.mesh is None:
            raise ShardcError(f"graph @{graph.name} is not partitioned; give a --plan",
                              hint="e.g. --plan dp=2, or a partitioned IR file written by `shardc plan -o`")
        pipeline = "estimate"
    graph = run(graph, pipeline or flags.pipeline or PIPELINES["estimate"], ctx, flags)
    if "estimate" not in ctx.options:
        raise ShardcError("the pipeline left no estimate; end it with the estimate pass",
                          hint=PIPELINES["estimate"])
    return ctx.options["estimate"], graph


def solve_pipeline(gbs: int, *, time_limit: float = 30.0, seed: int = 0, workers: int = 1,
                   memory_limit_gb: float | None = None, warm_start: str | None = None,
                   grid2d: bool = False, dtype: str = "bf16", wall_stop: float | None = None,
                   schedules: bool = True) -> str:
    """`shardc plan`'s default pipeline: `group-layers,solve{...}` with the command's options
    (`wall_stop`: the solve pass's `wall-stop`, None its default; `schedules=False`: Megatron's
    schedules only)."""
    from shardc.passes.solve import Solve

    more: dict[str, Any] = {} if wall_stop is None else {"wall_stop": wall_stop}
    if not schedules:
        more["schedules"] = False
    solve = Solve(gbs=gbs, time_limit=time_limit, seed=seed, workers=workers,
                  memory_limit_gb=memory_limit_gb or 0.0, warm_start=warm_start or "", grid2d=grid2d, dtype=dtype,
                  **more)
    return f"group-layers,{solve}"


def solve(source: Source | str, cluster: str | Cluster, gbs: int, *, flags: Flags = Flags(),
          pipeline: str | None = None, **options: Any) -> tuple[Graph, PassContext]:
    """Trace at the global batch (`solver_batch`) and run the `solve` pipeline; the search
    result is `ctx.options["search"]`. `options` are `solve_pipeline`'s."""
    if gbs < 1:
        raise ShardcError(f"--gbs must be a positive number of sequences, got {gbs}")
    source = open_model(source) if isinstance(source, str) else source
    ctx = PassContext(cluster=as_cluster(cluster))
    graph = source.trace(solver_batch(gbs) if source.resizable else None).graph
    text = pipeline or flags.pipeline or solve_pipeline(gbs, **options)
    graph = run(graph, text, ctx, flags)
    if "search" not in ctx.options:
        raise ShardcError("the pipeline left no search result; it needs the solve pass", hint=text)
    return graph, ctx


def split_at_lower(pipeline: str) -> tuple[list[Pass], list[Pass]]:
    """The compile pipeline cut before its last `lower` pass (hand-written partitions go between)."""
    return split_before(pipeline, "lower", "compile")


def split_before(pipeline: str, name: str, command: str) -> tuple[list[Pass], list[Pass]]:
    """`pipeline` cut before its last `name` pass; a ShardcError naming `command`'s default
    pipeline when it has none."""
    passes = parse_pipeline(pipeline)
    at = max((i for i, p in enumerate(passes) if p.name == name), default=None)
    if at is None:
        raise ShardcError(f"a {command} pipeline ends with the {name} pass; {pipeline!r} has none",
                          hint=PIPELINES[command])
    return passes[:at], passes[at:]
