"""Process groups, collectives and layout checks of tensor, pipeline and expert parallelism.

Used by the layers (each parallel layer owns its shard and its one collective), the models (pipeline
stages) and the runner (which creates the groups); so it stands below all of them, as config does.
`parallel_state` holds the groups and the collectives; `layout` checks, without torch, which
tensor/pipeline sizes a model can be split into.
"""
