"""Compute time of one node on one device: a roofline with the device's matmul efficiency curve.

Rules:
- Local work comes from the node's partition: every input and output gets the layout the
  registry derives (`node_layouts`), its local shard shape gives local FLOPs (the registry's
  formula on local shapes) and local bytes. Float tensors count at the plan's compute dtype.
- Forward time is `max(flops / rate, bytes / memory_bandwidth) + kernel_latency`, where the
  rate is the device's matmul curve for contractions and attention
  (`peak * matmul_efficiency * f / (f + matmul_half_flops)`) and the fp32 vector peak for the
  rest. Views (reshape, permute, split, ...) and creation ops launch nothing and cost nothing.
- Backward: a contraction does one matmul of the forward's size per multiplied input
  (`OpDef.operands`) that needs a gradient (dgrad and wgrad: 2x forward when both do); any
  other op reads the saved tensors and the output gradient and writes input gradients: 2x the
  forward FLOPs and forward bytes plus the output gradient read, one more kernel. Ops with no
  input needing a gradient have no backward.
- A device with measured eager costs (`DeviceSpec.eager`, the calibrated local CPU) is costed
  by them instead: per op class (`op_class`), forward `call + units * per_unit` and backward
  likewise, where units are the FLOPs of a matmul (its backward: FLOPs x inputs needing a
  gradient) and, for every other op, `class_bytes`, the forward's bytes. Views cost their call
  and, when they carry a gradient, their autograd node; dropout with p = 0 is a call only. Each
  parameter input (unbatched, needing a gradient) adds its gradient accumulation to backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardc.hardware import DeviceSpec
from shardc.ir import DTYPE_BYTES, Layout, Mesh, Node, TensorType
from shardc.ops.registry import IterationSpace, OpDef, get_op, node_layouts

MATMUL_KINDS = frozenset({"contraction", "attention"})
FREE_KINDS = frozenset({"view", "creation"})


@dataclass(frozen=True, slots=True)
class NodeCost:
    """One node's cost on one device for one micro-batch (seconds, FLOPs, bytes)."""

    fwd_s: float
    bwd_s: float
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float


@dataclass(frozen=True, slots=True)
class LocalNode:
    """A node's local view: required input layouts, output layouts and local tensor types."""

    op: OpDef
    in_layouts: tuple[Layout, ...]
    out_layouts: tuple[Layout, ...]
    in_types: tuple[TensorType, ...]
    out_types: tuple[TensorType, ...]
    space: IterationSpace | None


def local_type(t: TensorType, layout: Layout, mesh: Mesh | None, dtype: str) -> TensorType:
    """The shard one device holds, float tensors cast to the compute `dtype` (IR spelling)."""
    shape = layout.local_shape(t.shape, mesh) if mesh is not None and layout.placements else t.shape
    return TensorType(tuple(shape), dtype if t.is_float else t.dtype)


_OWN = object()


def localize(node: Node, mesh: Mesh | None, dtype: str, partition=_OWN) -> LocalNode:
    """Required layouts and local types of `node` under its partition (or `partition`) on `mesh`:
    the registry's layouts (`node_layouts`; rotating operands are sharded along their axis there)."""
    op = get_op(node.op)
    in_t = [v.type for v in node.inputs]
    out_t = [v.type for v in node.outputs]
    part = node.partition if partition is _OWN else partition
    if mesh is None or part is None or not (part.spatial or part.temporal):
        ins = tuple(Layout() for _ in in_t)
        outs = tuple(Layout() for _ in out_t)
        space = None
    else:
        space = op.iteration_space(in_t, out_t, node.attrs)
        in_l, out_l = node_layouts(space, part, mesh)
        ins, outs = tuple(in_l), tuple(out_l)
    return LocalNode(op, ins, outs,
                     tuple(local_type(t, l, mesh, dtype) for t, l in zip(in_t, ins)),
                     tuple(local_type(t, l, mesh, dtype) for t, l in zip(out_t, outs)), space)


