"""`objective`: the linearised step time and per-stage memory that the CP-SAT model minimises
(`shardc.search.constraints` states the same formulas as constraints), in Python, for
brute-force checks and for reporting the solver's bound; its coefficients are
`shardc.search.linear.coefficients`.

Coefficients come from the problem's priced candidates and edges (`shardc.search.costs`,
i.e. `shardc.cost`'s own per-node rules). Per section (prefix, one block, suffix), sums of the
chosen coefficients; with k_{s,r} blocks on stage s under recomputation r (none, selective,
full) and n_s = sum_r k_{s,r}:

    TL_r    = T_block + Z3 + [r=selective] core forward + [r=full] forward      one block
    S_s     = sum_r k_{s,r} TL_r + [s=0] T_pre + [s=p-1] T_post + sends          stage, per micro-batch
    pipe    = sum_s S_s + (m-1) max_s S_s                                        1F1B (`makespan_closed_form`)
    sync_s  = max(rate_z G_s - window_s, tail) + other axes                       exposed gradient sync
              (FSDP2, `Coefficients.fsdp`: alpha + beta G_s, one reduce_scatter after backward,
              beta with FSDP2's copies in and out)
    after_s = optimizer (28 B per local parameter, sharded by ZeRO) + ZeRO-1/2 gather
              (FSDP2: `sync.fsdp_gathers` gathers with their copies and FSDP2's per-micro-batch
              work, per tensor spread over the model's elements: `_fsdp_gather`)
    step    = pipe + max_s sync_s + max_s after_s
    mem_s   = states_z + in_flight_s * activations_r + recompute working + working + buffers
              - k_{s,full} copies + [k_{s,full} > 0] copies    (mixed precision's weight copies of
              a block recomputing in full: held only while it runs, `recompute_copy_bytes`)
              (buffers: DDP's flat gradient copy at ZeRO-0, two buckets for textbook ZeRO;
              FSDP2: states all sharded, buffers twice the stage's local weights; plus
              torch pipelining's send, receive and output buffers, m or m + in-flight of each, and
              the previous backward's input gradient, `peak.pipeline_buffers`)

With per-stage partitions (`Assignment.stage_choice`) the block sums are per stage, and a stage
boundary between different partitions adds to the later stage the chain edges' forward across
the two partitions less that within the later stage's, and to the earlier stage their gradient
across less that within the earlier stage's (`boundary`).

`compose` (what `evaluate` and `estimate` run) differs from this only where it is not linear:
the event-simulated schedule instead of the closed form, gradient buckets instead of a rate,
and exact first/last-block boundaries; the ZeRO-3 gather and the sync are affine in bytes here.
Edges that share a gradient cost the largest of their gradient redistributions (exact when
one consumer's contribution dominates, as Partial does). A block's saved activations include,
per edge, the gathered copy a later consumer of the same value saves (`_edge_saved`), as
`compose` counts one per consumer, and a value one group makes and another saves counts at the
layout it is made in (`_edge_root`), as `evaluate` does.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardc.cost.memory import in_flight
from shardc.search.linear import CAND_KEYS, EDGE_SECTION, coefficients, recompute_copy_bytes
from shardc.search.problem import Problem


@dataclass(frozen=True, slots=True)
class Linear:
    step_time_s: float
    memory_bytes: tuple[float, ...]


def section_sums(problem: Problem, choice: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """Per section (pre, block, post): the chosen coefficients summed, edges included."""
    co = coefficients(problem)
    acc = {s: dict.fromkeys((*CAND_KEYS, "pbytes", "send", "sbytes", "obytes"), 0.0) for s in ("pre", "block", "post")}
    for i, (var, c) in enumerate(zip(problem.groups, choice)):
        row = co.cand[i][c]
        sec = acc[var.section]
        for key in CAND_KEYS:
            sec[key] = max(sec[key], row[key]) if key == "transient" else sec[key] + row[key]
        sec["send"] += co.send[i][c]
        sec["sbytes"] += co.send_bytes[i][c]
        sec["obytes"] += co.out_bytes[i][c]
    shares: dict[int, float] = {}
    for i, e in enumerate(problem.edges):
        a, b = e.prod_class[choice[e.producer]], e.cons_class[choice[e.consumer]]
        fsec, gsec = EDGE_SECTION[e.kind]
        f = co.edge_fwd[i][a][b]
        acc[fsec]["time"] += f
        acc[fsec]["saved"] += co.edge_saved[i][a][b]
        if e.core:
            acc[fsec]["saved_core"] += co.edge_saved[i][a][b]
        acc[fsec]["saved"] += co.edge_root[i][a][b]  # the value at its producer's layout (`_edge_root`)
        if co.edge_root_core[i]:
            acc[fsec]["saved_core"] += co.edge_root[i][a][b]
        acc[fsec]["fwd"] += e.fwd_s(a, b)
        if e.core:
            acc[fsec]["core"] += e.fwd_s(a, b)
        shares[e.share] = max(shares.get(e.share, 0.0), co.edge_grad[i][a][b])
    for k, ids in enumerate(problem.shares):
        acc[EDGE_SECTION[problem.edges[ids[0]].kind][1]]["time"] += shares.get(k, 0.0)
    for sec in acc.values():
        sec["pbytes"] = sec["numel"] * co.w_elem
    return acc


def stage_vectors(problem: Problem, choice: tuple[int, ...], stages: tuple[tuple[int, int, int], ...],
                  stage_choice: tuple[tuple[int, ...], ...] = ()) -> list[tuple[int, ...]]:
    """Per stage the candidate vector it runs (`choice` everywhere when `stage_choice` is empty;
    a stage without blocks takes its neighbour's, as `shardc.search.evaluate.per_stage` does)."""
    p = len(stages)
    vecs = list(stage_choice) if stage_choice else [choice] * p
    if p > 1 and sum(stages[0]) == 0:
        vecs[0] = vecs[1]
    if p > 1 and sum(stages[-1]) == 0:
        vecs[-1] = vecs[-2]
    return vecs


def boundary(problem: Problem, prev: tuple[int, ...], cur: tuple[int, ...]) -> tuple[float, float, float]:
    """What a stage boundary between blocks at `prev` and at `cur` adds over a block boundary
    inside a stage at `cur` (forward seconds, of which pure forward redistribution) and inside a
    stage at `prev` (gradient seconds): the chain edges priced across the two partitions."""
    co = coefficients(problem)
    fwd = pure = grad = 0.0
    shares: dict[int, list[float]] = {}
    for i, e in enumerate(problem.edges):
        if e.kind != "chain":
            continue
        a, b = e.prod_class[prev[e.producer]], e.cons_class[cur[e.consumer]]
        a0, b0 = e.prod_class[cur[e.producer]], e.cons_class[prev[e.consumer]]
        a1 = e.prod_class[prev[e.producer]]
        fwd += co.edge_fwd[i][a][b] - co.edge_fwd[i][a0][b]
        pure += e.fwd_s(a, b) - e.fwd_s(a0, b)
        across, within = shares.setdefault(e.share, [0.0, 0.0])
        shares[e.share] = [max(across, co.edge_grad[i][a][b]), max(within, co.edge_grad[i][a1][b0])]
    grad = sum(x - y for x, y in shares.values())
    return fwd, pure, grad


def objective(problem: Problem, choice: tuple[int, ...], stages: tuple[tuple[int, int, int], ...],
              zero: int, stage_choice: tuple[tuple[int, ...], ...] = ()) -> Linear:
    """The linearised step time and per-stage memory CP-SAT works with (module formulas); with
    `stage_choice`, each stage's blocks at its own candidates and every stage boundary priced
    across the two stages' partitions (`boundary`)."""
    co = coefficients(problem)
    p, m = len(stages), problem.micro_batches
    vecs = stage_vectors(problem, choice, stages, stage_choice)
    where = [s for s, row in enumerate(stages) for _ in range(sum(row))]
    sums: dict[tuple[int, ...], dict[str, dict[str, float]]] = {}
    for v in vecs:
        if v not in sums:
            sums[v] = section_sums(problem, v)
    first_vec = vecs[where[0]] if where else choice
    last_vec = vecs[where[-1]] if where else vecs[-1]
    pre, post = sums[first_vec]["pre"], sums[last_vec]["post"]

    def z3(sums_: dict[str, float]) -> float:
        if zero >= 3 and co.zero3[1] > 0:
            ag = co.zero3[0] + co.zero3[1] * sums_["pbytes"]
            return max(0.0, ag - sums_["cfwd"]) + max(0.0, ag - sums_["cbwd"])
        return 0.0

    z3_pre, z3_post = z3(pre), z3(post)
    extra_t = [0.0] * p  # stage boundaries: forward into stage s, gradient out of stage s
    extra_w = [0.0] * p
    for s in range(1, p):
        if vecs[s] != vecs[s - 1]:
            fwd, pure, grad = boundary(problem, vecs[s - 1], vecs[s])
            extra_t[s] += fwd
            extra_w[s] += fwd - pure
            extra_t[s - 1] += grad
            extra_w[s - 1] += grad
    stage_time, exposed, after, memory = [], [], [], []
    for s, k in enumerate(stages):
        first, last = s == 0, s == p - 1
        blk = sums[vecs[s]]["block"]
        zb = z3(blk)
        layer = [blk["time"] + zb, blk["time"] + zb + blk["core"], blk["time"] + zb + blk["fwd"]]
        back = [t - blk["fwd"] for t in layer]
        act = [blk["saved"], blk["saved"] - blk["saved_core"], blk["inputs"]]
        send = blk["send"] if p > 1 else 0.0
        t = sum(n * lt for n, lt in zip(k, layer)) + send * (not last) + sums[vecs[s - 1]]["block"]["send"] * (
            not first) + extra_t[s]
        t += (pre["time"] + z3_pre) * first + (post["time"] + z3_post) * last
        stage_time.append(t)
        window = sum(n * b for n, b in zip(k, back)) + (sums[vecs[s - 1]]["block"]["send"] if not first else 0.0)
        window += (pre["time"] + z3_pre - pre["fwd"]) * first + (post["time"] + z3_post - post["fwd"]) * last
        window += extra_w[s]
        n = sum(k)
        grad = n * blk["gbytes"] + pre["gbytes"] * first + post["gbytes"] * last
        floor = co.tail[zero] + (co.rate[zero] * pre["gbytes"] if first else 0.0)
        other = n * blk["other"] + pre["other"] * first + post["other"] * last
        if co.serial_sync[zero]:
            exposed.append(co.serial[zero][0] + co.serial[zero][1] * grad + other)
        else:
            exposed.append(max(co.rate[zero] * grad - window, floor) + other)
        numel = n * blk["numel"] + pre["numel"] * first + post["numel"] * last
        gather = co.gather[zero][0] + co.gather[zero][1] * numel * co.w_elem if co.gather[zero][1] else 0.0
        after.append(numel * co.optimizer[zero] + gather)
        f = in_flight("1f1b", p, s, m)
        saved = sum(c * a for c, a in zip(k, act)) + pre["saved"] * first + post["saved"] * last
        rw = max(blk["saved"] if k[2] else 0.0, blk["saved_core"] if k[1] else 0.0)
        work = max(blk["transient"], pre["transient"] * first, post["transient"] * last)
        buffers = (grad if zero == 0 else min(co.buffer_cap, 2 * grad)) if co.buffer_cap else 0.0
        if co.fsdp[zero]:
            buffers = co.fsdp_buf * numel * co.w_elem
        elif zero >= 3 and co.buffer_cap:
            buffers += 2 * max(blk["pbytes"], pre["pbytes"] * first, post["pbytes"] * last)
        if co.pipeline_buffers:
            recv = sums[vecs[s - 1]]["block"]["sbytes"] if not first else 0.0
            buffers += (m + 1) * recv + ((m + f) * blk["sbytes"] if not last else post["obytes"] + co.out_const)
        # Mixed precision's weight copies are in `state`, once per parameter (the runtime shares
        # one among the micro-batches in flight), less those of blocks recomputing in full, which
        # hold theirs only while they run (`recompute_copy_bytes`).
        off, running = recompute_copy_bytes(co, zero, blk["numel"], k[2])
        states = numel * co.state[zero] - off
        mem = states + f * saved + rw + running + work + buffers
        if co.fsdp[zero]:  # FSDP2 once backward is over (`compose._device_memory`)
            mem = max(mem, states + buffers - co.fsdp_buf * numel * co.w_elem + numel * co.fsdp_after)
        memory.append(mem)
    pipe = sum(stage_time) + (m - 1) * max(stage_time)
    return Linear(pipe + max(exposed) + max(after), tuple(memory))
