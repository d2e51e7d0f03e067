"""The empirical study: run plans for real, measure time and memory per rank, compare with the model.

Entry point: `run_study(model_spec, nproc, *, plans_file=None, sweep=None, device="cpu",
out_dir, steps, warmup, console, flags) -> int` (the `shardc study` command). Modules: `plans`
(what runs), `predict` (each plan partitioned once through the driver, and the cost model's
figures of that graph), `worker` (what each rank adds to the training loop of `shardc.train`),
`runs` (process groups, results.json), `measure` (bytes the collectives send, profiler
breakdown), `compare` (errors and statistics), `report`, `gpu_report` and `findings` (markdown,
plots, conclusions), `sweep` (the order of work).
"""

from shardc.study.sweep import run_study

__all__ = ["run_study"]
