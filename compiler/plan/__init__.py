"""A plan: the parallel configuration (`parallel.ParallelPlan`) with its one text form, and its
validation against a model and a number of devices.
"""
