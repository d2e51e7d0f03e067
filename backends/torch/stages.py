"""Pipeline stages of a lowered graph: one sub-graph per (virtual) stage, plus the loss.

Rule. A node belongs to the stage of its layer. `send`/`recv` pairs (the `lower` pass's stage
cuts) become the stages' outputs and inputs: a value sent from stage i to stage j > i+1 is
carried through the stages between (each takes it as an input and returns it), because a
torch pipeline only moves tensors between neighbouring stages. Stage k's inputs are, in a fixed
order, every value crossing the cut between k-1 and k; stage k-1 returns exactly those.

The loss. The graph input that only the last stage reads (the targets) is not sent through the
pipeline: the nodes of the last stage that depend on it (reshape, cross entropy) form the
`loss` sub-graph, which torch's schedules call as `loss_fn(stage_output, target)` on each
micro-batch's target. Any other graph input read after stage 0 travels through the pipeline
from stage 0. Parameters read on several stages (a tied embedding and head) are held by each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardc.analysis.resharding import node_stage
from shardc.ir import Graph, Node, Value
from shardc.ir.diagnostics import ShardcError


@dataclass
class StagePlan:
    """The stage sub-graphs of a lowered graph; `loss` is None when the last stage returns the outputs."""

    stages: list[Graph]
    loss: Graph | None
    first_inputs: list[Value]      # graph inputs stage 0 takes (in graph order)
    target: Value | None           # the graph input the loss reads
    param_stages: dict[str, set[int]] = field(default_factory=dict)  # parameter -> stages holding it


def _stage_of(graph: Graph, node: Node) -> int:
    stage = node_stage(graph, node)
    if stage is None:
        raise ShardcError(f"node %{node.outputs[0].name} has no pipeline stage (its layer has none)", node=node,
                          hint="run apply-plan (or the solver) with pp > 1 so every layer gets a stage")
    return stage


def split_stages(graph: Graph) -> StagePlan:
    """Cut a lowered pipelined graph into stage graphs by the rule in the module docstring."""
    if not graph.nodes:
        raise ShardcError(f"graph @{graph.name} has no nodes to pipeline")
    stage = {n: _stage_of(graph, n) for n in graph.nodes}
    count = max(stage.values()) + 1
    last = count - 1
    readers: dict[Value, set[int]] = {}
    for n in graph.nodes:
        if n.op == "recv":
            continue
        for v in n.inputs:
            readers.setdefault(v, set()).add(stage[n])
    tail, target = _loss_closure(graph, stage, readers, last)
    wires = _wires(graph, stage, readers, target)
    first_inputs = [v for v in graph.inputs if 0 in readers.get(v, set()) or any(w[0] is v for w in wires)]
    body = [n for n in graph.nodes if n.op not in ("send", "recv") and n not in tail]
    stages: list[Graph] = []
    carried: list[Value] = first_inputs  # what enters the current stage
    carry_map: dict[int, Value] = {}     # wire index -> the value standing for its source in this stage
    for k in range(count):
        nodes = [n for n in body if stage[n] == k]
        outs: list[Value] = []
        next_map: dict[int, Value] = {}
        next_in: list[Value] = []
        for i, w in enumerate(wires):
            if not w[2] <= k < w[3]:  # crosses only if it leaves after stage k
                continue
            held = w[0] if w[2] == k else carry_map[i]
            outs.append(held)
            arriving = w[1] if w[3] == k + 1 else Value(f"{w[1].name}.carry{k + 1}", w[1].type, "activation",
                                                            w[1].layout, requires_grad=w[1].requires_grad)
            next_map[i] = arriving
            next_in.append(arriving)
        if k == last:
            outs = _tail_inputs(graph, tail, target) if target is not None else list(graph.outputs)
        stages.append(_sub_graph(graph, f"{graph.name}_stage{k}", carried, nodes, outs))
        carried, carry_map = next_in, next_map
    loss = None
    if target is not None:
        loss_nodes = [n for n in graph.nodes if n in tail]
        loss = _sub_graph(graph, f"{graph.name}_loss", _tail_inputs(graph, tail, target) + [target], loss_nodes,
                          list(graph.outputs))
    holders: dict[str, set[int]] = {}
    for k, g in enumerate(stages):
        for p in g.params:
            holders.setdefault(p.name, set()).add(k)
    return StagePlan(stages, loss, first_inputs, target, holders)


def _loss_closure(graph: Graph, stage: dict[Node, int], readers: dict[Value, set[int]],
                  last: int) -> tuple[set[Node], Value | None]:
    """The loss: the forward closure, in the last stage, of the one graph input only the last
    stage reads (the target); nothing when the graph's outputs do not all come from it."""
    candidates = [v for v in graph.inputs if readers.get(v) == {last}]
    target = candidates[-1] if candidates and last > 0 else None
    tail: set[Node] = set()
    if target is None:
        return tail, None
    reached = {target}
    for n in graph.nodes:
        if stage[n] == last and any(v in reached for v in n.inputs):
            tail.add(n)
            reached.update(n.outputs)
    if not all(v in reached for v in graph.outputs):
        return set(), None
    return tail, target


def _wires(graph: Graph, stage: dict[Node, int], readers: dict[Value, set[int]],
           target: Value | None) -> list[tuple[Value, Value, int, int]]:
    """What crosses stages: (value the producer side holds, value the consumer side reads, src
    stage, dst stage) for every send/recv pair, then graph inputs later stages read from stage 0."""
    wires: list[tuple[Value, Value, int, int]] = []
    for n in graph.nodes:
        if n.op == "recv":
            send = n.inputs[0].producer
            assert send is not None and send.op == "send", f"recv %{n.outputs[0].name} without its send"
            wires.append((send.inputs[0], n.outputs[0], stage[send], stage[n]))
    for v in graph.inputs:
        later = {s for s in readers.get(v, set()) if s > 0}
        if v is target or not later:
            continue
        for s in sorted(later):
            wires.append((v, v, 0, s))
    return wires


def _tail_inputs(graph: Graph, tail: set[Node], target: Value) -> list[Value]:
    """Values the loss nodes read from the last stage's body, in first-use order."""
    produced = {v for n in graph.nodes if n in tail for v in n.outputs}
    out: list[Value] = []
    for n in graph.nodes:
        if n in tail:
            for v in n.inputs:
                if v is not target and v not in produced and v.kind == "activation" and v not in out:
                    out.append(v)
    return out


def _sub_graph(graph: Graph, name: str, inputs: list[Value], nodes: list[Node], outputs: list[Value]) -> Graph:
    used = {v for n in nodes for v in n.inputs}
    params = [p for p in graph.params if p in used]
    buffers = [b for b in graph.buffers if b in used]
    defined = set(inputs) | set(params + buffers) | {v for n in nodes for v in n.outputs}
    missing = [v.name for n in nodes for v in n.inputs if v not in defined]
    missing += [v.name for v in outputs if v not in defined]
    if missing:
        raise ShardcError(f"pipeline stage {name} reads values no earlier stage sends: "
                          f"{', '.join(dict.fromkeys(missing))}", hint="lower the graph (shardc.compile does) "
                          "so every value crossing a stage has a send/recv pair")
    return Graph(name, list(inputs), params, buffers, list(nodes), list(outputs), graph.mesh, graph.layers,
                 dict(graph.attrs))
