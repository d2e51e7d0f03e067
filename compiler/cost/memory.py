"""Memory per device: model states by dtype and ZeRO stage, activations in flight, buffers.

Rules:
- Model states as the torch backend holds them (`backends/torch/precision.py`). fp32: 4 bytes
  of weights + 4 of gradients + 8 of Adam state (momentum, variance) per parameter. Mixed
  precision (bf16/fp16), Megatron's 18: the fp32 master weights (4) and their compute-dtype
  copies (2: cast where read, saved by the matmuls from forward to backward; the memory tracker
  files them as `parameters` too) + fp32 gradients (4: autograd through the cast; DDP reduces
  fp32) + Adam state (8), the copy counted once per parameter (as Megatron holds its bf16
  weights): the torch backend shares one copy among all the micro-batches in flight
  (`precision.weight_copy`). A layer that recomputes in full holds its copies only while it runs
  (`peak.recompute_copies` takes them off here and adds them to that layer's working memory;
  the solver likewise: `search.linear.recompute_copy_bytes`). Under FSDP2 the copies are FSDP2's
  unsharded compute-dtype parameters (`peak`), so there the weights are the master weights alone
  (`model_state_bytes(copies=False)`).
  ZeRO-1 divides the optimizer state by the sharding degree (the data-parallel group),
  ZeRO-2 the gradients too, ZeRO-3 the weights too. Textbook ZeRO (`zero_runtime="zero"`:
  Megatron-Core's distributed optimizer, DeepSpeed) counts the fp32 master weights in the
  optimizer state ZeRO-1 shards (12 bytes), holds gradients in the dtype it reduces them in
  (`gradient_reduce`), and shards an MoE model's dense weights over the ranks replicating them,
  the expert axis included (`sync.zero_width`).
- Bytes on the wire: gradient sync in fp32 (`gradient_bytes`), weight gathers (ZeRO-3, FSDP2)
  and every activation, tensor- and context-parallel collective in the compute dtype
  (`compute_bytes`).
- Activations: the bytes a micro-batch saves on a stage times the micro-batches in flight
  there at the peak (the one in progress by its timeline, `timeline` and `peak`): GPipe holds all m; 1F1B holds p - i on stage i (at most m); interleaved
  1F1B holds (p - i - 1) * 2 + (v - 1) * p + 1 model chunks' worth on device i (Megatron's
  warm-up count plus the one in progress), at most m * v.
- Working: the largest transient allocation of one node while it runs (its outputs; a loss's
  fp32 probabilities and their gradient), divided by its temporal chunks (`compute.working_bytes`).
- Buffers: DDP's gradient buckets (one flat copy of every gradient it syncs), textbook ZeRO's
  reduce-scatter buckets (two in flight) and ZeRO-3's all-gathered weights of the largest
  layer twice (the current one and the prefetched next); FSDP2 and pipeline buffers: `peak`.
"""

from __future__ import annotations

from shardc.cost.pipeline import ZB_SCHEDULES, in_flight_order
from shardc.ir.dtypes import precision

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "recompute_working", "working",
                     "buffers")


MASTER_BYTES = 4  # fp32 master weights, whatever the compute dtype
GRADIENT_BYTES = 4  # fp32 gradients on the master weights
ADAM_STATE_BYTES = 8  # fp32 momentum and variance


def mixed(dtype: str) -> bool:
    """Whether plan dtype `dtype` trains in mixed precision (bf16 or fp16 compute, fp32 master weights)."""
    return precision(dtype) in ("bf16", "fp16")


def compute_bytes(dtype: str) -> int:
    """Bytes of one element in the compute dtype: activations, gathered weights, tp/cp collectives."""
    return 2 if mixed(dtype) else 4


def weight_copy_bytes(dtype: str) -> int:
    """Bytes per parameter of its compute-dtype copy (0 in fp32: the weights are read as they are)."""
    return compute_bytes(dtype) if mixed(dtype) else 0


def state_bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per parameter for plan dtype `dtype`: (4 + 2,
    4, 8) in mixed precision (master weights and their compute copies), (4, 4, 8) in fp32."""
    return MASTER_BYTES + weight_copy_bytes(dtype), GRADIENT_BYTES, ADAM_STATE_BYTES


def model_state_bytes(params: float, dtype: str, zero: int, shard: int, copies: bool = True,
                      textbook: bool = False, gradient_bytes: int = GRADIENT_BYTES) -> dict[str, float]:
    """Weights, gradients and optimizer bytes on one device holding `params` local parameters,
    with ZeRO stage `zero` sharding over `shard` data-parallel ranks; `copies`: whether the
    weights' compute-dtype copies are held from forward to backward (module rules).
    `textbook`: ZeRO as Rajbhandari et al. define it and Megatron-Core's distributed optimizer
    and DeepSpeed run it, whose ZeRO-1 optimizer state is the fp32 master weights with Adam's
    (12 bytes in mixed precision), filed under `optimizer`; the torch backend's FSDP2 keeps
    them apart. `gradient_bytes`: per gradient element as the runtime holds it (4: fp32; the
    compute dtype's where it reduces in it, `EstimateOptions.gradient_reduce="compute"`)."""
    w, _, o = state_bytes_per_param(dtype)
    if not copies:
        w -= weight_copy_bytes(dtype)
    master = MASTER_BYTES if textbook and mixed(dtype) and 1 <= zero < 3 else 0
    shard = max(1, shard)
    return {
        "parameters": params * (w - master) / (shard if zero >= 3 else 1),
        "gradients": params * gradient_bytes / (shard if zero >= 2 else 1),
        "optimizer": params * (o + master) / (shard if zero >= 1 else 1),
    }


def in_flight(schedule: str, stages: int, device: int, micro_batches: int, virtual: int = 1) -> int:
    """Micro-batches (model chunks for interleaved) whose activations device `device` holds at its peak."""
    p, m, v = stages, micro_batches, virtual
    if p <= 1:
        return 1
    if schedule == "gpipe":
        return m
    if schedule in ZB_SCHEDULES:  # torch's order: chunks from forward to weight gradient
        return in_flight_order(schedule, p, device, m, v)
    if schedule == "interleaved" and v > 1:
        return min((p - device - 1) * 2 + (v - 1) * (m // max(1, m // p)) + 1, m * v)  # torch's rounds of m
    return min(p - device, m)


def buffer_bytes(grad_bytes: float, bucket_bytes: float, dp: int, zero: int, largest_layer_param_bytes: float) -> float:
    """Communication buffers of the data-parallel sync, `grad_bytes` the gradients it reduces.

    DDP (zero=0) allocates its buckets once for all gradients: one flat copy of them, whatever
    the bucket size. Textbook ZeRO reduce-scatters through two buckets in flight, and ZeRO-3
    holds the largest layer's gathered weights twice (the current and the prefetched one)."""
    if dp <= 1:
        return 0.0
    if zero == 0:
        return grad_bytes
    out = 2 * min(bucket_bytes, grad_bytes)
    if zero >= 3:
        out += 2 * largest_layer_param_bytes
    return out
