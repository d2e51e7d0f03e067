"""The torch backend: per-rank sharded modules, collectives, pipelines, checkpoints, launch."""
