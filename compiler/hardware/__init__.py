"""Hardware descriptions: devices, links and clusters (nodes x devices per node).

The preset catalog and `parse_cluster("8xA100-80GB")` live here; `shardc.hardware.local` makes this
machine's cluster (`local_cluster`) from its measured profile (`shardc.calibration.profile`, cached in
a file by `shardc calibrate`) as `make_cluster` does from a preset.

Units everywhere: FLOP/s, bytes, bytes/s, seconds. Decimal prefixes (1 GB/s = 1e9 B/s) for
bandwidths as data sheets print them; memory capacities in binary units (an "80GB" A100 has
80 GiB, which is what `nvidia-smi` reports and what the allocator can hand out).

Link bandwidth convention: `LinkSpec.bandwidth` is what ONE device can send in ONE direction
over that level at the same time as every other device does (per-direction, per-GPU). Data
sheets quote NVLink as the bidirectional total per GPU ("600 GB/s" for A100 is 300 GB/s each
way) and InfiniBand per port and direction ("HDR 200 Gb/s" is 25 GB/s each way, one port per
GPU on a DGX). A ring collective over n devices on one level therefore takes
`steps * latency + volume_factor * bytes / bandwidth` with the usual ring factors
(all_reduce: 2(n-1) steps, 2(n-1)/n of the buffer; all_gather / reduce_scatter: n-1 steps,
(n-1)/n of the full buffer). `efficiency` is the fraction of the wire rate a large NCCL
collective reaches in practice (nccl-tests bus bandwidth); `effective_bandwidth` applies it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from shardc.calibration.profile import EagerCosts, LocalProfile, read_profile
from shardc.ir.diagnostics import ShardcError
from shardc.ir.dtypes import precision

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One level of the interconnect: per-device bandwidth (bytes/s, one direction) and latency (s).

    `latency` is the per-message (per ring step) cost including software; `efficiency` the
    fraction of `bandwidth` large collectives reach (1.0 = wire rate). `call_overhead` (s) is
    what one of shardc's autograd-aware collective wrappers costs beyond the raw collective
    (forward and backward together; measured for the local gloo profile, 0 where unknown).
    `p2p` (latency s, bandwidth bytes/s) prices one point-to-point message (pipeline send/recv,
    rotation) where it was measured apart from the collectives' ring steps (gloo: a send costs
    a sixth of an all_reduce step here); None: a message is one ring step. `measured`: see below.
    """

    name: str
    bandwidth: float
    latency: float
    efficiency: float = 1.0
    call_overhead: float = 0.0
    p2p: tuple[float, float] | None = None
    # (collective, ranks, alpha s, beta s/byte): whole collectives measured on this link (the local
    # gloo profile); a group of that many ranks on this link alone is priced by its own fit.
    measured: tuple[tuple[str, int, float, float], ...] = ()
    # (ranks, s): what a blocking collective over a group of that many ranks waits inside a training
    # step beyond its measured fit (peers computing or descheduled: `LocalProfile.step_wait`); () elsewhere.
    step_wait: tuple[tuple[int, float], ...] = ()

    def wait(self, ranks: int) -> float:
        """`step_wait` for a group of `ranks` (the nearest size measured, ties to the larger; 0 without)."""
        if not self.step_wait or ranks <= 1:
            return 0.0
        return min(self.step_wait, key=lambda w: (abs(w[0] - ranks), -w[0]))[1]

    def measured_time(self, kind: str, ranks: int, nbytes: float) -> float | None:
        """`alpha + beta * nbytes` of the collective measured at `ranks` on this link, or None."""
        for name, n, alpha, beta in self.measured:
            if name == kind and n == ranks:
                return alpha + beta * nbytes
        return None

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0 or self.call_overhead < 0 or any(w < 0 for _, w in self.step_wait):
            raise ValueError(f"link {self.name}: bandwidth must be > 0, latency, call_overhead and step_wait >= 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"link {self.name}: efficiency must be in (0, 1], got {self.efficiency}")
        if self.p2p is not None and (self.p2p[0] < 0 or self.p2p[1] <= 0):
            raise ValueError(f"link {self.name}: p2p latency must be >= 0 and bandwidth > 0, got {self.p2p}")

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True, slots=True)
class Headroom:
    """Device memory the runtime holds that the cost model's categories do not count.

    `context_bytes`: the CUDA context (driver state, loaded kernels, cuBLAS/cuDNN handles and
    workspaces); `comm_bytes`: the collective library's buffers (NCCL's per-channel, per-peer
    FIFOs of every communicator); `fragmentation`: the fraction of the capacity the caching
    allocator holds in blocks it cannot hand out (reserved but unallocated at the peak);
    `model_error`: the fraction of the capacity held back for the cost model's own
    under-prediction of a rank's peak, where it has been measured (the local CPU cluster:
    `LOCAL_HEADROOM`), so that a plan predicted to fit also fits when run.
    Total: `context_bytes + comm_bytes + (fragmentation + model_error) * capacity`.
    """

    context_bytes: int = 0
    comm_bytes: int = 0
    fragmentation: float = 0.0
    model_error: float = 0.0

    def __post_init__(self) -> None:
        if self.context_bytes < 0 or self.comm_bytes < 0 or not 0 <= self.fragmentation + self.model_error < 1 \
                or self.fragmentation < 0 or self.model_error < 0:
            raise ValueError(f"headroom needs bytes >= 0 and fragmentation, model_error >= 0 summing below 1, "
                             f"got {self}")

    def bytes(self, memory_bytes: int) -> int:
        """The reserved bytes on a device of `memory_bytes`."""
        return self.context_bytes + self.comm_bytes + int((self.fragmentation + self.model_error) * memory_bytes)

    def describe(self, memory_bytes: int) -> str:
        """The total and its parts, for a device of `memory_bytes` (one line of a report)."""
        total = self.bytes(memory_bytes)
        if not total:
            return "0 B"
        if not (self.context_bytes or self.comm_bytes or self.fragmentation):
            return f"{format_bytes(total)} (the memory model's error, {self.model_error:.0%})"
        error = f", model error {self.model_error:.0%}" if self.model_error else ""
        return (f"{format_bytes(total)} (context {format_bytes(self.context_bytes)}, NCCL "
                f"{format_bytes(self.comm_bytes)}, fragmentation {self.fragmentation:.0%}{error})")


