"""Gradient synchronisation and the optimizer step, per pipeline device.

Rules:
- Gradients are fp32 (on the fp32 master weights, whatever the compute dtype: `memory`), so
  `g_elem` is 4; weight gathers move the compute dtype (`w_elem`, 2 under bf16/fp16).
- A parameter's gradient must be summed over every mesh axis on which it is `Partial`
  (see `edges.layer_params`). Over the data-parallel axes (dp, cp) that is the DP sync: all_reduce,
  or reduce_scatter when ZeRO shards the optimizer. It runs in buckets as torch DDP forms them
  (`ddp_buckets`): whole parameters in the order backward produces their gradients (last layer
  first, a layer's parameters in reverse registration order), a bucket closing once it holds
  at least its cap, the first bucket's cap 1 MiB when DDP's default 25 MiB is used (else the
  cap itself). Each bucket is launched when its last gradient is ready during the step's final
  backward and the buckets are serialised on the link. Only what outlasts that backward
  (`tail`) is exposed; a runtime that reduces only once backward is over
  (`EstimateOptions.overlap_grad_reduce=False`) exposes one collective over them all. Other axes (tp, for sequence-
  parallel norm weights, and every weight replicated over a tp that splits the batch) are
  all-reduced after backward, exposed: per axis group all of the device's such gradients end to
  end, in all_reduces of `SUM_BUCKET_BYTES`, as the torch backend runs it (`backends/torch/gradsum.py`).
- Gradients of model chunks that finished earlier (interleaved schedules) are ready when the
  final backward starts. Pipelines (pp > 1) sync the same way: torch's pipeline stage drives
  a DDP module per stage, whose reducer is armed only for that stage's last micro-batch and
  all-reduces its buckets while that backward runs.
- Textbook ZeRO-3 (`zero_runtime="zero"`) reduce-scatters each layer's gradients as that
  layer's backward ends, every micro-batch, on the link that gathers the next layer's weights:
  priced per layer with the gathers (`compose.zero3_exposed`), not in buckets here.
- ZeRO-1/2 reduce-scatter the gradients, or all-reduce them all where the runtime does so before
  updating its shard (`EstimateOptions.zero_gradient_collective="all_reduce"`: DeepSpeed's
  BF16_Optimizer, `_bf16_reduce_grads`). After the optimizer, ZeRO-1/2 all-gather the updated
  weights (exposed). As the torch backend runs ZeRO (`zero_runtime="fsdp2"`: FSDP2 on the whole
  module) each stage module a device holds is its own FSDP2 unit (`fsdp_units`: interleaved
  schedules hold `vpp`), with its own gathers,
  one reduce-scatter after its last backward (exposed) and its own measured step. Which ops
  all-gather is `fsdp.gather_ops`'s walk of the unit's forwards and backwards (ZeRO-1/2: the
  first forward only; ZeRO-3: m + 1 per step), and `DeviceSync.collectives` lists what one step
  sends (`fsdp.step_collectives`). Without a pipeline every gather is exposed here; in a pipeline
  only each unit's first, the later ones (ZeRO-3) block the schedule's ops and are priced in the
  pipeline simulation (`fsdp.pipeline_gathers`). Each gather also copies the local shard into
  the flat buffer and the gathered buffer out to the parameters, and the reduce-scatter copies
  the gradients in and the shard out, at the device's copy bandwidth (`fsdp_copy_time`). Where
  FSDP2's work per micro-batch was measured (the local profile), that figure, per parameter
  tensor and element, replaces the copies of the forward gathers (`fsdp_forward_work`). The
  optimizer step reads and writes 28 bytes per local parameter at memory bandwidth.
- Where a whole synchronising step was measured for the wrapper and the data-parallel group
  size (the local profile: wall time with the processes sharing the cores,
  `EagerCosts.sync_step`), that figure prices the sync (`measured_sync_step`): under FSDP2 the
  step's first gather, its micro-batch work and the reduce-scatter with their copies and waits
  (further gathers come on top as above); under DDP its hooks, buckets and
  all-reduces, exposed after the last backward, nothing overlapped: it is used only where the
  local processes outnumber the machine's cores (`hardware.local_cluster`), so no core is idle
  to overlap the sync on, and the figure was measured exposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardc.analysis.stages import stage_device
from shardc.cost.comm import collective_time
from shardc.cost.fsdp import (  # noqa: F401  (fsdp_gathers, fsdp_microbatch_time: importable from here too)
    fsdp_copy_time,
    fsdp_forward_work,
    fsdp_gathers,
    fsdp_microbatch_time,
    fsdp_units,
    gathers_by_phase,
    runtime_order,
    runtime_window,
    step_collectives,
)
from shardc.cost.pipeline import PipelineTimes
from shardc.ir import Axis
from shardc.plan.parallel import ParallelPlan

ADAM_BYTES_PER_PARAM = 28
DDP_DEFAULT_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb=25
DDP_FIRST_BUCKET_BYTES = 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
SUM_BUCKET_BYTES = DDP_DEFAULT_BUCKET_BYTES  # the runtime's model-axis gradient sums (`backends/torch/gradsum.py`)


@dataclass(frozen=True, slots=True)
class DeviceSync:
    """One pipeline device: exposed sync after backward, post-optimizer gather, optimizer time."""

    tail: float
    gather: float
    optimizer: float
    params: tuple[tuple[float, int], ...]  # (local elements, ZeRO stage) per parameter
    grad_bytes: float  # gradient bytes synchronised over the data-parallel group per step
    comm_bytes: float  # bytes this device sends for that sync (ring volume)
    # FSDP2's collectives per step (`fsdp.step_collectives`: kind, count, bytes each); empty otherwise
    collectives: tuple[tuple[str, int, float], ...] = ()
    # Gradient bytes summed over model axes once per step, per axis group (the runtime's `gradsum`)
    summed: tuple[tuple[tuple[str, ...], float], ...] = ()
    # Per parameter (as `params`), how many times wider than the data-parallel group ZeRO shards
    # it (`zero_width`); empty: every one over the data-parallel group
    widths: tuple[int, ...] = ()
    # Per parameter (as `params`), whether it is an expert weight (read by an `experts` op as one)
    experts: tuple[bool, ...] = ()

    def shards(self, shard: int) -> list[int]:
        """Per parameter, the ranks ZeRO shards it over (`shard`: the data-parallel group's size)."""
        return [shard * w for w in self.widths] if self.widths else [shard] * len(self.params)

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


def measured_sync_step(device, wrapper: str, tensors: float, elements: float, shard: int) -> float | None:
    """Seconds a whole synchronising step under `wrapper` ("fsdp2" or "ddp") adds on a device
    where it was measured for groups of `shard` (module rules; None elsewhere), for `tensors`
    parameter tensors of `elements` in all."""
    eager = device.eager
    return eager.sync_step_time(wrapper, shard, tensors, elements) if eager is not None and shard > 1 else None


def _sum_or_none(values: Sequence[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def zero_width(ctx, options, axes: frozenset[str]) -> int:
    """How many times wider than the data-parallel group textbook ZeRO (`zero_runtime="zero"`:
    Megatron-Core's distributed optimizer, DeepSpeed) shards a parameter whose gradient is summed
    over `axes`: a weight replicated over the expert axis (an MoE model's dense weights) is sharded
    over the ranks that replicate it, ep included (Megatron's data-parallel group with ep inside);
    an expert weight (split over ep) over the data-parallel group only (its expert-data-parallel
    group). 1 under the torch backend's FSDP2, which shards over the data axes only."""
    mesh = ctx.mesh
    if options.zero_runtime != "zero" or mesh is None or Axis.EP not in axes or Axis.EP not in mesh.names:
        return 1
    return mesh.degree(Axis.EP)


def gradient_sync(ctx, layers, plan: ParallelPlan, options, zero_axes: tuple[str, ...], shard: int,
                  pipe: PipelineTimes, stage_bwd: Sequence[float], g_elem: int, w_elem: int,
                  microbatches: int = 1) -> list[DeviceSync]:
    """A `DeviceSync` per pipeline device (see module rules). `ctx`: a `CostContext` or a
    `compose.Links` (link levels, algorithm, device); `microbatches` per step."""
    p = plan.pp
    out: list[DeviceSync] = []
    levels = ctx.levels(zero_axes)
    device = ctx.device
    def per_layer(layer) -> bool:  # textbook ZeRO-3 (`compose.zero3_reduces_per_layer`)
        return options.zero_runtime == "zero" and layer.annotation.zero >= 3 and shard > 1

    by_device: list[list] = [[] for _ in range(p)]
    for layer in layers:
        by_device[stage_device(layer.stage, p, plan.schedule)].append(layer)
    for d in range(p):
        mine = by_device[d]
        last_stage = d  # the final backward on device d is its first model chunk's
        seen: set[str] = set()
        params: list[tuple[float, int]] = []
        experts: list[bool] = []
        widths: list[int] = []
        unit_of: list[int] = []  # per parameter, the stage module (FSDP2 unit) that holds it
        ready: list[tuple[float, float]] = []
        other: dict[tuple[str, ...], float] = {}
        reduced = 0.0
        window = pipe.last_backward[d]
        total_b = max(stage_bwd[last_stage], 1e-30)
        t = 0.0
        # The last stage's layers first, each chunk's in reverse (backward) order: a stable sort of the reversed list.
        for layer in sorted(reversed(mine), key=lambda l: l.stage != last_stage):
            if layer.stage == last_stage:
                t += layer.cost.bwd_s * window / total_b
            at = t if layer.stage == last_stage else 0.0
            expert_names = expert_weights(layer)
            for name, (numel, axes) in reversed(layer.params.items()):  # backward: last registered first
                if name in seen:
                    continue
                seen.add(name)
                params.append((numel, layer.annotation.zero))
                experts.append(name.rsplit("/", 1)[-1] in expert_names)
                widths.append(zero_width(ctx, options, axes))
                unit_of.append(layer.stage)
                if axes & set(zero_axes):
                    if per_layer(layer):  # reduce-scattered in its own backward (`compose.zero3_exposed`)
                        reduced += numel * g_elem
                    else:
                        ready.append((at, numel * g_elem))
                rest = tuple(sorted(axes - set(zero_axes)))
                if rest:
                    other[rest] = other.get(rest, 0.0) + numel * g_elem
        zero = max((l.annotation.zero for l in mine), default=0)
        # ZeRO-1/2 reduce-scatter, unless the runtime all-reduces every gradient before updating its
        # shard (`EstimateOptions.zero_gradient_collective`, DeepSpeed's BF16_Optimizer).
        kind = "reduce_scatter" if zero >= 1 and options.zero_gradient_collective == "reduce_scatter" else "all_reduce"
        fsdp = options.zero_runtime == "fsdp2" and zero >= 1 and shard > 1
        local = sum(n for n, _ in params)
        units = fsdp_units(params, unit_of)
        measured = _sum_or_none([measured_sync_step(device, "fsdp2", t, n, shard) for t, n in units]) if fsdp else None
        ddp = (measured_sync_step(device, "ddp", len(ready), sum(b for _, b in ready) / g_elem, shard)
               if zero == 0 and shard > 1 and ready else None)
        if shard <= 1:
            tail = 0.0
        elif measured is not None:  # the whole step as measured: its first gather and the reduce-scatter
            tail = measured
        elif ddp is not None:  # DDP's sync as measured, exposed
            tail = ddp
        elif fsdp:  # one collective per stage module over its gradients once backward is over
            tail = sum(collective_time(kind, n * g_elem, levels, ctx.algorithm) + fsdp_copy_time(n * g_elem, shard, device)
                       for _, n in units)
        elif not options.overlap_grad_reduce:  # once backward is over, nothing to hide behind
            tail = collective_time(kind, sum(b for _, b in ready), levels, ctx.algorithm)
        else:
            tail = bucket_tail(ready, window, levels, kind, options.bucket_bytes, ctx.algorithm)
        tail += sum(collective_time("all_reduce", piece, ctx.levels(axes), ctx.algorithm)
                    for axes, b in other.items() for piece in sum_buckets(b))
        grad_bytes = sum(b for _, b in ready) + reduced
        gather = 0.0
        collectives: tuple[tuple[str, int, float], ...] = ()
        if fsdp:  # per stage module (`fsdp` module rules); a measured step holds the first forward gather
            order = runtime_order(p, d, microbatches, plan.vpp, plan.schedule)
            elements = {s: 0.0 for s in unit_of}
            for (numel, _), s in zip(params, unit_of):
                elements[s] += numel
            collectives = step_collectives(order, zero, elements, w_elem, g_elem,
                                           runtime_window(p, plan.vpp, plan.schedule))
            for s, (t, n) in zip(sorted(elements), units):
                # In a pipeline only each unit's first gather is here; ZeRO-3's later ones block the
                # schedule's ops and are priced there (`fsdp.pipeline_gathers`).
                forward, backward = gathers_by_phase(order, zero, s) if p == 1 else (1, 0)
                forward -= measured is not None
                gather += (forward + backward) * collective_time("all_gather", n * w_elem, levels, ctx.algorithm)
                gather += forward * fsdp_forward_work(device, t, n, n * w_elem, shard)
                gather += backward * fsdp_copy_time(n * w_elem, shard, device)
        elif shard > 1 and zero in (1, 2):  # ZeRO-1/2: after the optimizer
            gather = collective_time("all_gather", local * w_elem, levels, ctx.algorithm)
        opt_params = sum(n / (shard * w if z >= 1 else 1) for (n, z), w in zip(params, widths))
        optimizer = opt_params * ADAM_BYTES_PER_PARAM / device.memory_bandwidth
        factor = (2 if kind == "all_reduce" else 1) * (shard - 1) / shard if shard > 1 else 0.0
        out.append(DeviceSync(tail, gather, optimizer, tuple(params), grad_bytes, grad_bytes * factor, collectives,
                              tuple(sorted(other.items())), tuple(widths) if any(w > 1 for w in widths) else (),
                              tuple(experts) if any(experts) else ()))
    return out


def expert_weights(layer) -> frozenset[str]:
    """The names of the parameters `layer`'s `experts` ops read (`shardc.ops.moe`: the stacked
    expert weights), empty for a layer without experts."""
    return frozenset(v.name for node in getattr(layer, "nodes", ()) if node.op == "experts"
                     for v in node.inputs if v.kind == "parameter")


def model_axis_collectives(layers, microbatches: int, sync: DeviceSync) -> tuple[tuple[str, str, str, float, int], ...]:
    """The model-axis collectives one device runs per step as priced: (phase, kind, axis, bytes,
    calls per step), each layer's per-micro-batch ones (`LayerCost.collectives`) `microbatches`
    times, then the once-per-step gradient sums over model axes ("sync", "all_reduce", the axes
    joined by "x", bytes per bucket of `SUM_BUCKET_BYTES`, buckets). The data-parallel sync's
    buckets are not listed."""
    count: dict[tuple[str, str, str, float], int] = {}
    for layer in layers:
        for phase, step in (layer.cost.collectives if layer.cost is not None else ()):
            key = (phase, step.kind, step.axis, float(step.nbytes))
            count[key] = count.get(key, 0) + microbatches
    out = [(*key, n) for key, n in count.items()]
    for axes, nbytes in sync.summed:
        for size in sorted(set(sum_buckets(nbytes)), reverse=True):
            out.append(("sync", "all_reduce", "x".join(axes), size, sum_buckets(nbytes).count(size)))
    return tuple(out)


def sum_buckets(nbytes: float, bucket_bytes: int = SUM_BUCKET_BYTES) -> list[float]:
    """The all_reduce sizes the runtime sums `nbytes` of gradients over a model axis group in
    (`backends/torch/gradsum.py`): full buckets of `bucket_bytes`, then the rest."""
    full, rest = divmod(int(nbytes), bucket_bytes)
    return [float(bucket_bytes)] * full + ([float(rest)] if rest else [])
