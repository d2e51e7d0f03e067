"""Automatic partitioning: candidates, the CP-SAT model, the outer search, the grid baseline.

One model: candidates and edges are priced by the analytical model's own per-node rules
(`costs`), a plan is evaluated with the model's own composition (`evaluate`), CP-SAT minimises
its linearisation (`linear`, `cpsat`), and the plans compared and reported are scored by
`shardc.cost.estimate` on the graph annotated with them (`outer`, `planfile.annotate_graph`).

Public entry points: `search` (outer search), `solve` (one mesh shape), `enumerate_group`
(candidates), `best_grid`/`grid_assignments` (the baseline), `plan_summary`/`print_plan` (`shardc plan`),
`plan_file`/`assignment_from_plan`/`annotate_graph`/`partitioned_graph` (an assignment as a plan file
(`shardc.plan.file`) and as partitioned IR).
"""