NO_HEADROOM = Headroom()

# The reserved memory of one GPU training process (what `nvidia-smi` shows beyond
# `torch.cuda.max_memory_allocated()`), by source:
# - CUDA context: ~300-400 MB once PyTorch sets CUDA_MODULE_LOADING=LAZY (the default since
#   torch 1.13, pytorch/pytorch#86509 measured 287 MB lazy vs 667 MB eager; ptrblck on
#   pytorch/pytorch#107667 and #109888: "~300MB", "around 400MB if CUDA >= 11.7"; >1000 MB
#   before lazy loading), plus cuBLAS/cuDNN handles and workspaces: 0.5 GiB.
# - NCCL: every communicator allocates NCCL_BUFFSIZE (4 MiB by default, NCCL's environment
#   variable documentation) per channel, per peer and per protocol (Simple, LL, LL128), on
#   send and receive sides; 16-32 channels on NVLink systems make a few hundred MiB per
#   communicator (NVIDIA/nccl#864 reports ~1.6 GB used by a process with one communicator after
#   an all_reduce, its CUDA context included; NVIDIA/nccl#1685: an 8xH100 all_to_all grew NCCL's use
#   from 1.06 to 4.34 GB). A 3-D plan has dp, tp and pp communicators (and more groups for
#   FSDP/cp): 1 GiB.
# - Fragmentation: the caching allocator splits and caches blocks; what is reserved but
#   unallocated at the peak is commonly a few percent of the device (large jobs set
#   expandable_segments, pytorch/pytorch#96995, to keep it there): 5%.
# On an 80 GiB device: 0.5 + 1 + 4 = 5.5 GiB, leaving 74.5 GiB to the plan.
GPU_HEADROOM = Headroom(context_bytes=GiB // 2, comm_bytes=GiB, fragmentation=0.05)

# The local CPU cluster (`shardc.hardware.local`): gloo's buffers are a few MiB of host memory,
# and what a process holds besides tensors is the baseline of the tracker `shardc run` compares
# against, so nothing is reserved for the runtime. What is reserved is the memory model's error,
# as measured on this machine, rank by rank ((measured - predicted) / predicted peak):
# - the study (`shardc study`, GPT 4 layers, 41 plans on 2 and 4 processes, 130 ranks; session 6
#   run D on main 3e4914e): -3.3% .. +0.3%, median +0.07%;
# - the measured plan-quality cases (`benchmarks/plan_quality.py --measure`, run e, 10 plans):
#   -2.7% .. +3.4% (gpt-4l-tie's solver plan 4.35 -> 4.50 MiB; gpt-4l-zero's 3.03 -> 3.09 MiB,
#   which went over the 3.07 MiB it was planned under);
# - the closed-loop corpus (`tests/test_closed_loop.py`) holds every plan to within 5% per rank.
# 5% of the capacity: a plan predicted at most 95% of it and measured at most 5% above its
# prediction peaks under 99.75% of it.
LOCAL_HEADROOM = Headroom(model_error=0.05)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype, memory capacity and bandwidth.

    `matmul_efficiency` is the fraction of peak a large matmul reaches; smaller matmuls reach
    less, following `efficiency(flops) = matmul_efficiency * flops / (flops + matmul_half_flops)`.
    `kernel_latency` is the fixed cost of launching one op. `eager`: measured per-op-class costs
    (the calibrated local CPU), which replace the roofline.

    Memory: `memory_bytes` is the capacity; `headroom` what the runtime takes from it before
    training allocates anything (`Headroom`); `usable_memory_bytes` what plans must fit in:
    `memory_limit_bytes` when set (`--memory-limit`, which replaces the headroom), else the
    capacity less the headroom.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bytes: int
    memory_bandwidth: float
    matmul_efficiency: float = 0.8
    matmul_half_flops: float = 2e9
    kernel_latency: float = 5e-6
    eager: EagerCosts | None = None
    headroom: Headroom = NO_HEADROOM
    memory_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.peak_flops or any(f <= 0 for _, f in self.peak_flops):
            raise ValueError(f"device {self.name}: peak FLOP/s must be given and positive")
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"device {self.name}: memory capacity and bandwidth must be positive")
        if not 0 < self.matmul_efficiency <= 1 or self.matmul_half_flops < 0:
            raise ValueError(f"device {self.name}: matmul_efficiency in (0, 1], matmul_half_flops >= 0")
        if self.memory_limit_bytes is None and self.headroom.bytes(self.memory_bytes) >= self.memory_bytes:
            raise ValueError(f"device {self.name}: the headroom {self.headroom} leaves no memory")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes <= 0:
            raise ValueError(f"device {self.name}: memory limit must be positive, got {self.memory_limit_bytes}")

    @property
    def usable_memory_bytes(self) -> int:
        """What a plan's peak per-device memory must fit in (see the class docstring)."""
        if self.memory_limit_bytes is not None:
            return self.memory_limit_bytes
        return self.memory_bytes - self.headroom.bytes(self.memory_bytes)

    def describe_headroom(self) -> str:
        """One line: the reserved bytes and where they go, or the limit that replaced them."""
        if self.memory_limit_bytes is not None:
            return f"not counted: --memory-limit {format_bytes(self.memory_limit_bytes)}"
        return self.headroom.describe(self.memory_bytes)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.peak_flops)

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype` (plan or IR spelling: `bf16`, `fp32`, `f32`, ...)."""
        want = precision(dtype)  # peak tables use the plan's names
        for d, f in self.peak_flops:
            if d == want:
                return f
        raise ShardcError(
            f"device {self.name} has no peak FLOP/s for dtype {dtype!r}; it knows " + ", ".join(self.dtypes),
            hint="pick a dtype the device supports in the plan, e.g. dtype=fp16 on V100")

    def matmul_flops_per_s(self, flops: float, dtype: str) -> float:
        """Achieved FLOP/s of one matmul of `flops` FLOPs: peak x the efficiency curve."""
        return self.peak(dtype) * self.matmul_efficiency * flops / (flops + self.matmul_half_flops)


@dataclass(frozen=True, slots=True)
class Cluster:
    """`nodes` x `devices_per_node` identical devices; `intra` links within a node, `inter` across.

    Ranks are numbered node-major (rank = node * devices_per_node + local index), as torchrun
    does, so a group of consecutive ranks stays inside a node as long as it fits. `shared_cores`:
    the cores all its processes share (the local machine, `hardware.local`); 0: a device each.
    """

    device: DeviceSpec
    nodes: int
    devices_per_node: int
    intra: LinkSpec
    inter: LinkSpec
    name: str = field(default="")
    shared_cores: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1 or self.shared_cores < 0:
            raise ValueError(f"cluster needs >= 1 node and >= 1 device per node and shared_cores >= 0, got "
                             f"{self.nodes}x{self.devices_per_node}, {self.shared_cores}")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def spans_nodes(self, size: int, stride: int = 1) -> bool:
        """Whether a group of `size` ranks `stride` apart (a mesh axis) crosses node boundaries."""
        return size > 1 and (size - 1) * stride + 1 > self.devices_per_node

    def link_for(self, size: int, stride: int = 1) -> LinkSpec:
        """The slowest link level a group of `size` ranks `stride` apart has to use."""
        return self.inter if self.spans_nodes(size, stride) else self.intra

    def __str__(self) -> str:
        return self.name or f"{self.nodes}x{self.devices_per_node}x{self.device.name}"


@dataclass(frozen=True, slots=True)
class Preset:
    """A catalog entry: the device, its node (DGX/HGX) size and the two link levels."""

    device: DeviceSpec
    devices_per_node: int
    intra: LinkSpec
    inter: LinkSpec


def _half_flops(peak: float, efficiency: float, fixed_time: float = 5e-6) -> float:
    # A matmul reaches half its large-size rate when its ideal time equals the fixed cost of a
    # kernel (launch, tail, wave quantisation), taken as ~5 us on all these GPUs.
    return peak * efficiency * fixed_time


# Latencies: NCCL's per-step base latency over NVLink is a few us; over InfiniBand 5-10 us
# once the software stack (proxy thread, GPUDirect RDMA setup) is counted.
# Efficiencies: nccl-tests all_reduce bus bandwidth on DGX systems reaches ~80% of the NVLink
# wire rate (e.g. ~230-240 of 300 GB/s on DGX A100) and ~90% of InfiniBand's.
_NVLINK2 = LinkSpec("nvlink2", 150e9, 3e-6, 0.8)   # V100 SXM2: 6 links x 25 GB/s x 2 dirs = 300 GB/s total
_NVLINK3 = LinkSpec("nvlink3", 300e9, 3e-6, 0.8)   # A100 SXM4: 12 links, 600 GB/s total
_NVLINK4 = LinkSpec("nvlink4", 450e9, 3e-6, 0.8)   # H100/H200 SXM5: 18 links, 900 GB/s total
_NVLINK_H800 = LinkSpec("nvlink-h800", 200e9, 3e-6, 0.8)  # H800 SXM5: 400 GB/s total
_IB_EDR = LinkSpec("ib-edr", 12.5e9, 8e-6, 0.9)    # EDR 100 Gb/s per GPU
_IB_HDR = LinkSpec("ib-hdr", 25e9, 7e-6, 0.9)      # HDR 200 Gb/s per GPU (DGX A100: 8 ConnectX-6)
_IB_NDR = LinkSpec("ib-ndr", 50e9, 6e-6, 0.9)      # NDR 400 Gb/s per GPU (DGX H100/H200: 8 ConnectX-7)

# Tesla V100 SXM2 data sheet: 125 TFLOP/s tensor (fp16), 15.7 fp32, 7.8 fp64; 32 GB HBM2 at
# 900 GB/s. No bf16.
# Large fp16 GEMMs reach ~100 TFLOP/s with cuBLAS.
_V100 = DeviceSpec(
    "V100-32GB", (("fp16", 125e12), ("fp32", 15.7e12), ("fp64", 7.8e12)),
    32 * GiB, 900e9, 0.8, _half_flops(125e12, 0.8), 5e-6, headroom=GPU_HEADROOM)


def _a100(name: str, memory_gib: int, bandwidth: float) -> DeviceSpec:
    # A100 SXM4 data sheet: 312 TFLOP/s dense bf16/fp16 tensor, 156 tf32, 19.5 fp32, 19.5 fp64
    # tensor (9.7 plain); HBM2 1555 GB/s (40GB) or HBM2e 2039 GB/s (80GB).
    # Isolated large GEMMs reach ~85% of the bf16 peak in cuBLAS benchmarks, but GEMMs inside a
    # training step run at sustained (power-limited) clocks: 69% is the one sustained figure for
    # the device, fitted on the calibration rows of benchmarks/published_data.py (Narayanan et
    # al.'s four Megatron-LM runs, 1.7B-1008B: mean log error zero, `published_runs.py --fit
    # A100-80GB`), never per run; the other published A100 runs there are checks.
    return DeviceSpec(
        name, (("bf16", 312e12), ("fp16", 312e12), ("tf32", 156e12), ("fp32", 19.5e12), ("fp64", 19.5e12)),
        memory_gib * GiB, bandwidth, A100_EFFICIENCY, _half_flops(312e12, A100_EFFICIENCY), 5e-6,
        headroom=GPU_HEADROOM)


