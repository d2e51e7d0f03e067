"""The live memory of one layer while one micro-batch runs through it, op by op (eager PyTorch's autograd).

Saved activations are only part of a device's peak: while backward runs, the gradients of
activations and the weight gradients of the op in progress are live too, and the peak is the
largest sum over time. This walks the layer's partitioned IR as autograd executes it.

Rules (all sizes are local, batch-scaled, at the compute dtype):
- Storages: as eager PyTorch allocates them (`shardc.analysis.aliasing`, `CostContext.root`):
  a view (reshape, permute, expand, slice, select, split; dropout with p=0, which returns its
  input) aliases the storage of its input, unless PyTorch must copy (a reshape it cannot
  view); every other op's output is a new storage.
- Forward: an output lives until its last reader in the layer has run, or to the end of the
  layer when a later layer reads it; what an op saves for backward stays (`layer_terms`'s saved
  entries: the kept ones under the layer's recomputation). A loss also holds its log-probabilities
  (the size of its input read in fp32, `head.loss_logits_bytes`) while it runs. Under full recomputation the forward keeps only the
  layer's inputs; under selective, the attention core's own tensors are not kept.
- Backward, ops in reverse: the gradients of the layer's outputs arrive first. An op allocates a
  gradient for each input that needs one (a parameter's is a temporary, added into `.grad` and
  freed at once, unless the parameter is read again by an earlier op, a tied weight, whose
  contributions autograd sums before accumulating; `hold_param_grads`: kept to the end of
  backward, as FSDP2's unsharded gradients are). Views, dropout(p=0) and an `add` of equal
  shapes pass the output gradient through without allocating (`aliasing.passes_gradient`);
  split's backward concatenates.
  A loss's backward also holds the gradient of its log-probabilities (fp32, beside the logits'
  gradient, which it makes in fp32 before casting it back), except a vocabulary-
  parallel one (`head.vocab_parallel_loss`), which writes the logits' gradient over its saved
  softmax and allocates neither. After the op its output
  gradients and the storages no later op needs for backward are freed. Full recomputation runs
  the layer's forward again first (its saved tensors come back as recomputed); selective
  recomputation regenerates the attention core's saved tensors when backward reaches it.
- Sequence parallelism (`edges.saves_shard`): column-parallel readers of a gathered input keep
  its shard; their forward holds the gathered copy while they run, their one backward (at the
  first reader's turn, the later readers' output gradients held until then) holds the input
  gradient at the gathered size beside the pieces gathered again, then beside the reduce-
  scatter's full-size sum.
- Rotations (`rotating_loop`): a forward step holds the running sum, its partial product and
  their sum (three outputs); in backward each step's gradient of an indexed input is its
  chunk padded with zeros to full size and added to the steps' running sum: twice the input
  at the first step, three times at the later ones, where over two steps the last one has
  already freed the input itself (twice again). Gradients an op
  passes through (views, adds) share the output gradient's storage: counted once.
- A fused head and loss (`shardc.cost.head`): the head makes no logits; the loss holds one
  chunk's working set (`head_working`) in forward and in backward, where it allocates the head
  input's gradient and the weight's at once and the head's and reshapes' backward is its own.
- A graph without its own loss: the layer making its output also holds the training loop's
  loss on the gathered output (`default_loss_bytes`) on top of what it keeps.
The result is each phase's peak and what is live at it, which `compose` stacks on the layers
before (their saved activations) and the model states.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from shardc.analysis.aliasing import passes_gradient
from shardc.analysis.head_loss import HeadLoss
from shardc.cost.context import CostContext
from shardc.cost.edges import GATHERED, gathered_source
from shardc.cost.head import head_regions, vocab_parallel_loss
from shardc.cost.layer import LayerTerms, attention_core
from shardc.cost.moe import weight_gradient_copies
from shardc.cost.op_memory import (
    default_loss_bytes,
    gathered_readers,
    in_place_gradient,
    last_piece,
    loss_extra,
)
from shardc.cost.saved import SavedKey, heads, matmul_copy, rotation
from shardc.ir import Node, Value


@dataclass(frozen=True, slots=True)
class LayerMemory:
    """One layer, one micro-batch: live bytes at its forward and backward peaks, split by kind.

    `fwd_peak` = `fwd_saved` (its saved activations at that moment) + working (outputs not yet
    consumed, a loss's log-probabilities). `bwd_peak` = `bwd_saved` (kept activations not yet
    freed) + `bwd_recomputed` (recomputed ones) + working (activation and weight gradients,
    a loss's log-probability gradient). `param_grads`: the weight gradients the layer computes
    (what FSDP2 keeps unsharded until the end of backward); `held`: tied weights' gradients
    it leaves held for an earlier layer. `kept`: what it saves per micro-batch. `buffers`: the
    model buffers it reads (name, local bytes), resident all step. `weight_inputs`: the output
    gradients a split backward keeps from its input-gradient pass to its weight-gradient pass
    (`weight_gradient_inputs`); `input_peak`: the live bytes at the peak of that input-gradient
    pass, which keeps the graph (`retain_graph`: no saved tensor is freed), computes no weight
    gradient and keeps the captured output gradients as it goes. `saved_inputs`: the part of
    `kept` that is the layer's own input storages (made before it: on a pipeline stage's first
    layer, torch's receive buffer, which is the runtime's, not a new activation). `bwd_buffers`:
    the part of `bwd_peak` in collective buffers (sequence parallelism's gathers and reduce-
    scatters in backward), beside its working memory. `bwd_incoming`: the part of `bwd_peak` in
    the storages its outputs' gradients arrived in (on a pipeline stage's last layer, torch's
    gradient-receive buffer)."""

    fwd_peak: float
    fwd_saved: float
    bwd_peak: float
    bwd_saved: float
    bwd_recomputed: float
    kept: float
    param_grads: float = 0.0
    held: float = 0.0
    buffers: tuple[tuple[str, float], ...] = ()
    weight_inputs: float = 0.0
    input_peak: float = 0.0
    saved_inputs: float = 0.0
    bwd_buffers: float = 0.0
    bwd_incoming: float = 0.0


def _meets_weights(node: Node, ctx: CostContext) -> bool:
    """Whether `node` reads a parameter (or a view or cast of one) and an activation that needs a
    gradient: where a weight's gradient path meets the input's in autograd's graph."""
    from shardc.cost.pipeline import param_root

    return (any(param_root(v) for v in node.inputs)
            and any(v in ctx.needs_grad and not param_root(v) for v in node.inputs))


