"""Automatic partitioning: candidates, the CP-SAT model, the outer search, the grid baseline.

Public entry points: `search` (outer search), `solve` (one mesh shape), `enumerate_group`
(candidates), `best_grid`/`grid_assignments` (the baseline), `run_plan` (`shardc plan`),
`save_plan`/`load_plan`/`annotate_graph` (plan files and partitioned IR).
"""
