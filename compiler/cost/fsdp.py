"""FSDP2 as the torch backend runs ZeRO: which ops all-gather, what that costs, what one step sends.

Rules (torch 2.13, `fully_shard` on each stage module, counted on gloo by `shardc run`'s
memory-tracked step; `tests/test_fsdp_counts.py` compares them with this model):
- Each stage module a device holds is one FSDP2 unit (`fsdp_units`); it starts a step sharded.
  A forward all-gathers its unit's weights unless they are unsharded already; ZeRO-3
  (`reshard_after_forward=True`) reshards after every forward, ZeRO-1/2 keep them unsharded. A
  backward (or the input-gradient pass of a split backward) gathers unless unsharded and leaves
  them unsharded: every backward but the step's last runs with `set_reshard_after_backward(False)`
  (torch's pipeline stage does so itself; `Microbatched.train_step` does so without a pipeline).
  The weight-gradient pass gathers nothing. So per unit and step, in the unit's own order of
  forwards and backwards: ZeRO-1/2 gather once (the first forward), ZeRO-3 once plus once per
  op that follows a forward: m + 1 with m micro-batches, whatever the schedule (`gather_ops`).
  Under torch's `_PipelineScheduleRuntime` (interleaved 1F1B, zero-bubble schedules) the runtime
  itself also reshards a device's units beyond the next three it will run and gathers them again
  when they come within three (`runtime_window`): with vpp > 3 even ZeRO-1/2 regather.
- Gradients are reduce-scattered once per unit and step, after its last backward (gradient sync
  off before it: `set_requires_gradient_sync(False)`), in fp32 (`reduce_dtype`); gathers move
  the compute dtype. `step_collectives` lists them with their full (unsharded) buffer bytes,
  as the runtime records them.
- Beyond the collectives, FSDP2 copies into and out of its flat buffers around each gather and
  reduce-scatter (`fsdp_copy_time`); where its work per forward-gathering micro-batch was
  measured (the local profile), that figure replaces those copies for forward gathers
  (`fsdp_forward_work`); backward gathers pay their copies.
"""

from __future__ import annotations

from collections.abc import Sequence

Op = tuple[str, int, int]  # (F | B | I | W, micro-batch, virtual stage), as `pipeline.device_order`


def runtime_order(pp: int, d: int, microbatches: int, vpp: int, schedule: str) -> list[Op]:
    """Device `d`'s ops in the order the torch backend runs them: the pipeline schedule's
    (`pipeline.device_order`), or without a pipeline each micro-batch's forward then its
    backward (`Microbatched.train_step`)."""
    from shardc.cost.pipeline import device_order

    m = max(1, microbatches)
    if pp <= 1:
        return [op for j in range(m) for op in (("F", j, 0), ("B", j, 0))]
    return device_order(schedule, pp, d, m, vpp)


TORCH_ACTIVE_STAGES = 3  # torch's `_add_unshard_reshard(max_active_stages=3)`


def runtime_window(pp: int, vpp: int, schedule: str) -> int | None:
    """How many units torch's pipeline runtime keeps unsharded at once on a device, where it
    manages them: `_PipelineScheduleRuntime` (interleaved 1F1B, the zero-bubble schedules)
    unshards the next `TORCH_ACTIVE_STAGES` stages an order will run and reshards the others
    (UNSHARD/RESHARD actions); None under GPipe, 1F1B and without a pipeline."""
    from shardc.cost.pipeline import ZB_SCHEDULES

    return TORCH_ACTIVE_STAGES if pp > 1 and (vpp > 1 or schedule in ZB_SCHEDULES) else None