def rotation_steps(partition) -> int:
    """How many times a node runs its local kernel under `partition`: once per step of every
    rotating split (the local shapes are one step's: the rotating operand's shard)."""
    steps = 1
    for split in partition.temporal if partition is not None else ():
        if split.rotate is not None:
            steps *= max(1, split.steps)
    return steps


def repeated(cost: NodeCost, steps: int) -> NodeCost:
    """`cost` run `steps` times, one kernel after another."""
    if steps <= 1:
        return cost
    return NodeCost(cost.fwd_s * steps, cost.bwd_s * steps, cost.fwd_flops * steps, cost.bwd_flops * steps,
                    cost.fwd_bytes * steps)


def working_bytes(op: OpDef, in_types: Sequence[TensorType], out_types: Sequence[TensorType],
                  steps: int = 1, scale: float = 1.0, loss_copies: int = 2, concat: bool = True) -> float:
    """The node's transient allocation while it runs: its outputs (a view allocates nothing), plus
    a loss's probabilities and their gradient (`loss_copies` copies of its input: two; one for a
    vocabulary-parallel loss, whose gradient overwrites its softmax, `head.vocab_parallel_loss`).
    A temporal split into `steps` chunks on the same devices (`temporal.temporal_loop`) holds a
    loss's probabilities one chunk at a time, but its outputs as the loop keeps them: every
    chunk's and their concatenation (`concat`: the dim is parallel), or, when the dim is a
    reduction, the running sum, the step's partial sum and the new sum, each the whole output.
    `scale`: the batch scale."""
    if op.kind in FREE_KINDS:
        return 0.0
    outputs = float(sum(t.nbytes for t in out_types))
    inner = loss_copies * in_types[0].nbytes if op.kind == "loss" and in_types else 0.0
    if steps <= 1:
        return (outputs + inner) * scale
    return ((2 if concat else 3) * outputs + inner / steps) * scale


def kernel_time(flops: float, nbytes: float, device: DeviceSpec, dtype: str, *, matmul: bool) -> float:
    """Roofline time of one kernel, without launch latency."""
    if flops <= 0 and nbytes <= 0:
        return 0.0
    if matmul and flops > 0:
        compute = flops / device.matmul_flops_per_s(flops, dtype)
    else:
        compute = flops / device.peak("fp32") if flops > 0 else 0.0
    return max(compute, nbytes / device.memory_bandwidth)


_CLASS_OF = {"gelu": "transcendental", "exp": "transcendental", "log": "transcendental", "tanh": "transcendental",
             "sigmoid": "transcendental", "silu": "transcendental", "erf": "transcendental",
             "sin": "transcendental", "cos": "transcendental", "pow": "transcendental", "sqrt": "transcendental",
             "rsqrt": "transcendental", "softmax": "softmax", "log_softmax": "softmax", "dropout": "dropout",
             "layer_norm": "norm", "rms_norm": "norm", "cumsum": "reduction",
             "concat": "elementwise"}  # torch.cat copies: a view in the IR, a kernel at run time
_CLASS_OF_KIND = {"contraction": "matmul", "attention": "matmul", "reduction": "reduction", "index": "index",
                  "loss": "loss", "view": "view", "creation": "view", "norm": "norm"}


def op_class(op: OpDef, attrs: dict) -> str:
    """The class an op's eager cost is measured and charged by (see `EagerCosts`); dropout that
    drops nothing (p = 0 or not training) returns its input and is a `view`."""
    if op.name == "dropout" and (not attrs.get("p", 0) or not attrs.get("training", True)):
        return "view"
    return _CLASS_OF.get(op.name) or _CLASS_OF_KIND.get(op.kind, "elementwise")


def class_bytes(kind: str, in_bytes: Sequence[float], out_bytes: float) -> float:
    """The bytes an op of class `kind` is charged by: reads and writes, except that a lookup
    (`index`) reads only the rows it returns (its ids and twice its output, not the whole table)."""
    if kind == "index":
        return (in_bytes[0] if in_bytes else 0.0) + 2.0 * out_bytes
    return float(sum(in_bytes)) + out_bytes


