"""Analyses of a graph that every consumer shares, one function per fact: dim roles (`roles`),
layers and pipeline stages (`stages`), storage aliasing (`aliasing`), model dimensions
(`dims`), node groups (`groups`), the layouts a partition implies and following them
(`propagate`), redistributing one tensor between layouts (`redistribute`) and where a graph needs it
(`resharding`), the attention core selective recomputation
drops (`attention`). Each returns data; apply-plan, the
cost model, the solver and the study call the same function.
"""