def weight_gradient_inputs(ctx: CostContext, nodes: Sequence[Node]) -> float:
    """Bytes torch's split backward (`stage_backward_input`) captures per micro-batch for the
    weight-gradient pass: the gradient of the output of every op that reads a parameter (or a
    view or cast of one) and an activation that needs a gradient (a linear, a norm's affine,
    a head on tied weights): the autograd nodes where a weight's gradient path meets the
    input's, whose incoming gradients it keeps until the weight pass."""
    return sum(ctx.local_bytes(v) for node in nodes if _meets_weights(node, ctx)
               for v in node.outputs if v in ctx.needs_grad)


def layer_memory(ctx: CostContext, nodes: Sequence[Node], terms: LayerTerms, recompute: str = "none",
                 earlier_params: Collection[str] = (), hold_param_grads: bool = False) -> LayerMemory:
    """Walk `nodes` (one layer, graph order) forward and backward (module rules). `terms` is the
    layer's `layer_terms` (its saved entries); `earlier_params`: parameters earlier layers on the
    same device also read (their gradients are held here until that layer's backward)."""
    inside = set(nodes)
    core = attention_core(ctx, nodes) if recompute == "selective" else frozenset()
    copies, direct = _gathered_copies(ctx, nodes)
    shards = {root for _, _, root in copies.values()} - direct  # saved only as their gathered copies
    entries = {k: e for k, e in terms.saved_entries.items() if not (isinstance(k, Value) and k in shards)}
    entries.update({k: (b, c) for k, (b, c, _) in copies.items()})
    saved_all = {k: b for k, (b, _) in entries.items()}
    in_core = [k for k, (_, c) in entries.items() if c]  # a list: recomputed in saved order
    kept: dict[SavedKey, float]
    if recompute == "full":
        kept = dict(terms.input_entries.items())
    elif recompute == "selective":
        kept = {k: b for k, b in saved_all.items() if k not in in_core}
    else:
        kept = dict(saved_all)
    savers: dict[object, list[int]] = {}
    for idx, node in enumerate(nodes):
        for key in _saved_keys(ctx, node, entries.keys() | terms.input_entries.keys(), terms):
            savers.setdefault(key, []).append(idx)
    last_read: dict[Value, int] = {}
    exported: set[Value] = set()
    for idx, node in enumerate(nodes):
        for v in node.inputs:
            last_read[ctx.root(v)] = idx
        for v in node.outputs:
            users = ctx.users.get(v, [])
            if any(u not in inside for u in users) or v in ctx.graph.outputs:
                exported.add(ctx.root(v))
    preload = dict(terms.input_entries) if recompute == "full" else {}  # checkpoint keeps its inputs
    fused = gathered_readers(ctx, nodes, inside)
    regions = head_regions(ctx, nodes)
    fwd_peak, fwd_saved = _forward(ctx, nodes, kept, savers, last_read, exported, preload, fused, regions)
    if recompute == "full":  # the forward again, inputs kept and output gradients arriving
        again, again_saved = _forward(ctx, nodes, saved_all, savers, last_read, exported, preload, fused, regions)
        incoming = _incoming(ctx, nodes, inside)
        recompute_peak = again + incoming
        # The inputs the checkpoint saved stay saved activations; the rest comes back recomputed.
        live_saved: dict[Value | tuple[Node, int], float] = {k: b for k, b in preload.items()}
        recomputed = {k: b for k, b in saved_all.items() if k not in preload}
    else:
        recompute_peak = 0.0
        live_saved, recomputed = dict(kept), {}
    split_peak = _backward(ctx, nodes, dict(live_saved), dict(recomputed), savers, inside, core, saved_all, in_core,
                           set(earlier_params), hold_param_grads, fused, regions, split=True)[0]
    peak, at_saved, at_recomputed, param_grads, held, comm, incoming = _backward(
        ctx, nodes, live_saved, recomputed, savers, inside, core, saved_all, in_core, set(earlier_params),
        hold_param_grads, fused, regions)
    if recompute_peak > peak:
        inputs = sum(preload.values())
        peak, at_saved, at_recomputed, comm = recompute_peak, inputs, max(0.0, again_saved - inputs), 0.0
        incoming = _incoming(ctx, nodes, inside)
    tail = default_loss_bytes(ctx, nodes)
    if tail and sum(kept.values()) + tail > peak:  # everything this layer keeps is live while the loss runs
        peak, at_saved, at_recomputed, comm, incoming = sum(kept.values()) + tail, sum(kept.values()), 0.0, 0.0, 0.0
    buffers = {v.name: ctx.local_bytes(v) for node in nodes for v in node.inputs if v.kind == "buffer"}
    return LayerMemory(fwd_peak, fwd_saved, peak, at_saved, at_recomputed, sum(kept.values()), param_grads, held,
                       tuple(sorted(buffers.items())), weight_gradient_inputs(ctx, nodes),
                       max(split_peak, recompute_peak, sum(kept.values()) + tail),
                       sum(b for k, b in kept.items() if k in terms.input_entries), comm, incoming)


