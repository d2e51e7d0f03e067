"""The pricing budget: which (mesh shape, micro-batch) problems the outer search prices when an
MoE model offers more distinct pricings than its time limit allows.

Rule. Pricing a problem (every candidate of the represented layers enumerated and costed on its
pricing shape, `problem.build_problem`) is the search's dominant cost before CP-SAT runs, once
per distinct `problem.pricing_key` (cp, tp, ep, micro-batch, dp > 1). Expert parallelism
multiplies the keys: ep x tp x micro-batch sizes x (dp > 1 or not) gives 127 for Mixtral-8x7B on
64 H100s at global batch 256, about 1.9 s each on a loaded 2-core machine (cProfile, issue 15),
so `shardc plan` ran past 290 s before solving anything. For a model with `experts` ops the
search prices at most `PRICINGS_PER_SECOND` x its time limit keys (at least `MIN_PRICINGS`), in
a fixed order, so the plan depends on the time limit, never on the machine's speed:
- each ep rank's sequences per micro-batch (mb / ep) smallest first: a sweep of every shape at
  one sequence per rank comes before any shape's larger micro-batches (Megatron's published MoE
  mappings all run MBS=1: Mixtral 8x7B, Grok-1, DeepSeek-V3);
- then tp smallest first (tp's collectives cross every layer; ep's only the experts), ep
  largest first (expert weights divided the most), cp smallest first, dp > 1 before dp = 1;
- every problem of a kept key is kept (shapes sharing a key share its pricing).
Dense models are not cut (their keys are few). The problems left out are named in the search
log; a longer time limit prices more of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardc.search.problem import MeshShape

PRICINGS_PER_SECOND = 1.0  # distinct pricings an MoE search may run per second of its time limit
MIN_PRICINGS = 16


def pricing_order(shape: MeshShape, mb: int) -> tuple[int, int, int, int, int]:
    """The key by which an MoE search takes (shape, micro-batch) pricings (module rule)."""
    return (mb // max(shape.ep, 1), shape.tp * shape.tq, -shape.ep, shape.cp, 0 if shape.dp > 1 else 1)


def within_budget(pairs: Sequence[tuple[MeshShape, int]], key_of, time_limit: float, experts: int
                  ) -> tuple[list[tuple[MeshShape, int]], list[tuple[MeshShape, int]]]:
    """(kept, left out) of the (shape, micro-batch) `pairs`, in their given order, under the
    pricing budget (module rule); `key_of(shape, mb)`: the pair's pricing key; `experts`: the
    model's expert count (0: a dense model, nothing left out)."""
    keys = {key_of(s, mb) for s, mb in pairs}
    allowed = max(MIN_PRICINGS, int(PRICINGS_PER_SECOND * time_limit))
    if not experts or len(keys) <= allowed:
        return list(pairs), []
    chosen: set[object] = set()
    for shape, mb in sorted(pairs, key=lambda p: pricing_order(*p)):
        key = key_of(shape, mb)
        if key not in chosen and len(chosen) < allowed:
            chosen.add(key)
    kept = [(s, mb) for s, mb in pairs if key_of(s, mb) in chosen]
    return kept, [(s, mb) for s, mb in pairs if key_of(s, mb) not in chosen]