def _hopper(name: str, memory_gib: int, bandwidth: float, efficiency: float, fp64: float = 67e12) -> DeviceSpec:
    # H100 SXM5 data sheet: 989 TFLOP/s dense bf16/fp16 tensor (1979 with sparsity), 1979 fp8,
    # 494.5 tf32, 67 fp32, 67 fp64 tensor; 80 GB HBM3 at 3.35 TB/s.
    # H200 SXM: the same compute, 141 GB HBM3e at 4.8 TB/s.
    # H800 SXM5 (the export variant DeepSeek-V2/V3 trained on): the H100's tensor compute and
    # memory, fp64 cut to 1 TFLOP/s, NVLink cut to 400 GB/s (both directions).
    return DeviceSpec(
        name, (("bf16", 989e12), ("fp16", 989e12), ("fp8", 1979e12), ("tf32", 494.5e12),
               ("fp32", 67e12), ("fp64", fp64)),
        memory_gib * GiB, bandwidth, efficiency, _half_flops(989e12, efficiency), 4e-6, headroom=GPU_HEADROOM)


# Sustained matmul efficiency, one figure per device type, each fitted on named calibration rows
# of benchmarks/published_data.py (`published_runs.py --fit DEVICE`), never per run:
# - A100: Narayanan et al. 2021's four Megatron-LM runs under their own launch plans (Megatron-LM
#   examples/sc21/run_table_1.sh: micro-batches 16, 8, 2, 1; torch DDP overlapped where pp=1, local
#   DDP after backward otherwise; vpp=2 on 145.6B; pipeline scatter/gather): fit 0.693 (0.751
#   with the earlier misread plans, mb=1 everywhere).
# - H100 SXM: NVIDIA dgxc-benchmarking's NeMo GPT-3 175B BF16 on 128 H100, priced with the
#   run's userbuffers TP overlap and Transformer Engine's fused kernels priced compiled (fit 0.626;
#   0.703 with the TP collectives exposed and eager kernels).
# - H200: no published run in the set; cuBLAS's ~75% of the bf16 peak on large GEMMs (power and
#   clock limited) until a run or `benchmarks/gpu_check.sh` fits it.
A100_EFFICIENCY = 0.69
H100_EFFICIENCY = 0.63
H200_EFFICIENCY = 0.75


