"""Memory per device: model states by dtype and ZeRO stage, activations in flight, buffers.

Rules:
- Mixed precision (bf16/fp16): 2 bytes of weights + 2 of gradients + 12 of optimizer state
  (fp32 master weights, Adam momentum and variance) per parameter; fp32: 4 + 4 + 8.
  ZeRO-1 divides the optimizer state by the sharding degree (the data-parallel group),
  ZeRO-2 the gradients too, ZeRO-3 the weights too.
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

from shardc.ir.dtypes import precision

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "recompute_working", "working",
                     "buffers")


def state_bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per parameter for plan dtype `dtype`."""
    if precision(dtype) in ("bf16", "fp16"):
        return 2, 2, 12
    return 4, 4, 8


def model_state_bytes(params: float, dtype: str, zero: int, shard: int) -> dict[str, float]:
    """Weights, gradients and optimizer bytes on one device holding `params` local parameters,
    with ZeRO stage `zero` sharding over `shard` data-parallel ranks."""
    w, g, o = state_bytes_per_param(dtype)
    shard = max(1, shard)
    return {
        "parameters": params * w / (shard if zero >= 3 else 1),
        "gradients": params * g / (shard if zero >= 2 else 1),
        "optimizer": params * o / (shard if zero >= 1 else 1),
    }


def in_flight(schedule: str, stages: int, device: int, micro_batches: int, virtual: int = 1) -> int:
    """Micro-batches (model chunks for interleaved) whose activations device `device` holds at its peak."""
    p, m, v = stages, micro_batches, virtual
    if p <= 1:
        return 1
    if schedule == "gpipe":
        return m
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
