"""A plan: the parallel configuration (`parallel.ParallelPlan`) with its one text form, its one
coercion (`ParallelPlan.of`: text, plan or partitioned graph), its mesh (`ParallelPlan.mesh`),
its validation against a model and a number of devices, and its one file form (`file.PlanFile`,
what `shardc plan -o` writes).
"""