PRESETS: Mapping[str, Preset] = MappingProxyType({
    "V100-32GB": Preset(_V100, 8, _NVLINK2, _IB_EDR),
    "A100-40GB": Preset(_a100("A100-40GB", 40, 1555e9), 8, _NVLINK3, _IB_HDR),
    "A100-80GB": Preset(_a100("A100-80GB", 80, 2039e9), 8, _NVLINK3, _IB_HDR),
    "H100-SXM": Preset(_hopper("H100-SXM", 80, 3.35e12, H100_EFFICIENCY), 8, _NVLINK4, _IB_NDR),
    "H200": Preset(_hopper("H200", 141, 4.8e12, H200_EFFICIENCY), 8, _NVLINK4, _IB_NDR),
    # the H100's silicon and sustained efficiency; DeepSeek-V3's cluster: 8 GPUs per node, one
    # 400 Gb/s InfiniBand NIC per GPU (its report: IB 50 GB/s, NVLink 160 GB/s achieved)
    "H800": Preset(_hopper("H800", 80, 3.35e12, H100_EFFICIENCY, fp64=1e12), 8, _NVLINK_H800, _IB_NDR),
})
ALIASES: Mapping[str, str] = MappingProxyType({"H100": "H100-SXM", "A100": "A100-80GB", "V100": "V100-32GB"})

