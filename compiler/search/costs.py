"""Prices candidates and edges with the analytical model's primitives (`shardc.cost`).

Everything here is one micro-batch on one device, in seconds and bytes: compute from
`node_compute_time` on local shapes, collectives from `collective_time` over the link levels
a mesh axis spans (`group_levels`), redistributions from `reshard_steps`, model states from
`model_state_bytes`. Rotating operands overlap with compute (only the excess is charged),
as in the model's layer rule. The solver only combines these numbers linearly.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.cost.comm import collective_time, group_levels, neighbour_link, reshard_steps
from shardc.cost.compute import local_type, node_compute_time
from shardc.cost.memory import model_state_bytes
from shardc.hardware import Cluster
from shardc.ir import DTYPE_BYTES, Layout, Mesh, Value
from shardc.registry import get_op, has_op
from shardc.search.candidates import Candidate, Collective, Shapes
from shardc.search.groups import NodeGroup

PLAN_DTYPE_IR = {"bf16": "bf16", "fp16": "f16", "fp32": "f32"}


@dataclass(frozen=True, slots=True)
class Priced:
    """A candidate's numbers: forward/backward seconds (collectives included), the part of the
    forward that selective recomputation repeats, saved/transient bytes, and its parameters."""

    fwd: float
    bwd: float
    fwd_core: float
    saved: tuple[tuple[int, float, bool], ...]
    transient: float
    params: tuple[tuple[str, float, tuple[str, ...]], ...]  # (name, local elements, gradient-sum axes)


@dataclass
class Pricer:
    """Prices on one cluster for one full mesh (pp, dp, cp, tp) and one micro-batch size."""

    cluster: Cluster
    mesh: Mesh
    dtype: str
    shapes: Shapes
    needs_grad: frozenset[int]
    core: frozenset[int]  # ids of nodes in an attention core (selective recomputation)

    def __post_init__(self) -> None:
        self._levels: dict[tuple[str, ...], object] = {}

    @property
    def ir_dtype(self) -> str:
        return PLAN_DTYPE_IR.get(self.dtype, self.dtype)

    def levels(self, axes: tuple[str, ...]):
        if axes not in self._levels:
            self._levels[axes] = group_levels(self.mesh, axes, self.cluster)
        return self._levels[axes]

    def collective(self, c: Collective) -> float:
        if c.kind == "rotate":
            return c.steps * collective_time("rotate", c.nbytes, neighbour_link(self.mesh, c.axis, self.cluster),
                                             group_size=2)
        return collective_time(c.kind, c.nbytes, self.levels((c.axis,)))

    def reshard_time(self, src: Layout, dst: Layout, value: Value) -> float:
        ebytes = DTYPE_BYTES[self.ir_dtype if value.type.is_float else value.type.dtype]
        scale = self.shapes.batch_scale if self.shapes.scales(value) else 1.0
        return sum(collective_time(s.kind, s.nbytes * scale, self.levels((s.axis,)))
                   for s in reshard_steps(src, dst, value.type, self.mesh, ebytes))

    def edge(self, value: Value, produced: Layout, required: Layout, grad: Layout) -> tuple[float, float]:
        """Forward and backward seconds of one edge: produced -> required, and the gradient back."""
        if produced == required and grad == required:
            return 0.0, 0.0
        needed = Layout(tuple((a, p) for a, p in produced.placements if not _is_partial(p)))
        return self.reshard_time(produced, required, value), self.reshard_time(grad, needed, value)

    def _no_dp(self, value: Value, layout: Layout) -> Layout:
        if not self.shapes.scales(value):
            return layout
        return Layout(tuple((a, p) for a, p in layout.placements if a != "dp"))

    def candidate(self, group: NodeGroup, cand: Candidate) -> Priced:
        device = self.cluster.device
        fwd = bwd = core = 0.0
        anchor_compute = (0.0, 0.0)
        for j, node in enumerate(group.members):
            if not has_op(node.op):
                continue
            op = get_op(node.op)
            ins, outs = cand.layouts[j]
            # Batched tensors are priced at the per-replica batch (the dp split is in the scale),
            # so a graph traced at batch 1 is not rounded up by ceil division.
            in_t = [local_type(v.type, self._no_dp(v, lay), self.mesh, self.ir_dtype) for v, lay in zip(node.inputs, ins)]
            out_t = [local_type(v.type, self._no_dp(v, lay), self.mesh, self.ir_dtype)
                     for v, lay in zip(node.outputs, outs)]
            cost = node_compute_time(op, in_t, out_t, node.attrs, device, self.ir_dtype,
                                     needs_grad=[id(v) in self.needs_grad for v in node.inputs],
                                     scale=self.shapes.batch_scale / self.mesh.axis_size("dp"),
                                     scaled_in=[self.shapes.scales(v) for v in node.inputs],
                                     scaled_out=[self.shapes.scales(v) for v in node.outputs])
            f = cost.fwd_s + (cand.steps - 1) * device.kernel_latency
            fwd, bwd = fwd + f, bwd + cost.bwd_s
            if j == 0:
                anchor_compute = (cost.fwd_s, cost.bwd_s)
            if id(node) in self.core:
                core += f
        rot_f = rot_b = 0.0
        for c in cand.collectives:
            t = self.collective(c)
            if c.kind == "rotate":
                if c.backward:
                    rot_b += t
                else:
                    rot_f += t
            elif c.backward:
                bwd += t
            else:
                fwd += t
        steps = max(1, max((c.steps for c in cand.collectives if c.kind == "rotate"), default=0) + 1)
        fwd += max(0.0, rot_f - anchor_compute[0] * (steps - 1) / steps)
        bwd += max(0.0, rot_b - anchor_compute[1] * (steps - 1) / steps)
        params = []
        for e in cand.inputs:
            if e.value.kind == "parameter":
                numel = e.value.type.numel
                for axis, p in e.required.placements:
                    if not _is_partial(p) and hasattr(p, "dim"):
                        numel /= self.mesh.axis_size(axis)
                axes = tuple(a for a, p in e.grad.placements if _is_partial(p))
                params.append((e.value.name, numel, axes))
        return Priced(fwd, bwd, core, cand.saved, cand.transient, tuple(params))

    def state_bytes(self, numel: float, axes: tuple[str, ...], zero: int) -> float:
        shard = 1
        for a in axes:
            shard *= self.mesh.axis_size(a)
        return sum(model_state_bytes(numel, self.dtype, zero, shard).values())

    def grad_sync(self, numel: float, axes: tuple[str, ...], zero: int) -> tuple[float, float]:
        """(per step, per micro-batch) seconds to sum a parameter's gradient over `axes`:
        all_reduce (ZeRO 0), reduce_scatter + all_gather of the updated weights (ZeRO 1, 2),
        and for ZeRO 3 weights gathered in forward and backward and gradients scattered per
        micro-batch."""
        if not axes:
            return 0.0, 0.0
        nbytes = numel * DTYPE_BYTES[self.ir_dtype]
        lv = self.levels(axes)
        if zero == 0:
            return collective_time("all_reduce", nbytes, lv), 0.0
        if zero in (1, 2):
            return collective_time("reduce_scatter", nbytes, lv) + collective_time("all_gather", nbytes, lv), 0.0
        per_mb = 2 * collective_time("all_gather", nbytes, lv) + collective_time("reduce_scatter", nbytes, lv)
        return 0.0, per_mb

    def p2p(self, nbytes: float) -> float:
        if self.mesh.axis_size("pp") <= 1:
            return 0.0
        return collective_time("send_recv", nbytes, neighbour_link(self.mesh, "pp", self.cluster), group_size=2)


def _is_partial(p: object) -> bool:
    return type(p).__name__ == "Partial"
