"""The linearisation of the analytical model that the CP-SAT model minimises: `Coefficients`,
per candidate, edge class pair and ZeRO stage, from the problem's priced candidates and edges
(`shardc.search.costs`, i.e. `shardc.cost`'s own per-node rules). The formulas that combine
them are `shardc.search.objective`'s (its docstring states them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.cost.comm import collective_time
from shardc.cost.compose import EstimateOptions, fsdp2, zero_group
from shardc.cost.memory import compute_bytes, state_bytes_per_param, weight_copy_bytes
from shardc.cost.sync import (
    ADAM_BYTES_PER_PARAM,
    fsdp_copy_time,
    fsdp_forward_work,
    fsdp_gathers,
    fsdp_microbatch_time,
    measured_sync_step,
)
from shardc.ir import ZERO_STAGES, Layout, Value
from shardc.ops.registry import get_op, has_op
from shardc.search.problem import Problem

CAND_KEYS = ("time", "fwd", "core", "cfwd", "cbwd", "saved", "saved_core", "inputs", "transient", "numel",
             "gbytes", "other")
EDGE_SECTION = {"pre": ("pre", "pre"), "block": ("block", "block"), "post": ("post", "post"),
                "chain": ("block", "block"), "first": ("pre", "pre"), "last": ("post", "post"),
                "skip": ("post", "pre")}  # kind -> (forward section, gradient section)


@dataclass
class Coefficients:
    """Scalars per candidate (`CAND_KEYS`), per edge class pair, and the problem's constants."""

    cand: list[list[dict[str, float]]]
    edge_fwd: list[list[list[float]]]  # forward redistribution + backward re-gather
    edge_grad: list[list[list[float]]]
    send: list[list[float]]  # per group var, per candidate: its share of the pipeline send
    rate: tuple[float, ...]  # gradient sync seconds per byte, per ZeRO stage
    tail: tuple[float, ...]  # the last bucket's seconds, per ZeRO stage
    state: tuple[float, ...]  # model-state bytes per local parameter, per ZeRO stage
    optimizer: tuple[float, ...]  # optimizer seconds per local parameter, per ZeRO stage
    gather: tuple[tuple[float, float], ...]  # (seconds, seconds per byte) of the ZeRO-1/2 weight gather
    zero3: tuple[float, float]  # (seconds, seconds per byte) of a ZeRO-3 layer all-gather
    buffer_cap: float  # 2 x bucket when data-parallel, else 0
    w_elem: int
    # Per ZeRO stage: whether it runs as FSDP2 on the whole module (`compose.fsdp2`: states all
    # sharded, every weight gathered before forward and held, the gradients reduce-scattered
    # in one exposed collective after backward), and that collective's (seconds, per byte).
    fsdp: tuple[bool, ...] = (False, False, False, False)
    serial: tuple[tuple[float, float], ...] = ((0.0, 0.0),) * 4
    # torch.distributed.pipelining's buffers (`peak.pipeline_buffers`): per group and candidate
    # the bytes it sends to the next stage, and those of the loss's input (the last stage's output).
    send_bytes: list[list[float]] = field(default_factory=list)
    out_bytes: list[list[float]] = field(default_factory=list)
    out_const: float = 0.0
    pipeline_buffers: bool = False
    # FSDP2's bytes per local parameter once backward is over (`compose._device_memory`).
    fsdp_after: float = 0.0
    # FSDP2's buffers per local weight byte: the unsharded weights and their all-gather buffer,
    # and the unsharded gradients when micro-batches accumulate without syncing (`peak.device_memory`)
    fsdp_buf: float = 2.0
    # Per edge and layout class pair: the bytes of a gathered copy the candidates' sums miss (`_edge_saved`).
    edge_saved: list[list[list[float]]] = field(default_factory=list)
    # Per edge and layout class pair: a saved value at its producer's layout less the consumer's
    # row's view of it (`_edge_root`), and per edge whether selective recomputation drops it.
    edge_root: list[list[list[float]]] = field(default_factory=list)
    edge_root_core: list[bool] = field(default_factory=list)
    # Per ZeRO stage: whether the gradient sync is one exposed piece after backward priced by
    # `serial` (FSDP2; DDP where its whole step was measured, `sync.measured_sync_step`) rather
    # than buckets overlapping backward (`rate`, `tail`). Empty: as `fsdp`.
    serial_sync: tuple[bool, ...] = ()
    # Mixed precision's weight copy per local parameter that a block recomputing in full holds
    # only while it runs, per ZeRO stage (0 where none is held at rest: fp32, FSDP2, ZeRO-3):
    # `peak.recompute_copies`, `recompute_copy_bytes`.
    recompute_copy: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)

    def __post_init__(self) -> None:
        if not self.serial_sync:
            self.serial_sync = self.fsdp