def eager_time(op: OpDef, attrs: dict, flops: float, in_bytes: Sequence[float], out_bytes: float,
               grads: Sequence[bool], device: DeviceSpec, dtype: str, copies: bool = False
               ) -> tuple[float, float, float]:
    """(forward s, backward s, backward FLOPs) of one op from the device's measured eager costs;
    `copies`: a view node that copies at run time (`shardc.analysis.aliasing`)."""
    assert device.eager is not None
    kind = op_class(op, attrs)
    needs = any(grads)
    if kind == "view":
        fit = device.eager.fit("view")
        fwd, bwd = fit.fwd_call, (fit.bwd_call if needs and op.kind == "view" else 0.0)
        copy = device.eager.fit("elementwise")
        if copies:  # a reshape PyTorch cannot view: a copy (read and write); its gradient is a view
            fwd += copy.fwd_call + (sum(in_bytes) + out_bytes) * copy.fwd_per_unit
        if needs and op.name == "split":  # the pieces' gradients are concatenated: a copy of the input
            bwd += copy.fwd_call + 2.0 * sum(in_bytes) * copy.fwd_per_unit
        return fwd, bwd, 0.0
    # torch.matmul here is attention's batched one (its own fit); other ops by name, then class.
    fit = device.eager.fit("attention_matmul" if op.name == "matmul" else op.name, kind)
    if kind == "matmul":
        per_flop = device.peak("fp32") / device.peak(dtype)  # calibrated in fp32
        n = sum(1 for i in op.operands if i < len(grads) and grads[i]) or 1
        bwd_flops = n * flops if needs else 0.0
        fwd = fit.fwd_call + flops * fit.fwd_per_unit * per_flop
        bwd = fit.bwd_call + bwd_flops * fit.bwd_per_unit * per_flop if needs else 0.0
        return fwd, bwd, bwd_flops
    units = class_bytes(kind, in_bytes, out_bytes)
    bwd = fit.bwd_call + units * fit.bwd_per_unit if needs else 0.0
    return fit.fwd_call + units * fit.fwd_per_unit, bwd, 2 * flops if needs else 0.0


def optimizer_step_time(device: DeviceSpec, params: Sequence[tuple[float, int]], shard: int,
                        fsdp2: bool = False) -> float:
    """Seconds of the optimizer step and `zero_grad` on a device with measured eager costs, over
    `params` ((local elements, ZeRO stage) per parameter tensor; ZeRO >= 1 keeps 1/`shard` of
    each): a per-tensor cost plus a per-element one (`EagerCosts`), at the sharded-DTensor rates
    for parameters ZeRO shards when it runs as FSDP2 (`fsdp2`)."""
    assert device.eager is not None
    total = 0.0
    for n, z in params:
        sharded = z >= 1 and shard > 1
        per_tensor, per_element = device.eager.optimizer(sharded and fsdp2)
        total += per_tensor + n / (shard if sharded else 1) * per_element
    return total


