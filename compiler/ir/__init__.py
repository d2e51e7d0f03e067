"""The partition IR: values (`types`), the SSA graph (`graph`), its text form (`printer`,
`parser`), structural equality (`equality`) and the one error type (`diagnostics`).

The core types are re-exported here, so `from shardc.ir import Graph, Shard` is the usual import.
"""

from shardc.ir.graph import Graph, Layer, LayerAnnotation, Location, Node, Value
from shardc.ir.types import (
    DTYPE_BYTES,
    FLOAT_DTYPES,
    RECOMPUTE_CHOICES,
    VALUE_KINDS,
    Layout,
    Mesh,
    Partial,
    Partition,
    Placement,
    Replicate,
    Shard,
    TemporalSplit,
    TensorType,
)

__all__ = [
    "DTYPE_BYTES", "FLOAT_DTYPES", "RECOMPUTE_CHOICES", "VALUE_KINDS", "Graph", "Layer", "LayerAnnotation",
    "Layout", "Location", "Mesh", "Node", "Partial", "Partition", "Placement", "Replicate", "Shard",
    "TemporalSplit", "TensorType", "Value",
]
