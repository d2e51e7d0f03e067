"""Gradient synchronisation and the optimizer step, per pipeline device.

Rules:
- A parameter's gradient must be summed over every mesh axis on which it is `Partial`
  (see `layer_params`). Over the data-parallel axes (dp, cp) that is the DP sync: all_reduce,
  or reduce_scatter when ZeRO shards the optimizer. It runs in buckets as torch DDP forms them
  (`ddp_buckets`): whole parameters in the order backward produces their gradients (last layer
  first, a layer's parameters in reverse registration order), a bucket closing once it holds
  at least its cap, the first bucket's cap 1 MiB when DDP's default 25 MiB is used (else the
  cap itself). Each bucket is launched when its last gradient is ready during the step's final
  backward and the buckets are serialised on the link. Only what outlasts that backward
  (`tail`) is exposed. Other axes (tp, for sequence-
  parallel norm weights) are all-reduced after backward, exposed.
- Gradients of model chunks that finished earlier (interleaved schedules) are ready when the
  final backward starts. Pipelines (pp > 1) sync the same way: torch's pipeline stage drives
  a DDP module per stage, whose reducer is armed only for that stage's last micro-batch and
  all-reduces its buckets while that backward runs.
- After the optimizer, ZeRO-1/2 all-gather the updated weights (exposed). As the torch backend
  runs ZeRO (`zero_runtime="fsdp2"`: FSDP2 on the whole module) the weights are all-gathered
  once before forward and every gradient reduce-scattered once after backward, both exposed
  (in a pipeline, after the stage's last micro-batch, as torch's stage drives FSDP2). The
  optimizer step
  reads and writes 28 bytes per local parameter at memory bandwidth (host when offloaded,
  plus moving gradients down and weights up over PCIe).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardc.cost.comm import collective_time
from shardc.cost.pipeline import PipelineTimes
from shardc.plan import ParallelPlan

ADAM_BYTES_PER_PARAM = 28
DDP_DEFAULT_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb=25
DDP_FIRST_BUCKET_BYTES = 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True, slots=True)
class DeviceSync:
    """One pipeline device: exposed sync after backward, post-optimizer gather, optimizer time."""

    tail: float
    gather: float
    optimizer: float
    params: tuple[tuple[float, int], ...]  # (local elements, ZeRO stage) per parameter
    grad_bytes: float  # gradient bytes synchronised over the data-parallel group per step
    comm_bytes: float  # bytes this device sends for that sync (ring volume)

    @property
    def after(self) -> float:
        return self.gather + self.optimizer


def first_bucket_bytes(bucket_bytes: float) -> float:
    """DDP's cap on its first bucket: 1 MiB with the default bucket size (torch passes
    `bucket_cap_mb=None`), else the bucket size itself (torch 2.13 `BucketCapacityConfig`)."""
    return min(DDP_FIRST_BUCKET_BYTES, bucket_bytes) if bucket_bytes == DDP_DEFAULT_BUCKET_BYTES else bucket_bytes


def ddp_buckets(ready: Sequence[tuple[float, float]], bucket_bytes: float) -> list[tuple[float, float]]:
    """(ready time, bytes) per bucket as DDP's reducer rebuilds them after the first step: the
    gradients in `ready` order, never split, a bucket closing once it holds >= its cap (the
    first bucket's cap is `first_bucket_bytes`), the last bucket holding what is left."""
    out: list[tuple[float, float]] = []
    cap = first_bucket_bytes(bucket_bytes)
    fill, fill_ready = 0.0, 0.0
    for t, nbytes in ready:
        if nbytes <= 0:
            continue
        fill, fill_ready = fill + nbytes, max(fill_ready, t)
        if fill >= cap:
            out.append((fill_ready, fill))
            fill, cap = 0.0, bucket_bytes
    if fill > 0:
        out.append((fill_ready, fill))
    return out


def bucket_tail(ready: Sequence[tuple[float, float]], window: float, levels, kind: str, bucket_bytes: float,
                algorithm: str = "auto") -> float:
    """Exposed seconds of bucketed gradient sync. `ready`: (time a parameter's gradient is ready
    within the last backward of length `window`, its bytes), in backward order; buckets per
    `ddp_buckets`, each launched when ready and after the previous one, one at a time."""
    finish = 0.0
    for t, nbytes in ddp_buckets(ready, bucket_bytes):
        finish = max(finish, t) + collective_time(kind, nbytes, levels, algorithm)
    return max(0.0, finish - window)


def gradient_sync(ctx, layers, plan: ParallelPlan, options, zero_axes: tuple[str, ...], shard: int,
                  pipe: PipelineTimes, stage_bwd: Sequence[float], g_elem: int, w_elem: int) -> list[DeviceSync]:
    """A `DeviceSync` per pipeline device (see module rules). `ctx`: a `CostContext` or a
    `compose.Links` (link levels, algorithm, device)."""
    p = plan.pp
    out: list[DeviceSync] = []
    levels = ctx.levels(zero_axes)
    device = ctx.device
    position = {id(l): i for i, l in enumerate(layers)}
    by_device: list[list] = [[] for _ in range(p)]
    for layer in layers:
        by_device[layer.stage % p].append(layer)
    for d in range(p):
        mine = by_device[d]
        last_stage = d  # the final backward on device d is its first model chunk's
        seen: set[str] = set()
        params: list[tuple[float, int]] = []
        ready: list[tuple[float, float]] = []
        other: dict[tuple[str, ...], float] = {}
        window = pipe.last_backward[d]
        total_b = max(stage_bwd[last_stage], 1e-30)
        t = 0.0
        for layer in sorted(mine, key=lambda l: (l.stage != last_stage, -position[id(l)])):
            if layer.stage == last_stage:
                t += layer.cost.bwd_s * window / total_b
            at = t if layer.stage == last_stage else 0.0
            for name, (numel, axes) in reversed(layer.params.items()):  # backward: last registered first
                if name in seen:
                    continue
                seen.add(name)
                params.append((numel, layer.annotation.zero))
                if axes & set(zero_axes):
                    ready.append((at, numel * g_elem))
                rest = tuple(sorted(axes - set(zero_axes)))
                if rest:
                    other[rest] = other.get(rest, 0.0) + numel * g_elem
        zero = max((l.annotation.zero for l in mine), default=0)
        kind = "reduce_scatter" if zero >= 1 else "all_reduce"
        fsdp = options.zero_runtime == "fsdp2" and zero >= 1 and shard > 1
        if shard <= 1:
            tail = 0.0
        elif fsdp:  # one collective over every gradient once backward is over
            tail = collective_time(kind, sum(b for _, b in ready), levels, ctx.algorithm)
        else:
            tail = bucket_tail(ready, window, levels, kind, options.bucket_bytes, ctx.algorithm)
        tail += sum(collective_time("all_reduce", b, ctx.levels(axes), ctx.algorithm) for axes, b in other.items())
        grad_bytes = sum(b for _, b in ready)
        local = sum(n for n, _ in params)
        gather = 0.0
        if fsdp or (shard > 1 and zero in (1, 2)):  # FSDP2: before forward; ZeRO-1/2: after the optimizer
            gather = collective_time("all_gather", local * w_elem, levels, ctx.algorithm)
        opt_params = sum(n / (shard if z >= 1 else 1) for n, z in params)
        if plan.offload:
            optimizer = (opt_params * (g_elem + w_elem) / device.host_bandwidth
                         + opt_params * ADAM_BYTES_PER_PARAM / options.host_optimizer_bandwidth)
        else:
            optimizer = opt_params * ADAM_BYTES_PER_PARAM / device.memory_bandwidth
        factor = (2 if kind == "all_reduce" else 1) * (shard - 1) / shard if shard > 1 else 0.0
        out.append(DeviceSync(tail, gather, optimizer, tuple(params), grad_bytes, grad_bytes * factor))
    return out
