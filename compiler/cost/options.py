"""The cost model's knobs that are not part of the plan: how the runtime being priced runs
(ZeRO as FSDP2 or textbook, torch's or Megatron's or DeepSpeed's pipeline, which collective and
dtype reduce the gradients, what overlaps). Defaults are the torch backend's."""

from __future__ import annotations

from dataclasses import dataclass

from shardc.cost.lockstep import LOCKSTEP
from shardc.ir.diagnostics import ShardcError


@dataclass(frozen=True, slots=True)
class EstimateOptions:
    """Knobs of the model that are not part of the plan."""

    bucket_bytes: float = 25 * 2**20  # DDP's default bucket_cap_mb=25
    algorithm: str = "auto"  # collective algorithm: auto, ring, tree, hierarchical
    # How ZeRO runs: "fsdp2" as the torch backend does (fully_shard on the whole module: every
    # stage shards parameters, gradients and optimizer state at rest, one all-gather before
    # forward, one reduce-scatter after backward), or "zero" (textbook ZeRO-1/2/3).
    zero_runtime: str = "fsdp2"
    # Pipeline runtime: "torch" (torch.distributed.pipelining: its receive buffers, see `peak`),
    # "none" (Megatron's schedules, no such buffers) or "deepspeed" (DeepSpeed's PipelineEngine:
    # no torch buffers, its TrainSchedule with blocking exchanges, `lockstep`).
    pipeline_runtime: str = "torch"
    # An activation replicated over tp crosses to the next pipeline stage as 1/tp pieces, one per
    # tp rank, all-gathered over tp on arrival (Megatron-LM's scatter/gather optimisation,
    # DeepSpeed's partitioned pipe buffers); False: every tp rank sends the whole tensor (torch).
    pipeline_scatter_gather: bool = False
    # The collective ZeRO-1/2 reduce the gradients with: "reduce_scatter" (textbook: each rank
    # receives the sum of its shard) or "all_reduce" (DeepSpeed's BF16_Optimizer: every rank sums
    # all the fp32 gradients, then updates its shard and all-gathers the weights).
    zero_gradient_collective: str = "reduce_scatter"
    # After every micro-batch's backward the runtime adds each compute-dtype gradient into an fp32
    # copy in a pass of its own (DeepSpeed's BF16_Optimizer under its pipeline engine,
    # `update_hp_grads`): per local parameter the gradient read, an fp32 temporary written and
    # read, the fp32 accumulator read and written (`FP32_ACCUMULATE_BYTES` + the compute dtype's),
    # at memory bandwidth, in that backward.
    fp32_grad_accumulation: bool = False
    # The dtype gradients are reduced in: "fp32" as the torch backend runs mixed precision (fp32
    # gradients on the fp32 master weights; Megatron-LM's default for bf16), or "compute"
    # (Megatron-LM's fp16 default, accumulate_allreduce_grads_in_fp32=False: reduced in fp16).
    gradient_reduce: str = "fp32"
    # Tensor-parallel collectives overlapped with the GEMMs beside them (Transformer Engine's
    # userbuffers, NeMo/Megatron-Core `ub_tp_comm_overlap`): a layer's tp_comm is hidden behind
    # its compute in the same pass, only what outlasts it is exposed (`overlapped_tp`).
    tp_comm_overlap: bool = False
    # Data-parallel gradient reduction launched bucket by bucket during the last backward (torch
    # DDP, Megatron-Core's overlap_grad_reduce), or only once backward is over (False: Megatron-LM's
    # 2021 local DDP, DeepSpeed's pipeline engine `ReduceGrads`): then wholly exposed.
    overlap_grad_reduce: bool = True
    # Textbook ZeRO-3 layers run as FSDP2 units (torchtitan's fully_shard per block): each
    # weight gather and gradient reduce-scatter also copies into and out of FSDP2's flat
    # buffers (`sync.fsdp_copy_time`), on the compute's critical path.
    fsdp_copies: bool = False
    # How an MoE layer's tokens reach experts split over ep and tp (expert tensor parallelism):
    # "replicated" as the torch backend runs it (every tp rank holds the tp group's tokens and
    # dispatches all of them over ep), or "megatron" (Megatron-Core's alltoall dispatcher: each tp
    # rank dispatches its own tokens over ep, then the received rows are all-gathered over tp;
    # the combine reduce-scatters them over tp, then all-to-alls back: `shardc.cost.moe`).
    expert_dispatch: str = "replicated"

    def __post_init__(self) -> None:
        if self.zero_runtime not in ("fsdp2", "zero"):
            raise ShardcError(f"zero_runtime={self.zero_runtime!r}: use fsdp2 (the torch backend) or zero")
        if self.pipeline_runtime not in ("torch", "none", LOCKSTEP):
            raise ShardcError(f"pipeline_runtime={self.pipeline_runtime!r}: use torch, none or {LOCKSTEP}")
        if self.zero_gradient_collective not in ("reduce_scatter", "all_reduce"):
            raise ShardcError(f"zero_gradient_collective={self.zero_gradient_collective!r}: use reduce_scatter "
                              "(textbook ZeRO) or all_reduce (DeepSpeed's BF16_Optimizer)")
        if self.expert_dispatch not in ("replicated", "megatron"):
            raise ShardcError(f"expert_dispatch={self.expert_dispatch!r}: use replicated (the torch backend) or "
                              "megatron (Megatron-Core's alltoall dispatcher)")
        if self.gradient_reduce not in ("fp32", "compute"):
            raise ShardcError(f"gradient_reduce={self.gradient_reduce!r}: use fp32 (the torch backend) or compute")
