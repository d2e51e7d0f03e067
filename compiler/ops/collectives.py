"""Registry entries for the communication ops the `lower` pass makes explicit.

The IR is global-view: every value's type is its full (global) shape and its layout says how the
devices hold it. A collective therefore keeps the type and changes the layout, so on one device
(the reference backend) each of these ops is the identity. Attributes name the mesh axis and
what the op does there; `grad` says what backward does, because the same forward can have two
conjugates depending on how the gradient of a replicated value is held on that axis:

- model axes (tp, ...): a replicated value's gradient is replicated (every rank computes it), so
  all_gather's backward is `chunk`, chunk's backward is `all_gather`, all_reduce's is `identity`;
- data axes (dp, cp): a replicated value's gradient is partial (each rank's own loss), so
  all_gather's backward is `reduce_scatter`, chunk's backward is `pad`, all_reduce's is
  `all_reduce`.

| op                                    | forward                      | backward (grad attr)        |
|---------------------------------------|------------------------------|-----------------------------|
| all_reduce[axis, op, grad]            | P -> R: sum/avg/max          | identity or all_reduce      |
| grad_all_reduce[axis]                 | identity (R stays R)         | all_reduce sum              |
| all_gather[axis, dim, grad]           | S(dim) -> R                  | chunk or reduce_scatter     |
| reduce_scatter[axis, dim, op]         | P -> S(dim)                  | all_gather                  |
| chunk[axis, dim, grad]                | R -> S(dim), no traffic      | all_gather or pad           |
| to_partial[axis]                      | R -> P(sum): zero off rank 0 | identity                    |
| pad[axis, dim]                        | S(dim) -> P(sum), no traffic | chunk                       |
| all_to_all[axis, src, dst]            | S(src) -> S(dst)             | all_to_all S(dst) -> S(src) |
| rotate[axis, shift]                   | shard moves `shift` ranks    | rotate by -shift            |
| send[axis, src, dst] / recv[...]      | pipeline stage cut           | recv / send                 |
| grad_sync[axes, op, via, zero,        | identity on a parameter      | all_reduce over data axes;  |
|   sum_axes]                           |                              | sum over sum_axes once/step |

`ring_traffic` is the one table of what a collective moves: latency steps and the fraction of
the buffer each rank sends over a ring of n ranks. The cost model, the calibration's link fits,
resharding's byte counts and the study's measured traffic all read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from shardc.ir import TensorType
from shardc.ops.registry import IterationSpace, OpDef, register

COLLECTIVE_OPS = (
    "all_reduce", "grad_all_reduce", "all_gather", "reduce_scatter", "chunk", "to_partial", "pad", "all_to_all",
    "rotate", "send", "recv", "grad_sync",
)


def _same_shape_space(i: Sequence[TensorType], o: Sequence[TensorType], a: dict[str, Any]) -> IterationSpace:
    """Input and output are the same global tensor: one iteration dim per tensor dim."""
    names = tuple(f"d{k}" for k in range(o[0].rank))
    dims = tuple((n,) for n in names)
    return IterationSpace(tuple(zip(names, o[0].shape)), tuple(dims for _ in i), (dims,))


def _identity(x: Any, **attrs: Any) -> Any:
    # Global view: on one device a collective changes nothing.
    return x


def _collective(name: str, doc: str) -> OpDef:
    return register(OpDef(
        name, "collective", _same_shape_space, _identity,
        flops=lambda i, o, a: 0, saves=lambda i, o, a: [], doc=doc,
    ))


_collective("all_reduce", "P -> R over `axis` by `op`; backward per `grad` (identity | all_reduce)")
_collective("grad_all_reduce", "identity forward, all_reduce(sum) of the gradient over `axis` backward")
_collective("all_gather", "S(dim) -> R over `axis`; backward per `grad` (chunk | reduce_scatter)")
_collective("reduce_scatter", "P -> S(dim) over `axis`; backward all_gather")
_collective("chunk", "R -> S(dim) over `axis` by taking the local piece; backward per `grad` (all_gather | pad)")
_collective("to_partial", "R -> P(sum) over `axis` with no traffic: the value on coordinate 0, zeros "
                          "elsewhere (a bias added to a partial sum); backward identity")
_collective("pad", "S(dim) -> P(sum) over `axis` with no traffic: the shard placed in zeros of the full "
                   "size; backward chunk")
_collective("all_to_all", "S(src) -> S(dst) over `axis`; backward the reverse all_to_all")
_collective("rotate", "every rank passes its shard `shift` ranks along `axis`; backward rotates back")
_collective("send", "pipeline stage cut: the value leaves stage `src` for stage `dst` over `axis`")
_collective("recv", "pipeline stage cut: the value arrives at stage `dst` from stage `src` over `axis`")
_collective("grad_sync", "identity on a parameter; its gradient is averaged over the data `axes` "
                         "(by DDP, or FSDP2 for ZeRO stage `zero`, as `via` says) and summed over the "
                         "model axes `sum_axes` once per step, after the last backward")



# ---- traffic: the one table of what each collective sends ----------------------------------

@dataclass(frozen=True, slots=True)
class Traffic:
    """One collective over a group: `steps` rounds, each paying the link's latency, and each rank
    sending `numerator/denominator` of the buffer. The buffer is what all_reduce reduces, the
    gathered tensor of all_gather, the input of reduce_scatter, the message of a send."""

    steps: int
    numerator: int
    denominator: int = 1

    @property
    def fraction(self) -> float:
        """The share of the buffer one rank sends."""
        return self.numerator / self.denominator

    def sent_bytes(self, buffer: int) -> int:
        """Whole bytes one rank sends of a `buffer`-byte buffer (rounded down, exactly)."""
        return buffer * self.numerator // self.denominator


# Kind -> its traffic over n >= 2 ranks with ring algorithms: all_reduce is a reduce_scatter then
# an all_gather; the n-1 rounds of the others each pass one 1/n piece on; a broadcast is
# forwarded along the ring (n-1 ranks send it all: (n-1)/n on average); a point-to-point
# message is one round whatever the group.
_RING: Mapping[str, Callable[[int], Traffic]] = MappingProxyType({
    "all_reduce": lambda n: Traffic(2 * (n - 1), 2 * (n - 1), n),
    "all_gather": lambda n: Traffic(n - 1, n - 1, n),
    "reduce_scatter": lambda n: Traffic(n - 1, n - 1, n),
    "all_to_all": lambda n: Traffic(n - 1, n - 1, n),
    "broadcast": lambda n: Traffic(n - 1, n - 1, n),
    "send_recv": lambda n: Traffic(1, 1),
    "rotate": lambda n: Traffic(1, 1),
    "send": lambda n: Traffic(1, 1),
    "recv": lambda n: Traffic(1, 0),
})
POINT_TO_POINT = frozenset({"send_recv", "rotate", "send", "recv"})


def ring_traffic(kind: str, n: int) -> Traffic:
    """The steps and the share of the buffer one rank sends for collective `kind` over `n` ranks
    (ring algorithms, see `_RING`); a group of one rank moves nothing, a point-to-point message
    is the same whatever `n`."""
    if kind not in _RING:
        raise ValueError(f"no traffic rule for collective {kind!r}; known: {', '.join(_RING)}")
    if n <= 1 and kind not in POINT_TO_POINT:
        return Traffic(0, 0)
    return _RING[kind](n)
