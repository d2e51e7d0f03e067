"""Memory of one pipeline device at its peak: model states, runtime buffers, and the micro-batch timelines stacked.

Rules (what the torch backend runs; `EstimateOptions` names the choices):
- Model states: `memory.model_state_bytes` by ZeRO stage. With `zero_runtime="fsdp2"` (the
  torch backend: `fully_shard` on the whole module) every ZeRO stage shards parameters,
  gradients and optimizer state at rest over the data-parallel group; `"zero"` is the
  textbook ZeRO-1/2/3 (Rajbhandari et al.). Mixed precision's compute-dtype weight copies
  (`memory`): one per weight at rest however many micro-batches are in flight (the runtime
  shares one copy among them: `precision.weight_copy`), except the weights of a layer that
  recomputes in full, whose copies it holds only while it runs: in its forward's working memory
  and its backward's recomputation working memory (`recompute_copies`).
- Activations and working memory (`timeline.layer_memory`, per layer): the device holds the
  saved activations of the micro-batches in flight (`in_flight`) but the one in progress,
  plus the largest live total of that one, forward or backward: the saved activations of the
  layers before the layer in progress (all of them while it is in forward, those not yet
  reached in backward) plus that layer's own live bytes. Tied weights' gradients held for an
  earlier layer stay live until it; under FSDP2 the unsharded gradients of the layers already
  back-propagated stay until the end of backward.
- Buffers: DDP allocates one flat bucket per group of gradients, together a copy of every
  gradient it synchronises (whatever `bucket_cap_mb`; it caps each bucket, not their sum).
  FSDP2 on the whole module holds its unsharded parameters from the start of forward to the
  end of backward, and during forward also the flat all-gather buffer they were copied out
  of (both the local parameter bytes); for ZeRO-3 it frees both after forward and gathers
  again for backward (the buffer and the parameters once more). Accumulating micro-batches
  without syncing (all but the last), FSDP2 keeps every unsharded gradient from the first
  micro-batch's backward to the end of the step, and the unsharded parameters from one
  micro-batch's backward into the next one's forward (no reshard after backward but the last:
  only the first forward gathers). Textbook ZeRO-3: the largest layer's gathered weights
  twice (the current and the prefetched one). torch.distributed.pipelining
  (`pipeline_runtime="torch"`) preallocates a receive buffer per micro-batch for a stage's
  inputs and for the gradients of its outputs, keeps each in-flight micro-batch's output until
  its backward, and on the last stage keeps every micro-batch's output (the loss's input) until
  the step ends; with data parallelism each stage module is a DDP module (buckets as above).
  What a stage's first layer saves of its received input is that receive buffer (torch hands
  the buffer itself to the stage), so it is not counted again as an activation. Collective
  buffers live at a layer's backward peak (`LayerMemory.bwd_buffers`: sequence parallelism's
  pieces gathered again and reduce-scatter sum) are buffers at that peak.
- Model buffers (registered buffers, constants the trace folded) live all step at their local
  layout, each once per device (`model_buffers`).
Without per-layer timelines (the solver's layer costs) activations are the saved bytes times
the micro-batches in flight plus the largest recomputation and transient working sets.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

MiB = 2**20


def recompute_copies(layers: Sequence[Any], copy_bytes: float) -> tuple[float, dict[str, float]]:
    """Mixed precision's weight copies under full recomputation (`precision.weight_copy`): a layer
    that recomputes in full saves nothing, so it holds the compute-dtype copies of the weights only
    it reads while it runs (forward, then its recomputed forward and backward), none at rest. The
    bytes to take off the device's at-rest copies (each weight once), and per such layer (by
    name) the copies it holds while it runs. `copy_bytes`: bytes per local parameter of its copy
    (0: none held, fp32 or FSDP2's gathered weights)."""
    if copy_bytes <= 0:
        return 0.0, {}
    held = {name for l in layers if l.annotation.recompute != "full" for name in l.params}
    running: dict[str, float] = {}
    off: dict[str, float] = {}
    for l in layers:
        if l.annotation.recompute == "full":
            mine = {name: numel * copy_bytes for name, (numel, _) in l.params.items() if name not in held}
            running[l.name] = sum(mine.values())
            off.update(mine)
    return sum(off.values()), running


def _less(part: dict[str, float], nbytes: float) -> dict[str, float]:
    """`part` without `nbytes` that another category holds: taken from its activations, then
    from what recomputation brought back (a layer recomputing in full has its inputs there)."""
    out = dict(part)
    for key in ("activations", "recompute_working"):
        take = min(nbytes, out.get(key, 0.0))
        out[key] = out.get(key, 0.0) - take
        nbytes -= take
    return out


def _stage_peaks(layers: Sequence[Any], fsdp_hold: bool, running: dict[str, float],
                 received: float = 0.0, grad_received: float = 0.0
                 ) -> tuple[dict[str, float], dict[str, float], float, dict[str, float]]:
    """(forward peak split, backward peak split, kept bytes, input-gradient pass peak split) of
    one virtual stage's micro-batch; `running`: the weight copies a layer holds only while it
    runs (`recompute_copies`). The input-gradient pass of a split backward keeps the graph
    (`retain_graph`): every saved activation of the stage stays, and the output gradients
    captured for the weight pass (`LayerMemory.weight_inputs`) of the layers already passed.
    `received`: the bytes of the stage's input that torch's pipeline receives into a buffer of
    its own (`pipeline_buffers`); what the first layer saves of its input (`saved_inputs`) is
    that buffer, counted there, not again as activations; `grad_received`: likewise the bytes of
    the gradient of the stage's output that arrive in torch's gradient-receive buffer, which the
    last layer's backward holds (`bwd_incoming`), counted there, not again as working memory."""
    shared = min(layers[0].memory.saved_inputs, received) if layers else 0.0
    kept = [l.memory.kept for l in layers]
    zero = {"activations": 0.0, "recompute_working": 0.0, "working": 0.0}
    fwd, bwd, inp = dict(zero), dict(zero), dict(zero)
    for i, layer in enumerate(layers):
        mem = layer.memory
        copies = running.get(layer.name, 0.0)
        before = sum(kept[:i]) - (shared if i else 0.0)
        own = shared if i == 0 else 0.0
        later = layers[i + 1:]
        held = sum(l.memory.held for l in later) + (sum(l.memory.param_grads for l in later) if fsdp_hold else 0.0)
        candidate = _less({"activations": before + mem.fwd_saved, "recompute_working": 0.0,
                           "working": mem.fwd_peak - mem.fwd_saved + copies}, own)
        if sum(candidate.values()) > sum(fwd.values()):
            fwd = candidate
        comm = mem.bwd_buffers  # collective buffers at the backward peak
        arrived = min(mem.bwd_incoming, grad_received) if i == len(layers) - 1 else 0.0
        candidate = _less({"activations": before + mem.bwd_saved, "recompute_working": mem.bwd_recomputed + copies,
                           "working": mem.bwd_peak - mem.bwd_saved - mem.bwd_recomputed - comm - arrived + held,
                           "buffers": comm}, own)
        if sum(candidate.values()) > sum(bwd.values()):
            bwd = candidate
        # The input-gradient pass makes no weight gradient (no tied one held), and the stage's last
        # layer's incoming gradient is torch's gradient-receive buffer, captured all pass (counted there).
        working = max(0.0, mem.input_peak - mem.kept - arrived) + sum(l.memory.weight_inputs for l in later)
        if sum(kept) - shared + copies + working > sum(inp.values()):
            inp = {"activations": sum(kept) - shared, "recompute_working": copies, "working": working}
    return fwd, bwd, sum(kept) - shared, inp


def order_peaks(order: Sequence[tuple[str, int, int]], splits: dict[int, tuple[dict[str, float], dict[str, float],
                float, dict[str, float]]], held_for_weights: dict[int, float],
                first: int = 0) -> list[tuple[int, dict[str, float]]]:
    """The device's candidate peaks walking its schedule `order` ((F|B|I|W, micro-batch, virtual
    stage), `pipeline.device_order`): per op, (phase: 0 forward, 1 backward; the live bytes by
    category), each the op's own split (`_stage_peaks`) over what the micro-batches before it
    still hold. A forward keeps its stage's saved activations until its backward, or, split,
    until its weight pass (B, or I then W). Between I and W torch's `stage_backward_input` keeps
    `held_for_weights[s]` (the captured output gradients and the stage input's gradient, `.grad`
    of the received activation); the first stage's I runs nothing and its W the whole backward
    (its inputs need no gradient: torch's `backward_weight_one_chunk`)."""
    held: dict[tuple[int, int], tuple[float, float]] = {}  # (j, s) -> (activations, working)
    totals = [0.0, 0.0]  # held's sums, kept as entries come and go (a schedule holds m*vpp of them)
    out: list[tuple[int, dict[str, float]]] = []

    def hold(key: tuple[int, int], entry: tuple[float, float] | None) -> None:
        old = held.pop(key, (0.0, 0.0))
        new = entry or (0.0, 0.0)
        totals[0] += new[0] - old[0]
        totals[1] += new[1] - old[1]
        if entry is not None:
            held[key] = entry

    for kind, j, s in order:
        fwd, bwd, kept, inp = splits[s]
        mine = held.get((j, s), (0.0, 0.0))
        act, work = totals[0] - mine[0], totals[1] - mine[1]  # what the other micro-batches hold
        if kind == "F":
            part, phase = fwd, 0
            hold((j, s), (kept, 0.0))
        elif kind == "B" or (kind == "W" and s == first):
            part, phase = bwd, 1
            hold((j, s), None)
        elif kind == "I":
            if s == first:
                continue
            part, phase = inp, 1
            hold((j, s), (kept, held_for_weights.get(s, 0.0)))
        else:
            part, phase = {"activations": kept, "working": held_for_weights.get(s, 0.0)}, 1
            hold((j, s), None)
        out.append((phase, {**part, "activations": part.get("activations", 0.0) + act,
                            "working": part.get("working", 0.0) + work}))
    return out


_REPEATED = re.compile(r"^(.*?\.)\d+(\..*)$")  # `blocks.3.attn.future` -> (`blocks.`, `.attn.future`)


def _model_buffers(by_stage: Sequence[Sequence[Any]]) -> float:
    """The model buffers the device's layers read (a causal mask, a folded constant), each once.
    A repeated block's buffers are its own (each `blocks.i` registers its mask): the timelines
    equal blocks share name them after the block they were built on, so a buffer under a sibling
    block's path (`blocks.1.attn.future` read by `blocks.2`) is counted under the reading layer's."""
    found: dict[str, float] = {}
    for stage in by_stage:
        for layer in stage:
            own = _REPEATED.match(str(getattr(layer, "name", "")) + ".")
            for name, nbytes in dict(getattr(getattr(layer, "memory", None), "buffers", ())).items():
                sibling = _REPEATED.match(name)
                if own and sibling and sibling.group(1) == own.group(1):
                    name = f"{layer.name}{sibling.group(2)}"
                found[name] = nbytes
    return sum(found.values())


def pipeline_buffers(stages: Sequence[int], total: int, m: int, flight: int, send_bytes: Sequence[float],
                     output_bytes: float, pending_send: bool = True, warmup_send: bool = False,
                     last_outputs: int = 1) -> float:
    """torch.distributed.pipelining's buffers on a device holding virtual `stages` of `total`: per
    stage, a receive buffer per micro-batch for its input, and one more input-sized tensor, the
    input gradient of the previous backward, which the schedule's pending send (`bwd_sends`)
    holds while the next backward runs (measured: gpt-4l-zero's solver plan on local4, every
    stage but the first); a gradient-receive buffer per micro-batch and the outputs in flight;
    on the last stage, `last_outputs` outputs: the schedule is stepped with `return_outputs=False`,
    so torch keeps no micro-batch's output to the step's end (`output_chunks`), only each one from
    its forward (which computes the loss) to its backward in `fwd_cache`: one under the 1F1B family
    and the zero-bubble schedules (the last stage's backward follows its forward), m under GPipe
    (measured, torch 2.13: pipeline-tp and the ZB-V plan of `test_memory_categories` hold one
    output, m - 1 fewer than when the outputs were kept). `pending_send=False` under a split backward
    (zero-bubble schedules): that input gradient is the one held from I to W, priced there
    (`device_memory`'s `input_grads`), not again here. `warmup_send` (torch's Schedule1F1B): the
    work object of the warm-up's last send fired on its own holds that output until the 1B1F
    loop ends, past its backward: one more output on a stage with two or more warm-up forwards
    (min(m, stages - s)). A stage keeps at most its m micro-batches' outputs. At the turn of a V
    (zbv, dualpipev: stages s and s+1 on one device) torch hands stage s's outputs to stage s+1
    as its receive buffers and stage s+1's input gradients to stage s as its gradient-receive
    buffers: each is one tensor, counted once (as stage s+1's receive and stage s's gradient-
    receive buffers)."""
    out = 0.0
    for s in stages:
        if s > 0:
            out += (m + pending_send) * send_bytes[s - 1]
        if s < total - 1:
            turn = s + 1 in stages
            outputs = 0 if turn else min(m, flight) + (warmup_send and min(m, total - s) >= 2)
            out += (m + outputs) * send_bytes[s]
        else:
            out += min(m, last_outputs) * output_bytes
    return out


def device_memory(by_stage: Sequence[Sequence[Any]], states: dict[str, float], *, flight: int, virtual: int,
                  interleaved: bool, fsdp: bool, local_param_bytes: float, buffers: float,
                  after_backward: float = 0.0, regather: bool = False, accumulate: bool = False,
                  copy_bytes: float = 0.0, order: Sequence[tuple[str, int, int]] | None = None,
                  stage_ids: Sequence[int] = (), input_grads: dict[int, float] | None = None,
                  received: dict[int, float] | None = None,
                  grad_received: dict[int, float] | None = None, optimizer_step: float = 0.0) -> dict[str, float]:
    """The device's memory by category at its peak (module rules). `by_stage`: its layers per
    virtual stage, in order; `buffers`: persistent runtime buffers (DDP, pipelining);
    `after_backward`: a transient buffer once backward is over (a flat gradient copy);
    `regather`: FSDP2 frees the unsharded parameters after forward and gathers them again for
    backward (ZeRO-3), through the all-gather buffer again; `accumulate`: FSDP2 accumulates
    several micro-batches without syncing (every one but the last), so the unsharded gradients of
    the whole device stay from the first micro-batch's backward to the step's end and the later
    micro-batches run on top of them (working memory: the device's local parameter bytes);
    `copy_bytes`: mixed precision's weight copy per local parameter where `states` holds one at
    rest (taken off there for layers that recompute in full: `recompute_copies`); `order`: the
    device's pipeline schedule, its virtual stages `stage_ids` (those of `by_stage`), walked op by
    op (`order_peaks`; `input_grads[s]`: stage s's received activation's gradient, held from a
    split backward's I to its W) instead of counting `flight` micro-batches of the average stage;
    `received[s]`: the bytes of virtual stage s's input that land in torch's receive buffers
    (`_stage_peaks`: not activations too), `grad_received[s]` those of its output's gradient
    (not working memory too); `optimizer_step`: what the optimizer step allocates beside the states
    and the persistent buffers, once no activation is left (its own candidate peak)."""
    off, running = recompute_copies([l for stage in by_stage for l in stage], copy_bytes)
    states = {**states, "parameters": states.get("parameters", 0.0) - off, "model_buffers": _model_buffers(by_stage)}
    costs = [l.cost for stage in by_stage for l in stage if l.cost is not None]
    if not all(getattr(l, "memory", None) is not None for stage in by_stage for l in stage):
        saved = sum(c.saved_bytes for c in costs)
        activations = saved * flight / (virtual if interleaved else 1)
        return {**states, "activations": activations,
                "recompute_working": max((c.working_bytes for c in costs), default=0.0) + max(running.values(), default=0.0),
                "working": max((c.transient_bytes for c in costs), default=0.0),
                "buffers": buffers + (local_param_bytes if fsdp else 0.0)}
    accumulate = accumulate and fsdp
    ids = list(stage_ids) if len(stage_ids) == len(by_stage) else [-1] * len(by_stage)
    splits = [_stage_peaks(stage, fsdp and not accumulate, running, (received or {}).get(s, 0.0),
                           (grad_received or {}).get(s, 0.0))
              for s, stage in zip(ids, by_stage) if stage]
    unsharded_grads = local_param_bytes if accumulate else 0.0
    kept = sum(k for _, _, k, _ in splits)
    others = max(0.0, flight - 1) * (kept / len(splits) if interleaved and splits else kept)
    best: dict[str, float] = {**states, "activations": 0.0, "recompute_working": 0.0, "working": 0.0,
                              "buffers": buffers + after_backward}
    step = {**best, "working": optimizer_step, "buffers": buffers}  # after backward's transients are freed
    if sum(step.values()) > sum(best.values()):
        best = step
    # Backward holds the unsharded parameters; ZeRO-3's gather for it frees its flat buffer right
    # after copying out, before any gradient (its own candidate below).
    gathered = local_param_bytes if fsdp else 0.0
    # Accumulating, only the first micro-batch's forward gathers (the later ones find the weights
    # unsharded: no reshard after a backward but the last), and it runs before any gradient: each
    # forward holds the unsharded weights and one more copy's worth, the buffer or the gradients.
    extras = ((1.0 if accumulate else 2.0) * local_param_bytes if fsdp else 0.0, gathered)
    if order is not None and len(stage_ids) == len(by_stage) and all(by_stage):
        weights = {s: sum(l.memory.weight_inputs for l in stage) + (input_grads or {}).get(s, 0.0)
                   for s, stage in zip(stage_ids, by_stage)}
        parts = order_peaks(order, dict(zip(stage_ids, splits)), weights)
    else:
        parts = [(phase, (bwd if phase else fwd) | {"activations": others + (bwd if phase else fwd)["activations"]})
                 for phase in (0, 1) for fwd, bwd, _, _ in splits]
    if regather and fsdp:  # the gather before backward: every activation kept, both copies, no gradient yet
        parts.append((1, {"activations": others + kept, "recompute_working": 0.0, "working": 0.0,
                          "buffers": local_param_bytes}))
    for phase, part in parts:
        candidate = {**states, "activations": part["activations"],
                     "recompute_working": part.get("recompute_working", 0.0),
                     "working": part["working"] + unsharded_grads,
                     "buffers": buffers + extras[phase] + part.get("buffers", 0.0)}
        if sum(candidate.values()) > sum(best.values()):
            best = candidate
    return best
