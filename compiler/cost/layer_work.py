"""A layer as the composition of a plan sees it (`shardc.cost.compose`, and the runtime's CPU
per schedule action in `shardc.cost.runtime_cpu`): its own module so both can name it."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.cost.layer import LayerCost
from shardc.cost.timeline import LayerMemory
from shardc.ir import LayerAnnotation, Node


@dataclass(slots=True)
class LayerWork:
    """One layer as the composition sees it: its stage (virtual), recomputation and ZeRO stage,
    its cost per micro-batch, and its parameters (name -> local elements, gradient-sum axes)."""

    name: str
    block: str
    annotation: LayerAnnotation
    nodes: list[Node] = field(default_factory=list)
    stage: int = 0
    cost: LayerCost | None = None
    params: dict[str, tuple[float, frozenset[str]]] = field(default_factory=dict)
    memory: LayerMemory | None = None  # its micro-batch timeline (`timeline.layer_memory`), when known