_EXAMPLES = "8xA100-80GB, 64xH100 (8 per node), 2x8xH100 (nodes x per node), local, local4"


def known_presets() -> list[str]:
    """Preset names and aliases, as `parse_cluster` accepts them."""
    return list(PRESETS) + [f"{a} (= {t})" for a, t in ALIASES.items()] + ["local"]


def preset(name: str) -> Preset:
    """Look a preset up by name or alias, case-insensitively."""
    by_lower = {k.lower(): k for k in PRESETS} | {a.lower(): t for a, t in ALIASES.items()}
    key = by_lower.get(name.strip().lower())
    if key is None:
        raise ShardcError(f"unknown cluster preset {name!r}; known presets: {', '.join(known_presets())}",
                          hint=f"write a cluster as e.g. {_EXAMPLES}")
    return PRESETS[key]


def make_cluster(name: str, nodes: int, devices_per_node: int | None = None) -> Cluster:
    """`nodes` nodes of preset `name`, each with `devices_per_node` devices (the preset's default)."""
    p = preset(name)
    per_node = p.devices_per_node if devices_per_node is None else devices_per_node
    dev_name = p.device.name
    return Cluster(p.device, nodes, per_node, p.intra, p.inter, f"{nodes}x{per_node}x{dev_name}")


_LOCAL = re.compile(r"^local(?::?(\d+))?$", re.IGNORECASE)
_SHAPE = re.compile(r"^(\d+)\s*[xX]\s*(?:(\d+)\s*[xX]\s*)?([A-Za-z][\w.-]*)$")