def coefficients(problem: Problem, options: EstimateOptions | None = None) -> Coefficients:
    """The problem's `Coefficients` (cached on the problem)."""
    cached = getattr(problem, "_coefficients", None)
    if cached is not None:
        return cached
    options = options or EstimateOptions()
    ctx = problem.pricer.ctx
    axes, shard = zero_group(ctx.mesh)
    levels = ctx.levels(axes)
    w, g, o = state_bytes_per_param(problem.dtype)  # w: fp32 master + compute copy (`cost.memory`)
    held_copy, w_elem = weight_copy_bytes(problem.dtype), compute_bytes(problem.dtype)  # gathers move compute bytes
    cand = _candidate_rows(problem, axes, g)
    edge_fwd = [[[e.fwd_s(a, b) + sum(e.regather[a][b].values()) for b in range(len(e.cons_grad))]
                 for a in range(len(e.prod_info))] for e in problem.edges]
    edge_grad = [[[sum(e.bwd[a][b].values()) for b in range(len(e.cons_grad))] for a in range(len(e.prod_info))]
                 for e in problem.edges]
    send, send_bytes = _sends(problem)
    out_bytes, out_const = _output_bytes(problem)
    bucket = options.bucket_bytes
    kinds = ["all_reduce" if z == 0 else "reduce_scatter" for z in ZERO_STAGES]
    rate = tuple(collective_time(k, bucket, levels, ctx.algorithm) / bucket if shard > 1 else 0.0 for k in kinds)
    block_grad = sum(min(r["gbytes"] for r in rows) for rows, var in zip(cand, problem.groups) if var.section == "block")
    last = min(bucket, block_grad) if block_grad > 0 else bucket
    tail = tuple(collective_time(k, last, levels, ctx.algorithm) if shard > 1 else 0.0 for k in kinds)
    fsdp = tuple(fsdp2(options, z, shard) for z in ZERO_STAGES)
    unit = _fsdp_unit(problem)  # the model's parameter tensors and elements, as FSDP2 wraps them
    state = tuple((w - (held_copy if fsdp[z] else 0)) / (shard if z >= 3 or fsdp[z] else 1) + g / (shard if z >= 2 or fsdp[z] else 1)
                  + o / (shard if z >= 1 else 1) for z in ZERO_STAGES)
    optimizer = tuple(ADAM_BYTES_PER_PARAM / (shard if z >= 1 else 1) / ctx.device.memory_bandwidth for z in ZERO_STAGES)
    if ctx.device.eager is not None:  # measured eager optimizer (`compute.optimizer_step_time`), per element
        optimizer = tuple(_eager_optimizer(problem, unit, z, shard, fsdp[z]) for z in ZERO_STAGES)
    gather = tuple(_affine("all_gather", levels, ctx.algorithm) if (z in (1, 2) or fsdp[z]) and shard > 1
                   else (0.0, 0.0) for z in ZERO_STAGES)
    zero3 = _affine("all_gather", levels, ctx.algorithm) if shard > 1 and not fsdp[3] else (0.0, 0.0)
    serial = tuple(_affine("reduce_scatter", levels, ctx.algorithm) if fsdp[z] else (0.0, 0.0) for z in ZERO_STAGES)
    copy = fsdp_copy_time(1.0, shard, ctx.device)  # FSDP2's copies per byte around each collective
    serial = tuple((a, b + copy) if fsdp[z] else (a, b) for z, (a, b) in zip(ZERO_STAGES, serial))
    tensors, numel = unit
    measured = tuple(_measured_serial(problem, "fsdp2" if fsdp[z] else "ddp", tensors, numel, shard, g)
                     if fsdp[z] or z == 0 else None for z in ZERO_STAGES)
    serial = tuple(m or s for m, s in zip(measured, serial))  # a measured whole step replaces the collective
    gather = tuple(_fsdp_gather(problem, unit, z, gather[z], shard, w_elem, measured[z] is not None) if fsdp[z]
                   else gather[z] for z in ZERO_STAGES)
    serial_sync = tuple(fsdp[z] or measured[z] is not None for z in ZERO_STAGES)
    rate = tuple(0.0 if serial_sync[z] else rate[z] for z in ZERO_STAGES)
    tail = tuple(0.0 if serial_sync[z] else tail[z] for z in ZERO_STAGES)
    out = Coefficients(cand, edge_fwd, edge_grad, send, rate, tail, state, optimizer, gather, zero3,
                       2 * bucket if shard > 1 else 0.0, w_elem, fsdp, serial, send_bytes, out_bytes, out_const,
                       options.pipeline_runtime == "torch" and problem.shape.pp > 1,
                       w_elem + (w_elem if held_copy else 0) + g * (1 + 1 / max(1, shard)),
                       3.0 if problem.micro_batches > 1 and problem.shape.pp == 1 else 2.0, serial_sync=serial_sync)
    out.edge_saved = _edge_saved(problem)
    out.edge_root, out.edge_root_core = _edge_root(problem)
    out.recompute_copy = tuple(0.0 if fsdp[z] or z >= 3 else float(held_copy) for z in ZERO_STAGES)
    problem._coefficients = out  # type: ignore[attr-defined]
    return out


