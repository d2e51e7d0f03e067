"""The partition IR: values (`types`), the SSA graph (`graph`), its text form (`printer`,
`parser`), structural equality (`equality`) and the one error type (`diagnostics`).

Element types (names, aliases, sizes, torch dtypes) are `dtypes`. The core types are
re-exported here, so `from shardc.ir import Graph, Shard` is the usual import.
"""

from shardc.ir.dtypes import DTYPE_BYTES, FLOAT_DTYPES
from shardc.ir.graph import Graph, Layer, LayerAnnotation, Location, Node, Value
from shardc.ir.types import (
    DATA_AXES,
    RECOMPUTE_CHOICES,
    VALUE_KINDS,
    ZERO_STAGES,
    Axis,
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
    "DATA_AXES", "DTYPE_BYTES", "FLOAT_DTYPES", "RECOMPUTE_CHOICES", "VALUE_KINDS", "ZERO_STAGES", "Axis", "Graph", "Layer", "LayerAnnotation",
    "Layout", "Location", "Mesh", "Node", "Partial", "Partition", "Placement", "Replicate", "Shard",
    "TemporalSplit", "TensorType", "Value",
]
