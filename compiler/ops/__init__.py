"""The op registry: every op's iteration-space signature, partition rules and cost formulas.

`registry` holds the types and the lookup (`get_op`, `node_layouts`, the rotating-operand
rule); `builtin` registers the compute ops, `views` the view and data-movement ops,
`collectives` the communication ops (and the one table of their ring traffic), `fallback` the
one entry every aten op without its own takes (torch's DTensor strategies); `targets`
resolves the torch calls opaque ops stand for; `verifier` checks a graph against them all;
`lowering` says which partitions the torch backend lowers (one table for solver and codegen).
Importing this package registers every op.
"""

import shardc.ops.builtin  # noqa: F401
import shardc.ops.collectives  # noqa: F401
import shardc.ops.fallback  # noqa: F401
import shardc.ops.moe  # noqa: F401
import shardc.ops.views  # noqa: F401