def recompute_copy_bytes(co: Coefficients, zero: int, block_numel: float, full_blocks: int) -> tuple[float, float]:
    """Mixed precision's weight copies under full recomputation, as `peak.recompute_copies` has
    them: (bytes off the stage's at-rest copies: every block recomputing in full, bytes a running
    one holds: one block's copies, 0 without such a block)."""
    copy = co.recompute_copy[zero] * block_numel
    return full_blocks * copy, copy if full_blocks else 0.0


def _candidate_rows(problem: Problem, axes: tuple[str, ...], grad_bytes: float) -> list[list[dict[str, float]]]:
    """Per group and candidate, the `CAND_KEYS` scalars. A saved or read activation counts at
    the first group of its section that holds it (groups of one section share their entries);
    gradients synchronised over the ZeRO group are `gbytes`, those over other axes `other`."""
    ctx = problem.pricer.ctx
    first_saver: dict[object, int] = {}
    first_reader: dict[object, int] = {}
    for i, var in enumerate(problem.groups):
        for cost in var.costs:
            for key in cost.terms.saved_entries:
                first_saver.setdefault((var.section, key), i)
            for key in cost.terms.input_entries:
                first_reader.setdefault((var.section, key), i)
    cand = []
    for i, var in enumerate(problem.groups):
        rows = []
        for cost in var.costs:
            t = cost.terms
            other: dict[tuple[str, ...], float] = {}
            gbytes = 0.0
            for _, numel, grad_axes in cost.params:
                if grad_axes & set(axes):
                    gbytes += numel * grad_bytes
                rest = tuple(sorted(grad_axes - set(axes)))
                if rest:
                    other[rest] = other.get(rest, 0.0) + numel * grad_bytes
            rows.append({
                "time": sum(t.fwd.values()) + sum(t.bwd.values()), "fwd": sum(t.fwd.values()),
                "core": sum(t.core_fwd.values()), "cfwd": t.fwd.get("compute_fwd", 0.0),
                "cbwd": t.bwd.get("compute_bwd", 0.0),
                "saved": sum(b for k, (b, _) in t.saved_entries.items() if first_saver[(var.section, k)] == i),
                "saved_core": sum(b for k, (b, c) in t.saved_entries.items()
                                  if c and first_saver[(var.section, k)] == i),
                "inputs": sum(b for k, b in t.input_entries.items() if first_reader[(var.section, k)] == i),
                "transient": t.transient, "numel": sum(n for _, n, _ in cost.params), "gbytes": gbytes,
                "other": sum(collective_time("all_reduce", b, ctx.levels(a), ctx.algorithm) for a, b in other.items()),
            })
        cand.append(rows)
    return cand