def gather_ops(order: Sequence[Op], zero: int, window: int | None = None) -> list[Op]:
    """The ops of `order` at which their unit (virtual stage) all-gathers its weights (module
    rules). `window` (`runtime_window`): before each op, the units outside the next `window`
    distinct units of the order are resharded and those inside gathered (the gather is put on
    that unit's next op)."""
    unsharded: set[int] = set()
    active: set[int] = set()
    out: list[Op] = []
    for i, op in enumerate(order):
        kind, _, s = op
        if window:
            upcoming: list[int] = []
            for _, _, t in order[i:]:
                if t not in upcoming:
                    upcoming.append(t)
                    if len(upcoming) == window:
                        break
            for t in active - set(upcoming):
                active.discard(t)
                unsharded.discard(t)
            for t in upcoming:
                if t not in active:
                    active.add(t)
                    if t not in unsharded:
                        out.append(next(o for o in order[i:] if o[2] == t))
                        unsharded.add(t)
        if kind == "W":
            continue
        if s not in unsharded:
            out.append(op)
        if kind == "F" and zero >= 3:
            unsharded.discard(s)
        else:
            unsharded.add(s)
    return out


def gather_counts(zero: int, pp: int, microbatches: int, schedule: str = "1f1b", vpp: int = 1) -> tuple[int, int]:
    """(forward, backward) all-gathers per step of the FSDP2 unit that gathers most (module rules;
    the first such unit of the lowest device): ZeRO-1/2 (1, 0); ZeRO-3 m + 1 in all, split as
    the schedule orders the unit's forwards and backwards."""
    best = (0, 0)
    window = runtime_window(pp, vpp, schedule)
    for d in range(max(1, pp)):
        order = runtime_order(pp, d, microbatches, vpp, schedule)
        for unit in sorted({s for _, _, s in order}):
            counts = gathers_by_phase(order, zero, unit, window)
            if sum(counts) > sum(best):
                best = counts
    return best


def fsdp_gathers(zero: int, pp: int, microbatches: int, schedule: str = "1f1b", vpp: int = 1) -> int:
    """All-gathers per FSDP2 unit and step (module rules), the most of any unit: 1 for ZeRO-1/2,
    m + 1 for ZeRO-3."""
    return sum(gather_counts(zero, pp, microbatches, schedule, vpp))


def gathers_by_phase(order: Sequence[Op], zero: int, unit: int, window: int | None = None) -> tuple[int, int]:
    """(forward gathers, backward gathers) of virtual stage `unit` over `order` (`gather_ops`)."""
    ops = [op for op in gather_ops(order, zero, window) if op[2] == unit]
    forward = sum(1 for kind, _, _ in ops if kind == "F")
    return forward, len(ops) - forward


def fsdp_copy_time(nbytes: float, shard: int, device) -> float:
    """Seconds FSDP2 spends copying around one all-gather (or reduce-scatter) of `nbytes`
    (unsharded): the 1/`shard` local part into the flat buffer and the whole buffer out, each
    read and written at `device.memory_bandwidth` (bytes moved, read plus write, per second)."""
    return 2.0 * nbytes * (1.0 + 1.0 / max(shard, 1)) / device.memory_bandwidth


def fsdp_forward_work(device, tensors: float, elements: float, nbytes: float, shard: int) -> float:
    """Seconds of FSDP2's own work in one forward-gathering micro-batch (module rules): the measured
    per-micro-batch figure where there is one, else the copies of one gather."""
    eager = device.eager
    if eager is None or not eager.fsdp_measured():
        return fsdp_copy_time(nbytes, shard, device)
    return tensors * eager.fsdp_per_tensor + elements * eager.fsdp_per_param


def fsdp_microbatch_time(device, tensors: float, elements: float, zero: int, pp: int, microbatches: int,
                         nbytes: float, shard: int, schedule: str = "1f1b", vpp: int = 1) -> float:
    """Seconds per step of FSDP2's own work around its gathers (module rules), beyond the
    collectives, for a unit of `tensors` parameter tensors and `elements` elements (`nbytes`
    gathered) that gathers as `gather_counts` says: each forward gather's work
    (`fsdp_forward_work`) plus each backward gather's copies."""
    forward, backward = gather_counts(zero, pp, microbatches, schedule, vpp)
    return forward * fsdp_forward_work(device, tensors, elements, nbytes, shard) + \
        backward * fsdp_copy_time(nbytes, shard, device)


