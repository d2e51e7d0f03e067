"""shardc: a compiler for distributed training of Transformer models."""

from shardc.diagnostics import ShardcError
from shardc.ir import (
    Graph, Layer, LayerAnnotation, Layout, Location, Mesh, Node, Partial, Partition, Replicate, Shard,
    TemporalSplit, TensorType, Value,
)

__all__ = [
    "Graph", "Layer", "LayerAnnotation", "Layout", "Location", "Mesh", "Node", "Partial", "Partition",
    "Replicate", "Shard", "ShardcError", "TemporalSplit", "TensorType", "Value",
]
__version__ = "0.1.0"