def parse_cluster(text: str, *, local_profile: Callable[[], LocalProfile] = read_profile) -> Cluster:
    """Parse a cluster: `8xA100-80GB`, `64xH100` (8 per node), `2x8xH100`, `local`, `local4`/`local:4`.

    `NxPRESET` fills nodes of the preset's size (8): up to 8 devices make one node, more must be
    a multiple of 8. `AxBxPRESET` is A nodes of B devices. `local` is this machine as calibrated
    by `shardc calibrate` (one process per core; `localN` or `Nxlocal` for N processes), from the
    profile `local_profile()` gives, called only for a local cluster (default: the cached one).
    """
    s = text.strip()
    m = _LOCAL.match(s)
    if m:
        return local_cluster(int(m.group(1)) if m.group(1) else _default_local_procs(), local_profile())
    m = _SHAPE.match(s)
    if not m:
        raise ShardcError(f"cannot read cluster {text!r}; write e.g. {_EXAMPLES}; known presets: "
                          + ", ".join(known_presets()))
    first, second, name = int(m.group(1)), m.group(2), m.group(3)
    if name.lower() == "local":
        if second is not None:
            total = first * int(second)
            raise ShardcError(f"cluster {text!r}: the local machine is one node; write {total}xlocal or local{total}")
        return local_cluster(first, local_profile())
    p = preset(name)
    if second is not None:
        nodes, per_node = first, int(second)
    elif first <= p.devices_per_node:
        nodes, per_node = 1, first
    elif first % p.devices_per_node == 0:
        nodes, per_node = first // p.devices_per_node, p.devices_per_node
    else:
        per = p.devices_per_node
        lo, hi = first // per * per, -(-first // per) * per
        raise ShardcError(
            f"cluster {text!r}: {first} devices do not fill nodes of {per}; use {lo}x{name} or {hi}x{name}, "
            f"or say the node size as NODESxPER_NODEx{name}, e.g. " + _factorings(first, name, per))
    if nodes < 1 or per_node < 1:
        raise ShardcError(f"cluster {text!r} has no devices; write e.g. {_EXAMPLES}")
    return make_cluster(name, nodes, per_node)