def _gathered_copies(ctx: CostContext, nodes: Sequence[Node]) -> tuple[dict[SavedKey, tuple[float, bool, Value]],
                                                                        set[Value]]:
    """Saved inputs all-gathered on their way in (sequence parallelism, context parallelism's
    keys and values): eager autograd saves the gathered copy the op read, a storage of its own
    (`gathered_source`), not the shard. Lowering emits the gather right before its consumer,
    so the copy is inside an attention core (recomputed under selective) unless that consumer
    opens the core (QK^T's keys are gathered before it, PV's values inside). Returns the copies
    ((where, GATHERED - i) -> (bytes, inside a core, the shard's storage)) and the storages some
    op saves directly."""
    core = attention_core(ctx, nodes)
    opening = heads(core)
    copies: dict[SavedKey, tuple[float, bool, Value]] = {}
    direct: set[Value] = set()
    for node in nodes:
        local = ctx.local(node)
        for kind, i in local.op.saved_for_backward(local.in_types, local.out_types, node.attrs):
            if kind == "bytes":
                continue
            root = ctx.root(node.inputs[i] if kind == "in" else node.outputs[i])
            found = gathered_source(ctx, node, i) if kind == "in" else None
            if found is None:
                if kind != "in" or matmul_copy(ctx, node, i) is None:  # a matmul's copy is not the storage
                    direct.add(root)
                continue
            where, j, nbytes = found
            copies[(where, GATHERED - j)] = (nbytes, node in core and where in core and where not in opening, root)
    return copies, direct