def fsdp_units(params: Sequence[tuple[float, int]], unit_of: Sequence[int]) -> list[tuple[int, float]]:
    """(parameter tensors, elements) per FSDP2 unit of a device: the torch backend wraps each stage
    module it holds on its own (`fully_shard` per virtual stage: interleaved schedules hold
    several), in stage order; one empty unit when the device holds no parameter."""
    units: dict[int, tuple[int, float]] = {}
    for (numel, _), stage in zip(params, unit_of):
        tensors, elements = units.get(stage, (0, 0.0))
        units[stage] = (tensors + 1, elements + numel)
    return [units[s] for s in sorted(units)] or [(0, 0.0)]


def step_collectives(order: Sequence[Op], zero: int, units: dict[int, float], w_elem: int,
                     g_elem: int, window: int | None = None) -> tuple[tuple[str, int, float], ...]:
    """FSDP2's collectives on one device per step as (kind, count, bytes of each: the unsharded
    buffer), one entry per unit and kind: its all-gathers (`gather_ops`) and its one
    reduce-scatter. `units`: elements per virtual stage the device holds."""
    out: list[tuple[str, int, float]] = []
    ops = gather_ops(order, zero, window)
    for s in sorted(units):
        if units[s] <= 0:
            continue
        out.append(("all_gather", sum(1 for op in ops if op[2] == s), units[s] * w_elem))
        out.append(("reduce_scatter", 1, units[s] * g_elem))
    return tuple(out)


def pipeline_gathers(layers: Sequence, plan, microbatches: int, links, zero_axes: tuple[str, ...], shard: int,
                     w_elem: int) -> dict[Op, float]:
    """Seconds each op of a pipelined step spends in FSDP2 all-gathers beyond its unit's first
    (that one is priced with the step's sync, `sync.gradient_sync`): ZeRO-3's gathers before
    forwards and backwards, and any unit's regathers after torch's runtime resharded it
    (`gather_ops`), each the collective of the unit's weights plus its
    work (forward: `fsdp_forward_work`; backward: `fsdp_copy_time`). They block the stage where
    they run (gloo collectives on the compute thread), so the pipeline simulation adds them to
    those ops (`pipeline.simulate`'s `extra`). Each parameter belongs to the first unit of its
    device that reads it. Empty without a pipeline or data-parallel group."""
    from shardc.analysis.stages import stage_device
    from shardc.cost.comm import collective_time

    p = plan.pp
    out: dict[Op, float] = {}
    if p <= 1 or shard <= 1:
        return out
    levels = links.levels(zero_axes)
    device = links.device
    for d in range(p):
        mine = [layer for layer in layers if stage_device(layer.stage, p, plan.schedule) == d]
        zero = max((layer.annotation.zero for layer in mine), default=0)
        if zero < 1:
            continue
        units: dict[int, tuple[int, float]] = {}
        seen: set[str] = set()
        for layer in mine:
            for name, (numel, _) in layer.params.items():
                if name not in seen:
                    seen.add(name)
                    tensors, elements = units.get(layer.stage, (0, 0.0))
                    units[layer.stage] = (tensors + 1, elements + numel)
        first: set[int] = set()
        order = runtime_order(p, d, microbatches, plan.vpp, plan.schedule)
        for op in gather_ops(order, zero, runtime_window(p, plan.vpp, plan.schedule)):
            s = op[2]
            if s not in units or s not in first:
                first.add(s)
                continue
            tensors, elements = units[s]
            nbytes = elements * w_elem
            work = (fsdp_forward_work(device, tensors, elements, nbytes, shard) if op[0] == "F"
                    else fsdp_copy_time(nbytes, shard, device))
            out[op] = out.get(op, 0.0) + collective_time("all_gather", nbytes, levels, links.algorithm) + work
    return out