def _edge_saved(problem: Problem) -> list[list[list[float]]]:
    """Per edge and (produced, required) class pair, the saved bytes the candidates' own sums
    miss. Eager autograd saves, per consumer, the copy its input's all-gather made (sequence
    parallelism: wq, wk and wv each save their own gathered copy of the norm's output,
    `shardc.cost.timeline.gathered_source`), while a candidate row counts a saved value once per
    section, at its first consumer's layout; so every later consumer of the value in the section
    whose edge gathers a saved input adds its copy. A column-parallel reader (a linear or a
    rank-2-weight matmul reading the value as its input: `cost.edges.regathered_by`) saves no copy:
    the backend runs it through `gather_linears`, which saves the sequence shard once for all the
    readers of one gather and gathers it again in backward."""
    first: dict[tuple[str, Value], int] = {}
    for e in problem.edges:
        key = (EDGE_SECTION[e.kind][0], e.value)
        first[key] = min(first.get(key, e.consumer), e.consumer)
    out = []
    for e in problem.edges:
        node = problem.groups[e.consumer].group.members[e.member]
        column = e.index == 0 and (node.op == "linear" or (node.op == "matmul" and node.inputs[1].type.rank == 2)) \
            and all(v.kind == "parameter" for v in node.inputs[1:])
        later = first[(EDGE_SECTION[e.kind][0], e.value)] != e.consumer and not column
        out.append([[problem.pricer.local_bytes(e.value, e.cons_required[b]) if later and e.regather[a][b] else 0.0
                     for b in range(len(e.cons_required))] for a in range(len(e.prod_info))])
    return out


def _edge_root(problem: Problem) -> tuple[list[list[list[float]]], list[bool]]:
    """Per edge and (produced, required) class pair, what a value saved by the consumer costs at
    the layout its producer makes it in less what the consumer's candidate row counts (the view it
    reads, at the required layout); per edge whether the entry is dropped under selective
    recomputation. `evaluate` counts a storage made by another group at its producer's layout
    (`evaluate._merge`): sequence parallelism's norm output is saved as the sequence shard that
    `gather_linears` keeps, while the column-parallel reader's row counts the gathered view (4x at
    tp=4). Only on the first edge carrying the value into the group whose row counts it (the
    first of its section to save it, `_candidate_rows`); zero elsewhere."""
    first_saver: dict[tuple[str, object], int] = {}
    for i, var in enumerate(problem.groups):
        for cost in var.costs:
            for key in cost.terms.saved_entries:
                first_saver.setdefault((var.section, key), i)
    out: list[list[list[float]]] = []
    core: list[bool] = []
    done: set[tuple[int, Value]] = set()
    for e in problem.edges:
        rows = [[0.0] * len(e.cons_required) for _ in e.prod_info]
        flag = False
        var = problem.groups[e.consumer]
        section = EDGE_SECTION[e.kind][0]
        if (var.section == section and first_saver.get((section, e.value)) == e.consumer
                and problem.owner.get(e.value) == (e.producer, e.out_index) and (e.consumer, e.value) not in done):
            done.add((e.consumer, e.value))
            for b in range(len(e.cons_required)):
                terms = var.costs[e.cons_class.index(b)].terms
                entry = terms.saved_entries.get(e.value)
                if entry is None or e.value not in terms.roots:
                    continue
                flag = flag or entry[1]
                for a, info in enumerate(e.prod_info):
                    rows[a][b] = problem.pricer.local_bytes(e.value, info[0]) - entry[0]
        out.append(rows)
        core.append(flag)
    return out, core


def _sends(problem: Problem) -> tuple[list[list[float]], list[list[float]]]:
    """Per group and candidate, the seconds and the bytes of what it sends to the next pipeline
    stage: each chain edge's produced value once."""
    send = [[0.0] * len(var.cands) for var in problem.groups]
    send_bytes = [[0.0] * len(var.cands) for var in problem.groups]
    seen: set[tuple[int, int]] = set()
    for e in problem.edges:
        if e.kind == "chain" and (e.producer, e.out_index) not in seen:
            seen.add((e.producer, e.out_index))
            for c, cost in enumerate(problem.groups[e.producer].costs):
                nbytes = problem.pricer.local_bytes(e.value, cost.produced[e.out_index][0])
                send[e.producer][c] += problem.pricer.p2p(nbytes)
                send_bytes[e.producer][c] += nbytes
    return send, send_bytes


