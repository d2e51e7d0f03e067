"""The parallel plan users write by hand: `dp=8,tp=8,pp=16,vpp=3,mb=1,gbs=1536,...`.

One parser (`ParallelPlan.parse`) serves every command that takes `--plan`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    """A uniform Megatron-style plan. Degrees multiply to the device count: dp*tp*pp*cp.

    mb is the micro-batch size; gbs the global batch (sequences per optimizer step); the
    number of micro-batches per pipeline is gbs / (dp * mb) (gradient accumulation when pp=1).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    sp: bool = False
    mb: int = 1
    gbs: int | None = None
    schedule: str = "1f1b"
    recompute: str = "none"
    zero: int = 0
    dtype: str = "bf16"
    offload: bool = False

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp
