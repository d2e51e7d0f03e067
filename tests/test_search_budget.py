"""The outer search's pricing budget for MoE models (`shardc.search.budget`, issue 15): at most
`PRICINGS_PER_SECOND` x time limit distinct pricings, taken one sequence per ep rank first, the
published Megatron-Core mapping of Mixtral-8x7B on 64 H100s among them; dense models not cut."""

from __future__ import annotations

from shardc.search.budget import MIN_PRICINGS, PRICINGS_PER_SECOND, within_budget
from shardc.search.outer import mesh_shapes, micro_batch_sizes
from shardc.search.problem import MeshShape


def _pairs(experts: int) -> list[tuple[MeshShape, int]]:
    """Mixtral-8x7B's (shape, micro-batch) problems on 64 H100s (8 per node), 32 blocks, batch 256, seq 4096."""
    gbs = 256
    return [(s, mb) for s in mesh_shapes(64, 8, 32, gbs, 4096, experts=experts)
            for mb in micro_batch_sizes(gbs, s.dp, s.pp, s.ep) if mb % s.ep == 0]


def _key(shape: MeshShape, mb: int) -> tuple[object, ...]:  # as `problem.pricing_key`: the pipeline folded away
    return (shape.dp > 1, shape.cp, shape.tp, shape.tq, shape.ep, mb)


def test_an_moe_search_prices_one_sequence_per_ep_rank_first_and_keeps_the_published_mapping() -> None:
    pairs = _pairs(experts=8)
    keys = {_key(*p) for p in pairs}
    assert len(keys) > 100  # what exploded: ep x tp x micro-batch sizes x (dp > 1 or not)
    kept, left = within_budget(pairs, _key, 30.0, experts=8)
    assert len({_key(*p) for p in kept}) == max(MIN_PRICINGS, int(PRICINGS_PER_SECOND * 30))
    assert len(kept) + len(left) == len(pairs) and not set(kept) & set(left)
    assert kept == [p for p in pairs if p in set(kept)]  # the given order kept
    assert all(mb == s.ep for s, mb in kept)  # one sequence per ep rank: the sweep fits in 30 keys
    published = MeshShape(pp=4, dp=2, ep=8)  # Megatron-Core's TP1 EP8 PP4 (its DP 16 = dp 2 x ep 8), MBS 1
    assert (published, 8) in kept
    assert within_budget(pairs, _key, 30.0, experts=8) == (kept, left)  # deterministic
    assert len({_key(*p) for p in within_budget(pairs, _key, 1000.0, experts=8)[0]}) == len(keys)


def test_a_dense_search_is_not_cut() -> None:
    pairs = _pairs(experts=0)
    assert within_budget(pairs, _key, 1.0, experts=0) == (pairs, [])
