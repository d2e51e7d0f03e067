"""Analyses of a graph that every consumer shares: layouts and dim roles under a partition
(`propagate`, `groups`), resharding between layouts (`resharding`). Each returns data; passes,
the cost model, the solver and the study call the same function.
"""
