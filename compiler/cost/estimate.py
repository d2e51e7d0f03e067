"""The result of `estimate`: step time, throughput, MFU, and per-stage time and memory breakdowns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from shardc.hardware import Cluster, format_bytes
from shardc.ir import Graph
from shardc.plan.parallel import ParallelPlan

TIME_CATEGORIES = ("compute_fwd", "compute_bwd", "recompute", "tp_comm", "cp_comm", "pp_comm", "dp_comm",
                   "bubble", "optimizer", "ep_comm")
MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "recompute_working", "working",
                     "buffers", "model_buffers")


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """One pipeline device class (every device of pipeline rank `stage` looks alike).

    `time` maps TIME_CATEGORIES to seconds per step (they sum to the step time); `memory`
    maps MEMORY_CATEGORIES to bytes at the peak.
    """

    stage: int
    layers: tuple[str, ...]
    time: dict[str, float]
    memory: dict[str, float]
    in_flight: int
    activation_bytes_per_microbatch: float
    dp_grad_bytes: float
    dp_comm_bytes: float
    # Where the ranks of this pipeline device differ (causal ring attention: `ring.causal_ring_saved`):
    # (mesh axis, peak bytes per coordinate along it); `memory` is the largest of them.
    memory_by_coordinate: tuple[str, tuple[float, ...]] | None = None
    # The data-parallel collectives one step runs on this device, where the model counts them
    # (FSDP2: `cost.fsdp.step_collectives`): (kind, count per step, bytes of each).
    dp_collectives: tuple[tuple[str, int, float], ...] = ()
    # The model-axis collectives per step (`sync.model_axis_collectives`): (phase, kind, axis, bytes, calls)
    collectives: tuple[tuple[str, str, str, float, int], ...] = ()
    # Of the parameters, gradients and optimizer states at rest, the expert weights' (an MoE
    # model's `experts` ops; split over ep where the plan splits the experts)
    expert_state_bytes: float = 0.0

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    def rank_memory_bytes(self, coordinates: dict[str, int]) -> float:
        """The peak bytes of the rank at mesh `coordinates` (`memory_by_coordinate`, else `memory_bytes`)."""
        if self.memory_by_coordinate is None:
            return self.memory_bytes
        axis, figures = self.memory_by_coordinate
        return figures[min(coordinates.get(axis, len(figures) - 1), len(figures) - 1)]


@dataclass(frozen=True)
class Estimate:
    """Predicted training step of one plan on one cluster (see `shardc.cost.model.estimate`)."""

    plan: str
    cluster: str
    devices: int
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    tflops_per_device: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    micro_batches: int
    global_batch: int
    sequence: int
    bubble_fraction: float
    stages: tuple[StageEstimate, ...]
    memory_capacity_bytes: float
    layer_table: tuple[dict[str, Any], ...] = field(default=())
    notes: tuple[str, ...] = field(default=())
    # What the peak must fit in: the capacity less the device's headroom, or --memory-limit
    # (`DeviceSpec.usable_memory_bytes`); 0: the capacity. `memory_headroom` says which.
    memory_usable_bytes: float = 0.0
    memory_headroom: str = ""
    # What the pipeline simulation ran on (`compose.PipelineInputs`): the timeline plot redraws it.
    pipeline: Any = None

    @property
    def memory_per_device_bytes(self) -> float:
        """The largest per-device peak over stages."""
        return max(s.memory_bytes for s in self.stages)

    @property
    def peak_stage(self) -> StageEstimate:
        return max(self.stages, key=lambda s: s.memory_bytes)

    @property
    def memory_limit_bytes(self) -> float:
        """The usable memory per device the peak is compared against."""
        return self.memory_usable_bytes or self.memory_capacity_bytes

    @property
    def fits(self) -> bool:
        return self.memory_per_device_bytes <= self.memory_limit_bytes

    @property
    def overflow(self) -> str | None:
        """Which stage and category overflow device memory, or None when the plan fits."""
        if self.fits:
            return None
        s = self.peak_stage
        category = max(s.memory, key=lambda k: s.memory[k])
        return (f"stage {s.stage} (pipeline rank {s.stage}) needs {format_bytes(s.memory_bytes)} of "
                f"{format_bytes(self.memory_limit_bytes)} usable; largest category: {category} "
                f"({format_bytes(s.memory[category])})")

    @property
    def memory_breakdown(self) -> dict[str, float]:
        """The peak stage's memory by category."""
        return dict(self.peak_stage.memory)

    def time_breakdown(self) -> dict[str, float]:
        """Seconds by category on the critical (slowest-busy) stage."""
        s = min(self.stages, key=lambda x: x.time.get("bubble", 0.0))
        return dict(s.time)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan, "cluster": self.cluster, "devices": self.devices,
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "hfu": self.hfu, "tflops_per_device": self.tflops_per_device,
            "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "micro_batches": self.micro_batches, "global_batch": self.global_batch,
            "bubble_fraction": self.bubble_fraction,
            "memory_per_device_bytes": self.memory_per_device_bytes,
            "memory_capacity_bytes": self.memory_capacity_bytes, "memory_usable_bytes": self.memory_limit_bytes,
            "memory_headroom": self.memory_headroom,
            "memory_breakdown": self.memory_breakdown, "time_breakdown": self.time_breakdown(),
            "fits": self.fits, "overflow": self.overflow,
            "stages": [{"stage": s.stage, "layers": list(s.layers), "time": s.time, "memory": s.memory,
                        "memory_bytes": s.memory_bytes, "in_flight_microbatches": s.in_flight,
                        "dp_grad_bytes": s.dp_grad_bytes, "expert_state_bytes": s.expert_state_bytes,
                        "dp_collectives": [{"kind": k, "count": n, "bytes": b} for k, n, b in s.dp_collectives],
                        "collectives": [list(c) for c in s.collectives]}
                       for s in self.stages],
            "notes": list(self.notes),
        }

    @classmethod
    def build(cls, graph: Graph, cluster: Cluster, plan: ParallelPlan, layers, stages, step: float, m: int,
              gbs: int, seq: int, bubble: float, capacity: float, ctx, pipeline: Any = None) -> Estimate:
        # Each layer's matmul FLOPs cover `sequences` sequences; a step processes `gbs`.
        sequences = ctx.batch_scale * (graph.inputs[0].type.shape[0] if graph.inputs and graph.inputs[0].type.shape
                                       else 1)
        per_step = gbs / sequences
        model = 3 * per_step * sum(l.cost.matmul_flops for l in layers)
        hardware = model + per_step * sum(l.cost.recompute_matmul_flops for l in layers)
        devices = plan.devices
        peak = cluster.device.peak(plan.dtype)
        table = tuple({"layer": l.name, "block": l.block, "stage": l.stage,
                       "recompute": l.annotation.recompute, "fwd_s": l.cost.fwd_s, "bwd_s": l.cost.bwd_s,
                       "saved_bytes": l.cost.saved_bytes} for l in layers)
        notes = tuple(plan.notes(global_batch=gbs))
        return cls(str(plan), str(cluster), devices, step, gbs * seq / step, model / (step * devices * peak),
                   hardware / (step * devices * peak), hardware / (step * devices) / 1e12, model, hardware,
                   m, gbs, seq, bubble, tuple(stages), float(capacity), table, notes,
                   float(cluster.device.usable_memory_bytes), cluster.device.describe_headroom(), pipeline)
