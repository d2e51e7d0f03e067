"""The parallel plan users write by hand: `dp=8,tp=8,pp=16,vpp=3,mb=1,gbs=1536,...`; the module
every caller imports a plan's names from.

One parser (`ParallelPlan.parse`) serves every command that takes `--plan`; `str(plan)` prints
the same syntax back, every key in `PLAN_KEYS` order (those in `OPTIONAL_KEYS` only when set),
so `parse(str(p)) == p`. `ParallelPlan.of` is the one coercion from what callers hold (the text,
a plan, a partitioned graph: `plan_of`) to a plan; `plan.mesh()` is the device mesh it
partitions over. `validate_plan` checks a plan against a cluster size and a model's dimensions
(`model_dims` reads those off an IR graph) and names the nearest valid values when a
constraint fails.

Each job has its module, and this one re-exports their names: the keys and how plan text reads
(`keys`), the plan itself (`uniform`), its checks against a model and a cluster
(`validation`), and the nearest valid values errors name (`nearest`).
"""

from shardc.plan.keys import (
    CP_LAYOUTS,
    OPTIONAL_KEYS,
    PLAN_KEYS,
    SCHEDULES,
    V_SCHEDULES,
    ZB_SCHEDULES,
    plan_keys_help,
)
from shardc.plan.uniform import MESH_AXES, ParallelPlan, check_recompute_layers, plan_of
from shardc.plan.validation import microbatch_problem, validate_plan

__all__ = ["CP_LAYOUTS", "MESH_AXES", "OPTIONAL_KEYS", "PLAN_KEYS", "SCHEDULES", "V_SCHEDULES", "ZB_SCHEDULES",
           "ParallelPlan", "check_recompute_layers", "microbatch_problem", "plan_keys_help", "plan_of",
           "validate_plan"]
