"""Automatic partitioning: candidates, the CP-SAT model, the outer search, the grid baseline.

One model: candidates and edges are priced by the analytical model's own per-node rules
(`costs`), a plan is evaluated with the model's own composition (`evaluate`), CP-SAT minimises
its linearisation (`linear`, `cpsat`), and the plans compared and reported are scored by
`shardc.cost.estimate` on the graph annotated with them (`outer`, `planfile.annotate_graph`).

Public entry points: `search` (outer search), `solve` (one mesh shape), `enumerate_group`
(candidates), `best_grid`/`grid_assignments` (the baseline), `plan_summary`/`print_plan` (`shardc plan`),
`save_plan`/`load_plan`/`annotate_graph` (plan files and partitioned IR).
"""
