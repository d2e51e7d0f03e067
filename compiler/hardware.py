"""Hardware descriptions: devices, links and clusters (nodes x devices per node).

The preset catalog and `parse_cluster("8xA100-80GB")` live here; the calibrated `local`
profile is measured by `shardc.calibrate` and cached in a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One level of the interconnect: per-device bandwidth (bytes/s, one direction) and latency (s)."""

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"link {self.name}: bandwidth must be > 0 and latency >= 0")


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype, memory capacity and bandwidth.

    `matmul_efficiency` is the fraction of peak a large matmul reaches; smaller matmuls reach
    less, following `efficiency(flops) = matmul_efficiency * flops / (flops + matmul_half_flops)`.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bytes: int
    memory_bandwidth: float
    matmul_efficiency: float = 0.8
    matmul_half_flops: float = 2e9
    kernel_latency: float = 5e-6

    def peak(self, dtype: str) -> float:
        for d, f in self.peak_flops:
            if d == dtype:
                return f
        raise KeyError(f"device {self.name} has no peak FLOP/s for dtype {dtype!r}; it knows "
                       + ", ".join(d for d, _ in self.peak_flops))


@dataclass(frozen=True, slots=True)
class Cluster:
    """`nodes` x `devices_per_node` identical devices; `intra` links within a node, `inter` across."""

    device: DeviceSpec
    nodes: int
    devices_per_node: int
    intra: LinkSpec
    inter: LinkSpec
    name: str = field(default="")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node
