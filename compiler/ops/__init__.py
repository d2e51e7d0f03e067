"""The op registry: every op's iteration-space signature, partition rules and cost formulas.

`registry` holds the types and the lookup (`get_op`, `node_layouts`, the rotating-operand
rule); `builtin` registers the compute ops, `collectives` the communication ops, and
`verifier` checks a graph against them. Importing this package registers every op.
"""

import shardc.ops.builtin  # noqa: F401
import shardc.ops.collectives  # noqa: F401
