"""shardc: a compiler for distributed training of Transformer models."""

from shardc.ir import (
    Graph,
    Layer,
    LayerAnnotation,
    Layout,
    Location,
    Mesh,
    Node,
    Partial,
    Partition,
    Replicate,
    Shard,
    TemporalSplit,
    TensorType,
    Value,
)
from shardc.ir.diagnostics import ShardcError

__all__ = [
    "Graph", "Layer", "LayerAnnotation", "Layout", "Location", "Mesh", "Node", "Partial", "Partition",
    "Replicate", "Shard", "ShardcError", "TemporalSplit", "TensorType", "Value",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `shardc.compile` and friends load torch lazily, so `import shardc` stays light.
    if name in ("compile", "compile_to_dir", "CompiledPlan"):
        from shardc import api

        return getattr(api, name)
    raise AttributeError(f"module 'shardc' has no attribute {name!r}")
