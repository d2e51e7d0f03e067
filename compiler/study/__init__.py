"""The empirical study: run plans for real, measure time and memory per rank, compare with the model.

Entry point: `run_study(model_spec, nproc, *, plans_file=None, sweep=None, device="cpu",
out_dir, steps, warmup, console) -> int` (the `shardc study` command). Modules: `plans`
(what runs), `worker` (what each rank adds to the training loop of `shardc.train`), `measure`
(bytes the collectives send, profiler breakdown), `predict` (the cost model's figures), `compare` (errors and statistics),
`report` and `findings` (markdown, plots, conclusions), `sweep` (the driver).
"""

from shardc.study.sweep import run_study

__all__ = ["run_study"]