def _factorings(n: int, name: str, per: int) -> str:
    pairs = [f"{n // d}x{d}x{name}" for d in range(min(per, n), 0, -1) if n % d == 0]
    return ", ".join(pairs[:3])


def with_overrides(cluster: Cluster, *, memory_bytes: int | None = None, intra: LinkSpec | None = None,
                   inter: LinkSpec | None = None, memory_limit_bytes: int | None = None) -> Cluster:
    """A copy of `cluster` with a different device memory, usable memory limit (replacing the
    headroom: `--memory-limit`) or links (for what-if estimates)."""
    device = cluster.device if memory_bytes is None else replace(cluster.device, memory_bytes=memory_bytes)
    if memory_limit_bytes is not None:
        device = replace(device, memory_limit_bytes=memory_limit_bytes)
    return replace(cluster, device=device, intra=intra or cluster.intra, inter=inter or cluster.inter)


def with_memory_limit(cluster: Cluster, gib: float) -> Cluster:
    """`cluster` whose devices give plans `gib` GiB each (`--memory-limit`): the usable figure
    itself, the headroom no longer subtracted."""
    if not gib > 0:
        raise ShardcError(f"--memory-limit must be a positive number of GiB per device, got {gib}",
                          hint=f"e.g. --memory-limit {cluster.device.usable_memory_bytes / GiB:.0f} "
                               f"(the usable memory of {cluster.device.name})")
    return with_overrides(cluster, memory_limit_bytes=int(gib * GiB))


def format_bytes(n: float) -> str:
    """1.5 GiB, 512 MiB, ...: binary units, as memory is reported."""
    if n <= 0:
        return "0 B"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** exp:.3g} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[exp]}"


# This machine's cluster (its own module); imported here, after the types it builds on, so that
# `from shardc.hardware import local_cluster` keeps working.
from shardc.hardware.local import _default_local_procs, local_cluster, local_link  # noqa: E402, F401
