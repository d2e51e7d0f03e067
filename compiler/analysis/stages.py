"""Layers and pipeline stages: which layers are the embedding, the repeated blocks and the head,
and which stage each lands on. One rule for apply-plan (whose stage annotations the torch
backend splits the graph by), the cost model, the solver and the study.

Layering: the graph's layers in node order (nodes outside any layer form one layer, named by
the caller), then layers that hold no node. A block is a copy of a block class: a layer whose
class (`Layer.block`) is not its own name (group-layers names the classes of indexed layers
`block0`, `block1`, ...; `embed`, `head` and in-between layers are their own class). `pre` is
the layers before the first block, `post` those after the last, `blocks` the span from the
first block to the last (a layer between two blocks included).

Stages: the blocks are cut into `stages` contiguous runs as even as possible, the extra blocks
going to the middle stages first, then to the first and the last (which also hold the
embedding and the head), or into runs of the given sizes. `pre` joins stage 0, `post` the last
stage, a layer between blocks the stage of the block before it.

Placement: virtual stage s runs on pp rank `stage_device(s)`: s % pp (one stage per rank, or
interleaved round robin), and for the V schedules (zbv, dualpipev: two stages per rank) rank r
holds stages r and 2pp-1-r, as torch.distributed.pipelining's `style="v"` places them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardc.ir import Graph
from shardc.ir.diagnostics import ShardcError


@dataclass(frozen=True, slots=True)
class Layering:
    """The graph's layers in order, as embedding (`pre`), blocks and head (`post`)."""

    pre: tuple[str, ...]
    blocks: tuple[str, ...]
    post: tuple[str, ...]
    classes: tuple[str, ...]  # the class of each entry of `blocks` (its own name when not a block)

    @property
    def names(self) -> tuple[str, ...]:
        return self.pre + self.blocks + self.post

    @property
    def block_names(self) -> tuple[str, ...]:
        """The blocks proper (`blocks` without the layers between them)."""
        return tuple(n for n, c in zip(self.blocks, self.classes) if c != n)

    @property
    def count(self) -> int:
        return len(self.block_names)

    def uniform(self) -> Layering:
        """The run of copies of the most repeated block class as `blocks`, the layers before and
        after it as `pre` and `post` (the solver represents the run by one copy); every layer in
        `pre` when that class has fewer than two copies or they are not contiguous."""
        names, flat = self.names, Layering(self.names, (), (), ())
        counts: dict[str, int] = {}
        for n, c in zip(self.blocks, self.classes):
            if c != n:
                counts[c] = counts.get(c, 0) + 1
        if not counts:
            return flat
        best = max(counts, key=lambda c: counts[c])
        at = [len(self.pre) + i for i, c in enumerate(self.classes) if c == best]
        if len(at) < 2 or at != list(range(at[0], at[-1] + 1)):
            return flat
        return Layering(names[:at[0]], names[at[0]:at[-1] + 1], names[at[-1] + 1:], (best,) * len(at))


def layering(graph: Graph, ungrouped: str = "(ungrouped)") -> Layering:
    """The graph's layering (see the module rule); nodes without a layer form `ungrouped`."""
    order: dict[str, None] = {}
    for node in graph.nodes:
        order.setdefault(node.layer if node.layer is not None else ungrouped, None)
    names = list(order) + [n for n in graph.layers if n not in order]
    classes = [graph.layers[n].block if n in graph.layers else n for n in names]
    found = [i for i, (n, c) in enumerate(zip(names, classes)) if c != n]
    if not found:
        return Layering(tuple(names), (), (), ())
    first, last = found[0], found[-1] + 1
    return Layering(tuple(names[:first]), tuple(names[first:last]), tuple(names[last:]), tuple(classes[first:last]))


def stage_sizes(blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage: as even as possible, extra blocks to the middle stages first, then the
    first and the last."""
    sizes = [blocks // stages] * stages
    order = list(range(1, stages - 1)) + [0, stages - 1] if stages > 2 else list(range(stages))
    for k in range(blocks % stages):
        sizes[order[k]] += 1
    return tuple(sizes)


def layer_stages(graph: Graph, stages: int, sizes: Sequence[int] | None = None,
                 ungrouped: str = "(ungrouped)") -> dict[str, int]:
    """Layer name -> pipeline stage (see the module rule), blocks cut by `stage_sizes` or `sizes`."""
    lay = layering(graph, ungrouped)
    blocks = lay.block_names
    if sizes is None:
        if stages > 1 and len(blocks) < stages:
            raise ShardcError(f"{stages} pipeline stages but graph @{graph.name} has {len(blocks)} repeated blocks "
                              f"({', '.join(blocks) or 'none'}); every stage needs one",
                              hint=f"use pp*vpp <= {max(len(blocks), 1)}")
        sizes = stage_sizes(len(blocks), stages)
    elif sum(sizes) != len(blocks):
        raise ShardcError(f"split={'+'.join(map(str, sizes))} deals {sum(sizes)} blocks but graph @{graph.name} has "
                          f"{len(blocks)} repeated blocks ({', '.join(blocks[:4])}...)")
    stage_of: dict[str, int] = {}
    k = 0
    for stage, count in enumerate(sizes):
        for name in blocks[k:k + count]:
            stage_of[name] = stage
        k += count
    out = {name: 0 for name in lay.pre}
    current = 0
    for name in lay.blocks:
        current = stage_of.get(name, current)
        out[name] = current
    out.update({name: max(stages - 1, 0) for name in lay.post})
    return out


# The schedules that place a device's two model chunks in a V (torch's `style="v"`): device d
# holds virtual stages d and 2p-1-d, so the first and the last stage share device 0 and the
# turn of the V (stages p-1 and p) stays on device p-1 without a send.
V_SCHEDULES = ("zbv", "dualpipev")


def stage_device(stage: int, pp: int, schedule: str = "1f1b") -> int:
    """The pipeline device (pp rank) of virtual stage `stage`: `stage % pp` (round robin, the
    interleaved placement), or, for the V schedules (`V_SCHEDULES`), `stage` on the way down and
    `2pp-1-stage` on the way back."""
    if pp <= 1:
        return 0
    if schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def device_stages(device: int, pp: int, virtual: int, schedule: str = "1f1b") -> tuple[int, ...]:
    """The virtual stages device `device` holds, in order (see `stage_device`)."""
    return tuple(s for s in range(pp * virtual) if stage_device(s, pp, schedule) == device)