def _output_bytes(problem: Problem) -> tuple[list[list[float]], float]:
    """Per group and candidate, the bytes of the last stage's output per micro-batch it makes
    (the loss's input, else the graph's outputs), and the part no group makes."""
    graph = problem.facts.graph
    values = next(([n.inputs[0]] for n in reversed(graph.nodes)
                   if has_op(n.op) and get_op(n.op).kind == "loss" and n.inputs), list(graph.outputs))
    out = [[0.0] * len(var.cands) for var in problem.groups]
    const = 0.0
    for value in values:
        var, k = problem.owner.get(value, (-1, 0))
        if var < 0:
            const += problem.pricer.local_bytes(value, Layout())
            continue
        for c, cost in enumerate(problem.groups[var].costs):
            out[var][c] += problem.pricer.local_bytes(value, cost.produced[k][0] if k < len(cost.produced) else Layout())
    return out, const


def _affine(kind: str, levels, algorithm: str, size: float = 256 * 2**20) -> tuple[float, float]:
    """(latency, seconds per byte) of `kind` around `size` bytes: the alpha-beta line through it."""
    big, half = collective_time(kind, size, levels, algorithm), collective_time(kind, size / 2, levels, algorithm)
    beta = (big - half) / (size / 2)
    return max(0.0, big - beta * size), beta


def _eager_optimizer(problem: Problem, unit: tuple[float, float], zero: int, shard: int, dtensors: bool) -> float:
    """Seconds per local parameter element of the measured eager optimizer step
    (`compute.optimizer_step_time`): its per-tensor cost spread over the model's elements."""
    eager = problem.pricer.ctx.device.eager
    assert eager is not None
    sharded = zero >= 1 and shard > 1
    per_tensor, per_element = eager.optimizer(sharded and dtensors)
    tensors, numel = unit
    return (per_tensor * tensors / numel if numel > 0 else 0.0) + per_element / (shard if sharded else 1)


def _measured_serial(problem: Problem, wrapper: str, tensors: float, numel: float, shard: int,
                     grad_bytes: float) -> tuple[float, float] | None:
    """(seconds, seconds per gradient byte) of a synchronising step under `wrapper` where it was
    measured (`sync.measured_sync_step`), its per-tensor part spread over the model's elements;
    None where it was not."""
    device = problem.pricer.ctx.device
    step = measured_sync_step(device, wrapper, tensors, numel, shard) if numel > 0 else None
    if step is None:
        return None
    fixed = measured_sync_step(device, wrapper, 0, 0, shard) or 0.0
    return fixed, (step - fixed) / (numel * grad_bytes)


def _fsdp_unit(problem: Problem) -> tuple[float, float]:
    """(parameter tensors, elements) of the whole model as FSDP2 wraps it (one block's groups
    stand for every block)."""
    blocks = problem.facts.layering.count
    weight = lambda var: blocks if var.section == "block" else 1  # noqa: E731
    tensors = sum(weight(var) * len(var.costs[0].params) for var in problem.groups if var.costs)
    numel = sum(weight(var) * n for var in problem.groups if var.costs for _, n, _ in var.costs[0].params)
    return tensors, numel


def _fsdp_gather(problem: Problem, unit: tuple[float, float], zero: int, affine: tuple[float, float], shard: int,
                 w_elem: int, measured: bool = False) -> tuple[float, float]:
    """(seconds, seconds per byte) of FSDP2's gathers per step with their copies and its
    per-micro-batch work (`sync.fsdp_gathers`, `sync.fsdp_microbatch_time`): the per-tensor part
    spread over the model's elements (exact on one stage, the whole model). `measured`: a
    measured whole step (priced with the reduce-scatter) holds the first gather and its work."""
    pp, m = problem.shape.pp, problem.micro_batches
    tensors, numel = unit
    count = fsdp_gathers(zero, pp, m) - measured
    if numel <= 0:
        return count * affine[0], count * affine[1]
    device = problem.pricer.ctx.device
    work = fsdp_microbatch_time(device, tensors, numel, zero, pp, m, numel * w_elem, shard)
    if measured:
        work -= fsdp_forward_work(device, tensors, numel, numel * w_elem, shard)
    return count * affine[0], count * affine[1] + work / (numel * w_elem)