def node_compute_time(op: OpDef, in_types: Sequence[TensorType], out_types: Sequence[TensorType],
                      attrs: dict, device: DeviceSpec, dtype: str, *, needs_grad: Sequence[bool],
                      scale: float = 1.0, scaled_in: Sequence[bool] | None = None,
                      scaled_out: Sequence[bool] | None = None, copies: bool = False) -> NodeCost:
    """Forward and backward time of one op on local types (see the module rules).

    `needs_grad[i]` says whether input i needs a gradient. `scale` multiplies the batch of
    the tensors flagged in `scaled_in`/`scaled_out` (all when None) and the FLOPs, so a graph
    traced at one batch can be costed at another. `copies`: a view that copies at run time (a
    reshape PyTorch cannot view); a split's backward concatenates its pieces' gradients.
    """
    s_in = [scale if (scaled_in is None or scaled_in[i]) else 1.0 for i in range(len(in_types))]
    s_out = [scale if (scaled_out is None or scaled_out[i]) else 1.0 for i in range(len(out_types))]
    # FLOPs follow the batch when any operand is batched (a weight is not: max() would pick 1).
    batched = [x for x, flag in zip(s_in + s_out, list(scaled_in or [True] * len(s_in))
                                    + list(scaled_out or [True] * len(s_out))) if flag]
    flops = op.count_flops(in_types, out_types, attrs) * (batched[0] if batched else 1.0)
    in_bytes = [t.nbytes * s for t, s in zip(in_types, s_in)]
    out_bytes = sum(t.nbytes * s for t, s in zip(out_types, s_out))
    nbytes = sum(in_bytes) + out_bytes
    grads = [bool(g) for g in needs_grad]
    if op.kind in FREE_KINDS and device.eager is None:
        copy = 2.0 * out_bytes if copies else 0.0
        cat = 2.0 * sum(in_bytes) if op.name == "split" and any(grads) else 0.0
        fwd = kernel_time(0.0, copy, device, dtype, matmul=False) + device.kernel_latency if copy else 0.0
        bwd = kernel_time(0.0, cat, device, dtype, matmul=False) + device.kernel_latency if cat else 0.0
        return NodeCost(fwd, bwd, 0.0, 0.0, copy)
    if device.eager is not None:
        fwd_s, bwd_s, bwd_flops = eager_time(op, attrs, flops, in_bytes, out_bytes, grads, device, dtype, copies)
        acc = dict(device.eager.kinds).get("accumulate_grad")
        if acc is not None and scaled_in is not None:  # parameters (unbatched, needing a gradient)
            bwd_s += sum(acc.bwd_call + b * acc.bwd_per_unit for b, g, batched in zip(in_bytes, grads, scaled_in)
                         if g and not batched)
        return NodeCost(fwd_s, bwd_s, flops, bwd_flops, 0.0 if op.kind in FREE_KINDS else nbytes)
    matmul = op.kind in MATMUL_KINDS
    latency = device.kernel_latency
    fwd = kernel_time(flops, nbytes, device, dtype, matmul=matmul) + latency
    if not any(grads):
        return NodeCost(fwd, 0.0, flops, 0.0, nbytes)
    if matmul:
        # One matmul per input needing a gradient (a bias gradient is a cheap reduction).
        n = sum(1 for i in op.operands if i < len(grads) and grads[i]) or 1
        per = kernel_time(flops, nbytes, device, dtype, matmul=True)
        extra = sum(b for i, b in enumerate(in_bytes) if i >= 2 and grads[i] and i not in op.operands)
        bwd = n * (per + latency) + (extra / device.memory_bandwidth + latency if extra else 0.0)
        return NodeCost(fwd, bwd, flops, n * flops, nbytes)
    if op.kind == "index":
        # Embedding backward: scatter-add of the output gradient into the weight gradient.
        return NodeCost(fwd, 2 * out_bytes / device.memory_bandwidth + latency, flops, 0.0, nbytes)
    bwd = kernel_time(2 * flops, nbytes + out_bytes, device, dtype, matmul=False) + latency
    return NodeCost(fwd, bwd, flops, 2 * flops, nbytes)


def saved_bytes_of(op: OpDef, in_types: Sequence[TensorType], out_types: Sequence[TensorType],
                   attrs: dict) -> list[tuple[str, int, float]]:
    """What the op keeps for backward: ("in", i, bytes), ("out", i, bytes) or ("bytes", -1, n)."""
    out: list[tuple[str, int, float]] = []
    for kind, idx in op.saved_for_backward(in_types, out_types, attrs):
        if kind == "in":
            out.append(("in", idx, float(in_types[idx].nbytes)))
        elif kind == "out":
            out.append(("out", idx, float(out_types[idx].nbytes)))
        else:
            out.append(("bytes", -1, float(idx)))
    return out


def element_bytes(dtype: str) -> int:
    """Bytes per element of an IR dtype (`bf16` -> 2)."""
    return DTYPE_BYTES[dtype]