def _saved_keys(ctx: CostContext, node: Node, known: Collection[object], terms: LayerTerms) -> list[object]:
    """The saved-entry keys `node` contributes (storages, or (node, k) for raw bytes) among the
    layer's `known` entries (a gathered copy's key too, whether or not `terms` came from whole
    layers or from the solver's fragments, which cannot see the gather)."""
    local = ctx.local(node)
    keys: list[object] = []
    for k, (kind, i) in enumerate(local.op.saved_for_backward(local.in_types, local.out_types, node.attrs)):
        found = gathered_source(ctx, node, i) if kind == "in" else None
        key: object = (node, k) if kind == "bytes" else (found[0], GATHERED - found[1]) if found else ctx.root(
            node.inputs[i] if kind == "in" else node.outputs[i])
        if key in known:
            keys.append(key)
    keys += [k for k in terms.saved_entries if isinstance(k, tuple) and k[0] is node and GATHERED < k[1] < 0]
    return keys


def _new_outputs(ctx: CostContext, node: Node, regions: dict[Node, HeadLoss] | None = None) -> dict[Value, float]:
    if regions and node in regions and node is not regions[node].loss:
        return {}  # a fused head makes no logits
    return {v: ctx.local_bytes(v) for v in node.outputs if ctx.root(v) is v}


def _forward(ctx: CostContext, nodes: Sequence[Node], kept: dict, savers: dict, last_read: dict[Value, int],
             exported: set[Value], preload: dict,
             fused: dict[Node, tuple[list[Node], float]] | None = None,
             regions: dict[Node, HeadLoss] | None = None) -> tuple[float, float]:
    saved: dict[object, float] = dict(preload)
    temp: dict[Value, float] = {}
    peak, at_saved = 0.0, 0.0
    for idx, node in enumerate(nodes):
        new = _new_outputs(ctx, node, regions)
        extra = loss_extra(ctx, node, regions)
        total = sum(saved.values()) + sum(temp.values()) + sum(new.values()) + extra
        if fused and node in fused:  # the gathered copy, freed once the readers have run
            total += fused[node][1]
        if rotation(ctx, node) is not None:  # the running sum, this step's partial product and their sum
            total += 2 * sum(new.values())
        if total > peak:
            # An unfused loss ends holding its log-probabilities (saved: they are what it keeps in its
            # logits' place) beside its logits (freed when the forward returns): the peak's split. A
            # vocabulary-parallel one peaks inside its autograd function, before it saves its softmax.
            keeps = (not (regions and node in regions) and extra and not vocab_parallel_loss(ctx, node)
                     and ctx.root(node.inputs[0]) in kept)
            peak, at_saved = total, sum(saved.values()) + (extra if keeps else 0.0)
        temp.update(new)
        for key, readers in savers.items():
            if readers[0] == idx and key in kept:
                saved[key] = kept[key]
                if isinstance(key, Value):  # a storage, not an op's raw bytes
                    temp.pop(key, None)
        for key in [k for k in temp if last_read.get(k, -1) <= idx and k not in exported]:
            del temp[key]
    return peak, at_saved


