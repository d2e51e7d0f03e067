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

The steps have their modules: loading (`source`), the batch a plan needs (`batch`), pipelines
and the commands' roads through them (`pipelines`); every name is re-exported here, so
`shardc.driver.estimate` and `from shardc.driver import open_model` are the usual spellings.
"""

from shardc.driver.batch import batch_for, micro_batch_trace, solver_batch, trace_for, transfer_partitions
from shardc.driver.pipelines import (
    PIPELINES,
    PLAN_FILE_SUFFIXES,
    Flags,
    as_cluster,
    as_plan,
    estimate,
    load,
    partition,
    plan_file_graph,
    plan_file_of,
    run,
    solve,
    solve_pipeline,
    split_at_lower,
    split_before,
)
from shardc.driver.source import Source, model_source, open_model

__all__ = ["PIPELINES", "PLAN_FILE_SUFFIXES", "Flags", "Source", "as_cluster", "as_plan", "batch_for", "estimate",
           "load", "micro_batch_trace", "model_source", "open_model", "partition", "plan_file_graph", "plan_file_of",
           "run", "solve", "solve_pipeline", "solver_batch", "split_at_lower", "split_before", "trace_for",
           "transfer_partitions"]
