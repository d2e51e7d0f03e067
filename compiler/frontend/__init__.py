"""Frontends: torch (fx symbolic trace, torch.export) and ONNX, lifted into the partition IR.

    graph = shardc.frontend.trace(model, example_inputs)            # the IR
    result = shardc.frontend.trace_with_state(model, example_inputs)  # + values of `const.N` buffers
    print(shardc.frontend.coverage(graph))                           # opaque ops, if any
"""

from shardc.frontend.coverage import CoverageReport, OpaqueOp, coverage
from shardc.frontend.torch_trace import TraceResult, trace, trace_with_state

__all__ = ["CoverageReport", "OpaqueOp", "TraceResult", "coverage", "trace", "trace_with_state"]