def _incoming(ctx: CostContext, nodes: Sequence[Node], inside: set[Node]) -> float:
    """Bytes of the gradients of the layer's outputs that later layers send back."""
    total = 0.0
    for node in nodes:
        for v in node.outputs:
            users = ctx.users.get(v, [])
            if v in ctx.needs_grad and any(u not in inside for u in users):
                total += ctx.local_bytes(v)
    return total


def _backward(ctx: CostContext, nodes: Sequence[Node], saved: dict, recomputed: dict, savers: dict,
              inside: set[Node], core: Collection[Node], saved_all: dict, in_core: list, earlier: set[str],
              hold: bool, fused: dict[Node, tuple[list[Node], float]],
              regions: dict[Node, HeadLoss], split: bool = False) -> tuple[float, ...]:
    # Activation gradients by value, each with the storage it lives in: a gradient passed through
    # (a view's, an add's) is the output gradient's storage, counted once while any value holds it.
    grads: dict[Value, float] = {}
    owner: dict[Value, object] = {}
    for node in nodes:
        for v in node.outputs:
            users = ctx.users.get(v, [])
            if v in ctx.needs_grad and any(u not in inside for u in users):
                grads[v], owner[v] = ctx.local_bytes(v), v
    arrived = set(grads)  # the storages the incoming gradients arrived in
    first_use: dict[str, int] = {}
    for idx, node in enumerate(nodes):
        for v in node.inputs:
            if v.kind == "parameter":
                first_use.setdefault(v.name, idx)
    held: dict[str, float] = {}
    param_grads = 0.0
    remaining = {k: len(v) for k, v in savers.items()}
    position = {n: i for i, n in enumerate(nodes)}
    later_readers = {m for members, _ in fused.values() for m in members[1:]}
    later_readers |= {m for m, region in regions.items() if m is not region.loss}  # run at the loss's turn
    peak, at_saved, at_recomputed, at_comm, at_incoming = 0.0, 0.0, 0.0, 0.0, 0.0
    core_pending = bool(core)
    # split: output gradients kept for the weight pass (`weight_gradient_inputs`), by the storage
    # they live in: one the residual stream still passes on (the incoming gradient) is counted once.
    captured: dict[object, float] = {}
    for idx in range(len(nodes) - 1, -1, -1):
        node = nodes[idx]
        if not any(o in ctx.needs_grad for o in node.outputs):
            continue
        if node in later_readers:
            continue  # its backward runs with its first reader's (`gathered_readers`)
        members, gathered = fused.get(node, ([node], 0.0))
        region = regions.get(node)
        made: set[Value] = set()
        if region is not None:  # the fused loss: its own backward and the head's and reshapes'
            members = [node, *reversed(region.views), region.linear]
            made = {v for m in members[1:] for v in m.outputs}
        rot = rotation(ctx, node)
        indexed = set(rot[2]) if rot is not None else set()
        if core_pending and node in core:
            core_pending = False
            recomputed.update({k: saved_all[k] for k in in_core})
        allocs: dict[Value, float] = {}
        padding = 0.0
        new_params: dict[str, float] = {}
        passed: list[Value] = []
        for reader, i, v in ((r, i, v) for r in members for i, v in enumerate(r.inputs)):
            if v not in ctx.needs_grad or v in made:
                continue
            if v.kind == "parameter":
                new_params[v.name] = ctx.local_bytes(v) * weight_gradient_copies(ctx, reader, i)
            elif passes_gradient(reader, i):
                passed.append(v)
            else:
                allocs[v] = (0.0 if gathered else allocs.get(v, 0.0)) + ctx.local_bytes(v)
                if i in indexed:  # a rotation step's chunk gradient padded to full size, beside the running sum
                    padding += ctx.local_bytes(v) * (2.0 if rot is not None and rot[0] > 2 else 1.0)
        comm = 0.0
        if gathered and node.inputs[0] in ctx.needs_grad:
            # The input gradient at the gathered size, and one collective buffer of that size beside
            # it: the pieces gathered again while the weight gradients are made from them, freed
            # (`collectives._release`) before the input gradient is reduce-scattered into its full-
            # size sum (gloo: an all-reduce of a copy). (Two until session 9: gloo's work object
            # held the pieces until its thread let go, often past the reduce-scatter.)
            padding += gathered + last_piece(ctx, node, members[-1])
            comm = gathered
        # An output made whole (a partial sum, a replica) and held sharded (reduce-scattered,
        # chunked): its gradient arrives sharded and is gathered to the size made, for this backward.
        local = ctx.local(node)
        for o, made_as in zip(node.outputs, local.out_layouts):
            if o in grads and region is None:
                padding += max(0.0, ctx.local_bytes(o, made_as) - ctx.local_bytes(o))
        live_grads = _grad_bytes({v: b for v, b in grads.items() if owner[v] not in captured}, owner)
        live = sum(saved.values()) + sum(recomputed.values()) + live_grads + sum(held.values())
        if split:  # the input-gradient pass computes no weight gradient
            new_params = {}
        total = live + sum(allocs.values()) + padding + comm + sum(new_params.values()) + sum(captured.values()) \
            + loss_extra(ctx, node, regions, backward=True)
        if region is None:
            total -= in_place_gradient(ctx, node, saved, recomputed, allocs)
        if total > peak:
            peak, at_saved, at_recomputed, at_comm = total, sum(saved.values()), sum(recomputed.values()), comm
            at_incoming = _grad_bytes({v: b for v, b in grads.items() if owner[v] in arrived}, owner)
        if split and _meets_weights(node, ctx):
            for o in (o for o in node.outputs if o in ctx.needs_grad):
                key = owner.get(o, o)
                captured[key] = max(captured.get(key, 0.0), ctx.local_bytes(o))
        outs = [(grads.pop(o), owner.pop(o)) for m in members for o in m.outputs if o in grads]
        out_grad, out_owner = max(outs, key=lambda g: g[0], default=(0.0, None))
        for key in passed:
            if key in grads or out_owner is None:  # a second contribution: summed into a new storage
                grads[key], owner[key] = max(grads.get(key, 0.0), out_grad), key
            else:
                grads[key], owner[key] = out_grad, out_owner
        for key, nbytes in allocs.items():
            grads[key], owner[key] = max(grads.get(key, 0.0), nbytes), key
        for name, nbytes in new_params.items():
            param_grads += nbytes
            if hold or name in earlier or first_use.get(name, idx) < idx:
                held[name] = max(held.get(name, 0.0), nbytes)
            else:  # its last contribution: summed and added into .grad
                held.pop(name, None)
        for done in (k for m in members for k in _keys_of(savers, position[m]) if not split):
            remaining[done] -= 1
            if remaining[done] <= 0:
                saved.pop(done, None)
                recomputed.pop(done, None)
    tied = sum(b for name, b in held.items() if name in earlier and not hold)
    return peak, at_saved, at_recomputed, param_grads, tied, at_comm, at_incoming


def _grad_bytes(grads: dict[Value, float], owner: dict[Value, object]) -> float:
    """Live activation-gradient bytes, each storage once."""
    by_storage: dict[object, float] = {}
    for v, nbytes in grads.items():
        by_storage[owner[v]] = max(by_storage.get(owner[v], 0.0), nbytes)
    return sum(by_storage.values())


def _keys_of(savers: dict, idx: int) -> list[object]:
    return [k for k, readers in savers.items() if idx in readers]
